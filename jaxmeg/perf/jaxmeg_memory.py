"""Per-device memory of jaxmeg's own train step, as `memory_analysis()` reports it.

Words as in `jaxmeg.perf.model`; c the compute dtype's width in bytes, P the parameters a device
holds (`jaxmeg_params_per_device`), K and J the tick table's `num_input_slots` and
`num_cot_slots`, R the bytes one chunk keeps per microbatch for its backward (`stored_bytes`).

arguments = 12 P + 8 s b m     fp32 params and Adam's two moments; int32 tokens and targets
temp      = 12 P               fp32 gradient accumulators, and the update's temporaries (the
                               update and the new moments before they replace the donated ones)
          + K (c s b h + R)    the stage-input ring and, per slot, the chunk's stored residuals
          + J c s b h          the cotangent ring
          + W                  what one tick holds besides the rings (`working_bytes`)
          + 12 s b V / t       the last virtual stage's fp32 logits, softmax and their gradient
          + 4 P  (data > 1)    the data-parallel all-reduce's result beside the accumulators
                               it reads: the collective's output is a buffer of its own, and
                               the update reads it while the step's other temporaries live

With p v = 1 the whole model's forward and backward run inside one tick, and their residuals
are gone before the optimizer update, whose temporaries reuse that space: temp = max(12 P,
8 P + the rest), the update's buffers or, during the backward, the accumulators and one
microbatch's gradient beside the activations (the plain sum counted the update twice), plus
the all-reduce's result with data > 1. Against memory_analysis on 8 CPU devices (the tie cases
of tests/test_perf.py and their neighbours: data 1 or 2, m 1 to 8, b 1 to 4, each recompute
choice), arguments + temp come within 10%. A sharded optimizer (`zero_stage`) is not priced
here: its shards, scatters and gathers are `jaxmeg.perf.memory.memory_per_gpu`'s.

The residuals R cross the tick loop, so every one of them is a buffer of its own: they are
counted leaf by leaf from the pullback of jaxmeg's layer (`stored_layer_elements`). A backward
that runs its forward in the same computation (`full`, and the whole model when p v = 1) keeps
what its layers' policy keeps; a `full` layer's recompute, which keeps every intermediate but
lets XLA fuse the cheap elementwise ones into the backward, is counted at Korthikanti et al.'s
per-layer counts, with the compute dtype's width and the s x s scores (no flash attention on
CPU).
"""

from __future__ import annotations

import dataclasses

from jaxmeg.perf.layout import Layout
from jaxmeg.perf.memory import layer_activation_bytes
from jaxmeg.perf.model import Shape, busiest_stage_layers, stage_layout


@dataclasses.dataclass(frozen=True)
class StepMemory:
    params: float
    arguments: float
    temp: float

    @property
    def total(self) -> float:
        return self.arguments + self.temp


def jaxmeg_params_per_device(shape: Shape, layout: Layout, vocab_padded: int) -> float:
    """v Lc layer slots (a shorter stage's padding included: its zeros are real arrays), split
    t ways but for the norms and the row-parallel biases, plus the embedding and head, which
    every stage holds."""
    h, t = shape.hidden, layout.tensor
    split = 12 * h * h + 9 * h  # QKV, out, fc1, fc2 weights and the QKV / fc1 biases
    replicated = 6 * h  # two layer norms (scale, bias), two output biases
    slots = layout.chunks * stage_layout(shape, layout).layers_per_chunk
    embedding = vocab_padded * h / t + shape.seq_len * h + 2 * h
    return slots * (split / t + replicated) + embedding


def stored_layer_elements(shape: Shape, layout: Layout, flash_attention: bool = False) -> float:
    """Elements one layer's pullback keeps, per microbatch, as jaxmeg's GPT layer leaves them
    (`jaxmeg.models.remat.REMAT_POLICY`; XLA's attention, not cuDNN's).

    none       s b h (2 + 8 / t) + a s^2 b / t: the layer's input and the matmul outputs its
               backward reads: QKV (3 / t), the attention context (1 / t), fc1 (4 / t), the
               out-projection after its all-reduce (1), and the scores (a s^2 b / t, float32
               whatever the compute dtype: `attention_scores_elements`); the norms, softmax,
               GeLU, biases and the causal mask are recomputed;
    selective  s b h (2 + 7 / t): the layer's input and the outputs of the weight matmuls its
               backward reads (QKV 3 / t, fc1 4 / t, the out-projection after its all-reduce);
    full       none (the stage input is the ring's).
    With flash attention (cuDNN) the scores are never stored: `none` keeps the softmax's
    log-sum-exp rows (a s b / t) in their place.
    """
    s, b, h, t = shape.seq_len, layout.microbatch, shape.hidden, layout.tensor
    sbh = s * b * h
    if layout.recompute == "none":
        return sbh * (2 + 8 / t) + attention_scores_elements(shape, layout, flash_attention)
    if layout.recompute == "selective":
        flash = sbh / t + attention_scores_elements(shape, layout, True) if flash_attention else 0
        return sbh * (2 + 7 / t) + flash  # cuDNN's output and log-sum-exp are kept
    return 0.0


def attention_scores_elements(shape: Shape, layout: Layout, flash_attention: bool = False) -> float:
    """a s^2 b / t: the scores QK^T of one layer, kept in float32 by `none`; with flash
    attention their log-sum-exp rows, a s b / t."""
    s, b, a, t = shape.seq_len, layout.microbatch, shape.heads, layout.tensor
    return a * (1 if flash_attention else s) * s * b / t


def stored_layer_bytes(
    shape: Shape, layout: Layout, compute_bytes: int, flash_attention: bool = False
) -> float:
    """`stored_layer_elements` in bytes: the compute dtype's width, 4 for `none`'s scores."""
    flash = flash_attention
    scores = attention_scores_elements(shape, layout, flash) if layout.recompute == "none" else 0
    return (stored_layer_elements(shape, layout, flash) - scores) * compute_bytes + 4 * scores


def stored_bytes(
    shape: Shape, layout: Layout, compute_bytes: int, flash_attention: bool = False
) -> float:
    """R: Lc layer slots' residuals (padding slots included: the scan stacks them), less the
    first layer's input in an unrolled chunk; 0 with one stage and one chunk (nothing is kept
    across ticks)."""
    if layout.pipe * layout.chunks == 1 or layout.recompute == "full":
        return 0.0
    chunk = stage_layout(shape, layout)
    stored = chunk.layers_per_chunk * stored_layer_bytes(
        shape, layout, compute_bytes, flash_attention
    )
    if chunk.unrolled:  # the first layer's input is the stage input, kept in its own ring
        stored -= shape.seq_len * layout.microbatch * shape.hidden * compute_bytes
    return stored


def working_bytes(
    shape: Shape, layout: Layout, compute_bytes: int, flash_attention: bool = False
) -> float:
    """W. Stored residuals: one chunk's fresh R, made by the F slot before the ring write.
    `full`: one chunk's residuals while its backward recomputes it. p v = 1: the whole model's
    backward, each layer keeping what its remat policy keeps (and `full` one layer's residuals
    at a time)."""
    fp32 = compute_bytes / 2  # Korthikanti's counts are for 16-bit activations

    def recomputed_layer() -> float:
        plain = dataclasses.replace(layout, recompute="none")
        return layer_activation_bytes(shape, plain, flash_attention=flash_attention) * fp32

    if layout.pipe * layout.chunks == 1:
        layers = busiest_stage_layers(shape, layout)
        if layout.recompute == "none" or (flash_attention and layout.recompute == "selective"):
            # what the policy keeps; XLA's attention on CPU leaves selective more intermediates
            return layers * stored_layer_bytes(shape, layout, compute_bytes, flash_attention)
        kept = layer_activation_bytes(shape, layout, flash_attention=flash_attention) * fp32
        extra = recomputed_layer() if layout.recompute == "full" else 0.0
        return layers * kept + extra
    if layout.recompute == "full":
        return stage_layout(shape, layout).layers_per_chunk * recomputed_layer()
    return stored_bytes(shape, layout, compute_bytes, flash_attention)


def jaxmeg_step_memory(
    shape: Shape,
    layout: Layout,
    vocab_padded: int,
    compute_bytes: int = 4,
    input_slots: int = 1,
    cot_slots: int = 1,
    flash_attention: bool = False,
) -> StepMemory:
    """The module docstring's sums; `input_slots` K and `cot_slots` J from the tick table;
    `flash_attention` for a step that runs cuDNN's (no s x s scores anywhere).
    Without context parallelism only: its ring's buffers are not counted here (the planner's
    `memory.memory_per_gpu` prices them)."""
    if layout.context > 1:
        raise ValueError(
            f"jaxmeg_step_memory prices a step without context parallelism, got context = "
            f"{layout.context}"
        )
    params = jaxmeg_params_per_device(shape, layout, vocab_padded)
    s, b = shape.seq_len, layout.microbatch
    tokens = 2 * 4 * s * b * layout.microbatches
    arguments = 12 * params + tokens
    x = s * b * shape.hidden * compute_bytes
    stored = stored_bytes(shape, layout, compute_bytes, flash_attention)
    rings = input_slots * (x + stored) + cot_slots * x
    logits = 3 * 4 * s * b * vocab_padded / layout.tensor
    activations = rings + working_bytes(shape, layout, compute_bytes, flash_attention) + logits
    if layout.pipe * layout.chunks == 1:
        temp = max(12 * params, 8 * params + activations)
    else:
        temp = 12 * params + activations
    if layout.data > 1:
        temp += 4 * params
    return StepMemory(params=params, arguments=arguments, temp=temp)
