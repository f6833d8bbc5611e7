"""Context parallelism: the sequence split over the `context` mesh axis, attention as a ring.

Load balance (as Megatron-LM and MaxText do for causal attention): the sequence is cut into 2c
blocks and context rank i holds blocks i and 2c - 1 - i, so every rank has as many (query, key)
pairs under the causal mask as any other. `load_balanced_order` is that permutation of the
positions; the training step puts the tokens and targets in this order and the model reads the
positions from it (learned position rows, rotary angles, the causal mask), so nothing else in
the model knows the order. The loss is a mean over all tokens, which the order does not change.

Ring attention (Liu et al., 2023): each rank keeps its queries; the keys and values go around
the ring by `ppermute`, c - 1 sends in the forward, while each rank attends to the block it
holds and merges it into its running output with the log-sum-exp rule (online softmax). The
backward (a custom VJP) runs the ring again from the saved output and log-sum-exp: keys and
values go round once more with their gradient accumulators (c - 1 sends of K, V, dK, dV) and one
last send brings dK, dV home; so no rank ever holds more than two blocks of K and V. Sends and
block computations are independent within a step, so the sends can overlap the computations.
The block kernel is plain jnp in fp32 (the fused kernels return no log-sum-exp to merge with).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

AXIS = "context"
MASKED = -1e30  # a score that no real one reaches, finite so that fully masked rows stay finite


def load_balanced_order(seq_len: int, context: int) -> np.ndarray:
    """[seq_len] positions in the order the context ranks hold them: rank i's slice of
    seq_len / context rows is block i then block 2c - 1 - i of the 2c equal blocks."""
    if seq_len % (2 * context):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context ({context})")
    blocks = np.arange(seq_len).reshape(2 * context, -1)
    order = [b for i in range(context) for b in (i, 2 * context - 1 - i)]
    return blocks[order].reshape(-1)


def _scores(q_BxQxKxGxH, k_BxSxKxH, pos_q, pos_k):
    """Scaled scores [B, K, G, Q, S] in fp32, causal by position, and the mask."""
    scale = 1.0 / math.sqrt(q_BxQxKxGxH.shape[-1])
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_BxQxKxGxH, k_BxSxKxH) * scale
    mask = pos_q[:, None] >= pos_k[None, :]
    return jnp.where(mask, s, MASKED), mask


def _rotate(tree, c: int):
    """Each rank's `tree` to the next rank of the ring."""
    return jax.lax.ppermute(tree, AXIS, [(i, (i + 1) % c) for i in range(c)])


def _ring_forward(q, k, v, table, gathered: bool):
    """Inside a map manual over `context`: (o [B, Q, N, H] fp32, lse [B, K, G, Q]) of the local
    queries against the whole sequence. `table` [c, Q]: the positions each rank holds. Step t
    attends to block (r - t) mod c: sent along the ring, or with `gathered`, taken from one
    all-gather of every block."""
    c, r = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    b, nq, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, nq, kv_heads, n // kv_heads, h)
    pos_q = table[r]
    m = jnp.full((b, kv_heads, n // kv_heads, nq), MASKED, jnp.float32)
    l = jnp.zeros_like(m)
    acc = jnp.zeros((b, kv_heads, n // kv_heads, nq, h), jnp.float32)
    every = jax.lax.all_gather((k, v), AXIS) if gathered else None
    for t in range(c):
        j = (r - t) % c
        if gathered:
            k, v = every[0][j], every[1][j]
        s, mask = _scores(qg, k, pos_q, table[j])
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p, v)
        m = m_new
        if t < c - 1 and not gathered:
            k, v = _rotate((k, v), c)
    o = acc / l[..., None]  # [B, K, G, Q, H]
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, nq, n, h)
    return o, m + jnp.log(l)


def _ring_backward(q, k, v, o, lse, do, table, gathered: bool):
    """(dq, dk, dv) of `_ring_forward`: the blocks go round again (or are gathered again), each
    step's dK, dV travelling with its block (or summed into the block's slot, then
    reduce-scattered to the blocks' ranks)."""
    c, r = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    b, nq, n, h = q.shape
    kv_heads = k.shape[2]
    g = n // kv_heads
    scale = 1.0 / math.sqrt(h)
    # a barrier keeps XLA from reusing the forward's copies of the other ranks' blocks, which
    # would keep every block of the sequence alive until the backward
    k, v = jax.lax.optimization_barrier((k, v))
    qg = q.reshape(b, nq, kv_heads, g, h)
    dog = do.reshape(b, nq, kv_heads, g, h)
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", dog, o.reshape(b, nq, kv_heads, g, h))
    pos_q = table[r]
    dq = jnp.zeros_like(qg)
    dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
    if gathered:
        every = jax.lax.all_gather((k, v), AXIS)
        dk, dv = jnp.zeros_like(every[0]), jnp.zeros_like(every[1])
    for t in range(c):
        j = (r - t) % c
        if gathered:
            k, v = every[0][j], every[1][j]
        s, mask = _scores(qg, k, pos_q, table[j])
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
        dv_j = jnp.einsum("bkgqs,bqkgh->bskh", p, dog)
        dp = jnp.einsum("bqkgh,bskh->bkgqs", dog, v)
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bkgqs,bskh->bqkgh", ds, k)
        dk_j = jnp.einsum("bkgqs,bqkgh->bskh", ds, qg)
        if gathered:
            dk, dv = dk.at[j].add(dk_j), dv.at[j].add(dv_j)
        else:
            dk, dv = dk + dk_j, dv + dv_j
            if t < c - 1:
                k, v, dk, dv = _rotate((k, v, dk, dv), c)
    if gathered:
        dk, dv = jax.lax.psum_scatter((dk, dv), AXIS, scatter_dimension=0)
    else:
        dk, dv = _rotate((dk, dv), c)  # the block held last is the next rank's own
    return dq.reshape(b, nq, n, h), dk, dv


def _varying(x) -> set:
    return set(jax.typeof(x).manual_axis_type.varying)


def _vary_like(x, like):
    """`x` typed as varying over the manual axes `like` varies over (a custom VJP's gradient
    must have its primal input's type)."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def local_positions(positions: np.ndarray, context: int):
    """Inside a map manual over `context`: the positions of the rows this rank holds."""
    table = np.asarray(positions, np.int32).reshape(context, -1)
    return lambda: jnp.asarray(table)[jax.lax.axis_index(AXIS)]


def ring_attention(positions: np.ndarray, context: int, gathered: bool = False):
    """attend(q [B, Q, N, H], k, v [B, Q, K, H]) -> o [B, Q, N, H], inside a map manual over
    `context` (the pipeline executor's): causal attention of this rank's Q = S / c rows (by
    `positions`, the order of the sequence's S rows) against the whole sequence, as a ring;
    with `gathered`, from one all-gather of the keys and values over `context` (and a
    reduce-scatter of their gradients) instead."""
    table = np.asarray(positions, np.int32).reshape(context, -1)

    @jax.custom_vjp
    def ring(q, k, v):
        return _ring_forward(q, k, v, jnp.asarray(table), gathered)[0]

    def forward(q, k, v):
        o, lse = _ring_forward(q, k, v, jnp.asarray(table), gathered)
        return o, (q, k, v, o, lse)

    def backward(residuals, do):
        grads = _ring_backward(*residuals, do.astype(jnp.float32), jnp.asarray(table), gathered)
        return tuple(_vary_like(g, x) for g, x in zip(grads, residuals[:3], strict=True))

    ring.defvjp(forward, backward)

    def attend(q, k, v):
        f32 = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
        return ring(*f32).astype(q.dtype)

    return attend
