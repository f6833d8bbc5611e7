"""Microbatch gradient accumulation and the step's gradient reductions over `data` and `pipe`.

The one home of both for every layout (pipe = 1 is the degenerate pipeline): the executor calls
these inside its `shard_map`, manual over `data` and `pipe`. Gradients accumulate in fp32 in the
tick loop's carry; a step then makes
  stage gradients:   one pmean over `data` (each stage reduces its own layers);
  shared gradients:  one all-reduce over `pipe` x `data`: the sum over stages (embedding grads of
                     the first stage plus head grads of the last; with tied embeddings, the two
                     copies' sum) and the mean over replicas at once;
  loss:              the same (only the last stage has it).
With `data` > 1 each chunk's layer gradients are reduced inside the tick loop, in the tick of
the chunk's last backward on its stage (`reduce_final_chunk`), so the reduction overlaps the
backward of the chunks still running; after the loop only the shared gradients and the loss are
reduced. A sharded optimizer (reduce-scatter) or a compressed reduction replaces
`reduce_over_data`.
When `data` and `pipe` both have size 1 the reductions are skipped: they are the identity, and
XLA refuses a cross-device reduction in a manual partition whose manual axes all have size 1
(the mesh (1, 1, t) with t > 1; the executor then runs its shard_map without type checks).
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


MANUAL_AXES = ("data", "pipe")


def trivial(mesh_shape) -> bool:
    """Whether every manual axis has size 1, so no reduction is needed (or allowed)."""
    return all(mesh_shape[axis] == 1 for axis in MANUAL_AXES)


def _psum(tree, axis: str | tuple[str, ...]):
    sizes = {a: jax.lax.axis_size(a) for a in MANUAL_AXES}
    return tree if trivial(sizes) else jax.lax.psum(tree, axis)


def _pmean(tree, axis: str):
    sizes = {a: jax.lax.axis_size(a) for a in MANUAL_AXES}
    return tree if trivial(sizes) else jax.lax.pmean(tree, axis)


def reduce_over_data(tree):
    """The data-parallel gradient reduction: the mean over the `data` replicas."""
    return _pmean(tree, "data")


def _sum_stages_mean_replicas(tree):
    summed = _psum(tree, MANUAL_AXES)
    replicas = jax.lax.axis_size("data")
    return jax.tree.map(lambda a: a / replicas, summed) if replicas > 1 else summed


def reduce_final_chunk(stage_grads, chunk):
    """stage_grads [v, ...] with chunk `chunk` reduced over `data` (nothing when chunk is -1).
    The same on every replica of a stage (they run the same table row), so the collective may
    sit under this stage-dependent `lax.cond`."""
    safe = jnp.maximum(chunk, 0)
    part = jax.tree.map(lambda a: a[safe], stage_grads)
    part = jax.lax.cond(chunk >= 0, reduce_over_data, lambda tree: tree, part)
    return jax.tree.map(lambda a, p: a.at[safe].set(p), stage_grads, part)


def reduce_step(stage_grads, shared_grads, loss, stage_grads_reduced: bool = False):
    """(loss, stage_grads, shared_grads) of the whole step, identical on every device of a
    stage (see the module docstring for the collectives)."""
    shared_grads, loss = _sum_stages_mean_replicas((shared_grads, loss))
    if not stage_grads_reduced:
        stage_grads = reduce_over_data(stage_grads)
    return loss, stage_grads, shared_grads
