"""Per-device memory of jaxmeg's own train step, as `memory_analysis()` reports it.

arguments: fp32 params + Adam's two moments (12 B per parameter held; layers of one stage
split t ways, plus the embedding and head, which every pipeline stage holds) + the step's token
ids and targets (int32) of this data replica.
temp: fp32 gradient accumulators (4 B/param) and the optimizer update's temporaries (8 B/param:
the update and the new moments before they replace the donated ones); the activations that one
backward keeps -- all layers of a microbatch without a pipeline, one chunk's layers with one (the
executor recomputes a chunk from its saved input), at Korthikanti et al.'s per-layer counts with
the compute dtype's width and no flash attention on CPU; the fp32 logits, softmax and their
gradient of one microbatch; and the executor's rings of saved inputs and received cotangents.
"""

from __future__ import annotations

import dataclasses

from jaxmeg.perf.model import Layout, Shape, busiest_stage_layers, layer_activation_bytes


@dataclasses.dataclass(frozen=True)
class StepMemory:
    params: float
    arguments: float
    temp: float

    @property
    def total(self) -> float:
        return self.arguments + self.temp


def jaxmeg_params_per_device(shape: Shape, layout: Layout, vocab_padded: int) -> float:
    h, t = shape.hidden, layout.tensor
    split = 12 * h * h + 9 * h  # QKV, out, fc1, fc2 weights and the QKV / fc1 biases
    replicated = 6 * h  # two layer norms (scale, bias), two output biases
    layers = busiest_stage_layers(shape, layout)
    embedding = vocab_padded * h / t + shape.seq_len * h + 2 * h
    return layers * (split / t + replicated) + embedding


def jaxmeg_step_memory(
    shape: Shape,
    layout: Layout,
    vocab_padded: int,
    compute_bytes: int = 4,
    ring_slots: int = 0,
) -> StepMemory:
    params = jaxmeg_params_per_device(shape, layout, vocab_padded)
    s, b = shape.seq_len, layout.microbatch
    tokens = 2 * 4 * s * b * layout.microbatches
    arguments = 12 * params + tokens
    per_layer = layer_activation_bytes(
        shape, dataclasses.replace(layout, recompute="none"), flash_attention=False
    ) * (compute_bytes / 2)
    kept_layers = busiest_stage_layers(shape, layout) // layout.chunks
    logits = 3 * 4 * s * b * vocab_padded / layout.tensor
    ring = ring_slots * s * b * shape.hidden * compute_bytes
    temp = 12 * params + kept_layers * per_layer + logits + ring
    return StepMemory(params=params, arguments=arguments, temp=temp)
