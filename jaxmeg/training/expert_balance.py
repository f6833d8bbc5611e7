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


def _position(path) -> int:
    """A leaf's layer within its stack entry: k of a `LayerGroup`'s `layer_k`, else 0."""
    for key in path:
        name = str(getattr(key, "key", key))
        if name.startswith("layer_") and name[6:].isdigit():
            return int(name[6:])
    return 0


def take_loads(grads) -> tuple[object, list[jax.Array], list[jax.Array], list[jax.Array]]:
    """(the gradients with every routing bias's, kept slot's and taken-bounds slot's entry
    zeroed, the bias entries: the loads, the kept slots' entries: the kept shares, the taken
    slots' entries: the bounds' counts; [] where there are none). Each list holds a leaf per
    MoE block of a stack entry, in model order (a group's `layer_k` by k, not by name)."""
    taken = {BIAS: [], KEPT: [], TAKEN: []}

    def take(path, g):
        if _name(path) in taken:
            taken[_name(path)].append((_position(path), g))
            return jnp.zeros_like(g)
        return g

    cleaned = jax.tree_util.tree_map_with_path(take, grads)
    ordered = {name: [g for _, g in sorted(leaves, key=lambda x: x[0])]
               for name, leaves in taken.items()}  # fmt: skip
    return cleaned, ordered[BIAS], ordered[KEPT], ordered[TAKEN]


def without_bound_counts(grads):
    """The gradients with each dropless MoE layer's exchange-bound counts (`TAKEN`, a statistic
    of the expert exchange, which one device does not run) zeroed: a layout's gradients to
    compare with one device's (numpy or jax arrays)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: g * 0 if _name(path) == TAKEN else g, grads
    )


def move_biases(params, loads: list[jax.Array], rate: float):
    """Each bias + rate x sign(its layer's mean load - the expert's load); `loads` in
    `take_loads`' order."""
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params) if _is_bias(path)]
    order = sorted(range(len(paths)), key=lambda i: _position(paths[i]))
    by_leaf = dict(zip(order, loads, strict=True))
    leaf = iter(range(len(paths)))

    def move(path, p):
        if not _is_bias(path):
            return p
        load = by_leaf[next(leaf)]
        error = jnp.mean(load, axis=-1, keepdims=True) - load
        return p + (rate * jnp.sign(error)).astype(p.dtype)

    return jax.tree_util.tree_map_with_path(move, params)


def _model_order(leaves: list[jax.Array], layout: StageLayout) -> jax.Array:
    """[MoE layers, ...] in model order of the stack entries' MoE blocks' leaves, each
    [v, p, Lc, ...] (a stage layout's stack) in `take_loads`' order."""
    stacked = jnp.stack([layout.to_canonical(leaf) for leaf in leaves], axis=1)
    return stacked.reshape(-1, *stacked.shape[2:])


def load_spread(loads: list[jax.Array], layout: StageLayout) -> jax.Array:
    """max / mean load over the experts of each MoE layer [MoE layers], in model order
    (1 = even)."""
    load = _model_order(loads, layout)
    mean = jnp.mean(load, axis=-1)
    return jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0)


def dropped_share(kept: list[jax.Array], layout: StageLayout) -> jax.Array:
    """The share of each MoE layer's routing choices that its experts' capacity dropped
    [MoE layers], in model order (0 = none)."""
    return 1.0 - jnp.sum(_model_order(kept, layout), axis=-1)


def largest_bound(counts: list[jax.Array], layout: StageLayout, factors, ranks: int) -> jax.Array:
    """The largest exchange bound each MoE layer took in the step, as a multiple of an even
    load (`moe.exchange_bounds`; all T k choices count as `ranks`, E_ranks x an even load)
    [MoE layers], in model order; 0 where no exchange ran (one expert rank)."""
    count = _model_order(counts, layout)
    values = jnp.asarray(slot_factors(factors, ranks), jnp.float32)
    return jnp.max(jnp.where(count > 0, values, 0.0), axis=-1)
