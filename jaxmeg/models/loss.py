"""Vocab-parallel cross-entropy.

Written only with elementwise ops and reductions over the vocab dim, so that with logits sharded
on vocab over `tensor` XLA computes Megatron's vocab-parallel loss: local max / sum-exp /
target-logit, each followed by an all-reduce of a [tokens] vector. No gather over vocab, so the
full [tokens, vocab] logits never exist on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array, vocab_size: int) -> jax.Array:
    """Mean token cross-entropy; logits past `vocab_size` (padding rows) are masked out."""
    with jax.named_scope("loss"):  # the cost report's kernel class (`hlo_gpu.kernel_class`)
        logits = logits_BxSxV.astype(jnp.float32)
        vocab_ids_V = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        logits = jnp.where(vocab_ids_V < vocab_size, logits, -1e30)
        peak_BxS = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        shifted = logits - peak_BxS[..., None]
        log_sum_exp_BxS = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
        is_target = vocab_ids_V == targets_BxS[..., None]
        target_logit_BxS = jnp.sum(jnp.where(is_target, shifted, 0.0), -1)
        return jnp.mean(log_sum_exp_BxS - target_logit_BxS)
