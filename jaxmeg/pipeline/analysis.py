"""Checks a tick table by replaying it, and models its lockstep time.

`validate` replays the table with the executor's semantics, independently of how the table
was built: every (stage, F|B, microbatch, chunk) runs exactly once and in the stage's order,
each read finds the right data in its slot (so every dependency and latency holds), no slot is
overwritten while in use, and every send has a receiving slot.

`lockstep_efficiency`: a tick lasts max over stages of the F slot's cost plus max over stages of
the B slot's cost (each slot ends in an all-stage ppermute), with a forward of one chunk costing
1/v and a backward `backward_cost`/v (2; 3 with recompute counted). Efficiency = ideal compute
time m (1 + backward_cost) over the lockstep time. Megatron's asynchronous bound is
1 / (1 + bubble), bubble = (p - 1) / (v m).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np

from jaxmeg.pipeline.schedules import Schedule, build, stage_and_chunk
from jaxmeg.pipeline.tick_table import ONE_ACTION, TWO_SLOTS, TickTable, build_tick_table
from jaxmeg.pipeline.timing import (
    action_cost,
    async_efficiency,
    async_time,
    bubble_fraction,
    ideal_time,
)


class ScheduleError(AssertionError):
    """A tick table breaks a dependency, a buffer or the schedule's order."""


@dataclasses.dataclass(frozen=True)
class Report:
    input_slots: tuple[int, ...]
    """Stage inputs held at once, per stage (what the executor's ring must hold)."""
    cot_slots: tuple[int, ...]
    """Received cotangents held at once, per stage."""
    w_slots: tuple[int, ...]
    """Split backwards: microbatches between I and W at once, per stage (matmul inputs and
    output cotangents kept for W)."""
    num_ticks: int
    bubble: float
    """Megatron's asynchronous bubble fraction (p - 1) / (v m)."""
    lockstep_efficiency: float
    """Ideal compute / lockstep time, backward = 2 x forward."""
    lockstep_efficiency_recompute: float
    """The same with the recomputed forward counted in the backward (3 x forward)."""
    async_bound: float
    """1 / (1 + bubble)."""


def _fail(message: str) -> None:
    raise ScheduleError(message)


def _replay_slot(held: dict, slot: int, item, what: str) -> None:
    if held.get(slot) != item:
        _fail(f"{what}: slot {slot} holds {held.get(slot)}, expected {item}")


def _arrive(table: TickTable, t: int, what: str, sends: dict, deliver, placement: str) -> None:
    """Delivers tick t's sends {sender: (receiver, chunk, mb)} of `what` (act | cot) into the
    slots the table's receive columns name: local, against the usual direction (a V's chunk
    1), or the usual one; fails on a slot set where nothing arrives."""
    arrived: dict[tuple[str, int], tuple[int, int]] = {}
    for sender, (receiver, chunk, mb) in sends.items():
        if sender == receiver:
            column = f"recv_{what}_local_slot"
        elif placement == "v" and chunk == 1:
            column = f"recv_{what}_back_slot"
        else:
            column = f"recv_{what}_slot"
        arrived[column, receiver] = (chunk, mb)
    for column in (f"recv_{what}_slot", f"recv_{what}_back_slot", f"recv_{what}_local_slot"):
        for s in range(table.num_stages):
            slot = int(getattr(table, column)[t, s])
            if (column, s) in arrived:
                deliver(s, slot, arrived[column, s], f"tick {t} {column}")
            elif slot >= 0:
                _fail(f"tick {t} stage {s}: {column} {slot} set but nothing arrives")


class _Replay:
    """A tick table played out per stage: what each ring slot holds, the peak of each ring, and
    the order each stage ran its actions in; `_fail` at the first inconsistency."""

    def __init__(self, schedule: Schedule, table: TickTable):
        p = schedule.num_stages
        self.schedule, self.table, self.p = schedule, table, p
        self.last = p * schedule.num_chunks - 1
        self.inputs = [dict() for _ in range(p)]
        self.cots = [dict() for _ in range(p)]
        self.wstore = [dict() for _ in range(p)]
        self.xs = [dict() for _ in range(p)]  # split backwards: matmul inputs, F to W
        self.ran = [[] for _ in range(p)]
        self.peak_in, self.peak_cot, self.peak_w = [0] * p, [0] * p, [0] * p
        self.peak_x = [0] * p

    def neighbour(self, s: int, c: int, step: int) -> tuple[int, int]:
        sch = self.schedule
        return stage_and_chunk(sch.virtual_stage(s, c) + step, self.p, sch.placement)

    @staticmethod
    def deliver(held, s, slot, item, peak, what):
        if slot < 0:
            _fail(f"{what}: stage {s} receives {item} but has no slot for it")
        if slot in held:
            _fail(f"{what}: stage {s} slot {slot} overwritten while holding {held[slot]}")
        held[slot] = item
        peak[s] = max(peak[s], len(held))

    def forward(self, t: int) -> None:
        table, sch, sends = self.table, self.schedule, {}
        for s in range(self.p):
            mb, c, slot = (int(table.f_mb[t, s]), int(table.f_chunk[t, s]), int(table.f_slot[t, s]))
            if mb < 0:
                continue
            self.ran[s].append(("F", mb, c))
            where = f"tick {t} stage {s} F{mb}.{c}"
            u = sch.virtual_stage(s, c)
            if u == 0:
                self.deliver(self.inputs[s], s, slot, (c, mb), self.peak_in, where)
            else:
                _replay_slot(self.inputs[s], slot, (c, mb), where)
            if table.split:
                x_slot = int(table.f_x_slot[t, s])
                self.deliver(self.xs[s], s, x_slot, (c, mb), self.peak_x, where + " X")
            cot_slot = int(table.f_cot_slot[t, s])
            if u != self.last:
                ns, nc = self.neighbour(s, c, 1)
                sends[s] = (ns, nc, mb)
                if cot_slot >= 0:
                    _fail(f"{where}: a cotangent slot ({cot_slot}) off the last virtual stage")
            elif self.last > 0:
                where += " head cotangent"
                self.deliver(self.cots[s], s, cot_slot, (c, mb), self.peak_cot, where)
        _arrive(table, t, "act", sends, lambda s, slot, item, where: self.deliver(
            self.inputs[s], s, slot, item, self.peak_in, where), sch.placement)  # fmt: skip

    def backward(self, t: int) -> None:
        table, sch, sends = self.table, self.schedule, {}
        for s in range(self.p):
            mb, c = int(table.b_mb[t, s]), int(table.b_chunk[t, s])
            if mb < 0:
                continue
            split = bool(table.b_split[t, s])
            kind = "I" if split else "B"
            self.ran[s].append((kind, mb, c))
            where = f"tick {t} stage {s} {kind}{mb}.{c}"
            slot = int(table.b_slot[t, s])
            _replay_slot(self.inputs[s], slot, (c, mb), where)
            del self.inputs[s][slot]
            u = sch.virtual_stage(s, c)
            if u == self.last == 0:
                if ("F", mb, c) not in self.ran[s]:
                    _fail(f"{where}: backward before its forward")
            else:
                cot_slot = int(table.b_cot_slot[t, s])
                _replay_slot(self.cots[s], cot_slot, (c, mb), where + " cotangent")
                del self.cots[s][cot_slot]
            if split:
                w_slot = int(table.b_w_slot[t, s])
                self.deliver(self.wstore[s], s, w_slot, (c, mb), self.peak_w, where + " W")
            elif table.split:  # a whole B takes its matmul inputs with it
                self._take_x(s, int(table.b_x_slot[t, s]), (c, mb), where)
            if u != 0:
                ps, pc = self.neighbour(s, c, -1)
                sends[s] = (ps, pc, mb)
        _arrive(table, t, "cot", sends, lambda s, slot, item, where: self.deliver(
            self.cots[s], s, slot, item, self.peak_cot, where), sch.placement)  # fmt: skip

    def weights(self, t: int) -> None:
        table = self.table
        for s in range(self.p):
            mb, c = int(table.w_mb[t, s]), int(table.w_chunk[t, s])
            if mb < 0:
                continue
            self.ran[s].append(("W", mb, c))
            slot, where = int(table.w_slot[t, s]), f"tick {t} stage {s} W{mb}.{c}"
            _replay_slot(self.wstore[s], slot, (c, mb), where)
            del self.wstore[s][slot]
            self._take_x(s, int(table.w_x_slot[t, s]), (c, mb), where)
        if table.ticks == TWO_SLOTS:
            return
        paired = table.paired
        for s in range(self.p):
            count = sum(int(col[t, s] >= 0) for col in (table.f_mb, table.b_mb, table.w_mb))
            if count > 1 + bool(paired[t, s]):
                _fail(f"tick {t} stage {s}: {count} actions in one {table.ticks} tick")
            if table.ticks == ONE_ACTION or not paired[t, s]:
                continue
            listed = self.schedule.paired[s] if self.schedule.paired else ()
            if table.b_split[t, s] or len(self.ran[s]) - 2 not in listed:
                _fail(
                    f"tick {t} stage {s}: F and B share the tick but the order does not "
                    f"pair them ({self.ran[s][-2:]})"
                )

    def _take_x(self, s: int, slot: int, item: tuple[int, int], where: str) -> None:
        _replay_slot(self.xs[s], slot, item, where + " X")
        del self.xs[s][slot]

    def finish(self) -> None:
        """Every stage ran its order and ended with empty rings that fit the table's slots."""
        table, sch = self.table, self.schedule
        for s in range(self.p):
            if self.ran[s] != sch.order(s):
                _fail(
                    f"stage {s} ran {self.ran[s][:6]}... which is not its order "
                    f"{sch.order(s)[:6]}..."
                )
            if self.inputs[s] or self.cots[s] or self.wstore[s] or self.xs[s]:
                _fail(f"stage {s} ends with buffers still holding {self.inputs[s]} / "
                      f"{self.cots[s]} / {self.wstore[s]} / {self.xs[s]}")  # fmt: skip
        if max(self.peak_w) > table.num_w_slots:
            _fail(f"W needs {max(self.peak_w)} wstore slots, the table has {table.num_w_slots}")
        if max(self.peak_x) > table.num_x_slots:
            _fail(f"the matmul inputs need {max(self.peak_x)} slots, the table has "
                  f"{table.num_x_slots}")  # fmt: skip
        if max(self.peak_in) > table.num_input_slots or max(self.peak_cot) > table.num_cot_slots:
            _fail(
                f"buffers need {max(self.peak_in)}/{max(self.peak_cot)} slots, the table has "
                f"{table.num_input_slots}/{table.num_cot_slots}"
            )


def validate(schedule: Schedule, table: TickTable | None = None) -> Report:
    """Replays `table` (default: the schedule's own) and returns buffer sizes and efficiency."""
    table = table if table is not None else build_tick_table(schedule)
    replay = _Replay(schedule, table)
    for t in range(table.num_ticks):
        replay.forward(t)
        replay.backward(t)
        replay.weights(t)
    replay.finish()
    bubble = bubble_fraction(schedule.name, schedule.num_stages, schedule.num_microbatches,
                             schedule.num_chunks)  # fmt: skip
    return Report(
        input_slots=tuple(replay.peak_in),
        cot_slots=tuple(replay.peak_cot),
        w_slots=tuple(replay.peak_w),
        num_ticks=table.num_ticks,
        bubble=bubble,
        lockstep_efficiency=lockstep_efficiency(schedule, table=table),
        lockstep_efficiency_recompute=lockstep_efficiency(schedule, 3.0, table=table),
        async_bound=1.0 / (1.0 + bubble),
    )


def held_microbatches(
    schedule: Schedule, table: TickTable | None = None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage, the peak over ticks of (whole, split) microbatches held, in stage-microbatch
    units (a chunk's counts 1/v): whole = forward ran, B or I not yet (what the forward keeps
    for the backward); split = I ran, W not yet (the matmul inputs and output cotangents).
    Counted at the end of each tick, after its slots."""
    table = table if table is not None else build_tick_table(schedule)
    p, v = schedule.num_stages, schedule.num_chunks
    whole, split = np.zeros(p), np.zeros(p)
    peak_whole, peak_split = np.zeros(p), np.zeros(p)
    for t in range(table.num_ticks):
        whole += (table.f_mb[t] >= 0).astype(int) - (table.b_mb[t] >= 0)
        split += ((table.b_mb[t] >= 0) & (table.b_split[t] > 0)).astype(int) - (table.w_mb[t] >= 0)
        peak_whole, peak_split = np.maximum(peak_whole, whole), np.maximum(peak_split, split)
    return tuple((peak_whole / v).tolist()), tuple((peak_split / v).tolist())


def lockstep_time(
    schedule: Schedule,
    backward_cost: float = 2.0,
    table: TickTable | None = None,
    split: tuple[float, float] | None = None,
):
    """Sum over ticks of (max F-slot cost + max B-slot cost), one forward of a stage = 1; in
    ONE_ACTION and PAIRS ticks, of the max over stages of the tick's actions' cost (one action,
    or an F&B pair at F + B: the model counts no overlap of the pair's compute)
    (`timing.action_cost`: I and W half a backward each, or `split` = their measured costs)."""
    table = table if table is not None else build_tick_table(schedule)
    v = schedule.num_chunks

    def cost(kind: str) -> float:
        return action_cost(kind, v, backward_cost, split)

    forward = np.where(table.f_mb >= 0, cost("F"), 0.0)
    backward_kind = np.where(table.b_split > 0, cost("I"), cost("B"))
    backward = np.where(table.b_mb >= 0, backward_kind, 0.0)
    weight = np.where(table.w_mb >= 0, cost("W"), 0.0)
    if table.ticks != TWO_SLOTS:
        return float((forward + backward + weight).max(axis=1).sum())
    return float(forward.max(axis=1).sum() + backward.max(axis=1).sum())


def paired_share(schedule: Schedule) -> float:
    """The share of F, B and I actions that the lockstep table runs in F&B pairs (each pair
    two of them), over all stages."""
    table = build_tick_table(schedule)
    actions = int((table.f_mb >= 0).sum() + (table.b_mb >= 0).sum())
    return 2 * int(table.paired.sum()) / actions


@functools.lru_cache(maxsize=256)
def lockstep_bubble(name: str, p: int, m: int, v: int) -> float:
    """Idle over compute time of schedule `name`'s lockstep table (B = 2 F, I = W = F; the
    trainer's `min_bubble` warm-up for 1f1b)."""
    schedule = build(name, p, m, num_chunks=v, warmup="min_bubble")
    return 1.0 / lockstep_efficiency(schedule) - 1.0


@functools.lru_cache(maxsize=1024)
def _kinds_per_tick(name: str, p: int, m: int, v: int) -> tuple[tuple[tuple[str, ...], int], ...]:
    """A table's ticks counted by the kinds of action some stage runs in them: in a one-action
    table a tick then lasts its costliest kind (`lockstep_time`'s rule), whatever the costs,
    so the planner prices each layout's I and W on these counts, not on the table."""
    table = build_tick_table(build(name, p, m, num_chunks=v, warmup="min_bubble"))
    backward = table.b_mb >= 0
    runs = {"F": table.f_mb >= 0, "I": backward & (table.b_split > 0),
            "B": backward & (table.b_split == 0), "W": table.w_mb >= 0}  # fmt: skip
    counts = collections.Counter(
        tuple(kind for kind, ran in runs.items() if ran[t].any()) for t in range(table.num_ticks)
    )
    return tuple(counts.items())


def split_lockstep_bubble(name: str, p: int, m: int, v: int, split: tuple[float, float]) -> float:
    """Idle over compute time of a one-action table (the zero-bubble schedules) whose I and W
    cost `split` forwards of a stage each: a tick lasts its costliest action (`lockstep_time`),
    read off the table's ticks counted by the kinds they run, built once per (name, p, m, v)
    (the planner asks for many layouts' costs). At I = W = 1, `lockstep_bubble`."""
    ticks = _kinds_per_tick(name, p, m, v)
    lockstep = sum(n * max(action_cost(k, v, split=split) for k in kinds) for kinds, n in ticks
                   if kinds)  # fmt: skip
    return lockstep / (m * (1.0 + sum(split))) - 1.0


def lockstep_efficiency(
    schedule: Schedule,
    backward_cost: float = 2.0,
    table: TickTable | None = None,
    split: tuple[float, float] | None = None,
) -> float:
    """ideal_time / lockstep_time."""
    ideal = ideal_time(schedule, backward_cost, split)
    return ideal / lockstep_time(schedule, backward_cost, table, split)


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def efficiency_tables(stage_counts: tuple[int, ...] = (2, 4, 8), chunks=(2, 3, 4)) -> str:
    """Markdown: lockstep efficiency (backward = 2 and 3 forwards) against Megatron's bound
    1 / (1 + bubble) for every m in p..4p: 1F1B with both warm-ups (and the stage-0 stored
    inputs each needs), then interleaved 1F1B for each v where m is a multiple of p."""

    def eff(schedule, cost):
        return f"{lockstep_efficiency(schedule, cost):.3f}"

    lines = [
        "1F1B (`1f1b`): lockstep efficiency with backward = 2 / 3 forwards",
        "",
        _row("p", "m", "bound", "min_memory (async)", "min_bubble", "bound, bwd 3",
             "min_memory, bwd 3", "min_bubble, bwd 3", "stage-0 inputs lean / fast"),
        _row(*["---"] * 9),
    ]  # fmt: skip
    for p in stage_counts:
        for m in range(p, 4 * p + 1):
            lean, fast = build("1f1b", p, m), build("1f1b", p, m, warmup="min_bubble")
            r_lean, r_fast = validate(lean), validate(fast)
            bound3 = 1 / (1 + r_fast.bubble)  # the bound does not depend on the cost ratio
            lines.append(
                _row(p, m, f"{r_fast.async_bound:.3f}",
                     f"{eff(lean, 2)} ({async_efficiency(lean):.3f})", eff(fast, 2),
                     f"{bound3:.3f}", eff(lean, 3), eff(fast, 3),
                     f"{r_lean.input_slots[0]} / {r_fast.input_slots[0]}")
            )  # fmt: skip

    def chunked_table(title: str, cell) -> list[str]:
        """A table over p, m (multiples of p up to 4p) and v, one `cell(p, m, v)` each."""
        table = ["", title, "", _row("p", "m", *[f"v={v}" for v in chunks])]
        table.append(_row(*["---"] * (2 + len(chunks))))
        for p in stage_counts:
            for m in range(p, 4 * p + 1, p):
                table.append(_row(p, m, *[cell(p, m, v) for v in chunks]))
        return table

    def interleaved(p, m, v):
        inter = build("interleaved_1f1b", p, m, num_chunks=v)
        return f"{validate(inter).async_bound:.3f} / {eff(inter, 2)} / {eff(inter, 3)}"

    def breadth_against_interleaved(p, m, v):
        breadth = build("breadth_first", p, m, num_chunks=v)
        inter = build("interleaved_1f1b", p, m, num_chunks=v)
        stored = f"{validate(breadth).input_slots[0]} / {validate(inter).input_slots[0]}"
        return f"{eff(breadth, 2)} / {eff(inter, 2)}; {stored}"

    lines += chunked_table(
        "Interleaved 1F1B (`interleaved_1f1b`, Megatron's order): bound / lockstep with "
        "backward = 2 / lockstep with backward = 3",
        interleaved,
    )
    lines += chunked_table(
        "Breadth-first (`breadth_first`, layered gradient accumulation) against interleaved 1F1B "
        "at equal v: lockstep efficiency with backward = 2, and stage-0 stored inputs "
        "(breadth-first / interleaved). The bubble is the same; breadth-first keeps m v inputs.",
        breadth_against_interleaved,
    )
    return "\n".join(lines)


ZERO_BUBBLE_COLUMNS = (
    ("1f1b", 1, "min_bubble"), ("interleaved_1f1b", 2, "min_bubble"), ("zb_h1", 1, "min_memory"),
    ("interleaved_zb", 2, "min_memory"), ("zbv", 2, "min_memory"),
)  # fmt: skip


def zero_bubble_table(stage_counts: tuple[int, ...] = (2, 4, 8)) -> str:
    """Markdown: for p in `stage_counts` and m in {p, 2p, 4p}, per schedule, the lockstep
    efficiency with F = I = W = 1 (B = 2) and, largest over stages each, the held microbatches
    whole (forward ran, backward or I not yet) + split (I ran, W not yet), in stage-microbatch
    units (`held_microbatches`). 1F1B with the trainer's min_bubble warm-up."""
    header = [f"{name}{f' v={v}' if v > 1 else ''}" for name, v, _ in ZERO_BUBBLE_COLUMNS]
    lines = [_row("p", "m", *header), _row(*["---"] * (2 + len(header)))]
    for p in stage_counts:
        for m in (p, 2 * p, 4 * p):
            cells = []
            for name, v, warmup in ZERO_BUBBLE_COLUMNS:
                schedule = build(name, p, m, num_chunks=v, warmup=warmup)
                whole, split = held_microbatches(schedule)
                held = f"{max(whole):g}" + (f" + {max(split):g}" if max(split) else "")
                cells.append(f"{lockstep_efficiency(schedule):.3f} ({held})")
            lines.append(_row(p, m, *cells))
    return "\n".join(lines)


def deepseek_dualpipev(num_stages: int, split: tuple[float, float] = (0.5, 0.5)) -> dict:
    """DualPipeV as DeepSeek's table states it (DeepSeek-V3 report, table 2, and the DualPipe
    repository's DualPipeV row) for p devices, PP = 2p stages (chunks) in a V: bubble
    (PP/2 - 1)(F&B + B - 3W) and PP + 1 stage activations held, in this module's units (one
    forward of a whole stage = 1, a chunk's F = 1/2, B = I + W = `split` summed; F&B counted
    as F + B, no overlap): {"bubble", "held"}, held in stage microbatches (a chunk's = 1/2)."""
    i_cost, w_cost = split
    forward, backward = 0.5, i_cost + w_cost
    pp = 2 * num_stages
    bubble = (pp / 2 - 1) * ((forward + backward) + backward - 3 * w_cost)
    return {"bubble": bubble, "held": (pp + 1) / 2}


def dualpipev_table(stage_counts: tuple[int, ...] = (4, 8)) -> str:
    """Markdown: DualPipeV against DeepSeek's formulas and against zbv, for p in
    `stage_counts` and m in {2p, 4p}: idle time per step (lockstep table, asynchronous orders,
    DeepSeek's bubble; one forward of a stage = 1, F = I = W per chunk), the lockstep
    efficiency, and the held microbatches (whole + split, stage-microbatch units) against
    DeepSeek's PP + 1."""
    lines = [
        _row("p", "m", "dualpipev idle: lockstep / async / DeepSeek", "zbv idle: lockstep / async",
             "lockstep efficiency dualpipev / zbv", "held dualpipev (DeepSeek) / zbv"),
        _row(*["---"] * 6),
    ]  # fmt: skip
    for p in stage_counts:
        formula = deepseek_dualpipev(p)
        for m in (2 * p, 4 * p):
            cells = {}
            for name in ("dualpipev", "zbv"):
                schedule = build(name, p, m, num_chunks=2)
                ideal = ideal_time(schedule)
                lockstep = lockstep_time(schedule)
                idle = f"{lockstep - ideal:g} / {async_time(schedule) - ideal:g}"
                whole, split = held_microbatches(schedule)
                cells[name] = (idle, ideal / lockstep, f"{max(whole):g} + {max(split):g}")
            (d_idle, d_eff, d_held), (z_idle, z_eff, z_held) = cells["dualpipev"], cells["zbv"]
            lines.append(_row(
                p, m, f"{d_idle} / {formula['bubble']:g}", z_idle, f"{d_eff:.3f} / {z_eff:.3f}",
                f"{d_held} ({formula['held']:g}) / {z_held}",
            ))  # fmt: skip
    return "\n".join(lines)
