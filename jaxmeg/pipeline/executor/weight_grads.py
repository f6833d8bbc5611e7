"""A split backward's weight gradients, dW = X^T dY per weight, into a stage's gradient
accumulator (stacked or per layer, `accumulator`): what the W slot (and a whole B in a table
that splits backwards) runs, from the matmul inputs X and output cotangents dY kept for it.

With uneven stages, per-layer accumulators skip the layer slots a stage pads: a slot some stage
pads runs its GEMMs under the slot's conditional (`layout.PADDING_SLOT`), as its forward and
backward do, instead of X^T dY of the zeros a padding slot keeps; the conditional takes the
layer's own X and dY, the slices its GEMMs read anyway. (A stacked accumulator, a scan's, takes
one batched GEMM over the chunk's slots, padding included.)"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import accumulator
from jaxmeg.pipeline.layout import PADDING_SLOT


class Padding(NamedTuple):
    """The layer slots some stage pads (static) and this stage's real layers in the chunk."""

    slots: tuple[int, ...]
    real: jax.Array


def _in_slot(padding: Padding | None, i: int, run, skip, *operands):
    """run(*operands) for layer slot i; where some stage pads the slot, under its conditional:
    run on a stage with more than i real layers, skip on the others."""
    if padding is None or i not in padding.slots:
        return run(*operands)
    with jax.named_scope(f"{PADDING_SLOT}{i}"):
        return jax.lax.cond(i < padding.real, run, skip, *operands)


def _layer(kept, i: int):
    """Layer i's own slices of X and dY."""
    return jax.tree.map(lambda a: a[i], kept)


def _of_one(sf, one):
    """One layer's dW = X^T dY."""
    return sf.weight_grads(one["inputs"], one["dys"], lead=0)


def add_weights(sf, g_weights, index, kept, padding: Padding | None = None):
    """The weights' accumulator `g_weights` with dW = X^T dY of `kept` added at chunk
    `index`: stacked, one batched GEMM over the chunk's layers; per layer, a GEMM per layer
    (each runs as its accumulator's in-place update: `accumulator`), a padded slot's
    accumulator left as it is where the stage pads it."""
    if not accumulator.per_layer(g_weights):
        return accumulator.add_at(g_weights, index, sf.weight_grads(kept["inputs"], kept["dys"]))

    def plus(acc, one):
        return accumulator.add_at([acc], index, [_of_one(sf, one)])[0]

    return [
        _in_slot(padding, i, plus, lambda acc, _: acc, acc, _layer(kept, i))
        for i, acc in enumerate(g_weights)
    ]


def add(sf, g_stage, index, kept, padding: Padding | None = None):
    """g_stage with dW = X^T dY of `kept` ({"inputs", "dys"}) added at chunk `index`."""
    g_weights, g_rest = accumulator.split(g_stage, partial(sf.split_weights, taps=kept["dys"]))
    g_weights = add_weights(sf, g_weights, index, kept, padding)
    return accumulator.merge(g_weights, g_rest, sf.merge_weights)


def layers(sf, g_stage, at, kept, padding: Padding | None = None) -> list:
    """A chunk's last W: each layer's dW (from its own slices of X and dY, so that it does not
    wait for the other layers'), with zeros for the norms and biases, as per-layer trees; a
    padded slot's are zeros where the stage pads it."""
    count = jax.tree.leaves(kept["dys"])[0].shape[0]
    out = []
    of_one = partial(_of_one, sf)
    for i in range(count):
        d_weights = _in_slot(padding, i, of_one, _zeros_of(of_one), _layer(kept, i))
        _, rest = sf.split_weights(accumulator.layer(g_stage, at, i), kept["dys"])
        out.append(sf.merge_weights(d_weights, jax.tree.map(jnp.zeros_like, rest)))
    return out


def _zeros_of(fn):
    """fn's output as zeros, without running it."""
    return lambda *a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *a))
