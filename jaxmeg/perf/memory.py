"""Memory per GPU in the performance model: model states (16 B per parameter less what ZeRO
shards), the activations a schedule keeps for its backward at the remat choice, and the working
sets beside them. Words and references as `jaxmeg.perf.model`, whose parameter counts it reads."""

from __future__ import annotations

import dataclasses
import functools

from jaxmeg.perf import experts
from jaxmeg.perf.collectives import model_state_bytes
from jaxmeg.perf.context import local_seq_len, ring_buffer_bytes
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import busiest_stage_layers, parameter_groups, params_per_gpu
from jaxmeg.perf.shape import Shape
from jaxmeg.perf.split_backward import matmul_input_bytes_per_layer, split_store_bytes_per_layer
from jaxmeg.pipeline import schedules
from jaxmeg.pipeline.analysis import held_microbatches
from jaxmeg.pipeline.tick_table import STEADY_STATE_MICROBATCHES_PER_STAGE, build_tick_table


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
    moe = 0.0
    if shape.experts:  # the MoE block's in place of the dense MLP's, in a moe_share of layers
        moe = experts.kept_bytes_per_layer(shape, layout) - experts.dense_mlp_kept_bytes(
            shape, layout
        )
        moe *= shape.moe_share
    if layout.recompute == "selective":
        return sbh * (34 / t if sp else 10 + 24 / t) + moe
    return sbh * ((34 + scores) / t if sp else 10 + 24 / t + scores / t) + moe


@functools.cache
def _ring_slots(schedule: str, p: int, v: int, warmup: str) -> int:
    m = STEADY_STATE_MICROBATCHES_PER_STAGE * p  # 1F1B-type rings are full by then, flat after
    return build_tick_table(schedules.build(schedule, p, m, v, warmup)).num_input_slots


def stored_microbatches(layout: Layout) -> int:
    """K, the (microbatch, chunk) inputs a stage keeps for its backward at once: the stage-input
    ring of the schedule's tick table (`num_input_slots`, the same for every m) for 1F1B-type
    schedules, m for GPipe, m v for breadth-first (every microbatch's input to every chunk
    waits for the backward), 1 without a pipeline (microbatches run one after another)."""
    if not schedules.spec(layout.schedule).steady_rings and (layout.pipe > 1 or layout.chunks > 1):
        return layout.microbatches * layout.chunks
    if layout.pipe == 1:
        return 1
    return _ring_slots(layout.schedule, layout.pipe, layout.chunks, layout.warmup)


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
    (`context.ring_buffer_bytes`), an MoE block's exchange buffers (`experts.working_bytes`);
    the hardware's workspace. The busiest stage's, s the local s / c with context; the routed
    experts' states sharded over d c under ZeRO, the rest over d c e (`parameter_groups`)."""
    groups = parameter_groups(shape, layout)
    states = sum(model_state_bytes(g.params, g.chunk_params, layout, g.ranks) for g in groups)
    if schedules.splits_backward(layout.schedule) and layout.pipe > 1:
        stored = split_backward_stored_bytes(shape, layout)
    else:
        stored = stored_microbatches(layout) * kept_bytes_per_microbatch(shape, layout)
    s, b, h, t = local_seq_len(shape, layout), layout.microbatch, shape.hidden, layout.tensor
    logits = 3 * 4 * s * b * shape.vocab / t  # fp32 logits, softmax and gradient
    activations = stored + recompute_working_bytes(shape, layout) + logits + 2 * s * b * h
    activations += ring_buffer_bytes(shape, layout)
    if shape.experts:
        activations += experts.working_bytes(shape, layout)
    return Memory(params_per_gpu(shape, layout), states, activations, hw.workspace_gb * 1e9)
