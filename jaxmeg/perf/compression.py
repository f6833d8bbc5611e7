"""Pipeline-aware communication compression in the performance model (Optimus-CC: Song et al.,
2023, "Optimus-CC: Efficient Large NLP Model Training with 3D Parallelism Aware Communication
Compression", ASPLOS): for each technique of jaxmeg's `compression` section
(`config.CompressionConfig`), the bytes per link per step, the compute it adds and its effect
on the step time of `jaxmeg.perf.model.step_time`.

Words as `jaxmeg.perf.model`; r a rank; elements of 2 bytes (the model's compute and wire
dtype), low-rank factors fp32 (4 bytes). A rank at or above a matrix's smaller side sends the
matrix whole (exact), as jaxmeg does.

pipe_grad       (`pipe_grad_rank`, `pipe_grad_phase`, `pipe_error_feedback`) The cotangent a
                stage sends back, one tensor rank's [n, h] matrix (n = b s, b s / t with
                sequence parallelism), goes as P [n, r] and Q [h, r]: 4 r (n + h) bytes instead
                of 2 n h, split over t like the dense message (`model.pipe_message_seconds`);
                per compressed transfer the sender runs one power iteration (two matmuls and
                the QR of both factors), the receiver rebuilds P Q^T, and lazy error feedback
                adds the sender's rebuild and an fp32 add and subtract over n h (no bytes; an
                fp32 [n, h] buffer per chunk, beside each link's Q [h, r]). Counts:
                `all` every backward transfer, m v per link (m (v - 1) on the wrap-around link
                from stage 0 to p - 1); `epilogue` those of
                `jaxmeg.pipeline.critical_path.exposed_backward_sends` (the executor's ticks from
                the step's last forward on; p - s - 1 on the link from stage s + 1 to s for
                1F1B). Time: the executor runs in lockstep, so a tick's backward ppermute is
                shorter only when every send in it is compressed: of the model's m v + p - 1
                backward sends (`model.step_time`, every one on the critical path), the fraction
                of the table's sending ticks that are all compressed saves t_dense - t_comp
                each (t_comp with its compute); a tick mixing both sends both, t_comp more.
embedding_sync  (`fused_embedding_sync`) jaxmeg reduces the tied embedding/head and position
                gradients, S = V h / t + s h per GPU, in one all-reduce over pipe x data (every
                GPU, a ring of p d); fused, over {first, last stage} x data (a ring of 2 d),
                and since every jaxmeg stage keeps a replica of the shared params, the p - 2
                middle stages then receive the result, S each, in ceil(log2((p - 2) / 2 + 1))
                rounds of ppermute (`gradients.broadcast_rounds`). Megatron-LM's middle stages
                hold no embedding. Megatron-LM's own synchronisation, for comparison:
                the all-reduce of the word embedding V h / t between the first and last stage (a
                ring of 2; its data-parallel average rides in those stages' gradient reduction).
                Time: the change of that all-reduce (ring size, latency steps, link), plus
                the middle stages' rounds, each S over the pipeline's link.
data_grad       (`data_grad_rank`, `data_grad_stages`, `warmup_steps`) PowerSGD on the stage's
                layer gradients: each weight matrix [n, m] a tensor rank holds (QKV [h, 3h/t],
                attention output [h/t, h], fc1 [h, f/t], fc2 [f/t, h]) is reduced as two
                all-reduces of fp32 factors, P [n, r] and Q [m, r], in place of its share of
                the gradient collective (`collectives.data_parallel_collectives`); vectors and
                the shared parameters stay in that collective, whole. Compute per matrix: two
                matmuls, the QR of both factors, the rebuild P Q^T and the error feedback's
                fp32 add and subtract. Only stages < k compress (`data_grad_stages`): in 1F1B's
                cool-down stage s ends its backward s chunk-backwards before stage 0, so its
                reduction may run that much longer without delaying the step; the step waits
                for max(R_comp, R_dense - k b) where b is one chunk's backward of one
                microbatch (stage 0 has no slack, as the model's flush-then-reduce has none).
                ZeRO-3's per-use gathers are not modelled with it (ValueError).
                `warmup_steps` runs the first steps uncompressed; the figures here are the
                steady state's (average over a run of N steps: W dense steps, N - W compressed).

Step time with compression = `model.step_time(...).total` + each technique's change (negative
when it saves). The model counts every pipeline send as exposed (Megatron-LM's accounting, as
`model.step_time`); the executor's premise for `epilogue` is that sends in ticks with a forward
overlap it, in which case `all` would save no more than `epilogue` does here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxmeg.config import ERROR_FEEDBACK, PIPE_GRAD_PHASES, CompressionConfig, ConfigError
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
    step_time,
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
MODES = ("off", "on", "auto")
"""`planner.plan(compression=...)`: none; every technique wherever it applies; each technique
where it predicts a saving (`choose`)."""
DEFAULT_RANK = 16
"""Rank `on` and `auto` give both low-rank techniques (`plan.py --compression-rank`)."""
AUTO_MIN_SAVING = 0.01
"""`auto` turns on a lossy technique (pipe_grad, data_grad) only where it saves at least this
fraction of the step; the exact fused embedding sync, wherever it saves anything."""


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


# ---------------------------------------------------------------------------------------------
# The report


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


@dataclasses.dataclass(frozen=True)
class CompressionCost:
    config: CompressionConfig
    pipe_grad: TechniqueCost
    embedding_sync: TechniqueCost
    data_grad: TechniqueCost
    base_step_s: float
    """`model.step_time(...).total`, nothing compressed."""

    @property
    def techniques(self) -> tuple[TechniqueCost, ...]:
        return (self.pipe_grad, self.embedding_sync, self.data_grad)

    @property
    def saved_s(self) -> float:
        return sum(t.saved_s for t in self.techniques)

    @property
    def step_s(self) -> float:
        return self.base_step_s - self.saved_s

    @property
    def on(self) -> list[str]:
        return [t.name for t in self.techniques if t.on]

    def as_dict(self) -> dict:
        return {
            "on": self.on,
            "config": dataclasses.asdict(self.config),
            "base_step_time_s": round(self.base_step_s, 4),
            "step_time_s": round(self.step_s, 4),
            "saved_s": round(self.saved_s, 4),
            **{t.name: t.as_dict() for t in self.techniques},
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


# ---------------------------------------------------------------------------------------------
# The whole step, and the planner's choice


def check_section(comp: CompressionConfig, layout: Layout) -> None:
    """`config.ConfigError` naming a field of `comp` the model cannot take: a negative rank or
    warm-up, an unknown phase or error feedback, `data_grad_stages` neither -1 nor in [1, p].
    The model prices every technique, including those training does not run yet (the config's
    own checks say which); one that does not apply to the layout (pipe_grad with p = 1,
    data_grad with d = 1) is off."""
    for name in ("pipe_grad_rank", "data_grad_rank", "warmup_steps"):
        if getattr(comp, name) < 0:
            raise ConfigError(f"compression.{name} must be >= 0, got {getattr(comp, name)}")
    for name, value, choices in (
        ("pipe_error_feedback", comp.pipe_error_feedback, ERROR_FEEDBACK),
        ("pipe_grad_phase", comp.pipe_grad_phase, PIPE_GRAD_PHASES),
    ):
        if value not in choices:
            raise ConfigError(f"compression.{name} must be one of {list(choices)}, got {value!r}")
    if not -1 <= comp.data_grad_stages <= layout.pipe or comp.data_grad_stages == 0:
        raise ConfigError(
            f"compression.data_grad_stages must be -1 (all) or a stage count in [1, "
            f"pipe = {layout.pipe}], got {comp.data_grad_stages}"
        )
    if layout.context > 1 and (
        comp.pipe_grad_rank or comp.data_grad_rank or comp.fused_embedding_sync
    ):
        raise ConfigError(
            f"compression is priced without context parallelism (as training runs it), got "
            f"context = {layout.context}"
        )


def compression_cost(
    shape: Shape,
    layout: Layout,
    hw: Hardware,
    comp: CompressionConfig,
    timing: StepTime | None = None,
) -> CompressionCost:
    """Every technique's bytes, compute and saving for `comp` on `layout` (`check_section`),
    and the step time with them."""
    check_section(comp, layout)
    timing = timing or step_time(shape, layout, hw)
    return CompressionCost(
        comp,
        pipe_grad_cost(shape, layout, hw, comp),
        embedding_sync_cost(shape, layout, hw, comp),
        data_grad_cost(shape, layout, hw, comp, timing),
        timing.total,
    )


def check_mode(mode: str, rank: int, phase: str) -> None:
    """ValueError naming a bad `choose` argument."""
    if mode not in MODES:
        raise ValueError(f"compression must be one of {list(MODES)}, got {mode!r}")
    if rank < 1:
        raise ValueError(f"compression rank must be >= 1, got {rank}")
    if phase not in critical_path.PHASES:
        raise ValueError(
            f"pipe_grad_phase must be one of {list(critical_path.PHASES)}, got {phase!r}"
        )


def choose(
    shape: Shape,
    layout: Layout,
    hw: Hardware,
    mode: str,
    rank: int = DEFAULT_RANK,
    phase: str = "all",
    timing: StepTime | None = None,
) -> CompressionConfig:
    """The `compression` section `mode` gives `layout`: `off` none; `on` every technique that
    applies (pipe_grad at `rank` and `phase` with lazy error feedback and the fused sync where
    p > 1, PowerSGD at `rank` on every stage where d > 1 and no ZeRO-3); `auto` each of those
    where it saves: pipe_grad if it saves AUTO_MIN_SAVING of the step, the fused sync if it
    saves anything, PowerSGD on the fewest first stages k that give its best saving, if that
    is AUTO_MIN_SAVING of the step."""
    check_mode(mode, rank, phase)
    if mode == "off":
        return CompressionConfig()
    p, d = layout.pipe, layout.data
    pipe = {"pipe_grad_rank": rank, "pipe_grad_phase": phase} if p > 1 else {}
    fused = {"fused_embedding_sync": True} if p > 1 else {}
    data = {"data_grad_rank": rank} if d > 1 and layout.zero_stage != 3 else {}
    if mode == "on":
        return CompressionConfig(**pipe, **fused, **data)
    timing = timing or step_time(shape, layout, hw)
    floor = AUTO_MIN_SAVING * timing.total
    chosen: dict = {}
    if pipe and pipe_grad_cost(shape, layout, hw, CompressionConfig(**pipe)).saved_s >= floor:
        chosen |= pipe
    if fused and embedding_sync_cost(shape, layout, hw, CompressionConfig(**fused)).saved_s > 0:
        chosen |= fused
    if data:
        every = data_grad_cost(shape, layout, hw, CompressionConfig(**data), timing)
        if every.on and every.saved_s >= floor:
            chosen |= {**data, "data_grad_stages": fewest_stages(every, p)}
    return CompressionConfig(**chosen)
