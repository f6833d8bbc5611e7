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
which is the s of every per-token figure below. Mixture-of-experts layers (`Shape.experts`,
e expert ranks) are priced in `jaxmeg.perf.experts`: their experts split over e GPUs that are
data-parallel replicas for every other weight, their block's time and bytes in place of the
dense MLP's.

Words: t tensor, p pipe, c context, d data, v chunks, b microbatch, m microbatches per replica,
B = d m b sequences per step, s sequence, h hidden, a heads, l layers, V vocabulary, Lc layers
per chunk, K the stage-input ring (microbatch-chunk inputs a stage keeps at once).

Recompute (`model.remat`), as jaxmeg's pipeline executor runs it, per (microbatch, chunk):
  full       keeps the chunk's input; the backward recomputes the chunk once (its residuals live
             while it runs): 1 + 3 forwards.
  selective  keeps the chunk's residuals but the attention internals (scores, softmax, context),
             which the backward recomputes (Korthikanti et al., 2022, section 4); with cuDNN's
             fused attention (`Shape.flash_attention`) it keeps the kernel's output and
             log-sum-exp, and reruns none of it.
  none       keeps all the chunk's residuals: 1 + 2 forwards.
Without a pipeline the model applies the same choice per layer (Megatron's full: each layer's
input kept, one layer recomputed at a time).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxmeg.perf import experts, split_backward
from jaxmeg.perf.collectives import (
    data_parallel_collectives,
    ring_all_reduce_seconds,
)
from jaxmeg.perf.context import (
    exposed_ring_seconds,
    local_seq_len,
)
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.hardware import gemm_seconds as _gemm_seconds
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.links import (  # noqa: F401 (device_grid, hardware_link, inside_node: re-exported)
    context_link,
    data_link,
    device_grid,
    expert_data_link,
    hardware_link,
    inside_node,
    pipe_link,
    tensor_link,
)
from jaxmeg.perf.shape import Shape, shape_of  # noqa: F401 (re-exported)
from jaxmeg.pipeline import analysis, schedules, timing
from jaxmeg.pipeline.layout import StageLayout


def parameter_count(shape: Shape) -> float:
    """Megatron eq. 2: P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) (MLP of 4h); with
    experts, the MoE layers' (`experts.moe_layer_parameters`), the dense ones' (leading, and
    between MoE layers, `Experts.unit`) as eq. 2 counts a layer, and the same
    embeddings."""
    h, l, v, s = shape.hidden, shape.layers, shape.vocab, shape.seq_len
    if shape.experts:
        dense = (l - shape.moe_layers) * (12 * h * h + 13 * h)
        return shape.moe_layers * experts.moe_layer_parameters(shape) + dense + (v + s) * h
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def active_parameters(shape: Shape) -> float:
    """The parameters a token runs through: `parameter_count` less the routed experts it is not
    sent to (E - k of each layer's E)."""
    x = shape.experts
    if x is None:
        return parameter_count(shape)
    unused = shape.moe_layers * experts.expert_parameters(shape) * (1 - x.top_k / x.count)
    return parameter_count(shape) - unused


def flops_per_iteration(shape: Shape, batch: int, recompute: bool = True) -> float:
    """Megatron eq. 3: F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) with full recompute
    (one extra forward); 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)) without. With experts,
    the MoE block's active FLOPs (`experts.mlp_flops_per_token`) replace the dense MLP's 16 h^2
    per token and pass, in the MoE layers (not the dense ones)."""
    h, l, v, s = shape.hidden, shape.layers, shape.vocab, shape.seq_len
    moe = 0.0
    if shape.experts:
        dense = experts.mlp_flops_per_token(dataclasses.replace(shape, experts=None))
        per_token = experts.mlp_flops_per_token(shape) - dense
        moe = (4 if recompute else 3) * batch * s * shape.moe_layers * per_token
    if recompute:
        return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)) + moe
    return 72 * batch * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)) + moe


def stage_layout(shape: Shape, layout: Layout) -> StageLayout:
    """Which layers each stage holds (`jaxmeg.pipeline.layout`); raises LayoutError naming the
    numbers when l does not split over p v (or `stage_layers` does not fit). Its layers are
    the entries of the layer stack (units of `Experts.unit` layers)."""
    return _stage_layout(
        shape.stacked_layers, layout.pipe, layout.chunks, tuple(layout.stage_layers),
        schedules.placement_of(layout.schedule),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _stage_layout(layers: int, pipe: int, chunks: int, stage_layers: tuple[int, ...],
                  placement: str) -> StageLayout:  # fmt: skip
    """The planner asks for the same few layouts hundreds of thousands of times (frozen)."""
    return StageLayout.create(layers, pipe, chunks, stage_layers, placement=placement)


def pipeline_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Idle over compute time of the pipeline as jaxmeg's executor runs it: the asynchronous
    bubble (`timing.bubble_fraction`), which the lockstep tables meet, except where a schedule
    pairs an F with a B in one tick (DualPipeV): a tick then lasts its slowest stage's pair,
    and the bubble is the lockstep table's (`analysis.lockstep_bubble`)."""
    if p > 1 and schedules.spec(schedule).pairs is not None:
        return analysis.lockstep_bubble(schedule, p, m, v)
    return timing.bubble_fraction(schedule, p, m, v)


def paired_share(schedule: str, p: int, m: int, v: int) -> float:
    """The share of forwards and backwards a schedule runs in F&B pairs (DualPipeV), whose
    communication the other's compute hides; 0 for the others."""
    if p == 1 or schedules.spec(schedule).pairs is None:
        return 0.0
    return analysis.paired_share(schedules.build(schedule, p, m, v))


def busiest_stage_layers(shape: Shape, layout: Layout) -> int:
    """Real layers of the stage with the most (l / p when even). Every stage runs v Lc layer
    slots in lockstep (a shorter stage's padding is identity layers), so this stage sets the
    pace and the memory; padding holds no parameters and counts in no FLOPs. With MoE every
    n-th layer a slot holds a group of n layers, all counted."""
    return max(stage_layout(shape, layout).stage_layers) * shape.layers_per_entry


def layer_parameters(shape: Shape) -> float:
    """One layer's parameters, 12 h^2 + 13 h (eq. 2's per-layer term), or an MoE layer's
    (`experts.moe_layer_parameters`, all E experts); with MoE every n-th layer, a group's
    mean."""
    dense = 12 * shape.hidden * shape.hidden + 13 * shape.hidden
    if shape.experts:
        share = shape.moe_share
        return share * experts.moe_layer_parameters(shape) + (1 - share) * dense
    return dense


def layer_parameters_per_gpu(shape: Shape, layout: Layout) -> float:
    """One layer's parameters on one GPU: split t ways, the routed experts e t ways."""
    routed = experts.expert_parameters(shape) * shape.moe_share
    return (layer_parameters(shape) - routed + routed / layout.expert) / layout.tensor


def shared_parameters_per_gpu(shape: Shape, tensor: int) -> float:
    """The vocab-parallel word embedding (V h / t, tied with the head) and the positions (s h)."""
    return shape.vocab * shape.hidden / tensor + shape.seq_len * shape.hidden


def params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Layer parameters of the busiest stage on one GPU (`layer_parameters_per_gpu`), plus the
    vocab-parallel embedding."""
    layers = busiest_stage_layers(shape, layout)
    return layers * layer_parameters_per_gpu(shape, layout) + shared_parameters_per_gpu(
        shape, layout.tensor
    )


def chunk_params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Parameters of the busiest chunk on one GPU (its Lc layers and the embedding): what
    ZeRO-3 gathers at once."""
    lc = busiest_stage_layers(shape, layout) // layout.chunks
    return lc * layer_parameters_per_gpu(shape, layout) + shared_parameters_per_gpu(
        shape, layout.tensor
    )


@dataclasses.dataclass(frozen=True)
class ParameterGroup:
    """Parameters one GPU holds that the same GPUs hold (and reduce, and shard under ZeRO)."""

    params: float
    chunk_params: float
    """Of the busiest chunk (what ZeRO-3 gathers at once)."""
    ranks: int
    """The GPUs that hold them: `Layout.gradient_group`, or `expert_gradient_group`."""
    experts: bool
    """The routed experts (their data-parallel traffic takes `links.expert_data_link`)."""


def parameter_groups(shape: Shape, layout: Layout) -> list[ParameterGroup]:
    """The busiest stage's parameters by who shares them: every weight over the d c e GPUs of
    the gradient group, except the routed experts, over d c."""
    params, chunk = params_per_gpu(shape, layout), chunk_params_per_gpu(shape, layout)
    dense = ParameterGroup(params, chunk, layout.gradient_group, False)
    if shape.experts is None:
        return [dense]
    per_layer = experts.expert_parameters(shape) * shape.moe_share / (layout.expert * layout.tensor)
    layers = busiest_stage_layers(shape, layout)
    routed = ParameterGroup(
        layers * per_layer, layers // layout.chunks * per_layer, layout.expert_gradient_group, True
    )
    dense = dataclasses.replace(
        dense, params=params - routed.params, chunk_params=chunk - routed.chunk_params
    )
    return [dense, routed]


# ---------------------------------------------------------------------------------------------
# Communication and time


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


FP8_SCALING_BYTES = 5
"""Bytes per element that current scaling moves to put a 16-bit operand into FP8: read for its
amax, read again to scale and cast, written as one byte."""


def fp8_scaling_seconds(linears, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds that FP8 scaling adds to a layer's linears
    ([((m, n, k), count)]): per linear the forward puts x [m, k] and w [k, n] into FP8, the
    backward the output's cotangent [m, n] (it reuses the forward's FP8 x and w), each at
    `FP8_SCALING_BYTES` per element of HBM traffic and, for current scaling with tensor
    parallelism, one amax all-reduce over `tensor` (latency: the scalar's bytes are nothing)
    before it can scale. The compiled H100 program (docs/benchmarks.md, FP8) shows both: the
    amax passes as elementwise kernels, and the all-reduces exposed. Delayed scaling still
    passes over each operand for its amax (recorded for the next steps; XLA does not fuse it
    into the cast), but nothing waits on that all-reduce."""
    bandwidth = hw.hbm_tb_per_s * 1e12
    latency = 0.0
    if layout.tensor > 1 and layout.fp8 == "current":
        latency = ring_all_reduce_seconds(4.0, layout.tensor, tensor_link(layout, hw))
    forward = backward = 0.0
    for (m, n, k), count in linears:
        forward += count * (FP8_SCALING_BYTES * (m * k + k * n) / bandwidth + 2 * latency)
        backward += count * (FP8_SCALING_BYTES * m * n / bandwidth + latency)
    return forward, backward


def layer_seconds(shape: Shape, layout: Layout, hw: Hardware) -> LayerSeconds:
    """Seconds of one layer for one microbatch. With context, s is the s / c local tokens and
    attention runs as c block steps of s / c queries against s / c keys, each waiting for its
    ring send where the send is the longer (`context.exposed_ring_seconds`)."""
    s, b, h, a = local_seq_len(shape, layout), layout.microbatch, shape.hidden, shape.heads
    t, c = layout.tensor, layout.context
    tokens = s * b
    # the dense MLP's width; an MoE block takes the place of fc1, fc2 and their GeLU in a
    # `moe_share` of the layers (all of them unless MoE is every n-th layer only)
    f, share = shape.mlp_ratio * h, shape.moe_share
    # the linears (m, n, k) and how many of each a layer runs: qkv, out, and the dense MLP's
    linears = [((tokens, 3 * h / t, h), 1.0), ((tokens, h, h / t), 1.0),
               ((tokens, f / t, h), 1 - share), ((tokens, h, f / t), 1 - share)]  # fmt: skip
    fp8 = layout.fp8 != "none"
    gemms = sum(count * _gemm_seconds(*mnk, hw, fp8) for mnk, count in linears)
    scaling_f, scaling_b = fp8_scaling_seconds(linears, layout, hw) if fp8 else (0.0, 0.0)
    moe_f = moe_b = 0.0
    if shape.experts:
        hidden = paired_share(layout.schedule, layout.pipe, layout.microbatches, layout.chunks)
        moe_f, moe_b = (share * sec for sec in experts.moe_seconds(shape, layout, hw, hidden))
    heads = a / t
    block = (
        b * heads * (_gemm_seconds(s, s, h / a, hw) + _gemm_seconds(s, h / a, s, hw))
    )  # scores and context, as batched GEMMs per head, of one block step
    attention = c * block
    # Memory-bound work per layer, in 2-byte elements read + written: two layer norms, two
    # dropouts and two residual adds on the hidden stream (~12 s b h; split over t only with
    # sequence parallelism), bias + GeLU on the 4h MLP activations and the QKV bias (~16 s b h
    # / t), and scale-mask-softmax + dropout over the attention scores (~6 b a s^2 / t, per
    # block step), which fused attention keeps on chip (the context ring's blocks are XLA's).
    fused = shape.flash_attention and c == 1
    hbm_bytes_per_s = hw.hbm_tb_per_s * 1e12
    replicated = 12 * tokens * h / (t if layout.sequence_parallel else 1)
    block_softmax = 0.0 if fused else 6 * b * heads * s * s * 2 / hbm_bytes_per_s
    softmax = c * block_softmax
    elementwise = (replicated + (1 - share) * 4 * tokens * f / t) * 2 / hbm_bytes_per_s + softmax
    all_reduce = ring_all_reduce_seconds(2 * tokens * h, t, tensor_link(layout, hw))
    ring_f, ring_b = exposed_ring_seconds(
        shape, layout, context_link(layout, hw), block + block_softmax
    )
    forward = gemms + attention + elementwise + 2 * all_reduce + ring_f + moe_f + scaling_f
    backward = 2 * (gemms + attention + elementwise) + 2 * all_reduce + ring_b + moe_b + scaling_b
    if fused:  # its backward reruns the scores' GEMM; selective keeps its output (`remat`)
        backward += attention / 2
    # A whole backward's two all-reduces can run beside the column-parallel linears' weight-
    # gradient GEMMs, which nothing waits for (`Shape.backward_overlap`); a split backward's I
    # has none beside them (its W runs later).
    if shape.backward_overlap and not _splits_backward(layout):
        beside = sum(_gemm_seconds(*mnk, hw, fp8) * n for mnk, n in linears[::2])
        backward -= min(2 * all_reduce, beside)
    core = 0.0 if fused else attention + softmax
    return LayerSeconds(forward, backward, core, ring_f, ring_b)


def _splits_backward(layout: Layout) -> bool:
    """Whether the pipeline runs a split backward (I and W: zero-bubble schedules, p > 1)."""
    return layout.pipe > 1 and schedules.splits_backward(layout.schedule)


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
    d c e GPUs of the data x context x expert group (`Layout.gradient_group`), and for the
    routed experts the d c of `expert_gradient_group`, over their own link."""
    total = 0.0
    for group in parameter_groups(shape, layout):
        link = (expert_data_link if group.experts else data_link)(layout, hw)
        collectives = data_parallel_collectives(group.params, group.chunk_params, layout)
        total += sum(c.seconds(group.ranks, link) for c in collectives)
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
    if layout.sequence_parallel:  # the next stage wants the tensor-split piece as it is
        return send
    gb_per_s, latency_us = tensor_link(layout, hw)
    gather = (t - 1) / t * message / (gb_per_s * 1e9) + (t - 1) * latency_us * 1e-6
    return send + gather


def logits_seconds(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """The output projection's forward for one microbatch (its backward is two of these), of
    the s / c local tokens with context."""
    tokens = local_seq_len(shape, layout) * layout.microbatch
    return _gemm_seconds(tokens, shape.vocab / layout.tensor, shape.hidden, hw)


def optimizer_seconds(
    params: float, layout: Layout, hw: Hardware, group: int | None = None
) -> float:
    """The optimizer step of `params` parameters, memory bound: 16 bytes per parameter read
    and written, on the 1 / `group` shard with ZeRO (default: the gradient group's)."""
    updated = params / ((group or layout.gradient_group) if layout.zero_stage else 1)
    return 16 * updated * 2 / (hw.hbm_tb_per_s * 1e12)


def leading_dense_seconds(shape: Shape, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of the dense leading layers (`moe.first_dense`) for one
    microbatch: the first stage runs them with the embedding, and its backward recomputes
    them (a forward more) before their backward. (0, 0) without."""
    if not shape.dense_layers:
        return 0.0, 0.0
    dense = layer_seconds(dataclasses.replace(shape, experts=None), layout, hw)
    return shape.dense_layers * dense.forward, shape.dense_layers * (dense.forward + dense.backward)


def _split_backward(shape: Shape, layout: Layout, hw: Hardware, forward: float, backward: float,
                    layers: int, bubble: float) -> tuple[float, float]:  # fmt: skip
    """A split backward's (backward, bubble): I and W each half the backward's GEMMs plus the
    traffic of the slots they keep X and dY in (`split_backward.ring_seconds`, per layer); in
    a one-action table the bubble then comes from its ticks at those costs (a tick lasts its
    costliest action: `analysis.split_lockstep_bubble`), not at F = I = W. DualPipeV's F&B
    pairs keep theirs."""
    i_ring, w_ring = (layers * x for x in split_backward.ring_seconds(shape, layout, hw))
    if schedules.spec(layout.schedule).pairs is None:
        split = ((backward / 2 + i_ring) / forward, (backward / 2 + w_ring) / forward)
        p, m, v = layout.pipe, layout.microbatches, layout.chunks
        bubble = analysis.split_lockstep_bubble(layout.schedule, p, m, v, split)
    return backward + i_ring + w_ring, bubble


def step_time(shape: Shape, layout: Layout, hw: Hardware) -> StepTime:
    """Megatron's pipeline: m microbatch slots of the busiest stage's forward + backward and
    (p - 1) / v of a stage's without the heavier end's own work (the last stage's logits, the
    first stage's dense leading layers; both with one stage), which only the m slots of its
    own stage carry: the bubble is the wait for the other stages. The backward reruns what the
    remat choice did not keep (`LayerSeconds.recompute`: a forward for full). The pipeline
    sends are on the critical path; the
    data-parallel traffic (`data_parallel_seconds`) and the optimizer step (on the 1/d shard
    with ZeRO) follow the flush."""
    p, v, m = layout.pipe, layout.chunks, layout.microbatches
    layer = layer_seconds(shape, layout, hw)
    layers = busiest_stage_layers(shape, layout)
    logits_f = logits_seconds(shape, layout, hw)
    # The last stage also runs the output projection, the first the dense leading layers;
    # lockstep or not, the pipeline moves at the pace of its slowest stage, counted as the
    # busiest one plus the heavier end's own work.
    end_f, end_b = logits_f, 2 * logits_f
    dense_f, dense_b = leading_dense_seconds(shape, layout, hw)
    if p == 1:  # one stage is both ends
        end_f, end_b = end_f + dense_f, end_b + dense_b
    elif dense_f + dense_b > end_f + end_b:
        end_f, end_b = dense_f, dense_b
    forward = layers * layer.forward + end_f
    backward = layers * (layer.backward + layer.recompute(layout.recompute)) + end_b
    bubble = pipeline_bubble(layout.schedule, p, m, v)
    if _splits_backward(layout):
        backward, bubble = _split_backward(shape, layout, hw, forward, backward, layers, bubble)
    # The bubble's slots are the other stages' (the last waits for their forwards, then for
    # their backwards), so the end's own work weighs in the m busy slots only.
    pipeline = m * (forward + backward) + m * bubble * (forward + backward - end_f - end_b)
    p2p = 0.0
    if p > 1:  # per slot and chunk, one send forward and one back
        p2p = 2 * v * (m + (p - 1) / v) * pipe_message_seconds(shape, layout, hw)
    compute = m * (forward + backward)
    dp = data_parallel_seconds(shape, layout, hw, compute)
    optimizer = sum(
        optimizer_seconds(g.params, layout, hw, g.ranks) for g in parameter_groups(shape, layout)
    )
    return StepTime(forward, backward, pipeline, p2p, dp, optimizer, bubble)


def tflops_per_gpu(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """Achieved model TFLOP/s per GPU as Megatron reports it (eq. 3, recompute counted when
    the run recomputes)."""
    flops = flops_per_iteration(shape, layout.global_batch, layout.recompute == "full")
    return flops / step_time(shape, layout, hw).total / layout.gpus / 1e12


def paper_training_days(shape: Shape, gpus: int, tflops_per_gpu_: float, tokens: float) -> float:
    """Megatron section 5.1: end-to-end time ~ 8 T P / (n X)."""
    return 8 * tokens * parameter_count(shape) / (gpus * tflops_per_gpu_ * 1e12) / 86400
