"""Pipeline schedules as plain data: for every stage, the ordered actions it runs.

An action is a tuple `("F" | "B", microbatch, chunk)`. Words: p = stages, v = chunks (virtual
stages) per stage, m = microbatches. Virtual stage c*p + s is chunk c on stage s (Megatron's
interleaved placement), so a microbatch visits stage 0..p-1 with chunk 0, then again with
chunk 1, and so on; its backward runs the same path in reverse.

Schedules (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2):
  gpipe             all forwards, then all backwards (v = 1). Stores m stage inputs.
  1f1b              PipeDream-Flush: stage s runs `warm-up` forwards, then one forward and one
                    backward alternately, then the remaining backwards. Warm-up:
                      min_memory: p - s - 1 (Megatron's), at most p stored stage inputs;
                      min_bubble: 2 (p - s - 1), so that the lockstep executor, where an
                        activation needs one tick per hop, meets the asynchronous bubble; at
                        most 2p - 1 stored stage inputs (docs/schedules.md).
  interleaved_1f1b  Megatron's interleaved schedule: warm-up 2 (p - s - 1) + (v - 1) p forwards
                    (at most m v), then 1F1B, then cool-down. Microbatches go in groups of p
                    through the chunks: the k-th forward of a stage is chunk (k // p) % v of
                    microbatch (k // (p v)) p + k % p; backwards walk the chunks in reverse.

The tick table that the executor runs is built from these orders in `tick_table.py`.
"""

from __future__ import annotations

import dataclasses
import functools

Action = tuple[str, int, int]
NAMES = ("gpipe", "1f1b", "interleaved_1f1b")
WARMUPS = ("min_memory", "min_bubble")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The per-stage action orders of one schedule; `.order(stage)` is what a stage runs."""

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    warmup: str
    orders: tuple[tuple[Action, ...], ...]

    def order(self, stage: int) -> list[Action]:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be in [0, {self.num_stages}), got {stage}")
        return list(self.orders[stage])

    @functools.cached_property
    def tick_table(self):
        from jaxmeg.pipeline.tick_table import build_tick_table

        return build_tick_table(self)


def check_layers(num_layers: int, num_stages: int, num_chunks: int = 1) -> int:
    """Layers per chunk; raises unless num_layers is divisible by p * v."""
    if num_layers % (num_stages * num_chunks):
        raise ValueError(
            f"layers ({num_layers}) must be divisible by stages * chunks = "
            f"{num_stages} * {num_chunks} = {num_stages * num_chunks}"
        )
    return num_layers // (num_stages * num_chunks)


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
    if v > 1 and name != "interleaved_1f1b":
        raise ValueError(f"{name} runs one chunk per stage, got num_chunks = {v}")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches ({m}) to be a multiple of num_stages ({p})"
        )


def _interleaved_action(kind: str, k: int, p: int, v: int) -> Action:
    """Megatron's get_model_chunk_id / microbatch id for the k-th forward or backward."""
    chunk = (k % (p * v)) // p
    if kind == "B":
        chunk = v - 1 - chunk
    return (kind, (k // (p * v)) * p + k % p, chunk)


def _one_f_one_b(p: int, s: int, m: int, v: int, warmup: int) -> tuple[Action, ...]:
    total = m * v
    warmup = min(warmup, total)
    order = [_interleaved_action("F", k, p, v) for k in range(warmup)]
    for i in range(total - warmup):
        order.append(_interleaved_action("F", warmup + i, p, v))
        order.append(_interleaved_action("B", i, p, v))
    order += [_interleaved_action("B", k, p, v) for k in range(total - warmup, total)]
    return tuple(order)


def _stage_order(name: str, p: int, s: int, m: int, v: int, warmup: str) -> tuple[Action, ...]:
    if name == "gpipe":
        return tuple([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])
    if name == "1f1b":
        steps = p - s - 1 if warmup == "min_memory" else 2 * (p - s - 1)
        return _one_f_one_b(p, s, m, 1, steps)
    return _one_f_one_b(p, s, m, v, 2 * (p - s - 1) + (v - 1) * p)


def build(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    warmup: str = "min_bubble",
) -> Schedule:
    """The schedule `name` for p stages, m microbatches and v chunks per stage.

    `warmup` applies to `1f1b` only (see the module docstring); the interleaved order is always
    Megatron's.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    _check(name, p, m, v, warmup)
    orders = tuple(_stage_order(name, p, s, m, v, warmup) for s in range(p))
    return Schedule(name, p, m, v, warmup, orders)


def bubble_fraction(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1):
    """Megatron's asynchronous bubble: (p - 1) / (v m) (v = 1 for gpipe and 1f1b)."""
    return (num_stages - 1) / (num_chunks * num_microbatches)
