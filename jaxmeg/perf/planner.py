"""The parallel-configuration planner: every (t, p, d, v, b, recompute) that fits in memory,
ranked by predicted step time for a fixed global batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxmeg.config import REMAT_POLICIES
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.model import (
    Layout,
    Shape,
    bytes_per_step,
    memory_per_gpu,
    paper_training_days,
    step_time,
    tflops_per_gpu,
)

MICROBATCH_SIZES = (1, 2, 4, 8)
MAX_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout
    tflops_per_gpu: float
    percent_of_peak: float
    step_time_s: float
    memory_per_gpu_gb: float
    bubble: float
    bytes_per_step: dict
    training_days: float | None
    paper_days: float | None

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "tensor": lay.tensor,
            "pipe": lay.pipe,
            "data": lay.data,
            "chunks": lay.chunks,
            "microbatch": lay.microbatch,
            "microbatches": lay.microbatches,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "outer_axis": lay.outer_axis,
            "tflops_per_gpu": round(self.tflops_per_gpu, 2),
            "percent_of_peak": round(self.percent_of_peak, 2),
            "step_time_s": round(self.step_time_s, 4),
            "memory_per_gpu_gb": round(self.memory_per_gpu_gb, 2),
            "bubble": round(self.bubble, 4),
            "tensor_bytes_per_step": self.bytes_per_step["tensor"],
            "pipe_bytes_per_step": self.bytes_per_step["pipe"],
            "data_bytes_per_step": self.bytes_per_step["data"],
            "training_days": None if self.training_days is None else round(self.training_days, 2),
            "paper_estimate_days": None if self.paper_days is None else round(self.paper_days, 2),
        }


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(
    shape: Shape,
    gpus: int,
    batch: int,
    hw: Hardware,
    *,
    tensor: int | None = None,
    pipe: int | None = None,
    chunks: int | None = None,
    microbatch: int | None = None,
    recompute: tuple[str, ...] = ("full", "selective"),
    sequence_parallel: bool = False,
    outer_axis: str = "pipe",
) -> Iterator[Layout]:
    """Every layout whose sizes divide the model, the GPUs and the batch; pinned values only."""
    # A tensor group stays inside a node and splits it evenly (t divides the GPUs per node).
    tensors = (
        [tensor] if tensor else [t for t in _divisors(shape.heads) if hw.gpus_per_node % t == 0]
    )
    for t in tensors:
        pipes = [pipe] if pipe else _divisors(shape.layers)
        for p in pipes:
            if gpus % (t * p):
                continue
            d = gpus // (t * p)
            for b in [microbatch] if microbatch else MICROBATCH_SIZES:
                if batch % (d * b):
                    continue
                m = batch // (d * b)
                chunk_options = [chunks] if chunks else _divisors(shape.layers // p)
                for v in chunk_options:
                    if v > MAX_CHUNKS and not chunks:
                        continue
                    if (shape.layers % (p * v)) or (v > 1 and (p == 1 or m % p)):
                        continue
                    for r in recompute:
                        yield Layout(
                            tensor=t, pipe=p, data=d, chunks=v, microbatch=b, microbatches=m,
                            recompute=r, sequence_parallel=sequence_parallel,
                            outer_axis=outer_axis,
                            schedule="interleaved_1f1b" if v > 1 else "1f1b",
                        )  # fmt: skip


def evaluate(shape: Shape, layout: Layout, hw: Hardware, tokens: float | None = None) -> Plan:
    timing = step_time(shape, layout, hw)
    memory = memory_per_gpu(shape, layout, hw)
    tflops = tflops_per_gpu(shape, layout, hw)
    days = paper = None
    if tokens:
        steps = tokens / (layout.global_batch * shape.seq_len)
        days = steps * timing.total / 86400
        paper = paper_training_days(shape, layout.gpus, tflops, tokens)
    return Plan(
        layout=layout,
        tflops_per_gpu=tflops,
        percent_of_peak=100 * tflops / hw.peak_tflops,
        step_time_s=timing.total,
        memory_per_gpu_gb=memory.total / 1e9,
        bubble=timing.bubble,
        bytes_per_step=bytes_per_step(shape, layout),
        training_days=days,
        paper_days=paper,
    )


def check_inputs(shape: Shape, gpus: int, batch: int, **pins) -> None:
    """Raises ValueError naming the field and value of the first impossible input."""
    fields = {"gpus": gpus, "batch": batch, **{f"shape.{k}": v for k, v in vars(shape).items()}}
    fields.update({k: v for k, v in pins.items() if type(v) is int})
    for name, value in fields.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if shape.hidden % shape.heads:
        raise ValueError(f"hidden ({shape.hidden}) must be divisible by heads ({shape.heads})")
    unknown = [r for r in pins.get("recompute", ()) if r not in REMAT_POLICIES]
    if unknown:
        raise ValueError(f"recompute must be among {list(REMAT_POLICIES)}, got {unknown}")


def plan(
    shape: Shape, gpus: int, batch: int, hw: Hardware, tokens: float | None = None, **pins
) -> list[Plan]:
    """Plans that fit in memory, fastest step first (same global batch, so same tokens)."""
    check_inputs(shape, gpus, batch, **pins)
    plans = [
        evaluate(shape, layout, hw, tokens)
        for layout in candidate_layouts(shape, gpus, batch, hw, **pins)
    ]
    fitting = [p for p in plans if p.memory_per_gpu_gb <= hw.memory_gb]
    return sorted(fitting, key=lambda p: (p.step_time_s, p.layout.tensor * p.layout.pipe))
