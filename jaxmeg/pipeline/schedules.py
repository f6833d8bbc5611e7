"""Pipeline schedules as plain data: for every stage, the ordered actions it runs.

An action is a tuple `(kind, microbatch, chunk)`, kind "F" (forward), "B" (whole backward), or
"I" and "W" (the backward split into the input cotangent and the weight gradients; zero-bubble
schedules, `zero_bubble.py`). Words: p = stages, v = chunks (virtual stages) per stage, m =
microbatches. Virtual stage c*p + s is chunk c on stage s (Megatron's interleaved placement), so
a microbatch visits stage 0..p-1 with chunk 0, then again with chunk 1, and so on; its backward
runs the same path in reverse. `zbv` places its two chunks in a V instead: chunk 0 of stage s
is virtual stage s, chunk 1 is 2p - 1 - s (`Schedule.virtual_stage`).

Schedules (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2):
  gpipe             all forwards, then all backwards. One chunk per stage (v > 1 is refused:
                    breadth-first interleaving is a different schedule). Stores m stage inputs.
  1f1b              PipeDream-Flush: stage s runs w_s warm-up forwards, then one forward and one
                    backward alternately, then the remaining backwards. Warm-up:
                      min_memory: w_s = min(p - s - 1, m), Megatron's; at most p stored inputs.
                      min_bubble: w_s = min(2 (p - s - 1), m), the smallest warm-up with which the
                        lockstep executor (one tick per hop) meets the bound 1 / (1 + (p-1)/m);
                        at most 2p - 1 stored inputs (docs/schedules.md).
  interleaved_1f1b  Megatron's interleaved schedule (`warmup` is ignored): w_s =
                    min(2 (p - s - 1) + (v - 1) p, m v) warm-up forwards, then 1F1B, then
                    cool-down. Microbatches go in groups of p through the chunks: the k-th
                    forward of a stage is chunk (k mod pv) // p of microbatch
                    (k // pv) p + k mod p; the k-th backward is the same with chunk v - 1 - that
                    (m must be a multiple of p).
  breadth_first     Lamy-Poirier's layered gradient accumulation (2021): every microbatch
                    through chunk 0, then every microbatch through chunk 1, ...; then the
                    backwards chunk v-1 .. 0, each over every microbatch. With v = L / p (one
                    layer per chunk, layer l on stage l mod p) it is modular pipeline
                    parallelism. Same bubble as interleaved, (p - 1) / (v m), if m >= p (with
                    m < p a stage waits p - m ticks before each chunk after the first); stores
                    m v stage inputs; each chunk's gradient is final after its last backward.

Zero bubble (Qi et al., 2024; the orders of PyTorch's `torch.distributed.pipelining`):
  zb_h1             1F1B whose backward is I then W: p - s - 1 warm-up forwards, F and I
                    alternate, W fills the cool-down's bubbles. v = 1.
  interleaved_zb    the same over v >= 2 chunks (`ScheduleInterleavedZeroBubble`).
  zbv               ZB-V: v = 2 in a V placement, loss on stage 0 (`ScheduleZBVZeroBubble`).

DualPipeV (DeepSeek-V3, `dual_pipe.py`; the order of PyTorch's `ScheduleDualPipeV`):
  dualpipev         v = 2 in zbv's V; in the steady state a forward of one chunk runs
                    overlapped with a whole backward (B) of the other, the pair listed forward
                    first (`Schedule.paired`); the step's first and last backwards are split
                    (I, W). m >= 2p.

Each schedule is one row of `SPECS` (its orders, placement, chunk and microbatch rules), which
every other module reads instead of testing names; `check` holds the rules. `timing.py` runs
the orders event-driven (no ticks, zero latency). The package imports in one direction:
`zero_bubble` and `dual_pipe` (orders) <- this module (orders, pure data) <- `timing.py` <-
`tick_table.py` (the lockstep table the executor runs) <- `analysis.py` (replays and times a
table) <- `executor`.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable
from typing import Any

import jaxmeg.pipeline.dual_pipe as dual_pipe
import jaxmeg.pipeline.zero_bubble as zero_bubble

Action = tuple[str, int, int]
WARMUPS = ("min_memory", "min_bubble")
"""The 1F1B warm-ups (`parallel.pipeline_warmup`)."""


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """Everything jaxmeg knows of one schedule: what config validation, the tick table, the
    executor and the perf model read instead of testing its name.

    orders(p, s, m, v, warmup) -> stage s's actions
    placement: "interleaved" (virtual stage c p + s) or "v" (chunk 1 of stage s is 2p - 1 - s)
    min_chunks, max_chunks: the chunks per stage it runs (max None: any)
    interleaved: its chunks take turns on a stage (the planner gives it v >= 2)
    split_backward: backwards run as I then W (zero-bubble)
    steady_rings: its rings stop growing with m (`tick_table.build_tick_table`); else a stage
        keeps every microbatch's input to each of its chunks (m v)
    layered: every microbatch passes a chunk before the next chunk runs (Lamy-Poirier's
        layered gradient accumulation): a chunk's weights are used once per step, its
        gradient final after the chunk's last backward
    microbatches: "any", "multiple_of_stages" (Megatron's interleaving), "rounds"
        (`zero_bubble.rounds`) or "twice_stages" (m >= 2p, `dual_pipe.check_microbatches`)
    pairs(p, s, m) -> the positions in stage s's order of the forwards that run overlapped
        with the backward listed right after them (None: none do)
    uneven_stages: it runs `parallel.stage_layers` (one chunk per stage)
    one_chunk_form: the schedule it becomes with one chunk, for the error that says so
    """

    name: str
    orders: Callable[[int, int, int, int, str], tuple[Action, ...]]
    placement: str = "interleaved"
    min_chunks: int = 1
    max_chunks: int | None = 1
    interleaved: bool = False
    split_backward: bool = False
    steady_rings: bool = False
    microbatches: str = "any"
    uneven_stages: bool = False
    layered: bool = False
    one_chunk_form: str | None = None
    pairs: Callable[[int, int, int], tuple[int, ...]] | None = None

    @property
    def chunked(self) -> bool:
        """Whether it runs v > 1 chunks per stage."""
        return self.max_chunks is None or self.max_chunks > 1


def _gpipe(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    return tuple([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])


def _one_f_one_b(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    return _warmup_then_alternate(p, m, v, warmup_forwards("1f1b", p, s, v, warmup))


def _interleaved(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    return _warmup_then_alternate(p, m, v, warmup_forwards("interleaved_1f1b", p, s, v, warmup))


def _breadth_first(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    forwards = [("F", mb, c) for c in range(v) for mb in range(m)]
    backwards = [("B", mb, c) for c in reversed(range(v)) for mb in range(m)]
    return tuple(forwards + backwards)


def _zero_bubble(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    return zero_bubble.interleaved_order(p, s, m, v)


def _zbv(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    return zero_bubble.v_order(p, s, m)


def _dualpipev(p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    return dual_pipe.v_order(p, s, m)


SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", _gpipe, uneven_stages=True),
        ScheduleSpec("1f1b", _one_f_one_b, steady_rings=True, uneven_stages=True),
        ScheduleSpec(
            "interleaved_1f1b", _interleaved, max_chunks=None, interleaved=True,
            steady_rings=True, microbatches="multiple_of_stages",
        ),
        ScheduleSpec(
            "breadth_first", _breadth_first, max_chunks=None, uneven_stages=True, layered=True
        ),
        ScheduleSpec(
            "zb_h1", _zero_bubble, split_backward=True, steady_rings=True, microbatches="rounds",
            uneven_stages=True,
        ),
        ScheduleSpec(
            "interleaved_zb", _zero_bubble, min_chunks=2, max_chunks=None, interleaved=True,
            split_backward=True, steady_rings=True, microbatches="rounds",
            one_chunk_form="zb_h1",
        ),
        ScheduleSpec(
            "zbv", _zbv, placement="v", min_chunks=2, max_chunks=2, interleaved=True,
            split_backward=True, steady_rings=True, microbatches="rounds",
        ),
        ScheduleSpec(
            "dualpipev", _dualpipev, placement="v", min_chunks=2, max_chunks=2, interleaved=True,
            split_backward=True, steady_rings=True, microbatches="twice_stages",
            pairs=dual_pipe.pairs,
        ),
    )
}  # fmt: skip
"""One row per schedule `build` knows (see the module docstring for each)."""
NAMES = tuple(SPECS)
"""The schedules `build` knows."""
LOCKSTEP = tuple(n for n, spec in SPECS.items() if not spec.split_backward)
"""The schedules of whole backwards, which the F-then-B tick executor runs."""
ZERO_BUBBLE = tuple(n for n, spec in SPECS.items() if spec.split_backward)
"""The schedules of split backwards (I, W)."""
CHUNKED = tuple(n for n, spec in SPECS.items() if spec.chunked)
"""The schedules that run v > 1 chunks per stage."""


def spec(name: str) -> ScheduleSpec:
    """The row of schedule `name` (ValueError naming the known ones)."""
    if name not in SPECS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(NAMES)}")
    return SPECS[name]


def placement_of(name: str) -> str:
    """Where schedule `name` puts its chunks: `v` for zbv, else `interleaved` (virtual stage
    c p + s, also for a `Schedule` of hand-written orders); `jaxmeg.pipeline.layout.StageLayout`
    lays the layers out the same way."""
    return SPECS[name].placement if name in SPECS else "interleaved"


def splits_backward(name: str) -> bool:
    """Whether schedule `name` splits a backward into I and W."""
    return name in SPECS and SPECS[name].split_backward


class ScheduleCheckError(ValueError):
    """A schedule that cannot run p stages, m microbatches and v chunks; `field` is the number
    at fault ("num_stages", "num_microbatches" or "num_chunks"), for config validation to name
    its own field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check(name: str, p: int, m: int, v: int) -> None:
    """Raises ScheduleCheckError (a ValueError) naming the numbers where schedule `name` cannot
    run p stages, m microbatches and v chunks per stage; the one home of these rules."""
    row = spec(name)
    for field, value in (("num_stages", p), ("num_microbatches", m), ("num_chunks", v)):
        if value < 1:
            raise ScheduleCheckError(f"{field} must be >= 1, got {value}", field)
    if v > 1 and p == 1:
        raise ScheduleCheckError(f"num_chunks = {v} needs num_stages > 1, got 1", "num_chunks")
    if row.split_backward and p < 2:  # its W slots fill the bubbles of a pipeline
        raise ScheduleCheckError(f"{name} needs num_stages >= 2, got {p}", "num_stages")
    if row.max_chunks is not None and v > row.max_chunks:
        runs = "one chunk" if row.max_chunks == 1 else f"{row.max_chunks} chunks"
        message = f"{name} runs {runs} per stage, got num_chunks = {v}"
        raise ScheduleCheckError(message, "num_chunks")
    if v < row.min_chunks:
        runs = f"{name} runs {row.min_chunks} chunks per stage"
        if row.max_chunks is None:
            runs = f"{name} needs num_chunks >= {row.min_chunks}"
        hint = f" ({row.one_chunk_form} is its one-chunk form)" if row.one_chunk_form else ""
        raise ScheduleCheckError(f"{runs}, got num_chunks = {v}{hint}", "num_chunks")
    if row.microbatches == "multiple_of_stages" and m % p:
        raise ScheduleCheckError(
            f"{name} needs num_microbatches ({m}) to be a multiple of num_stages ({p})",
            "num_microbatches",
        )
    if row.microbatches == "twice_stages":
        try:
            dual_pipe.check_microbatches(p, m)
        except ValueError as err:
            raise ScheduleCheckError(str(err), "num_microbatches") from None
    if row.microbatches == "rounds":
        try:
            zero_bubble.rounds(p, m)
        except ValueError as err:
            raise ScheduleCheckError(str(err), "num_microbatches") from None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The per-stage action orders of one schedule; `.order(stage)` is what a stage runs.

    Every stage's order holds, for each (microbatch, chunk) once, F and then B, or F, I, W in
    that order. `paired[s]`: the positions in stage s's order of the forwards that run
    overlapped with the backward right after them (DualPipeV's F&B; empty for the others).
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    warmup: str
    orders: tuple[tuple[Action, ...], ...]
    paired: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _check_orders(self)

    def order(self, stage: int) -> list[Action]:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be in [0, {self.num_stages}), got {stage}")
        return list(self.orders[stage])

    @property
    def placement(self) -> str:
        return placement_of(self.name)

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return virtual_stage(stage, chunk, self.num_stages, self.placement)


def virtual_stage(stage: int, chunk: int, num_stages: int, placement: str = "interleaved") -> int:
    """Position of chunk `chunk` of `stage` along the model: c p + s, or in a V (`zbv`) s for
    chunk 0 and 2p - 1 - s for chunk 1."""
    if placement == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def stage_and_chunk(u: int, num_stages: int, placement: str = "interleaved") -> tuple[int, int]:
    """(stage, chunk) of virtual stage u (inverse of `virtual_stage`)."""
    if placement == "v":
        return (u, 0) if u < num_stages else (2 * num_stages - 1 - u, 1)
    return u % num_stages, u // num_stages


def next_stage(stage: int, chunk: int, num_stages: int) -> tuple[int, int]:
    """(stage, chunk) of virtual stage chunk p + stage + 1: stage p - 1 feeds chunk + 1 on 0."""
    return (stage + 1, chunk) if stage < num_stages - 1 else (0, chunk + 1)


def prev_stage(stage: int, chunk: int, num_stages: int) -> tuple[int, int]:
    """(stage, chunk) of virtual stage chunk p + stage - 1: stage 0 feeds chunk - 1 on p - 1."""
    return (stage - 1, chunk) if stage > 0 else (num_stages - 1, chunk - 1)


def _check_orders(schedule: Schedule) -> None:
    p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    if len(schedule.orders) != p:
        raise ValueError(f"orders has {len(schedule.orders)} stages, num_stages is {p}")
    for s, order in enumerate(schedule.orders):
        kinds = {key: [] for key in ((mb, c) for mb in range(m) for c in range(v))}
        for kind, mb, c in order:
            if (mb, c) not in kinds or kind not in "FBIW":
                raise ValueError(f"stage {s} order runs {(kind, mb, c)}: no such action")
            kinds[mb, c].append(kind)
        for (mb, c), done in kinds.items():
            ran = "".join(done) or "nothing"
            if ran not in ("FB", "FIW"):
                raise ValueError(
                    f"stage {s} order must run F then B, or F, I, W, for each of the {m} "
                    f"microbatches x {v} chunks; (mb={mb}, chunk={c}) runs {ran}"
                )
    if schedule.paired and len(schedule.paired) != p:
        raise ValueError(f"paired has {len(schedule.paired)} stages, num_stages is {p}")
    for s, positions in enumerate(schedule.paired):
        order = schedule.orders[s]
        for i in positions:
            kinds = "".join(a[0] for a in order[i : i + 2])
            if kinds != "FB":
                raise ValueError(f"stage {s}: a pair at {i} must be F then B, got {kinds!r}")


def _as_int(field: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{field} must be an integer, got {value!r}") from None


def _check(name: str, p: int, m: int, v: int, warmup: str) -> None:
    if warmup not in WARMUPS:
        raise ValueError(f"warmup must be one of {list(WARMUPS)}, got {warmup!r}")
    check(name, p, m, v)


def _grouped_action(kind: str, k: int, p: int, v: int) -> Action:
    """The k-th forward (or backward) of a stage when microbatches go through the chunks in
    groups of p: chunk (k mod p v) // p (reversed, v - 1 - chunk, for backwards), microbatch
    (k // p v) p + k mod p. Megatron's get_schedule_table / get_model_chunk_id for m mod p = 0."""
    chunk = (k % (p * v)) // p
    if kind == "B":
        chunk = v - 1 - chunk
    return (kind, (k // (p * v)) * p + k % p, chunk)


def _warmup_then_alternate(p: int, m: int, v: int, warmup: int) -> tuple[Action, ...]:
    """Megatron's three loops: `warmup` forwards; F(warmup + i), B(i) for the remaining
    m v - warmup; then the last `warmup` backwards."""
    total = m * v
    warmup = min(warmup, total)
    order = [_grouped_action("F", k, p, v) for k in range(warmup)]
    for i in range(total - warmup):
        order.append(_grouped_action("F", warmup + i, p, v))
        order.append(_grouped_action("B", i, p, v))
    order += [_grouped_action("B", k, p, v) for k in range(total - warmup, total)]
    return tuple(order)


def warmup_forwards(name: str, num_stages: int, stage: int, num_chunks: int, warmup: str) -> int:
    """Warm-up forwards of `stage` before 1F1B starts (uncapped by m v); gpipe has no warm-up
    phase (ValueError)."""
    p, s, v = num_stages, stage, num_chunks
    if name == "interleaved_1f1b":
        return 2 * (p - s - 1) + (v - 1) * p
    if name == "1f1b":
        return p - s - 1 if warmup == "min_memory" else 2 * (p - s - 1)
    raise ValueError(f"{name} has no warm-up phase")


def breadth_first_stall(num_stages: int, num_microbatches: int) -> int:
    """Ticks a stage waits before each chunk after the first when m < p: microbatch 0 comes
    back around the ring after p ticks, but the stage ran out of microbatches after m."""
    return max(num_stages - num_microbatches, 0)


def build(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    warmup: str = "min_memory",
) -> Schedule:
    """The schedule `name` for p stages, m microbatches and v chunks per stage.

    `warmup` applies to `1f1b` only (see the module docstring); the default is Megatron's
    PipeDream-Flush order. The trainer runs `parallel.pipeline_warmup` (default `min_bubble`,
    the faster in jaxmeg's lockstep executor). The interleaved order is always Megatron's.
    Raises ValueError naming the numbers for an impossible combination.
    """
    p = _as_int("num_stages", num_stages)
    m = _as_int("num_microbatches", num_microbatches)
    v = _as_int("num_chunks", num_chunks)
    _check(name, p, m, v, warmup)
    if SPECS[name].layered and v > 1 and breadth_first_stall(p, m):
        warnings.warn(
            f"breadth_first with num_microbatches ({m}) < num_stages ({p}): every stage stalls "
            f"{breadth_first_stall(p, m)} ticks before each of its {v - 1} later chunks; "
            f"use m >= p",
            stacklevel=2,
        )
    row = SPECS[name]
    orders = tuple(row.orders(p, s, m, v, warmup) for s in range(p))
    paired = () if row.pairs is None else tuple(row.pairs(p, s, m) for s in range(p))
    return Schedule(name, p, m, v, warmup, orders, paired)
