"""Microbatch gradient accumulation and the step's gradient reductions over `data` and `pipe`.

The one home of both for every layout (pipe = 1 is the degenerate pipeline): the executor calls
these inside its `shard_map`, manual over `data` and `pipe`. Gradients accumulate in fp32 in the
tick loop's carry; a step then makes
  stage gradients:   one pmean over `data` (each stage reduces its own layers);
  shared gradients:  one psum over `pipe` (embedding grads of the first stage plus head grads of
                     the last; with tied embeddings, the two copies' sum), then a pmean over `data`;
  loss:              psum over `pipe` (only the last stage has it), pmean over `data`.
A sharded optimizer (reduce-scatter) or a compressed reduction replaces `reduce_over_data`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros_f32(tree):
    """fp32 accumulators shaped like `tree` (and varying over the same manual axes)."""
    return jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), tree)


def accumulate(acc, delta):
    """acc + delta, delta cast to the accumulator's dtype."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, delta)


def accumulate_at(acc, index, delta):
    """acc[index] += delta along the leading (chunk) dim, in place in the loop carry."""
    return jax.tree.map(lambda a, d: a.at[index].add(d.astype(a.dtype)), acc, delta)


def reduce_over_data(tree):
    """The data-parallel gradient reduction: the mean over the `data` replicas."""
    return jax.lax.pmean(tree, "data")


def reduce_step(stage_grads, shared_grads, loss):
    """(loss, stage_grads, shared_grads) of the whole step, identical on every device of a
    stage (see the module docstring for the collectives)."""
    shared_grads = reduce_over_data(jax.lax.psum(shared_grads, "pipe"))
    loss = jax.lax.pmean(jax.lax.psum(loss, "pipe"), "data")
    return loss, reduce_over_data(stage_grads), shared_grads
