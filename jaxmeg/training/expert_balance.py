"""The step's side of the MoE layers' routing bias (`jaxmeg.models.moe`): the bias's "gradient"
is each expert's load (its share of a microbatch's k x tokens routing choices, averaged over
the step's microbatches and replicas), not a gradient. The step takes it out of the gradients
before the norm, clipping and the optimizer (which then leave the bias alone: AdamW's moments
of a zero gradient stay zero, and the bias has no weight decay), moves the bias toward an even
load (DeepSeek-V3's loss-free balancing: + rate where an expert got less than the layer's
mean, - rate where more), and reports how uneven each layer's load was and, with a capacity
factor, what share of its choices it dropped."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmeg.config_moe import slot_factors
from jaxmeg.models.moe import TAKEN
from jaxmeg.pipeline.layout import StageLayout

BIAS = "router_bias"
KEPT = "router_kept"
"""With a capacity factor: a never-trained [E] whose "gradient" is each expert's share of the
kept choices (`jaxmeg.models.moe`)."""


def _name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def _is_bias(path) -> bool:
    return _name(path) == BIAS


def take_loads(grads) -> tuple[object, list[jax.Array], list[jax.Array], list[jax.Array]]:
    """(the gradients with every routing bias's, kept slot's and taken-bounds slot's entry
    zeroed, the bias entries: the loads, the kept slots' entries: the kept shares, the taken
    slots' entries: the bounds' counts; [] where there are none)."""
    taken = {BIAS: [], KEPT: [], TAKEN: []}

    def take(path, g):
        if _name(path) in taken:
            taken[_name(path)].append(g)
            return jnp.zeros_like(g)
        return g

    cleaned = jax.tree_util.tree_map_with_path(take, grads)
    return cleaned, taken[BIAS], taken[KEPT], taken[TAKEN]


def without_bound_counts(grads):
    """The gradients with each dropless MoE layer's exchange-bound counts (`TAKEN`, a statistic
    of the expert exchange, which one device does not run) zeroed: a layout's gradients to
    compare with one device's (numpy or jax arrays)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: g * 0 if _name(path) == TAKEN else g, grads
    )


def move_biases(params, loads: list[jax.Array], rate: float):
    """Each bias + rate x sign(its layer's mean load - the expert's load)."""
    moves = iter(loads)

    def move(path, p):
        if not _is_bias(path):
            return p
        load = next(moves)
        error = jnp.mean(load, axis=-1, keepdims=True) - load
        return p + (rate * jnp.sign(error)).astype(p.dtype)

    return jax.tree_util.tree_map_with_path(move, params)


def load_spread(loads: list[jax.Array], layout: StageLayout) -> jax.Array:
    """max / mean load over the experts of each MoE layer [L - moe.first_dense], in model order
    (1 = even)."""
    (load,) = loads  # the stacked layers' one bias leaf, [v, p, Lc, E]
    load = layout.to_canonical(load)
    mean = jnp.mean(load, axis=-1)
    return jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0)


def dropped_share(kept: list[jax.Array], layout: StageLayout) -> jax.Array:
    """The share of each MoE layer's routing choices that its experts' capacity dropped
    [L - moe.first_dense], in model order (0 = none)."""
    (share,) = kept  # the stacked layers' one leaf, [v, p, Lc, E]
    return 1.0 - jnp.sum(layout.to_canonical(share), axis=-1)


def largest_bound(counts: list[jax.Array], layout: StageLayout, factors, ranks: int) -> jax.Array:
    """The largest exchange bound each MoE layer took in the step, as a multiple of an even
    load (`moe.exchange_bounds`; all T k choices count as `ranks`, E_ranks x an even load)
    [L - moe.first_dense], in model order; 0 where no exchange ran (one expert rank)."""
    (count,) = counts  # the stacked layers' one leaf, [v, p, Lc, BOUND_SLOTS]
    count = layout.to_canonical(count)
    values = jnp.asarray(slot_factors(factors, ranks), jnp.float32)
    return jnp.max(jnp.where(count > 0, values, 0.0), axis=-1)
