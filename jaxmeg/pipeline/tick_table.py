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

Split backwards (zero-bubble schedules: I and W instead of B) run in unit ticks: a stage runs
at most one action per tick, F in the F slot, I in the B slot (it sends the input cotangent as
B does, and keeps the output cotangents of the weight matmuls for W in the `wstore` ring), W in
a third slot that sends nothing. The matmul inputs W reads stay in the ring slot (`x slots`)
their forward wrote, from F until W: no backward copies them. With F, I and W of one cost each,
every tick lasts one action and a hop one tick in both directions, so the lockstep grid is the
asynchronous schedule.

Paired ticks (DualPipeV, `Schedule.paired`): one action per stage and tick as above, but a
forward that the order pairs with the backward after it runs in the same tick as that
backward (if it is ready then), one microbatch's F and another's B in one slot of the executor
(F&B), each one's communication under the other's compute. A table may mix whole backwards
(B) and split ones (I, W).

The table is columns of int32 [num_ticks, p]; a later action kind or payload (compressed
ppermute) adds columns, not a new format.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

from jaxmeg.pipeline.schedules import SPECS, Schedule, build, stage_and_chunk, virtual_stage

FIELDS = (
    "f_mb", "f_chunk", "f_slot", "f_x_slot",
    "f_cot_slot",
    "b_mb", "b_chunk", "b_slot", "b_cot_slot", "b_split", "b_w_slot", "b_x_slot",
    "w_mb", "w_chunk", "w_slot", "w_x_slot",
    "recv_act_slot", "recv_cot_slot",
    "recv_act_back_slot", "recv_cot_back_slot", "recv_act_local_slot", "recv_cot_local_slot",
)  # fmt: skip
STEADY_STATE_MICROBATCHES_PER_STAGE = 2
TWO_SLOTS, ONE_ACTION, PAIRS = "two_slots", "one_action", "pairs"
"""How a stage's actions share a tick (`TickTable.ticks`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TickTable:
    """int32 arrays [num_ticks, p], -1 for none.

    f_mb, f_chunk: the forward in the F slot; f_slot: the `inputs` slot it reads (on the first
        virtual stage, the slot the embedded microbatch is written to first).
    f_cot_slot: on the last virtual stage (p v > 1), the `cots` slot where the F slot puts the
        output cotangent that the head and loss backward gives.
    b_mb, b_chunk: the backward in the B slot; b_slot: the `inputs` slot of its stage input
        (freed after); b_cot_slot: the `cots` slot of its output cotangent (-1 when p v = 1).
    b_split: 1 where the B slot runs I (a split backward), which keeps what W needs in the
        `wstore` slot b_w_slot.
    f_x_slot, b_x_slot, w_x_slot: in a table that splits backwards, the `matmul_inputs` slot
        that F writes (the weight matmuls' inputs), that a whole B reads (freed after) or an I
        reads and keeps, and that W reads (freed after); held from F to W, so I moves
        nothing (its stored residuals and then its dY share the slot: `executor.pool`).
    w_mb, w_chunk: the W in the W slot; w_slot: the `wstore` slot it reads (freed after).
    recv_act_slot: after the F slot's ppermute, the `inputs` slot the arriving activation goes to.
    recv_cot_slot: after the B slot's ppermute, the `cots` slot the arriving cotangent goes to.
    recv_act_back_slot, recv_cot_back_slot: the same for what travels against the usual
        direction (ZB-V's chunk 1: activations from stage s + 1, cotangents from s - 1);
        recv_act_local_slot, recv_cot_local_slot: what a stage hands itself (the V's turn on
        stage p - 1). -1 for every other placement.
    num_input_slots (K), num_cot_slots (J), num_w_slots, num_x_slots: ring sizes, max over
        stages.
    ticks: how a stage's actions share a tick: TWO_SLOTS (an F then a B; whole backwards),
        ONE_ACTION (one action; zero-bubble) or PAIRS (one action, or an F&B pair; DualPipeV)
    split: the schedule splits backwards (I and W): the forward keeps what W reads, there is
        a W slot and a `wstore` ring (DualPipeV: some backwards split, some whole)
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
    recv_act_back_slot: np.ndarray
    recv_cot_back_slot: np.ndarray
    recv_act_local_slot: np.ndarray
    recv_cot_local_slot: np.ndarray
    b_split: np.ndarray
    b_w_slot: np.ndarray
    w_mb: np.ndarray
    w_chunk: np.ndarray
    w_slot: np.ndarray
    f_x_slot: np.ndarray
    b_x_slot: np.ndarray
    w_x_slot: np.ndarray
    num_input_slots: int
    num_cot_slots: int
    num_w_slots: int = 0
    num_x_slots: int = 0
    ticks: str = "two_slots"
    split: bool = False
    placement: str = "interleaved"
    """The schedule's chunk placement (`schedules.placement_of`)."""

    def virtual_stages(self, chunks: np.ndarray) -> np.ndarray:
        """int [num_ticks, p]: the virtual stage of each (tick, stage) running chunk `chunks`."""
        p = self.num_stages
        stage = np.arange(p)[None, :]
        if self.placement == "v":
            return np.where(chunks == 1, 2 * p - 1 - stage, stage)
        return chunks * p + stage

    @property
    def whole_backwards(self) -> bool:
        """Whether any backward runs whole (B), in a table that may also split some."""
        return bool(((self.b_mb >= 0) & (self.b_split == 0)).any())

    @property
    def paired(self) -> np.ndarray:
        """bool [num_ticks, p]: the (tick, stage) cells whose F and B run as one F&B slot."""
        if self.ticks != PAIRS:
            return np.zeros(self.f_mb.shape, bool)
        return (self.f_mb >= 0) & (self.b_mb >= 0)

    @property
    def num_ticks(self) -> int:
        return int(self.f_mb.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.f_mb.shape[1])


class _Slots:
    """Lowest-free-index slot allocator that remembers what each slot holds: the slots freed
    below the highest one ever used wait in a heap, so each call is O(log K) (the planner
    builds tables of hundreds of stages and microbatches)."""

    def __init__(self) -> None:
        self.slot_of: dict[tuple[int, int], int] = {}
        self.freed: list[int] = []
        self.used = 0  # slots 0 .. used - 1 have held something
        self.peak = 0

    def put(self, item: tuple[int, int]) -> int:
        if self.freed:
            slot = heapq.heappop(self.freed)
        else:
            slot, self.used = self.used, self.used + 1
        self.slot_of[item] = slot
        self.peak = max(self.peak, len(self.slot_of))
        return slot

    def find(self, item: tuple[int, int]) -> int:
        return self.slot_of[item]

    def pop(self, item: tuple[int, int]) -> int:
        slot = self.slot_of.pop(item)
        heapq.heappush(self.freed, slot)
        return slot


class _Packer:
    """State of the greedy placement: each stage's position in its order, the tick at which
    every (kind, virtual stage, microbatch) ran, and the slot allocators."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.p, self.v = schedule.num_stages, schedule.num_chunks
        self.placement = schedule.placement
        self.orders = [schedule.order(s) for s in range(self.p)]
        self.position = [0] * self.p
        self.ran_at: dict[tuple[str, int, int], int] = {}
        self.inputs = [_Slots() for _ in range(self.p)]
        self.cots = [_Slots() for _ in range(self.p)]
        self.wstore = [_Slots() for _ in range(self.p)]
        self.xs = [_Slots() for _ in range(self.p)]  # the matmul inputs, F to W
        self.split = split_backward(schedule)
        self.ticks = PAIRS if schedule.paired else ONE_ACTION if self.split else TWO_SLOTS
        self.paired = [set(positions) for positions in schedule.paired] or [set()] * self.p
        self.busy: set[int] = set()  # stages that ran their tick's last action
        self.rows: list[dict[str, list[int]]] = []

    def virtual(self, stage: int, chunk: int) -> int:
        return virtual_stage(stage, chunk, self.p, self.placement)

    def stage_and_chunk(self, u: int) -> tuple[int, int]:
        return stage_and_chunk(u, self.p, self.placement)

    def arrival_column(self, what: str, sender: int, receiver: int, chunk: int) -> str:
        """The receive column of an activation or cotangent (`what`) that `sender` sends to
        `chunk` on `receiver`: local (the V's turn), against the usual direction (the V's
        chunk 1 gets activations from s + 1 and cotangents from s - 1), or the usual one."""
        if sender == receiver:
            return f"recv_{what}_local_slot"
        if self.placement == "v" and chunk == 1:
            return f"recv_{what}_back_slot"
        return f"recv_{what}_slot"

    def done(self) -> bool:
        return all(pos == len(order) for pos, order in zip(self.position, self.orders, strict=True))

    def next_action(self, s: int, kind: str) -> tuple[int, int] | None:
        """(microbatch, chunk) of stage s's next action if it is of `kind`."""
        if self.position[s] == len(self.orders[s]) or s in self.busy:
            return None
        action_kind, mb, c = self.orders[s][self.position[s]]
        return (mb, c) if action_kind in kind else None

    def ran_before(self, kind: str, virtual_stage: int, mb: int, t: int) -> bool:
        return self.ran_at.get((kind, virtual_stage, mb), t) < t

    def run(self, kind: str, s: int, mb: int, c: int, t: int) -> None:
        self.ran_at[(kind, self.virtual(s, c), mb)] = t
        pairs_with_next = kind == "F" and self.position[s] in self.paired[s]
        self.position[s] += 1
        if self.ticks != TWO_SLOTS and not pairs_with_next:
            self.busy.add(s)

    def forward_slot(self, t: int, row: dict[str, list[int]]) -> None:
        """F(mb, virtual stage u) runs if F(mb, u - 1) ran before tick t; then sends."""
        p, v = self.p, self.v
        sent = []
        for s in range(p):
            action = self.next_action(s, "F")
            if action is None:
                continue
            mb, c = action
            u = self.virtual(s, c)
            if u == 0:
                slot = self.inputs[s].put((c, mb))
            elif self.ran_before("F", u - 1, mb, t):
                slot = self.inputs[s].find((c, mb))
            else:
                continue
            row["f_mb"][s], row["f_chunk"][s], row["f_slot"][s] = mb, c, slot
            if self.split:
                row["f_x_slot"][s] = self.xs[s].put((c, mb))
            self.run("F", s, mb, c, t)
            if u != p * v - 1:
                sent.append((s, *self.stage_and_chunk(u + 1), mb))
            elif p * v > 1:
                row["f_cot_slot"][s] = self.cots[s].put((c, mb))
        for s, ns, nc, mb in sent:
            column = self.arrival_column("act", s, ns, nc)
            row[column][ns] = self.inputs[ns].put((nc, mb))

    def backward_slot(self, t: int, row: dict[str, list[int]]) -> None:
        """B or I (mb, u) runs if B or I (mb, u + 1) ran before tick t (u last: if F(mb, u)
        ran by t with TWO_SLOTS, else before it)."""
        p, v = self.p, self.v
        sent = []
        for s in range(p):
            action = self.next_action(s, "BI")
            if action is None:
                continue
            mb, c = action
            u = self.virtual(s, c)
            if u == p * v - 1:
                if not self.ran_before("F", u, mb, t + (self.ticks == TWO_SLOTS)):
                    continue
                cot_slot = self.cots[s].pop((c, mb)) if p * v > 1 else -1
            elif self.ran_before("B", u + 1, mb, t):
                cot_slot = self.cots[s].pop((c, mb))
            else:
                continue
            row["b_mb"][s], row["b_chunk"][s] = mb, c
            row["b_slot"][s], row["b_cot_slot"][s] = self.inputs[s].pop((c, mb)), cot_slot
            if self.orders[s][self.position[s]][0] == "I":
                row["b_split"][s] = 1
                row["b_w_slot"][s] = self.wstore[s].put((c, mb))
                row["b_x_slot"][s] = self.xs[s].slot_of[(c, mb)]  # held until its W
            elif self.split:  # a whole B in a table that splits others: its W at once
                row["b_x_slot"][s] = self.xs[s].pop((c, mb))
            self.run("B", s, mb, c, t)
            if u != 0:
                sent.append((s, *self.stage_and_chunk(u - 1), mb))
        for s, ps, pc, mb in sent:
            column = self.arrival_column("cot", s, ps, pc)
            row[column][ps] = self.cots[ps].put((pc, mb))

    def weight_slot(self, t: int, row: dict[str, list[int]]) -> None:
        """W(mb, u) runs if I(mb, u) ran before tick t; it sends nothing."""
        for s in range(self.p):
            action = self.next_action(s, "W")
            if action is None:
                continue
            mb, c = action
            if not self.ran_before("B", self.virtual(s, c), mb, t):
                continue
            row["w_mb"][s], row["w_chunk"][s] = mb, c
            row["w_slot"][s] = self.wstore[s].pop((c, mb))
            row["w_x_slot"][s] = self.xs[s].pop((c, mb))
            self.run("W", s, mb, c, t)

    def tick(self) -> None:
        t = len(self.rows)
        row = {field: [-1] * self.p for field in FIELDS}
        row["b_split"] = [0] * self.p
        before = list(self.position)
        self.busy = set()
        self.forward_slot(t, row)
        self.backward_slot(t, row)
        self.weight_slot(t, row)
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


def split_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits its backwards into I and W (then it runs in unit ticks)."""
    return any(kind == "I" for kind, _, _ in schedule.order(0))


def _pack(schedule: Schedule) -> _Packer:
    packer = _Packer(schedule)
    while not packer.done():
        packer.tick()
    return packer


def _ring_sizes(packer: _Packer) -> tuple[int, int, int, int]:
    rings = (packer.inputs, packer.cots, packer.wstore, packer.xs)
    return tuple(max(b.peak for b in ring) for ring in rings)


def _steady_state_ring_sizes(schedule: Schedule) -> tuple[int, int, int, int]:
    """(K, J, W, X) of the same schedule at m = 2p, where 1F1B-type rings reach their steady
    state."""
    m = STEADY_STATE_MICROBATCHES_PER_STAGE * schedule.num_stages
    steady = build(schedule.name, schedule.num_stages, m, schedule.num_chunks, schedule.warmup)
    return _ring_sizes(_pack(steady))


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
    sizes = _ring_sizes(packer)
    steady_m = STEADY_STATE_MICROBATCHES_PER_STAGE * p
    if (
        schedule.name in SPECS
        and SPECS[schedule.name].steady_rings
        and schedule.num_microbatches < steady_m
    ):
        sizes = tuple(map(max, sizes, _steady_state_ring_sizes(schedule)))
    input_slots, cot_slots, w_slots, x_slots = sizes
    return TickTable(
        **arrays, num_input_slots=max(input_slots, 1), num_cot_slots=max(cot_slots, 1),
        num_w_slots=w_slots, num_x_slots=x_slots, ticks=packer.ticks, split=packer.split,
        placement=schedule.placement,
    )  # fmt: skip
