"""The costs of each compression technique in the performance model (`pipe_grad`,
`embedding_sync`, `data_grad`): bytes per link, added compute and the step-time saving, as
`jaxmeg.perf.compression` describes them; that module sums them into a step and chooses."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxmeg.config import CompressionConfig
from jaxmeg.perf.collectives import (
    WIRE_BYTES,
    Collective,
    data_parallel_collectives,
)
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import (
    Shape,
    StepTime,
    _gemm_seconds,
    busiest_stage_layers,
    data_link,
    device_grid,
    exposed_data_parallel_seconds,
    hardware_link,
    layer_parameters,
    pipe_message_seconds,
    shared_parameters_per_gpu,
    stage_layout,
)
from jaxmeg.perf.traffic import bytes_per_step
from jaxmeg.pipeline import critical_path, schedules
from jaxmeg.pipeline.gradients import broadcast_rounds
from jaxmeg.pipeline.tick_table import build_tick_table

FACTOR_BYTES = 4
"""Bytes per element of the low-rank factors (fp32)."""
FEEDBACK_BYTES_PER_ELEMENT = 24
"""HBM bytes per matrix element of error feedback: an fp32 add (x = g + e) and subtract
(e = x - P Q^T), each reading two fp32 operands and writing one."""


# ---------------------------------------------------------------------------------------------
# Low-rank factors


def compresses(n: int, m: int, rank: int) -> bool:
    """Whether an [n, m] matrix goes as rank-`rank` factors: 0 < rank < min(n, m)."""
    return 0 < rank < min(n, m)


def matrix_bytes(n: int, m: int, rank: int) -> float:
    """Bytes of an [n, m] matrix on the wire: P [n, r] and Q [m, r] in fp32, 4 r (n + m), or
    the matrix whole at 2 bytes per element where it is not compressed (`compresses`)."""
    if compresses(n, m, rank):
        return FACTOR_BYTES * rank * (n + m)
    return WIRE_BYTES * n * m


def power_iteration_seconds(
    n: int, m: int, rank: int, hw: Hardware, *, rebuild: bool, feedback: bool
) -> float:
    """Compute of one rank-r power iteration on an [n, m] matrix: P = M Q and Q = M^T P, the
    orthogonalisation (QR) of both factors, each counted as two [rows, r] x [r, r] matmuls;
    with `rebuild` the product P Q^T; with `feedback` the error feedback's fp32 add and subtract
    over the n m elements, at HBM bandwidth."""
    seconds = (
        _gemm_seconds(n, rank, m, hw)
        + _gemm_seconds(m, rank, n, hw)
        + 2 * (_gemm_seconds(n, rank, rank, hw) + _gemm_seconds(m, rank, rank, hw))
    )
    if rebuild:
        seconds += _gemm_seconds(n, m, rank, hw)
    if feedback:
        seconds += FEEDBACK_BYTES_PER_ELEMENT * n * m / (hw.hbm_tb_per_s * 1e12)
    return seconds


@dataclasses.dataclass(frozen=True)
class TechniqueCost:
    name: str
    """`pipe_grad`, `embedding_sync` or `data_grad`."""
    on: bool
    per_gpu_bytes: tuple[float, float]
    """(uncompressed, compressed) bytes per step that one GPU sends for this traffic: the GPU
    that sends most (pipe_grad: forward and backward sends, the least compressed link), a
    first- or last-stage GPU (embedding_sync), a GPU of a compressed stage (data_grad)."""
    total_bytes: tuple[float, float]
    """(uncompressed, compressed) bytes per step all GPUs together send for it."""
    compute_s: float
    """Seconds of compute the technique adds to the step's critical path."""
    saved_s: float
    """Step-time saving, compute included (negative: slower)."""
    detail: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "on": self.on,
            "per_gpu_bytes_before": self.per_gpu_bytes[0],
            "per_gpu_bytes_after": self.per_gpu_bytes[1],
            "total_bytes_before": self.total_bytes[0],
            "total_bytes_after": self.total_bytes[1],
            "compute_s": round(self.compute_s, 6),
            "saved_s": round(self.saved_s, 6),
            **self.detail,
        }


# ---------------------------------------------------------------------------------------------
# pipe_grad: compressed backpropagation


def pipe_grad_matrix(shape: Shape, layout: Layout) -> tuple[int, int]:
    """[n, h] of the cotangent one tensor rank sends back: n = b s, or b s / t with sequence
    parallelism (each rank its sequence shard)."""
    tokens = shape.seq_len * layout.microbatch
    return (tokens // layout.tensor if layout.sequence_parallel else tokens), shape.hidden


def pipe_grad_message(shape: Shape, layout: Layout, rank: int) -> float:
    """One backward transfer's bytes as `model.pipe_message_seconds` takes them (the tensor
    group's message before Megatron's scatter/gather splits it over t): 2 s b h dense; with
    `rank` compressing, each rank's factors, 4 r (n + h) (times t with sequence parallelism,
    where every rank sends its own shard's)."""
    n, h = pipe_grad_matrix(shape, layout)
    if not compresses(n, h, rank):
        return float(WIRE_BYTES * shape.seq_len * layout.microbatch * shape.hidden)
    return matrix_bytes(n, h, rank) * (layout.tensor if layout.sequence_parallel else 1)


def per_gpu_message(layout: Layout, message: float) -> float:
    """What one GPU sends of a pipeline message: 1/t with scatter/gather or sequence
    parallelism (as `traffic.bytes_per_step`)."""
    split = layout.pipe_scatter_gather or layout.sequence_parallel
    return message / layout.tensor if split else message


def backward_transfers(layout: Layout) -> dict[tuple[int, int], int]:
    """Backward transfers per step on each link (sender, receiver): m v from stage s to s - 1;
    with v > 1, m (v - 1) on the wrap-around link from stage 0 to p - 1 (chunk c on stage 0
    feeds chunk c - 1 on the last)."""
    return _links(layout.pipe, layout.microbatches, layout.chunks)


def _links(p: int, m: int, v: int) -> dict[tuple[int, int], int]:
    links = {(s, s - 1): m * v for s in range(1, p)}
    if v > 1:
        links[(0, p - 1)] = m * (v - 1)
    return links


@dataclasses.dataclass(frozen=True)
class PhaseCounts:
    per_link: dict[tuple[int, int], int]
    """Compressed backward transfers per step on each link (sender, receiver)."""
    whole: float
    """Fraction of the executor's sending ticks whose backward sends are all compressed."""
    mixed: float
    """Fraction of them with both compressed and dense sends (the executor then sends both)."""


@functools.cache
def _epilogue(schedule: str, p: int, m: int, v: int, warmup: str) -> PhaseCounts:
    table = build_tick_table(schedules.build(schedule, p, m, v, warmup))
    compressed = critical_path.exposed_backward_sends(table) == 1
    stage = np.arange(p)[None, :]
    sends = (table.b_mb >= 0) & ~((stage == 0) & (table.b_chunk == 0))
    per_link = {link: 0 for link in _links(p, m, v)}
    for t, s in zip(*np.nonzero(compressed), strict=True):
        per_link[critical_path.link(int(s), int(table.b_chunk[t, s]), p)] += 1
    sending = max(int(sends.any(axis=1).sum()), 1)
    some, dense = compressed.any(axis=1), (sends & ~compressed).any(axis=1)
    whole, mixed = int((some & ~dense).sum()), int((some & dense).sum())
    return PhaseCounts(per_link, whole / sending, mixed / sending)


def phase_counts(layout: Layout, phase: str) -> PhaseCounts:
    """What `pipe_grad_phase` = `phase` compresses: `all` every backward transfer (every tick
    whole); `epilogue` the sends of `critical_path.exposed_backward_sends` on the layout's tick
    table (the hook: a schedule's own analysis, not a 1F1B rule)."""
    if phase == "all":
        return PhaseCounts(backward_transfers(layout), 1.0, 0.0)
    return _epilogue(
        layout.schedule, layout.pipe, layout.microbatches, layout.chunks, layout.warmup
    )


def pipe_grad_cost(
    shape: Shape, layout: Layout, hw: Hardware, comp: CompressionConfig
) -> TechniqueCost:
    """Bytes, compute and step-time saving of compressed backpropagation (module docstring)."""
    rank = comp.pipe_grad_rank
    n, h = pipe_grad_matrix(shape, layout)
    dense = float(WIRE_BYTES * shape.seq_len * layout.microbatch * shape.hidden)
    dense_gpu = per_gpu_message(layout, dense)
    base = bytes_per_step(shape, layout)["pipe"]
    transfers = backward_transfers(layout) if layout.pipe > 1 else {}
    ranks = layout.data * layout.tensor  # GPUs sending on each stage-to-stage link
    total = ranks * 2 * sum(transfers.values()) * dense_gpu
    if not (layout.pipe > 1 and compresses(n, h, rank)):
        return TechniqueCost("pipe_grad", False, (base, base), (total, total), 0.0, 0.0)
    message = pipe_grad_message(shape, layout, rank)
    small = per_gpu_message(layout, message)
    counts = phase_counts(layout, comp.pipe_grad_phase)
    backward = {
        link: (count - counts.per_link[link]) * dense_gpu + counts.per_link[link] * small
        for link, count in transfers.items()
    }
    forward = layout.microbatches * layout.chunks * dense_gpu
    after_total = ranks * (sum(transfers.values()) * dense_gpu + sum(backward.values()))
    lazy = comp.pipe_error_feedback != "none"
    compute = power_iteration_seconds(n, h, rank, hw, rebuild=lazy, feedback=lazy)
    compute += _gemm_seconds(n, h, rank, hw)  # the receiver's P Q^T
    t_dense = pipe_message_seconds(shape, layout, hw)
    t_comp = pipe_message_seconds(shape, layout, hw, message=message) + compute
    slots = layout.microbatches * layout.chunks + layout.pipe - 1  # as model.step_time
    # An all-compressed tick takes t_comp for t_dense; a mixed one sends both, t_comp more.
    change = slots * (counts.whole * (t_comp - t_dense) + counts.mixed * t_comp)
    detail = {
        "rank": rank,
        "phase": comp.pipe_grad_phase,
        "error_feedback": comp.pipe_error_feedback,
        "matrix": [n, h],
        "message_bytes": dense_gpu,
        "compressed_message_bytes": small,
        "transfers_per_link": _named(transfers),
        "compressed_per_link": _named(counts.per_link),
        "compressed_slot_fraction": round(counts.whole, 4),
        # Per GPU, kept across steps: each chunk's warm start Q [h, r], lazy's error [n, h].
        "state_bytes_per_gpu": layout.chunks * FACTOR_BYTES * (h * rank + (n * h if lazy else 0)),
    }
    return TechniqueCost(
        "pipe_grad", True, (base, forward + max(backward.values())), (total, after_total),
        slots * (counts.whole + counts.mixed) * compute, -change, detail,
    )  # fmt: skip


def _named(per_link: dict[tuple[int, int], int]) -> dict[str, int]:
    return {f"{s}->{r}": c for (s, r), c in sorted(per_link.items())}


# ---------------------------------------------------------------------------------------------
# embedding_sync: fused embedding synchronisation


def _ring_link(layout: Layout, hw: Hardware, stages: list[int]) -> tuple[float, float]:
    """The link of a ring over `stages` x data (one tensor rank's): NVLink when it sits in one
    node."""
    node = device_grid(layout)[:, stages, 0, 0, 0] // hw.gpus_per_node
    return hardware_link(hw, bool(node.min() == node.max()))


def embedding_sync_cost(
    shape: Shape, layout: Layout, hw: Hardware, comp: CompressionConfig
) -> TechniqueCost:
    """Bytes and time of the tied embedding/head and position gradients' all-reduce, over pipe
    x data or, fused, over {first, last stage} x data (module docstring)."""
    d, p, t = layout.data, layout.pipe, layout.tensor
    sync = Collective("all-reduce", WIRE_BYTES * shared_parameters_per_gpu(shape, t), 1)
    before = sync.wire_bytes(p * d)
    before_total = p * d * t * before
    word = Collective("all-reduce", WIRE_BYTES * shape.vocab * shape.hidden / t, 1)
    detail = {
        "fused": bool(comp.fused_embedding_sync and p > 1),
        "ring_before": p * d,
        "megatron_total_bytes": 2 * d * t * word.wire_bytes(2) if p > 1 else 0.0,
    }
    if not detail["fused"]:
        return TechniqueCost(
            "embedding_sync", False, (before, before), (before_total, before_total), 0.0, 0.0,
            {**detail, "ring_after": p * d},
        )  # fmt: skip
    after = sync.wire_bytes(2 * d)
    pipe_link = _ring_link(layout, hw, list(range(p)))
    rounds = len(broadcast_rounds(p))
    gb_per_s, latency_us = pipe_link
    broadcast_s = rounds * (sync.nbytes / (gb_per_s * 1e9) + latency_us * 1e-6)
    saved = (
        sync.seconds(p * d, pipe_link)
        - sync.seconds(2 * d, _ring_link(layout, hw, [0, p - 1]))
        - broadcast_s
    )
    middle_total = (p - 2) * d * t * sync.nbytes
    return TechniqueCost(
        "embedding_sync", True, (before, after), (before_total, 2 * d * t * after + middle_total),
        0.0, saved, {**detail, "ring_after": 2 * d, "middle_rounds": rounds},
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# data_grad: PowerSGD on the data-parallel reduction, on selected stages


def layer_matrices(shape: Shape, tensor: int) -> list[tuple[int, int]]:
    """One layer's weight matrices as a tensor rank holds them: QKV [h, 3h/t], attention output
    [h/t, h], fc1 [h, f/t], fc2 [f/t, h] (f = mlp_ratio h)."""
    h, f, t = shape.hidden, shape.mlp_ratio * shape.hidden, tensor
    return [(h, 3 * h // t), (h // t, h), (h, f // t), (f // t, h)]


def stage_data_collectives(
    shape: Shape, layout: Layout, layers: int, rank: int
) -> list[Collective]:
    """A stage's data-parallel collectives (`collectives.data_parallel_collectives` of its
    `layers` and the shared parameters) with the gradients of the matrices that `rank`
    compresses taken out of the gradient collective and reduced as two all-reduces of fp32
    factors, P (4 r sum n) and Q (4 r sum m)."""
    t = layout.tensor
    shared = shared_parameters_per_gpu(shape, t)
    params = layers * layer_parameters(shape) / t + shared
    chunk = layers // layout.chunks * layer_parameters(shape) / t + shared
    collectives = data_parallel_collectives(params, chunk, layout)
    matrices = [(n, m) for n, m in layer_matrices(shape, t) if compresses(n, m, rank)]
    if not matrices:
        return collectives
    if layout.zero_stage == 3:
        raise ValueError("compression.data_grad_rank is not modelled with zero_stage 3")
    grad, *rest = collectives
    removed = layers * sum(n * m for n, m in matrices)
    return [
        Collective(grad.kind, grad.nbytes - WIRE_BYTES * removed, grad.count),
        Collective("all-reduce", FACTOR_BYTES * rank * layers * sum(n for n, _ in matrices), 1),
        Collective("all-reduce", FACTOR_BYTES * rank * layers * sum(m for _, m in matrices), 1),
        *rest,
    ]


def data_grad_cost(
    shape: Shape, layout: Layout, hw: Hardware, comp: CompressionConfig, timing: StepTime
) -> TechniqueCost:
    """Bytes, compute and step-time saving of PowerSGD on stages < `data_grad_stages` (module
    docstring); `timing` is the layout's uncompressed `model.step_time`."""
    d, p, t, rank = layout.data, layout.pipe, layout.tensor, comp.data_grad_rank
    busiest = busiest_stage_layers(shape, layout)
    k = p if comp.data_grad_stages in (-1, p) else comp.data_grad_stages
    if d == 1:
        rank = 0
    link = data_link(layout, hw)

    def wire(layers: int, r: int) -> float:
        return sum(c.wire_bytes(d) for c in stage_data_collectives(shape, layout, layers, r))

    stages = stage_layout(shape, layout).stage_layers
    before_total = d * t * sum(wire(n, 0) for n in stages)
    after_total = d * t * sum(wire(n, rank if s < k else 0) for s, n in enumerate(stages))
    before, after = wire(busiest, 0), wire(busiest, rank)
    compressed = [(n, m) for n, m in layer_matrices(shape, t) if compresses(n, m, rank)]
    detail = {"rank": rank, "stages": comp.data_grad_stages, "compressed_stages": k}
    if not compressed:
        return TechniqueCost(
            "data_grad", False, (before, before), (before_total, before_total), 0.0, 0.0,
            {**detail, "compressed_stages": 0},
        )  # fmt: skip
    compute = busiest * sum(
        power_iteration_seconds(n, m, rank, hw, rebuild=True, feedback=True) for n, m in compressed
    )
    work = layout.microbatches * (timing.forward + timing.backward)

    def exposed(r: int, extra: float = 0.0) -> float:
        seconds = sum(c.seconds(d, link) for c in stage_data_collectives(shape, layout, busiest, r))
        return exposed_data_parallel_seconds(seconds + extra, layout, work)

    dense, small = exposed(0), exposed(rank, compute)
    # Stage s >= k ends its last backward s chunk-backwards before stage 0 (1F1B's cool-down).
    slack = timing.backward / layout.chunks
    saved = dense - max(small, dense - k * slack if k < p else -math.inf)
    detail |= {
        "matrices_per_layer": [list(x) for x in compressed],
        "exposed_dense_s": dense,
        "exposed_compressed_s": small,
        "stage_slack_s": slack,
    }
    return TechniqueCost(
        "data_grad", True, (before, after), (before_total, after_total), compute, saved, detail
    )


def fewest_stages(cost: TechniqueCost, pipe: int) -> int:
    """`data_grad_stages` for the fewest first stages that save what compressing every stage
    saves (`cost`, of every stage): the least k with R_dense - k b <= R_comp; -1 for all."""
    gap = cost.detail["exposed_dense_s"] - cost.detail["exposed_compressed_s"]
    k = math.ceil(gap / cost.detail["stage_slack_s"])
    return -1 if k >= pipe else max(k, 1)
