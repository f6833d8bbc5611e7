"""The tick table the executor runs, built from a schedule's per-stage orders.

All stages advance in lockstep, one tick at a time. A tick is an F slot then a B slot:
  F slot  a stage may run one forward; then every stage ppermutes activations s -> s+1 (stage
          p-1 feeds chunk c+1 on stage 0). The last virtual stage sends nothing: its forward
          ends in the head and loss, and their backward, which gives the chunk's output
          cotangent locally.
  B slot  a stage may run one backward; then every stage ppermutes input cotangents s -> s-1
          (stage 0 feeds chunk c-1 on stage p-1). The first virtual stage sends nothing.
Latency: what is sent in tick t is usable from tick t+1. On the last virtual stage F(mb) and
B(mb) may share a tick: the loss is local.

Buffers per stage: `inputs`, stage inputs written on arrival (on the first virtual stage by its
own forward: the embedded microbatch), read by F and again by B, freed after B (what a stage
keeps for its backward besides the input lives in rings indexed by the same slot); `cots`,
output cotangents, received or (last virtual stage) made by the F slot, freed after B. A new
item takes the lowest free slot. With p v = 1 the one stage is first and last: its backward
runs the whole model from the stored input, so no cotangent is buffered.

Ring sizes depend on the schedule family (p, v, warm-up), not on m: for 1F1B-type schedules the
rings are sized for the steady state, the peak at m = 2p (the same at any larger m), so a step's
memory is the same for any m; GPipe keeps all m stage inputs and breadth_first all m v, so their
rings grow with m.

Placement is greedy and keeps each stage's order: in every tick each stage runs its next action
if its inputs have arrived, a forward in the F slot and then, if the next action is a backward
whose cotangent is there, that backward in the B slot. A tick in which no stage can move means
the orders deadlock (nothing changes by waiting): ValueError.

The table is columns of int32 [num_ticks, p]; a later action kind (a W slot for zero-bubble
weight gradients) or payload (compressed ppermute) adds columns, not a new format.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxmeg.pipeline.schedules import Schedule, build, next_stage, prev_stage

FIELDS = (
    "f_mb", "f_chunk", "f_slot",
    "f_cot_slot",
    "b_mb", "b_chunk", "b_slot", "b_cot_slot",
    "recv_act_slot", "recv_cot_slot",
)  # fmt: skip
STEADY_STATE_MICROBATCHES_PER_STAGE = 2


@dataclasses.dataclass(frozen=True, eq=False)
class TickTable:
    """int32 arrays [num_ticks, p], -1 for none.

    f_mb, f_chunk: the forward in the F slot; f_slot: the `inputs` slot it reads (on the first
        virtual stage, the slot the embedded microbatch is written to first).
    f_cot_slot: on the last virtual stage (p v > 1), the `cots` slot where the F slot puts the
        output cotangent that the head and loss backward gives.
    b_mb, b_chunk: the backward in the B slot; b_slot: the `inputs` slot of its stage input
        (freed after); b_cot_slot: the `cots` slot of its output cotangent (-1 when p v = 1).
    recv_act_slot: after the F slot's ppermute, the `inputs` slot the arriving activation goes to.
    recv_cot_slot: after the B slot's ppermute, the `cots` slot the arriving cotangent goes to.
    num_input_slots (K), num_cot_slots (J): ring sizes, max over stages.
    """

    f_mb: np.ndarray
    f_chunk: np.ndarray
    f_slot: np.ndarray
    f_cot_slot: np.ndarray
    b_mb: np.ndarray
    b_chunk: np.ndarray
    b_slot: np.ndarray
    b_cot_slot: np.ndarray
    recv_act_slot: np.ndarray
    recv_cot_slot: np.ndarray
    num_input_slots: int
    num_cot_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.f_mb.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.f_mb.shape[1])


class _Slots:
    """Lowest-free-index slot allocator that remembers what each slot holds."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[int, int]] = {}
        self.peak = 0

    def put(self, item: tuple[int, int]) -> int:
        slot = next(i for i in range(len(self.held) + 1) if i not in self.held)
        self.held[slot] = item
        self.peak = max(self.peak, len(self.held))
        return slot

    def find(self, item: tuple[int, int]) -> int:
        return next(slot for slot, held in self.held.items() if held == item)

    def pop(self, item: tuple[int, int]) -> int:
        slot = self.find(item)
        del self.held[slot]
        return slot


class _Packer:
    """State of the greedy placement: each stage's position in its order, the tick at which
    every (kind, virtual stage, microbatch) ran, and the slot allocators."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.p, self.v = schedule.num_stages, schedule.num_chunks
        self.orders = [schedule.order(s) for s in range(self.p)]
        self.position = [0] * self.p
        self.ran_at: dict[tuple[str, int, int], int] = {}
        self.inputs = [_Slots() for _ in range(self.p)]
        self.cots = [_Slots() for _ in range(self.p)]
        self.rows: list[dict[str, list[int]]] = []

    def done(self) -> bool:
        return all(pos == len(order) for pos, order in zip(self.position, self.orders, strict=True))

    def next_action(self, s: int, kind: str) -> tuple[int, int] | None:
        """(microbatch, chunk) of stage s's next action if it is of `kind`."""
        if self.position[s] == len(self.orders[s]):
            return None
        action_kind, mb, c = self.orders[s][self.position[s]]
        return (mb, c) if action_kind == kind else None

    def ran_before(self, kind: str, virtual_stage: int, mb: int, t: int) -> bool:
        return self.ran_at.get((kind, virtual_stage, mb), t) < t

    def run(self, kind: str, s: int, mb: int, c: int, t: int) -> None:
        self.ran_at[(kind, c * self.p + s, mb)] = t
        self.position[s] += 1

    def forward_slot(self, t: int, row: dict[str, list[int]]) -> None:
        """F(mb, virtual stage u) runs if F(mb, u - 1) ran before tick t; then sends."""
        p, v = self.p, self.v
        sent = []
        for s in range(p):
            action = self.next_action(s, "F")
            if action is None:
                continue
            mb, c = action
            u = c * p + s
            if u == 0:
                slot = self.inputs[s].put((c, mb))
            elif self.ran_before("F", u - 1, mb, t):
                slot = self.inputs[s].find((c, mb))
            else:
                continue
            row["f_mb"][s], row["f_chunk"][s], row["f_slot"][s] = mb, c, slot
            self.run("F", s, mb, c, t)
            if u != p * v - 1:
                sent.append((*next_stage(s, c, p), mb))
            elif p * v > 1:
                row["f_cot_slot"][s] = self.cots[s].put((c, mb))
        for ns, nc, mb in sent:
            row["recv_act_slot"][ns] = self.inputs[ns].put((nc, mb))

    def backward_slot(self, t: int, row: dict[str, list[int]]) -> None:
        """B(mb, u) runs if B(mb, u + 1) ran before tick t (u last: if F(mb, u) ran by t)."""
        p, v = self.p, self.v
        sent = []
        for s in range(p):
            action = self.next_action(s, "B")
            if action is None:
                continue
            mb, c = action
            u = c * p + s
            if u == p * v - 1:
                if not self.ran_before("F", u, mb, t + 1):
                    continue
                cot_slot = self.cots[s].pop((c, mb)) if p * v > 1 else -1
            elif self.ran_before("B", u + 1, mb, t):
                cot_slot = self.cots[s].pop((c, mb))
            else:
                continue
            row["b_mb"][s], row["b_chunk"][s] = mb, c
            row["b_slot"][s], row["b_cot_slot"][s] = self.inputs[s].pop((c, mb)), cot_slot
            self.run("B", s, mb, c, t)
            if u != 0:
                sent.append((*prev_stage(s, c, p), mb))
        for ps, pc, mb in sent:
            row["recv_cot_slot"][ps] = self.cots[ps].put((pc, mb))

    def tick(self) -> None:
        t = len(self.rows)
        row = {field: [-1] * self.p for field in FIELDS}
        before = list(self.position)
        self.forward_slot(t, row)
        self.backward_slot(t, row)
        if self.position == before:
            raise self.deadlock(t)
        self.rows.append(row)

    def deadlock(self, t: int) -> ValueError:
        sch = self.schedule
        waiting = {
            s: self.orders[s][self.position[s]]
            for s in range(self.p)
            if self.position[s] < len(self.orders[s])
        }
        return ValueError(
            f"schedule {sch.name} (p={sch.num_stages}, m={sch.num_microbatches}, "
            f"v={sch.num_chunks}) deadlocks at tick {t}: no stage can run its next action "
            f"{waiting}"
        )


def _pack(schedule: Schedule) -> _Packer:
    packer = _Packer(schedule)
    while not packer.done():
        packer.tick()
    return packer


def _steady_state_ring_sizes(schedule: Schedule) -> tuple[int, int]:
    """(K, J) of the same schedule at m = 2p, where 1F1B-type rings reach their steady state."""
    m = STEADY_STATE_MICROBATCHES_PER_STAGE * schedule.num_stages
    steady = build(schedule.name, schedule.num_stages, m, schedule.num_chunks, schedule.warmup)
    packer = _pack(steady)
    return max(b.peak for b in packer.inputs), max(b.peak for b in packer.cots)


@functools.lru_cache(maxsize=64)
def build_tick_table(schedule: Schedule) -> TickTable:
    """Places each stage's order into ticks (greedy, order kept) and allocates buffer slots.

    K = max over stages of stage inputs held at once, J likewise for cotangents (at least 1);
    for 1F1B-type schedules with m < 2p, the steady-state sizes at m = 2p, so K and J do not
    depend on m. Cached per (frozen, hashable) schedule; the columns are read-only.
    """
    packer = _pack(schedule)
    p, rows = schedule.num_stages, packer.rows
    arrays = {f: np.array([r[f] for r in rows], np.int32).reshape(len(rows), p) for f in FIELDS}
    for column in arrays.values():
        column.flags.writeable = False
    input_slots = max(b.peak for b in packer.inputs)
    cot_slots = max(b.peak for b in packer.cots)
    steady_m = STEADY_STATE_MICROBATCHES_PER_STAGE * p
    if schedule.name in ("1f1b", "interleaved_1f1b") and schedule.num_microbatches < steady_m:
        steady_k, steady_j = _steady_state_ring_sizes(schedule)
        input_slots, cot_slots = max(input_slots, steady_k), max(cot_slots, steady_j)
    return TickTable(**arrays, num_input_slots=max(input_slots, 1), num_cot_slots=max(cot_slots, 1))
