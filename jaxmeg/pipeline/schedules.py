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

`async_time` runs the orders event-driven (no ticks, zero latency). The package imports in one
direction: this module (orders, pure data) <- `tick_table.py` (the lockstep table the executor
runs) <- `analysis.py` (replays and times a table) <- `executor.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Any

import jaxmeg.pipeline.zero_bubble as zero_bubble

Action = tuple[str, int, int]
LOCKSTEP = ("gpipe", "1f1b", "interleaved_1f1b", "breadth_first")
"""The schedules of whole backwards, which the F-then-B tick executor runs."""
ZERO_BUBBLE = ("zb_h1", "interleaved_zb", "zbv")
"""The schedules of split backwards (I, W)."""
NAMES = LOCKSTEP + ZERO_BUBBLE
"""The schedules `build` knows."""
CHUNKED = ("interleaved_1f1b", "breadth_first", "interleaved_zb", "zbv")
"""The schedules that run v > 1 chunks per stage."""


def placement_of(name: str) -> str:
    """Where schedule `name` puts its chunks: `v` for zbv, else `interleaved` (virtual stage
    c p + s); `jaxmeg.pipeline.layout.StageLayout` lays the layers out the same way."""
    return "v" if name == "zbv" else "interleaved"


def splits_backward(name: str) -> bool:
    """Whether schedule `name` splits a backward into I and W."""
    return name in ZERO_BUBBLE


CHUNKS_REQUIRED = {"zb_h1": 1, "zbv": 2}
"""Schedules defined for one number of chunks only."""
WARMUPS = ("min_memory", "min_bubble")
"""The 1F1B warm-ups (`parallel.pipeline_warmup`)."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The per-stage action orders of one schedule; `.order(stage)` is what a stage runs.

    Every stage's order holds, for each (microbatch, chunk) once, F and then B, or F, I, W in
    that order.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    warmup: str
    orders: tuple[tuple[Action, ...], ...]

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


def _as_int(field: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{field} must be an integer, got {value!r}") from None


def _check(name: str, p: int, m: int, v: int, warmup: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(NAMES)}")
    if warmup not in WARMUPS:
        raise ValueError(f"warmup must be one of {list(WARMUPS)}, got {warmup!r}")
    for field, value in (("num_stages", p), ("num_microbatches", m), ("num_chunks", v)):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if v > 1 and p == 1:
        raise ValueError(f"num_chunks = {v} needs num_stages > 1, got 1")
    if name in CHUNKS_REQUIRED and v != CHUNKS_REQUIRED[name]:
        raise ValueError(f"{name} runs {CHUNKS_REQUIRED[name]} chunk(s) per stage, got "
                         f"num_chunks = {v}")  # fmt: skip
    if name == "interleaved_zb" and v < 2:
        raise ValueError(f"interleaved_zb needs num_chunks >= 2, got {v} (zb_h1 is v = 1)")
    if v > 1 and name not in CHUNKED:
        raise ValueError(f"{name} runs one chunk per stage, got num_chunks = {v}")
    if name in ("zb_h1", "interleaved_zb"):
        zero_bubble.rounds(p, m)
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches ({m}) to be a multiple of num_stages ({p})"
        )


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


def _stage_order(name: str, p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    if name in ("zb_h1", "interleaved_zb"):
        return zero_bubble.interleaved_order(p, s, m, v)
    if name == "zbv":
        return zero_bubble.v_order(p, s, m)
    if name == "gpipe":
        return tuple([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])
    if name == "breadth_first":
        forwards = [("F", mb, c) for c in range(v) for mb in range(m)]
        backwards = [("B", mb, c) for c in reversed(range(v)) for mb in range(m)]
        return tuple(forwards + backwards)
    return _warmup_then_alternate(p, m, v, warmup_forwards(name, p, s, v, warmup))


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
    if name == "breadth_first" and v > 1 and breadth_first_stall(p, m):
        warnings.warn(
            f"breadth_first with num_microbatches ({m}) < num_stages ({p}): every stage stalls "
            f"{breadth_first_stall(p, m)} ticks before each of its {v - 1} later chunks; "
            f"use m >= p",
            stacklevel=2,
        )
    orders = tuple(_stage_order(name, p, s, m, v, warmup) for s in range(p))
    return Schedule(name, p, m, v, warmup, orders)


def bubble_fraction(
    schedule_or_name: Schedule | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    num_chunks: int = 1,
) -> float:
    """Idle over compute time of the asynchronous schedule: Megatron's (p - 1) / (v m), v = 1
    for gpipe and 1f1b; for the split-backward schedules, read from their orders with F = I = W
    (`async_time`; ZB-H1's is a third of 1F1B's). Takes a Schedule, or (name, p, m, v)."""
    if isinstance(schedule_or_name, Schedule):
        sch = schedule_or_name
        name, p, m, v = sch.name, sch.num_stages, sch.num_microbatches, sch.num_chunks
    elif num_stages is None or num_microbatches is None:
        raise ValueError("bubble_fraction needs a Schedule or name, num_stages, num_microbatches")
    else:
        name, p, m, v = schedule_or_name, num_stages, num_microbatches, num_chunks
    if splits_backward(name) and p > 1:
        return _split_bubble(name, p, m, v)
    return (p - 1) / (v * m)


@functools.lru_cache(maxsize=256)
def _split_bubble(name: str, p: int, m: int, v: int) -> float:
    schedule = build(name, p, m, v)
    return async_time(schedule) / ideal_time(schedule) - 1.0


def ideal_time(
    schedule: Schedule, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """One stage's compute with no bubble: m (1 + backward), a stage's forward = 1 (backward
    = I + W with `split`)."""
    backward = sum(split) if split else backward_cost
    return schedule.num_microbatches * (1.0 + backward)


def action_cost(
    kind: str, num_chunks: int, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """A chunk's action in forwards of a whole stage: F 1/v, B backward_cost/v, and I and W half
    of B each (each is one pass of the chunk's matmuls, as is F), or (I, W) = `split` (measured
    ratios; B is then their sum)."""
    i_cost, w_cost = split or (backward_cost / 2, backward_cost / 2)
    unit = {"F": 1.0, "B": i_cost + w_cost, "I": i_cost, "W": w_cost}
    return unit[kind] / num_chunks


def _dependency(
    action: Action, stage: int, p: int, v: int, placement: str = "interleaved"
) -> tuple[str, int, int] | None:
    """(kind, virtual stage, microbatch) that `action` on `stage` waits for, None if none.
    F on virtual stage u needs F on u - 1; B or I on u needs B or I on u + 1 (both named "B":
    the input cotangent it sends), or F on u if u is last; W on u needs I on u."""
    kind, mb, c = action
    u = virtual_stage(stage, c, p, placement)
    if kind == "F":
        return None if u == 0 else ("F", u - 1, mb)
    if kind == "W":
        return ("B", u, mb)
    return ("F", u, mb) if u == p * v - 1 else ("B", u + 1, mb)


def _done_key(action: Action, stage: int, p: int, placement: str) -> tuple[str, int, int]:
    """The key `_dependency` names for a finished action (I is filed under "B")."""
    kind, mb, c = action
    return ("B" if kind == "I" else kind, virtual_stage(stage, c, p, placement), mb)


def async_time(
    schedule: Schedule, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """Makespan when every stage runs its order as soon as its input is there (no ticks, no
    communication time): start = max(stage free, dependency finished); costs `action_cost`.
    Raises ValueError if the orders deadlock."""
    p, v, placement = schedule.num_stages, schedule.num_chunks, schedule.placement
    orders = [schedule.order(s) for s in range(p)]
    finished: dict[tuple[str, int, int], float] = {}
    free, position = [0.0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                dependency = _dependency(action, s, p, v, placement)
                if dependency is not None and dependency not in finished:
                    break
                cost = action_cost(action[0], v, backward_cost, split)
                free[s] = max(free[s], finished.get(dependency, 0.0)) + cost
                finished[_done_key(action, s, p, placement)] = free[s]
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][position[s]] for s in range(p) if position[s] < len(orders[s])}
            raise ValueError(f"schedule {schedule.name} deadlocks; next actions by stage: {stuck}")
    return max(free)


def async_efficiency(
    schedule: Schedule, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """ideal_time / async_time; Megatron's analysis says 1 / (1 + bubble_fraction)."""
    return ideal_time(schedule, backward_cost, split) / async_time(schedule, backward_cost, split)
