"""The tick table the executor runs, built from a schedule's per-stage orders, and its checks.

All stages advance in lockstep, one tick at a time. A tick is an F slot then a B slot:
  F slot  a stage may run one forward; then every stage ppermutes activations s -> s+1 (stage
          p-1 feeds chunk c+1 on stage 0). The last virtual stage sends nothing.
  B slot  a stage may run one backward (forward recomputed from the saved input, then vjp);
          then every stage ppermutes input cotangents s -> s-1 (stage 0 feeds chunk c-1 on
          stage p-1). The first virtual stage sends nothing.
Latency: what is sent in tick t is usable from tick t+1. On the last virtual stage F(mb) and
B(mb) may share a tick: the loss is local.

Buffers per stage: `inputs`, a ring of stage inputs, written on arrival (on the first virtual
stage, by its own forward: the embedded microbatch), read by F and again by B, freed after B;
`cots`, a ring of received cotangents, freed after B. Slots are the lowest free index.

Ring sizes depend on the schedule family (p, v, warm-up), not on m: for 1F1B-type schedules the
rings are sized for the steady state (the peak at m = 2p), so a step's memory is the same for any
m; GPipe keeps all m stage inputs, its rings grow with m.

Placement is greedy and keeps each stage's order: in every tick each stage runs its next action
if its inputs have arrived, a forward in the F slot and then, if the next action is a backward
whose cotangent is there, that backward in the B slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FIELDS = (
    "f_mb", "f_chunk", "f_slot",
    "b_mb", "b_chunk", "b_slot", "b_cot_slot",
    "recv_act_slot", "recv_cot_slot",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class TickTable:
    """int32 arrays [num_ticks, p], -1 for none. f_*: the F slot's action and the input slot it
    reads; b_*: the B slot's action, its saved-input slot and its cotangent slot (-1 on the last
    virtual stage); recv_*: the slot an arriving activation / cotangent is written to."""

    f_mb: np.ndarray
    f_chunk: np.ndarray
    f_slot: np.ndarray
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


class _Slots:
    """Lowest-free-index slot allocator that remembers what each slot holds."""

    def __init__(self):
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


def _next_stage(s: int, c: int, p: int) -> tuple[int, int]:
    return (s + 1, c) if s < p - 1 else (0, c + 1)


def _prev_stage(s: int, c: int, p: int) -> tuple[int, int]:
    return (s - 1, c) if s > 0 else (p - 1, c - 1)


def build_tick_table(schedule) -> TickTable:
    """Places each stage's order into ticks (greedy, order kept) and allocates buffer slots."""
    p, v = schedule.num_stages, schedule.num_chunks
    orders = [schedule.order(s) for s in range(p)]
    position = [0] * p
    forward_tick: dict[tuple[int, int, int], int] = {}  # (stage, chunk, mb) -> tick
    backward_tick: dict[tuple[int, int, int], int] = {}
    inputs, cots = [_Slots() for _ in range(p)], [_Slots() for _ in range(p)]
    rows: list[dict[str, list[int]]] = []
    limit = 4 * sum(len(o) for o in orders) + 4 * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        if t > limit:
            raise RuntimeError(f"schedule {schedule.name} cannot be placed: stuck at tick {t}")
        row = {f: [-1] * p for f in FIELDS}
        sent = []
        for s in range(p):
            action = orders[s][position[s]] if position[s] < len(orders[s]) else None
            if action is None or action[0] != "F":
                continue
            _, mb, c = action
            if s == 0 and c == 0:
                slot = inputs[s].put((c, mb))
            else:
                ps, pc = _prev_stage(s, c, p)
                if forward_tick.get((ps, pc, mb), t) >= t:
                    continue
                slot = inputs[s].find((c, mb))
            row["f_mb"][s], row["f_chunk"][s], row["f_slot"][s] = mb, c, slot
            forward_tick[(s, c, mb)] = t
            position[s] += 1
            if not (s == p - 1 and c == v - 1):
                sent.append(_next_stage(s, c, p) + (mb,))
        for ns, nc, mb in sent:
            row["recv_act_slot"][ns] = inputs[ns].put((nc, mb))
        sent = []
        for s in range(p):
            action = orders[s][position[s]] if position[s] < len(orders[s]) else None
            if action is None or action[0] != "B":
                continue
            _, mb, c = action
            last = s == p - 1 and c == v - 1
            if last:
                if forward_tick.get((s, c, mb), t + 1) > t:
                    continue
                row["b_cot_slot"][s] = -1
            else:
                ns, nc = _next_stage(s, c, p)
                if backward_tick.get((ns, nc, mb), t) >= t:
                    continue
                row["b_cot_slot"][s] = cots[s].pop((c, mb))
            row["b_mb"][s], row["b_chunk"][s], row["b_slot"][s] = mb, c, inputs[s].pop((c, mb))
            backward_tick[(s, c, mb)] = t
            position[s] += 1
            if not (s == 0 and c == 0):
                sent.append(_prev_stage(s, c, p) + (mb,))
        for ps, pc, mb in sent:
            row["recv_cot_slot"][ps] = cots[ps].put((pc, mb))
        rows.append(row)
    arrays = {f: np.array([r[f] for r in rows], np.int32).reshape(len(rows), p) for f in FIELDS}
    input_slots = max(max(b.peak for b in inputs), 1)
    cot_slots = max(max(b.peak for b in cots), 1)
    steady = 2 * p
    if schedule.name != "gpipe" and schedule.num_microbatches < steady:
        from jaxmeg.pipeline.schedules import build

        ref = build(schedule.name, p, steady, v, schedule.warmup).tick_table
        input_slots = max(input_slots, ref.num_input_slots)
        cot_slots = max(cot_slots, ref.num_cot_slots)
    return TickTable(**arrays, num_input_slots=input_slots, num_cot_slots=cot_slots)
