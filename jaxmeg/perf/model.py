"""Analytic performance model of a 3D-parallel GPT step: parameters, FLOPs, memory per GPU,
bytes per link and time per step, from the model shape, the layout and a hardware profile.

References: Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (eq. 2 parameters, eq. 3 FLOPs, section 2.2 bubble, section 5.1
training time); Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models" (activation bytes per layer, table 2); Rajbhandari et al., 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models" (sharded model states);
Lamy-Poirier, 2021, "Layered gradient accumulation and modular pipeline parallelism" (the
breadth-first schedule's gathers once per chunk and its overlapped data-parallel traffic).
Context parallelism (c GPUs per sequence, a ring of key/value blocks) is priced in
`jaxmeg.perf.context`; each GPU then holds s / c tokens of each sequence (`local_seq_len`),
which is the s of every per-token figure below.

Words: t tensor, p pipe, c context, d data, v chunks, b microbatch, m microbatches per replica,
B = d m b sequences per step, s sequence, h hidden, a heads, l layers, V vocabulary, Lc layers
per chunk, K the stage-input ring (microbatch-chunk inputs a stage keeps at once).

Recompute (`model.remat`), as jaxmeg's pipeline executor runs it, per (microbatch, chunk):
  full       keeps the chunk's input; the backward recomputes the chunk once (its residuals live
             while it runs): 1 + 3 forwards.
  selective  keeps the chunk's residuals but the attention internals (scores, softmax, context),
             which the backward recomputes (Korthikanti et al., 2022, section 4).
  none       keeps all the chunk's residuals: 1 + 2 forwards.
Without a pipeline the model applies the same choice per layer (Megatron's full: each layer's
input kept, one layer recomputed at a time).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxmeg.perf.collectives import (
    data_parallel_collectives,
    model_state_bytes,
    ring_all_reduce_seconds,
)
from jaxmeg.perf.context import (
    exposed_ring_seconds,
    local_seq_len,
    ring_buffer_bytes,
    ring_bytes_per_layer,
)
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.links import (  # noqa: F401 (device_grid, hardware_link, inside_node: re-exported)
    context_link,
    data_link,
    device_grid,
    hardware_link,
    inside_node,
    pipe_link,
    tensor_link,
)
from jaxmeg.perf.shape import Shape, shape_of  # noqa: F401 (re-exported)
from jaxmeg.pipeline import schedules, timing
from jaxmeg.pipeline.analysis import held_microbatches
from jaxmeg.pipeline.layout import StageLayout
from jaxmeg.pipeline.tick_table import STEADY_STATE_MICROBATCHES_PER_STAGE, build_tick_table


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
    """Bytes of fp32 params, fp32 gradients, Adam first and second moments (16 B / param),
    less what ZeRO shards (`collectives.model_state_bytes`)."""
    activations: float
    """Bytes of activations kept for the backward at the busiest moment."""
    workspace: float
    """Bytes held by libraries and transient buffers."""

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.workspace


def stage_layout(shape: Shape, layout: Layout) -> StageLayout:
    """Which layers each stage holds (`jaxmeg.pipeline.layout`); raises LayoutError naming the
    numbers when l does not split over p v (or `stage_layers` does not fit)."""
    return StageLayout.create(
        shape.layers, layout.pipe, layout.chunks, layout.stage_layers,
        placement=schedules.placement_of(layout.schedule),
    )  # fmt: skip


def busiest_stage_layers(shape: Shape, layout: Layout) -> int:
    """Real layers of the stage with the most (l / p when even). Every stage runs v Lc layer
    slots in lockstep (a shorter stage's padding is identity layers), so this stage sets the
    pace and the memory; padding holds no parameters and counts in no FLOPs."""
    return max(stage_layout(shape, layout).stage_layers)


def layer_parameters(shape: Shape) -> float:
    """One layer's parameters, 12 h^2 + 13 h (eq. 2's per-layer term)."""
    return 12 * shape.hidden * shape.hidden + 13 * shape.hidden


def shared_parameters_per_gpu(shape: Shape, tensor: int) -> float:
    """The vocab-parallel word embedding (V h / t, tied with the head) and the positions (s h)."""
    return shape.vocab * shape.hidden / tensor + shape.seq_len * shape.hidden


def params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Layer parameters of the busiest stage split t ways, plus the vocab-parallel embedding."""
    layers = busiest_stage_layers(shape, layout)
    return layers * layer_parameters(shape) / layout.tensor + shared_parameters_per_gpu(
        shape, layout.tensor
    )


def chunk_params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Parameters of the busiest chunk split t ways (its Lc layers and the embedding): what
    ZeRO-3 gathers at once."""
    lc = busiest_stage_layers(shape, layout) // layout.chunks
    return lc * layer_parameters(shape) / layout.tensor + shared_parameters_per_gpu(
        shape, layout.tensor
    )


def layer_activation_bytes(shape: Shape, layout: Layout, flash_attention: bool = True) -> float:
    """Korthikanti et al. table 2, 16-bit activations, per layer per microbatch.

    none:      s b h (10 + 24/t + 5 a s / (h t)),  with sequence parallelism (34 + 5 a s/h) / t
    selective: s b h (10 + 24/t),                  with sequence parallelism 34 / t
    full:      2 s b h (the layer input),          with sequence parallelism / t
    Flash attention keeps no s x s scores, so the 5 a s / h term drops. With context, s b h is
    of the s / c local tokens, whose scores rows are s long.
    """
    s, b, h, a, t = shape.seq_len, layout.microbatch, shape.hidden, shape.heads, layout.tensor
    sbh = local_seq_len(shape, layout) * b * h
    scores = 0.0 if flash_attention else 5 * a * s / h
    sp = layout.sequence_parallel
    if layout.recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if layout.recompute == "selective":
        return sbh * (34 / t if sp else 10 + 24 / t)
    return sbh * ((34 + scores) / t if sp else 10 + 24 / t + scores / t)


@functools.cache
def _ring_slots(schedule: str, p: int, v: int, warmup: str) -> int:
    m = STEADY_STATE_MICROBATCHES_PER_STAGE * p  # 1F1B-type rings are full by then, flat after
    return build_tick_table(schedules.build(schedule, p, m, v, warmup)).num_input_slots


def stored_microbatches(layout: Layout) -> int:
    """K, the (microbatch, chunk) inputs a stage keeps for its backward at once: the stage-input
    ring of the schedule's tick table (`num_input_slots`, the same for every m) for 1F1B-type
    schedules, m for GPipe, m v for breadth-first (every microbatch's input to every chunk
    waits for the backward), 1 without a pipeline (microbatches run one after another)."""
    if layout.schedule == "breadth_first" and (layout.pipe > 1 or layout.chunks > 1):
        return layout.microbatches * layout.chunks
    if layout.pipe == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.microbatches
    return _ring_slots(layout.schedule, layout.pipe, layout.chunks, layout.warmup)


def split_store_bytes_per_layer(shape: Shape, layout: Layout) -> float:
    """What a split backward keeps per layer between I and W (`jaxmeg.models.split_backward`):
    each weight matmul's input X and output cotangent dY, 16-bit. The column-parallel matmuls'
    inputs and the row-parallel ones' output cotangents are whole over the tensor group, split
    on the sequence with sequence parallelism: s b (4 h + (4 h + 2 f) / t), with it s b (8 h +
    2 f) / t, f the MLP width (16 s b h / t)."""
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    f = shape.mlp_ratio * h
    residual = h / t if layout.sequence_parallel else h  # a residual-stream-shaped tensor
    return 2 * s * b * (4 * residual + (4 * h + 2 * f) / t)


def matmul_input_bytes_per_layer(shape: Shape, layout: Layout) -> float:
    """The matmul inputs X a split backward's forward keeps for W until I moves them (with
    stored residuals), 16-bit: s b (2 h + (h + f) / t), the first term / t with sequence
    parallelism."""
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    f = shape.mlp_ratio * h
    residual = h / t if layout.sequence_parallel else h
    return 2 * s * b * (2 * residual + (h + f) / t)


@functools.cache
def _held_microbatches(schedule: str, p: int, v: int) -> tuple[tuple[float, ...], ...]:
    m = STEADY_STATE_MICROBATCHES_PER_STAGE * p
    return held_microbatches(schedules.build(schedule, p, m, v))


def split_backward_stored_bytes(shape: Shape, layout: Layout) -> float:
    """A split-backward schedule's stored activations on its busiest stage: per stage, the
    microbatches held whole (forward ran, I not yet) times what the forward keeps, plus those
    between I and W times `split_store_bytes_per_layer`, from the tick table
    (`analysis.held_microbatches`, flat in m)."""
    whole, split = _held_microbatches(layout.schedule, layout.pipe, layout.chunks)
    v, lc = layout.chunks, busiest_stage_layers(shape, layout) // layout.chunks
    kept = kept_bytes_per_microbatch(shape, layout)
    if layout.recompute != "full":
        kept += lc * matmul_input_bytes_per_layer(shape, layout)
    per_split = lc * split_store_bytes_per_layer(shape, layout)
    return max(v * (w * kept + x * per_split) for w, x in zip(whole, split, strict=True))


def kept_bytes_per_microbatch(shape: Shape, layout: Layout) -> float:
    """Bytes one ring slot holds for the backward: the chunk's input (2 s b h, /t with sequence
    parallelism) and, unless `full`, the residuals of its Lc layers at the remat choice's
    per-layer count. Without a pipeline or chunks, every layer keeps its per-layer count."""
    lc = busiest_stage_layers(shape, layout) // layout.chunks
    per_layer = layer_activation_bytes(shape, layout)
    if layout.pipe == 1 and layout.chunks == 1:
        return lc * per_layer
    chunk_input = layer_activation_bytes(shape, dataclasses.replace(layout, recompute="full"))
    return chunk_input + (0.0 if layout.recompute == "full" else lc * per_layer)


def recompute_working_bytes(shape: Shape, layout: Layout) -> float:
    """Residuals alive while `full` recompute runs: a whole chunk's (the executor recomputes
    the chunk at once), one layer's without a pipeline or chunks; none for the other choices."""
    if layout.recompute != "full":
        return 0.0
    all_kept = layer_activation_bytes(shape, dataclasses.replace(layout, recompute="none"))
    lc = busiest_stage_layers(shape, layout) // layout.chunks
    return all_kept * (lc if layout.pipe > 1 or layout.chunks > 1 else 1)


def memory_per_gpu(shape: Shape, layout: Layout, hw: Hardware) -> Memory:
    """Model states at 16 B/param less ZeRO's sharding (`collectives.model_state_bytes`);
    activations: K ring slots of what the remat choice keeps
    (`stored_microbatches` x `kept_bytes_per_microbatch`), the recompute working set, the last
    stage's fp32 logits, one received activation and the context ring's blocks
    (`context.ring_buffer_bytes`); the hardware's workspace. The busiest stage's, s the local
    s / c with context."""
    params = params_per_gpu(shape, layout)
    states = model_state_bytes(params, chunk_params_per_gpu(shape, layout), layout)
    if schedules.splits_backward(layout.schedule) and layout.pipe > 1:
        stored = split_backward_stored_bytes(shape, layout)
    else:
        stored = stored_microbatches(layout) * kept_bytes_per_microbatch(shape, layout)
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    logits = 3 * 4 * s * b * shape.vocab / t  # fp32 logits, softmax and gradient
    activations = stored + recompute_working_bytes(shape, layout) + logits + 2 * s * b * h
    activations += ring_buffer_bytes(shape, layout)
    return Memory(params, states, activations, hw.workspace_gb * 1e9)


# ---------------------------------------------------------------------------------------------
# Communication and time


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
    """Seconds of data-parallel traffic on the critical path (`data_parallel_seconds`)."""
    optimizer: float
    """Seconds of the optimizer step (memory bound)."""
    bubble: float
    """(p - 1) / (v m)."""

    @property
    def total(self) -> float:
        return self.pipeline + self.p2p + self.data_parallel + self.optimizer


@dataclasses.dataclass(frozen=True)
class LayerSeconds:
    forward: float
    """One layer's forward for one microbatch, tensor-parallel all-reduces included."""
    backward: float
    """Its backward without recompute."""
    attention_core: float
    """The part of the forward that selective recompute reruns: scores, softmax, context."""
    ring_forward: float = 0.0
    """Seconds of the forward's context ring sends that its block steps do not hide (in
    `forward`; `context.exposed_ring_seconds`)."""
    ring_backward: float = 0.0
    """The backward's (in `backward`)."""

    def recompute(self, choice: str) -> float:
        """Seconds the backward adds to rerun what `choice` did not keep."""
        return {"full": self.forward, "selective": self.attention_core, "none": 0.0}[choice]


def layer_seconds(shape: Shape, layout: Layout, hw: Hardware) -> LayerSeconds:
    """Seconds of one layer for one microbatch. With context, s is the s / c local tokens and
    attention runs as c block steps of s / c queries against s / c keys, each waiting for its
    ring send where the send is the longer (`context.exposed_ring_seconds`)."""
    s, b, h, a = local_seq_len(shape, layout), layout.microbatch, shape.hidden, shape.heads
    t, c = layout.tensor, layout.context
    tokens = s * b
    f = shape.mlp_ratio * h
    gemms = (
        _gemm_seconds(tokens, 3 * h / t, h, hw)  # QKV
        + _gemm_seconds(tokens, h, h / t, hw)  # attention output
        + _gemm_seconds(tokens, f / t, h, hw)  # fc1
        + _gemm_seconds(tokens, h, f / t, hw)  # fc2
    )
    heads = a / t
    block = (
        b * heads * (_gemm_seconds(s, s, h / a, hw) + _gemm_seconds(s, h / a, s, hw))
    )  # scores and context, as batched GEMMs per head, of one block step
    attention = c * block
    # Memory-bound work per layer, in 2-byte elements read + written: two layer norms, two
    # dropouts and two residual adds on the hidden stream (~12 s b h; split over t only with
    # sequence parallelism), bias + GeLU on the 4h MLP activations and the QKV bias (~16 s b h
    # / t), and scale-mask-softmax + dropout over the attention scores (~6 b a s^2 / t, per
    # block step).
    hbm_bytes_per_s = hw.hbm_tb_per_s * 1e12
    replicated = 12 * tokens * h / (t if layout.sequence_parallel else 1)
    block_softmax = 6 * b * heads * s * s * 2 / hbm_bytes_per_s
    softmax = c * block_softmax
    elementwise = (replicated + 16 * tokens * h / t) * 2 / hbm_bytes_per_s + softmax
    all_reduce = ring_all_reduce_seconds(2 * tokens * h, t, tensor_link(layout, hw))
    ring_f, ring_b = exposed_ring_seconds(
        shape, layout, context_link(layout, hw), block + block_softmax
    )
    forward = gemms + attention + elementwise + 2 * all_reduce + ring_f
    backward = 2 * (gemms + attention + elementwise) + 2 * all_reduce + ring_b
    return LayerSeconds(forward, backward, attention + softmax, ring_f, ring_b)


def data_parallel_seconds(
    shape: Shape, layout: Layout, hw: Hardware, compute_seconds: float
) -> float:
    """Seconds of data-parallel traffic on the critical path. Depth-first, none of it overlaps
    compute (as in the Megatron-LM measurements): a gradient is final only after the last
    microbatch. Breadth-first, chunk c's gradient is final once every microbatch has passed
    back through it, while the backward of chunks c-1 .. 0 is still to run, and the next
    chunk's weights can be gathered while this one computes (Lamy-Poirier, 2021, sections 4-5):
    only the first gather and the last reduce-scatter, 1/v of the traffic, must wait, and the
    rest hides behind the step's compute C: max(T / v, T - C). With context the ring is the
    d c GPUs of the data x context group (`Layout.gradient_group`)."""
    link = data_link(layout, hw)
    collectives = data_parallel_collectives(
        params_per_gpu(shape, layout), chunk_params_per_gpu(shape, layout), layout
    )
    total = sum(c.seconds(layout.gradient_group, link) for c in collectives)
    return exposed_data_parallel_seconds(total, layout, compute_seconds)


def exposed_data_parallel_seconds(total: float, layout: Layout, compute_seconds: float) -> float:
    """What of `total` seconds of data-parallel traffic the step waits for: all of it
    depth-first, max(T / v, T - C) breadth-first (`data_parallel_seconds`)."""
    if layout.schedule != "breadth_first":
        return total
    return max(total / layout.chunks, total - compute_seconds)


def pipe_message_seconds(
    shape: Shape,
    layout: Layout,
    hw: Hardware,
    link: tuple[float, float] | None = None,
    message: float | None = None,
) -> float:
    """One activation (or cotangent) of 2 s b h bytes (s / c tokens with context; or `message`
    bytes, the tensor group's whole message) from a stage to its neighbour, over `link` (GB/s,
    latency us; default `pipe_link`).

    With Megatron's scatter/gather each of the t ranks of a tensor group sends 1/t of it on its
    own link, and the receivers all-gather the t pieces over the tensor group before the stage
    can start (Narayanan et al., 2021, section 4.1); without it every rank sends it whole.
    """
    if message is None:
        message = 2 * local_seq_len(shape, layout) * layout.microbatch * shape.hidden
    t = layout.tensor
    gb_per_s, latency_us = pipe_link(layout, hw) if link is None else link
    if not (layout.pipe_scatter_gather or layout.sequence_parallel) or t == 1:
        return message / (gb_per_s * 1e9) + latency_us * 1e-6
    send = message / t / (gb_per_s * 1e9) + latency_us * 1e-6
    if layout.sequence_parallel:  # the next stage wants the sequence-sharded piece as it is
        return send
    gb_per_s, latency_us = tensor_link(layout, hw)
    gather = (t - 1) / t * message / (gb_per_s * 1e9) + (t - 1) * latency_us * 1e-6
    return send + gather


def logits_seconds(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """The output projection's forward for one microbatch (its backward is two of these), of
    the s / c local tokens with context."""
    tokens = local_seq_len(shape, layout) * layout.microbatch
    return _gemm_seconds(tokens, shape.vocab / layout.tensor, shape.hidden, hw)


def optimizer_seconds(params: float, layout: Layout, hw: Hardware) -> float:
    """The optimizer step of `params` parameters, memory bound: 16 bytes per parameter read
    and written, on the 1/d shard with ZeRO (1/(d c) with context: the gradient group's)."""
    updated = params / (layout.gradient_group if layout.zero_stage else 1)
    return 16 * updated * 2 / (hw.hbm_tb_per_s * 1e12)


def step_time(shape: Shape, layout: Layout, hw: Hardware) -> StepTime:
    """Megatron's pipeline: (m + (p - 1) / v) microbatch slots of the busiest stage's forward +
    backward; the backward reruns what the remat choice did not keep (`LayerSeconds.recompute`:
    a forward for full). The last stage's logits and the pipeline sends are on the critical
    path; the data-parallel traffic (`data_parallel_seconds`) and the optimizer step (on the
    1/d shard with ZeRO) follow the flush."""
    p, v, m = layout.pipe, layout.chunks, layout.microbatches
    layer = layer_seconds(shape, layout, hw)
    layers = busiest_stage_layers(shape, layout)
    logits_f = logits_seconds(shape, layout, hw)
    # The last stage also runs the output projection; lockstep or not, the pipeline moves at
    # the pace of its slowest stage, counted as the busiest one plus the head.
    forward = layers * layer.forward + logits_f
    backward = layers * (layer.backward + layer.recompute(layout.recompute)) + 2 * logits_f
    bubble = timing.bubble_fraction(layout.schedule, p, m, v)
    pipeline = m * (1 + bubble) * (forward + backward)
    p2p = 0.0
    if p > 1:  # per slot and chunk, one send forward and one back
        p2p = 2 * v * (m + (p - 1) / v) * pipe_message_seconds(shape, layout, hw)
    compute = m * (forward + backward)
    dp = data_parallel_seconds(shape, layout, hw, compute)
    optimizer = optimizer_seconds(params_per_gpu(shape, layout), layout, hw)
    return StepTime(forward, backward, pipeline, p2p, dp, optimizer, bubble)


def tflops_per_gpu(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Achieved model TFLOP/s per GPU as Megatron reports it (eq. 3, recompute counted when
    the run recomputes)."""
    flops = flops_per_iteration(shape, layout.global_batch, layout.recompute == "full")
    return flops / step_time(shape, layout, hw).total / layout.gpus / 1e12


def paper_training_days(shape: Shape, gpus: int, tflops_per_gpu_: float, tokens: float) -> float:
    """Megatron section 5.1: end-to-end time ~ 8 T P / (n X)."""
    return 8 * tokens * parameter_count(shape) / (gpus * tflops_per_gpu_ * 1e12) / 86400


def bytes_per_step(shape: Shape, layout: Layout, compute_bytes: int = 2) -> dict[str, float]:
    """Bytes one GPU sends per step on each link, and the message sizes behind them.

    tensor: 2 all-reduces of b s h per layer in the forward and 2 in the backward (+2 more for
    the recomputed forward with `recompute="full"`), each moving 2 (t-1)/t of the message, and
    with scatter/gather the all-gather of each received pipeline message, (t-1)/t of it; pipe:
    b s h per microbatch per boundary each way (/t with scatter-gather), as a stage with a
    neighbour on both sides sends (jaxmeg's executor sends only what Megatron-LM sends); data: the
    `collectives.data_parallel_collectives` on a ring of d (d c with context); context: the
    ring's blocks (`context.ring_bytes_per_layer`) per layer per microbatch, its forward twice
    with `recompute="full"`. s is the s / c local tokens with context. Layers are the busiest
    stage's.
    """
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    message = s * b * h * compute_bytes
    per_layer = 6 if layout.recompute == "full" else 4
    layers = busiest_stage_layers(shape, layout)
    tensor = per_layer * layers * layout.microbatches
    tensor_bytes = tensor * message * (2 * (t - 1) / t if t > 1 else 0)
    split = layout.pipe_scatter_gather or layout.sequence_parallel
    pipe_message = message / t if split else message
    sends = 2 * layout.microbatches * layout.chunks
    pipe_bytes = sends * pipe_message if layout.pipe > 1 else 0
    if layout.pipe > 1 and t > 1 and layout.pipe_scatter_gather and not layout.sequence_parallel:
        # scatter/gather: each received message is all-gathered over the tensor group
        tensor_bytes += sends * message * (t - 1) / t
    collectives = data_parallel_collectives(
        params_per_gpu(shape, layout), chunk_params_per_gpu(shape, layout), layout
    )
    data_bytes = sum(c.wire_bytes(layout.gradient_group) for c in collectives)
    ring = ring_bytes_per_layer(shape, layout, compute_bytes)
    ring_forwards = 2 if layout.recompute == "full" else 1
    context_bytes = layers * layout.microbatches * (ring_forwards * ring.forward + ring.backward)
    return {
        "tensor_message": float(message),
        "tensor_all_reduces": float(tensor),
        "tensor": float(tensor_bytes),
        "pipe_message": float(pipe_message),
        "pipe": float(pipe_bytes),
        "data": float(data_bytes),
        "context_block": float(ring.block),
        "context_per_layer": float(ring.per_layer),
        "context": float(context_bytes),
    }
