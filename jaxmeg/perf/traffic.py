"""Bytes one GPU sends per step on each link in the performance model (tensor, pipe, data,
context, expert), and the message sizes behind them. Words as `jaxmeg.perf.model`."""

from __future__ import annotations

from jaxmeg.perf import experts
from jaxmeg.perf.collectives import data_parallel_collectives
from jaxmeg.perf.context import local_seq_len, ring_bytes_per_layer
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import busiest_stage_layers, parameter_groups
from jaxmeg.perf.shape import Shape


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
    stage's. expert: each MoE layer's all-to-alls (`experts.all_to_alls`, the forward's twice
    with `recompute="full"`) of `experts.all_to_all_bytes` each; data: the routed experts'
    collectives on their own group of d c (`model.parameter_groups`).
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
    data_bytes = sum(
        c.wire_bytes(g.ranks)
        for g in parameter_groups(shape, layout)
        for c in data_parallel_collectives(g.params, g.chunk_params, layout)
    )
    expert_message = expert_bytes = 0.0
    if shape.experts:
        expert_message = experts.all_to_all_bytes(shape, layout, compute_bytes)
        forward, backward = experts.all_to_alls(shape, layout)
        forward *= 2 if layout.recompute == "full" else 1
        moe_layers = layers * shape.moe_share
        expert_bytes = moe_layers * layout.microbatches * (forward + backward) * expert_message
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
        "expert_message": float(expert_message),
        "expert": float(expert_bytes),
    }
