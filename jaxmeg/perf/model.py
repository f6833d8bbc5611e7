"""Analytic performance model of a 3D-parallel GPT step: parameters, FLOPs, memory per GPU,
bytes per link and time per step, from the model shape, the layout and a hardware profile.

References: Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (eq. 2 parameters, eq. 3 FLOPs, section 2.2 bubble, section 5.1
training time); Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models" (activation bytes per layer, table 2).

Words: t tensor, p pipe, d data, v chunks, b microbatch, m microbatches per replica,
B = d m b sequences per step, s sequence, h hidden, a heads, l layers, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmeg.config import MESH_AXES, OUTER_AXES, REMAT_POLICIES, ModelConfig
from jaxmeg.perf.hardware import Hardware
from jaxmeg.pipeline.schedules import bubble_fraction


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    seq_len: int
    vocab: int
    mlp_ratio: int = 4


def shape_of(model: ModelConfig) -> Shape:
    """The Shape of a model config: h, l, a, s, V (`vocab_size`, which must be set) and the
    MLP ratio. The one place a config becomes a Shape."""
    if model.vocab_size < 1:
        raise ValueError(f"model.vocab_size must be set (>= 1), got {model.vocab_size}")
    return Shape(
        hidden=model.hidden, layers=model.layers, heads=model.heads, seq_len=model.seq_len,
        vocab=model.vocab_size, mlp_ratio=model.mlp_ratio,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    tensor: int
    pipe: int
    data: int
    chunks: int = 1
    microbatch: int = 1
    microbatches: int = 1
    recompute: str = "full"
    """What a layer keeps for its backward, one of `config.REMAT_POLICIES` (`model.remat`)."""
    pipe_scatter_gather: bool = True
    """Megatron splits each pipeline message over the t ranks of a tensor group; jaxmeg's
    executor sends the whole b s h activation unless sequence parallelism already splits it."""
    sequence_parallel: bool = False
    """Shard the residual stream on the sequence over `tensor` (Korthikanti et al., 2022); off
    in the Megatron-LM 2021 measurements. Pipeline messages are always scatter/gathered (/t)."""
    outer_axis: str = "pipe"
    """Which of pipe and data varies slowest over the GPUs (`parallel.outer_axis`), and so
    crosses nodes first."""

    def __post_init__(self) -> None:
        if self.recompute not in REMAT_POLICIES:
            raise ValueError(
                f"recompute must be one of {list(REMAT_POLICIES)}, got {self.recompute!r}"
            )
        if self.outer_axis not in OUTER_AXES:
            raise ValueError(
                f"outer_axis must be one of {list(OUTER_AXES)}, got {self.outer_axis!r}"
            )

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipe * self.data

    @property
    def global_batch(self) -> int:
        return self.data * self.microbatches * self.microbatch


def parameter_count(shape: Shape) -> float:
    """Megatron eq. 2: P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) (MLP of 4h)."""
    h, l, v, s = shape.hidden, shape.layers, shape.vocab, shape.seq_len
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def flops_per_iteration(shape: Shape, batch: int, recompute: bool = True) -> float:
    """Megatron eq. 3: F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) with full recompute
    (one extra forward); 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)) without."""
    h, l, v, s = shape.hidden, shape.layers, shape.vocab, shape.seq_len
    if recompute:
        return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * batch * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


# ---------------------------------------------------------------------------------------------
# Memory


@dataclasses.dataclass(frozen=True)
class Memory:
    params: float
    """Parameter count held by one GPU (the busiest stage)."""
    model_states: float
    """Bytes: fp32 params, fp32 gradients, Adam first and second moments (16 B / param)."""
    activations: float
    """Bytes of activations kept for the backward at the busiest moment."""
    workspace: float
    """Bytes held by libraries and transient buffers."""

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.workspace


def params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Layer parameters of one stage split t ways, plus the vocab-parallel embedding."""
    h = shape.hidden
    layer = 12 * h * h + 13 * h
    stage_layers = shape.layers / layout.pipe
    embedding = shape.vocab * h / layout.tensor + shape.seq_len * h
    return stage_layers * layer / layout.tensor + embedding


def layer_activation_bytes(shape: Shape, layout: Layout, flash_attention: bool = True) -> float:
    """Korthikanti et al. table 2, 16-bit activations, per layer per microbatch.

    none:      s b h (10 + 24/t + 5 a s / (h t)),  with sequence parallelism (34 + 5 a s/h) / t
    selective: s b h (10 + 24/t),                  with sequence parallelism 34 / t
    full:      2 s b h (the layer input),          with sequence parallelism / t
    Flash attention keeps no s x s scores, so the 5 a s / h term drops.
    """
    s, b, h, a, t = shape.seq_len, layout.microbatch, shape.hidden, shape.heads, layout.tensor
    sbh = s * b * h
    scores = 0.0 if flash_attention else 5 * a * s / h
    sp = layout.sequence_parallel
    if layout.recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if layout.recompute == "selective":
        return sbh * (34 / t if sp else 10 + 24 / t)
    return sbh * ((34 + scores) / t if sp else 10 + 24 / t + scores / t)


def in_flight_microbatches(layout: Layout, schedule: str = "1f1b") -> float:
    """Microbatches whose activations stage 0 holds at its peak (as chunks of L/(p v) layers),
    counted in whole-stage equivalents: 1F1B p (Megatron), interleaved p (1 + (p-1)/(p v)),
    GPipe m."""
    p, v, m = layout.pipe, layout.chunks, layout.microbatches
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if v > 1:
        return min(p * (1 + (p - 1) / (p * v)), m)
    return float(min(p, m))


def memory_per_gpu(shape: Shape, layout: Layout, hw: Hardware, schedule: str = "1f1b") -> Memory:
    """Model states at 16 B/param, activations of the in-flight microbatches, the recompute
    working set of one layer, the last stage's fp32 logits, and the hardware's workspace."""
    params = params_per_gpu(shape, layout)
    states = 16.0 * params
    layers = shape.layers / layout.pipe
    stored = (
        layer_activation_bytes(shape, layout) * layers * in_flight_microbatches(layout, schedule)
    )
    s, b, h, t = shape.seq_len, layout.microbatch, shape.hidden, layout.tensor
    working = 0.0
    if layout.recompute == "full":  # one layer's full activations while it is recomputed
        working = layer_activation_bytes(shape, dataclasses.replace(layout, recompute="none"))
    logits = 3 * 4 * s * b * shape.vocab / t  # fp32 logits, softmax and gradient
    activations = stored + working + logits + 2 * s * b * h
    return Memory(params, states, activations, hw.workspace_gb * 1e9)


# ---------------------------------------------------------------------------------------------
# Communication and time


def _ring_all_reduce_seconds(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """Ring all-reduce: 2 (n-1)/n of the message over the link, 2 (n-1) latency steps."""
    if n == 1:
        return 0.0
    gb_per_s, latency_us = link
    return 2 * (n - 1) / n * nbytes / (gb_per_s * 1e9) + 2 * (n - 1) * latency_us * 1e-6


def _gemm_seconds(m: float, n: float, k: float, hw: Hardware) -> float:
    """2 m n k FLOPs at the profile's GEMM efficiency, lower along each dimension below
    `gemm_half_dim` (tile quantisation and launch overheads), or the HBM roofline."""
    c = hw.gemm_half_dim
    efficiency = hw.gemm_efficiency * (m / (m + c)) * (n / (n + c)) * (k / (k + c))
    compute = 2 * m * n * k / (hw.peak_tflops * 1e12 * efficiency)
    memory = 2 * (m * k + k * n + m * n) / (hw.hbm_tb_per_s * 1e12)
    return max(compute, memory)


@dataclasses.dataclass(frozen=True)
class StepTime:
    forward: float
    """Seconds of one microbatch's forward through one stage (compute + tensor-parallel comm)."""
    backward: float
    """Seconds of its backward, recompute included."""
    pipeline: float
    """Seconds of the pipeline of m microbatches (Megatron's asynchronous schedule)."""
    p2p: float
    """Seconds of pipeline sends on the critical path."""
    data_parallel: float
    """Seconds of the gradient all-reduce (not overlapped)."""
    optimizer: float
    """Seconds of the optimizer step (memory bound)."""
    bubble: float
    """(p - 1) / (v m)."""

    @property
    def total(self) -> float:
        return self.pipeline + self.p2p + self.data_parallel + self.optimizer


def _link(hw: Hardware, inside_node: bool) -> tuple[float, float]:
    """(achievable GB/s, latency us): datasheet bandwidth x the collectives' efficiency."""
    if inside_node:
        return hw.intra_node_gb_per_s * hw.collective_efficiency, hw.intra_node_latency_us
    return hw.inter_node_gb_per_s * hw.collective_efficiency, hw.inter_node_latency_us


def device_grid(layout: Layout) -> np.ndarray:
    """int [d, p, t]: each GPU's rank in the device order, laid out as
    `jaxmeg.parallel.mesh.make_mesh` lays out the mesh: tensor fastest, `outer_axis` slowest.
    Nodes are runs of `gpus_per_node` consecutive ranks."""
    d, p, t = layout.data, layout.pipe, layout.tensor
    ranks = np.arange(layout.gpus)
    if layout.outer_axis == "pipe":
        return ranks.reshape(p, d, t).transpose(1, 0, 2)
    return ranks.reshape(d, p, t)


def inside_node(layout: Layout, hw: Hardware, axis: str) -> bool:
    """Whether every group along mesh `axis` sits in one node (its collectives use NVLink)."""
    node = device_grid(layout) // hw.gpus_per_node
    dim = MESH_AXES.index(axis)
    return bool((node.min(axis=dim) == node.max(axis=dim)).all())


def tensor_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """A tensor group is consecutive GPUs: NVLink while it fits in a node."""
    return _link(hw, inside_node(layout, hw, "tensor"))


def pipe_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """Pipeline neighbours are t GPUs apart (outer_axis data) or t d (outer_axis pipe); the
    pipeline moves at the pace of its slowest hop, so one hop across nodes makes it inter-node."""
    return _link(hw, inside_node(layout, hw, "pipe"))


def data_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """A data group is t GPUs apart (outer_axis pipe) or t p (outer_axis data)."""
    return _link(hw, inside_node(layout, hw, "data"))


def layer_seconds(shape: Shape, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward without recompute) seconds of one layer for one microbatch."""
    s, b, h, a, t = shape.seq_len, layout.microbatch, shape.hidden, shape.heads, layout.tensor
    tokens = s * b
    f = shape.mlp_ratio * h
    gemms = (
        _gemm_seconds(tokens, 3 * h / t, h, hw)  # QKV
        + _gemm_seconds(tokens, h, h / t, hw)  # attention output
        + _gemm_seconds(tokens, f / t, h, hw)  # fc1
        + _gemm_seconds(tokens, h, f / t, hw)  # fc2
    )
    heads = a / t
    attention = (
        b * heads * (_gemm_seconds(s, s, h / a, hw) + _gemm_seconds(s, h / a, s, hw))
    )  # scores and context, as batched GEMMs per head
    # Memory-bound work per layer, in 2-byte elements read + written: two layer norms, two
    # dropouts and two residual adds on the hidden stream (~12 s b h; split over t only with
    # sequence parallelism), bias + GeLU on the 4h MLP activations and the QKV bias (~16 s b h
    # / t), and scale-mask-softmax + dropout over the attention scores (~6 b a s^2 / t).
    replicated = 12 * tokens * h / (t if layout.sequence_parallel else 1)
    split = 16 * tokens * h / t + 6 * b * heads * s * s
    elementwise = (replicated + split) * 2 / (hw.hbm_tb_per_s * 1e12)
    all_reduce = _ring_all_reduce_seconds(2 * tokens * h, t, tensor_link(layout, hw))
    forward = gemms + attention + elementwise + 2 * all_reduce
    backward = 2 * (gemms + attention + elementwise) + 2 * all_reduce
    return forward, backward


def _pipe_message_seconds(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """One activation (or cotangent) of 2 s b h bytes from a stage to its neighbour.

    With Megatron's scatter/gather each of the t ranks of a tensor group sends 1/t of it on its
    own link, and the receivers all-gather the t pieces over the tensor group before the stage
    can start (Narayanan et al., 2021, section 4.1); without it every rank sends it whole.
    """
    message = 2 * shape.seq_len * layout.microbatch * shape.hidden
    t = layout.tensor
    gb_per_s, latency_us = pipe_link(layout, hw)
    if not (layout.pipe_scatter_gather or layout.sequence_parallel) or t == 1:
        return message / (gb_per_s * 1e9) + latency_us * 1e-6
    send = message / t / (gb_per_s * 1e9) + latency_us * 1e-6
    if layout.sequence_parallel:  # the next stage wants the sequence-sharded piece as it is
        return send
    gb_per_s, latency_us = tensor_link(layout, hw)
    gather = (t - 1) / t * message / (gb_per_s * 1e9) + (t - 1) * latency_us * 1e-6
    return send + gather


def step_time(shape: Shape, layout: Layout, hw: Hardware) -> StepTime:
    """Megatron's pipeline: (m + (p - 1) / v) microbatch slots of a stage's forward + backward;
    full recompute adds one forward to each backward. The last stage's logits and the pipeline
    sends are on the critical path; the data-parallel all-reduce and the optimizer step follow
    the flush (no overlap, as in the Megatron-LM measurements)."""
    p, v, m = layout.pipe, layout.chunks, layout.microbatches
    layer_f, layer_b = layer_seconds(shape, layout, hw)
    layers = shape.layers / p
    tokens = shape.seq_len * layout.microbatch
    logits_f = _gemm_seconds(tokens, shape.vocab / layout.tensor, shape.hidden, hw)
    # The last stage also runs the output projection: it is the slowest stage, and lockstep
    # or not, the pipeline moves at the pace of its slowest stage.
    forward = layers * layer_f + logits_f
    backward = layers * layer_b + 2 * logits_f
    if layout.recompute == "full":
        backward += layers * layer_f
    elif layout.recompute == "selective":
        backward += layers * layer_f * 0.05  # attention scores/softmax recomputed
    bubble = bubble_fraction("interleaved_1f1b" if v > 1 else "1f1b", p, m, v)
    pipeline = m * (1 + bubble) * (forward + backward)
    p2p = 0.0
    if p > 1:  # per slot and chunk, one send forward and one back
        p2p = 2 * v * (m + (p - 1) / v) * _pipe_message_seconds(shape, layout, hw)
    params = params_per_gpu(shape, layout)
    dp = _ring_all_reduce_seconds(2 * params, layout.data, data_link(layout, hw))
    optimizer = 16 * params * 2 / (hw.hbm_tb_per_s * 1e12)
    return StepTime(forward, backward, pipeline, p2p, dp, optimizer, bubble)


def tflops_per_gpu(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Achieved model TFLOP/s per GPU as Megatron reports it (eq. 3, recompute counted when
    the run recomputes)."""
    flops = flops_per_iteration(shape, layout.global_batch, layout.recompute == "full")
    return flops / step_time(shape, layout, hw).total / layout.gpus / 1e12


def paper_training_days(shape: Shape, gpus: int, tflops_per_gpu_: float, tokens: float) -> float:
    """Megatron section 5.1: end-to-end time ~ 8 T P / (n X)."""
    return 8 * tokens * parameter_count(shape) / (gpus * tflops_per_gpu_ * 1e12) / 86400


def bytes_per_step(
    shape: Shape, layout: Layout, compute_bytes: int = 2, ticks: int | None = None
) -> dict[str, float]:
    """Bytes one GPU sends per step on each link, and the message sizes behind them.

    tensor: 2 all-reduces of b s h per layer in the forward and 2 in the backward (+2 more for
    the recomputed forward with `recompute="full"`, which jaxmeg's pipeline executor always
    does), each moving 2 (t-1)/t of the message; pipe: b s h per microbatch per
    boundary each way (/t with scatter-gather); data: the fp32 gradients, 2 (d-1)/d of them.
    """
    s, b, h, t = shape.seq_len, layout.microbatch, shape.hidden, layout.tensor
    message = s * b * h * compute_bytes
    per_layer = 6 if layout.recompute == "full" else 4
    layers = shape.layers / layout.pipe
    tensor = per_layer * layers * layout.microbatches
    tensor_bytes = tensor * message * (2 * (t - 1) / t if t > 1 else 0)
    split = layout.pipe_scatter_gather or layout.sequence_parallel
    pipe_message = message / t if split else message
    sends = 2 * ticks if ticks is not None else 2 * layout.microbatches * layout.chunks
    pipe_bytes = sends * pipe_message if layout.pipe > 1 else 0
    params = params_per_gpu(shape, layout)
    d = layout.data
    data_bytes = 4 * params * (2 * (d - 1) / d if d > 1 else 0)
    return {
        "tensor_message": float(message),
        "tensor_all_reduces": float(tensor),
        "tensor": float(tensor_bytes),
        "pipe_message": float(pipe_message),
        "pipe": float(pipe_bytes),
        "data": float(data_bytes),
    }
