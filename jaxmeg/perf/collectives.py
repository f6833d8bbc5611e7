"""Ring collectives, and what a data group holds and sends under ZeRO (Rajbhandari et al.,
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models").

Words: n GPUs in a ring, P the parameters one GPU's stage holds split t ways, P_c those of one
chunk (what ZeRO-3 gathers at once), d the data group (with context, data x context: d c GPUs
hold the same parameters), v chunks per stage, m microbatches.
"""

from __future__ import annotations

import dataclasses

from jaxmeg.perf.layout import Layout
from jaxmeg.pipeline import schedules

WIRE_BYTES = 2
"""Bytes per gradient or weight element on the data group's links: half precision, as
Megatron-LM reduces gradients in the measurements the model is checked against."""


def ring_all_reduce_seconds(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """Ring all-reduce: 2 (n-1)/n of the message over the link, 2 (n-1) latency steps."""
    if n == 1:
        return 0.0
    gb_per_s, latency_us = link
    return 2 * (n - 1) / n * nbytes / (gb_per_s * 1e9) + 2 * (n - 1) * latency_us * 1e-6


def ring_half_seconds(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """Ring all-gather or reduce-scatter (half an all-reduce): (n-1)/n of the message over the
    link, n-1 latency steps."""
    if n == 1:
        return 0.0
    gb_per_s, latency_us = link
    return (n - 1) / n * nbytes / (gb_per_s * 1e9) + (n - 1) * latency_us * 1e-6


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    """all-reduce, all-gather or reduce-scatter."""
    nbytes: float
    """Bytes of the whole (unsharded) message."""
    count: int
    """How many per step."""

    def wire_bytes(self, n: int) -> float:
        """Bytes one GPU sends per step on a ring of n: 2 (n-1)/n of each all-reduce, (n-1)/n
        of each all-gather or reduce-scatter."""
        share = (n - 1) / n * (2 if self.kind == "all-reduce" else 1)
        return self.count * self.nbytes * share

    def seconds(self, n: int, link: tuple[float, float]) -> float:
        ring = ring_all_reduce_seconds if self.kind == "all-reduce" else ring_half_seconds
        return self.count * ring(self.nbytes, n, link)


def model_state_bytes(
    params: float, chunk_params: float, layout: Layout, group: int | None = None
) -> float:
    """Bytes of model states one GPU holds (section 5), P = `params`, P_c = `chunk_params`, d
    the gradient group (`group`, else `Layout.gradient_group`: the GPUs that hold the same
    parameters):
    stage 0   16 P                fp32 weights 4, fp32 gradients 4, Adam moments 8
    stage 1   (2 + 4) P + 12 P/d  a bf16 weight copy and the fp32 gradients whole; the fp32
                                  master weights and moments sharded
    stage 3   16 P/d + 8 P_c      everything sharded; the bf16 weights of the chunk in use and
                                  of the next (prefetched), 2 x 2 P_c, and the chunk's fp32
                                  gradient until it is reduce-scattered, 4 P_c
    """
    d = group or layout.gradient_group
    if layout.zero_stage == 0:
        return 16.0 * params
    if layout.zero_stage == 1:
        return 6.0 * params + 12.0 * params / d
    return 16.0 * params / d + 8.0 * chunk_params


def data_parallel_collectives(
    params: float, chunk_params: float, layout: Layout
) -> list[Collective]:
    """The data group's collectives per step, WIRE_BYTES (2) per element:
    stage 0   one all-reduce of the gradients, 2 P
    stage 1   a reduce-scatter of the gradients, 2 P, and an all-gather of the updated
              weights, 2 P (section 7: the bytes of stage 0)
    stage 3   an all-gather of each chunk's weights, 2 P_c, per use, forward and backward:
              2 v per step breadth-first (every microbatch passes a chunk before the next
              chunk runs; Lamy-Poirier, 2021, section 4), 2 v m depth-first (one microbatch
              at a time); a reduce-scatter of each chunk's gradient, 2 P_c, once final: v
              breadth-first, v m depth-first (the gradient is not kept whole between
              microbatches)
    """
    if layout.zero_stage == 0:
        return [Collective("all-reduce", WIRE_BYTES * params, 1)]
    if layout.zero_stage == 1:
        return [Collective("reduce-scatter", WIRE_BYTES * params, 1),
                Collective("all-gather", WIRE_BYTES * params, 1)]  # fmt: skip
    uses = layout.chunks * (1 if schedules.spec(layout.schedule).layered else layout.microbatches)
    return [Collective("all-gather", WIRE_BYTES * chunk_params, 2 * uses),
            Collective("reduce-scatter", WIRE_BYTES * chunk_params, uses)]  # fmt: skip
