"""A split backward's weight gradients, dW = X^T dY per weight, into a stage's gradient
accumulator (stacked or per layer, `accumulator`): what the W slot (and a whole B in a table
that splits backwards) runs, from the matmul inputs X and output cotangents dY kept for it."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import accumulator


def of_chunk(sf, acc, kept):
    """dW = X^T dY of `kept` ({"inputs", "dys"}, [Lc, ...] leaves) for an accumulator of the
    chunk's weights: one batched GEMM over the layers, or per-layer accumulators a GEMM per
    layer (each runs as its accumulator's in-place update: `accumulator`)."""
    if not accumulator.per_layer(acc):
        return sf.weight_grads(kept["inputs"], kept["dys"])
    return [of_layer(sf, kept, i) for i in range(len(acc))]


def of_layer(sf, kept, i: int):
    """Layer i's dW, from its own slices of X and dY."""
    one = jax.tree.map(lambda a: a[i], kept)
    return sf.weight_grads(one["inputs"], one["dys"], lead=0)


def add(sf, g_stage, index, kept):
    """g_stage with dW = X^T dY of `kept` ({"inputs", "dys"}) added at chunk `index`."""
    g_weights, g_rest = accumulator.split(g_stage, partial(sf.split_weights, taps=kept["dys"]))
    g_weights = accumulator.add_at(g_weights, index, of_chunk(sf, g_weights, kept))
    return accumulator.merge(g_weights, g_rest, sf.merge_weights)


def layers(sf, g_stage, at, kept) -> list:
    """A chunk's last W: each layer's dW (from its own slices of X and dY, so that it does not
    wait for the other layers'), with zeros for the norms and biases, as per-layer trees."""
    count = jax.tree.leaves(kept["dys"])[0].shape[0]
    out = []
    for i in range(count):
        d_weights = of_layer(sf, kept, i)
        _, rest = sf.split_weights(accumulator.layer(g_stage, at, i), kept["dys"])
        out.append(sf.merge_weights(d_weights, jax.tree.map(jnp.zeros_like, rest)))
    return out
