"""Context parallelism in the performance model: what each of the c GPUs of a context group
holds, sends and waits for when a sequence is split over them (`parallel.context`,
`jaxmeg.parallel.context`).

The sequence is cut into 2c blocks and rank i holds blocks i and 2c - 1 - i, s / c tokens, so
every rank has the same share of the causal (query, key) pairs. Everything per token (the
layer matmuls, the activations kept for the backward, the logits, the pipeline messages) is
that of s / c tokens; attention is c block steps of s / c queries against s / c keys, 1 / c of
the whole sequence's attention. Keys and values go around the ring (Liu et al., 2023, "Ring
Attention with Blockwise Transformers"; Megatron-LM's context parallelism):

  block     K and V of one rank's s / c tokens: 2 b (s / c) (g / t) (h / a) elements in the
            compute dtype, g the key/value heads (a without grouped-query attention), split over
            the tensor group when t divides g, whole on every tensor rank otherwise
  forward   c - 1 steps that each send one block to the next rank: (c - 1) blocks per layer
  backward  c - 1 steps that each send a block with its gradient accumulators dK, dV (two
            blocks), and one last send of dK, dV home: (2c - 1) blocks, about twice the
            forward (jaxmeg accumulates dK, dV in fp32; they are priced in the compute dtype,
            as Megatron-LM sends them)

A step's send and its block's attention are independent, so they run together: each step
waits for max(0, send - block compute) beyond its compute, the backward's block compute
being twice the forward's; the last send of dK, dV follows the last block and waits whole.
Parameters are replicated over context: their gradients are reduced over d x c GPUs
(`Layout.gradient_group`), on the link of the data x context group.

Words: c context, t tensor, b microbatch, s sequence, h hidden, a heads, g key/value heads.
"""

from __future__ import annotations

import dataclasses

from jaxmeg.perf.layout import Layout
from jaxmeg.perf.shape import Shape

RING_BLOCKS_HELD = 4
"""Blocks the ring holds at once beside the activations: in the backward, the block in use and
the one arriving, each K, V and their gradients dK, dV (2 x 2 blocks; the forward holds 2)."""


def local_seq_len(shape: Shape, layout: Layout) -> float:
    """s / c: the tokens of each sequence one GPU of a context group holds (an int when c
    divides s, so that c = 1 prices exactly as without context)."""
    s, c = shape.seq_len, layout.context
    return s // c if s % c == 0 else s / c


def kv_heads_per_rank(shape: Shape, layout: Layout) -> float:
    """g / t key/value heads per tensor rank when t divides g, all g otherwise (the kv heads
    are then replicated over the tensor group, `config_validation.kv_head_rules`)."""
    g = shape.heads if shape.kv_heads is None else shape.kv_heads
    return g / layout.tensor if g % layout.tensor == 0 else float(g)


def ring_block_bytes(shape: Shape, layout: Layout, compute_bytes: int = 2) -> float:
    """One block of the ring: K and V of s / c tokens, 2 b (s / c) (g / t) (h / a) elements of
    `compute_bytes`."""
    head_dim = shape.hidden / shape.heads
    return (
        2 * layout.microbatch * local_seq_len(shape, layout) * kv_heads_per_rank(shape, layout)
        * head_dim * compute_bytes
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RingBytes:
    block: float
    """Bytes of one K/V block (`ring_block_bytes`)."""
    forward: float
    """Bytes one GPU sends in one layer's forward for one microbatch: (c - 1) blocks."""
    backward: float
    """In its backward: (c - 1) blocks of K, V and (c - 1) + 1 of dK, dV, (2c - 1) blocks."""

    @property
    def per_layer(self) -> float:
        """Forward and backward: (3c - 2) blocks."""
        return self.forward + self.backward


def ring_bytes_per_layer(shape: Shape, layout: Layout, compute_bytes: int = 2) -> RingBytes:
    """What one GPU sends around the ring per layer per microbatch; zeros without context."""
    c = layout.context
    block = ring_block_bytes(shape, layout, compute_bytes) if c > 1 else 0.0
    return RingBytes(block, (c - 1) * block, (2 * c - 1) * block if c > 1 else 0.0)


def send_seconds(nbytes: float, link: tuple[float, float]) -> float:
    """One point-to-point send of `nbytes` over `link` (achievable GB/s, latency us)."""
    gb_per_s, latency_us = link
    return nbytes / (gb_per_s * 1e9) + latency_us * 1e-6


def exposed_ring_seconds(
    shape: Shape, layout: Layout, link: tuple[float, float], block_forward: float
) -> tuple[float, float]:
    """(forward, backward) seconds one layer waits for the ring, per microbatch, beyond its
    attention compute, given `block_forward`, the seconds of one block step's forward attention
    (s / c queries against s / c keys): forward (c - 1) max(0, send(block) - f), backward
    (c - 1) max(0, send(2 blocks) - 2 f) + send(block), the last send of dK, dV home."""
    c = layout.context
    if c == 1:
        return 0.0, 0.0
    block = ring_block_bytes(shape, layout)
    forward = (c - 1) * max(0.0, send_seconds(block, link) - block_forward)
    backward = (c - 1) * max(0.0, send_seconds(2 * block, link) - 2 * block_forward)
    return forward, backward + send_seconds(block, link)


def ring_buffer_bytes(shape: Shape, layout: Layout, compute_bytes: int = 2) -> float:
    """Bytes the ring holds beside the activations: RING_BLOCKS_HELD blocks; none without
    context."""
    if layout.context == 1:
        return 0.0
    return RING_BLOCKS_HELD * ring_block_bytes(shape, layout, compute_bytes)
