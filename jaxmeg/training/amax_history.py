"""The step's side of delayed FP8 scaling (`model.fp8: delayed`, `jaxmeg.models.fp8`): each
linear's `_amax_seen` "gradient" is what the step's microbatches and replicas saw of its
operands' amaxes (power-of-two bins, summed by the step's gradient reduction), not a gradient.
The step takes it out of the gradients before the norm, clipping and the optimizer, and after
the update shifts its bound into the linear's `_amax_history` (whatever the optimizer did to
either leaf is overwritten: the history is set, the seen leaf stays zero)."""

from __future__ import annotations

import flax.traverse_util as traverse
import jax.numpy as jnp

from jaxmeg.models import fp8


def _sibling(key: tuple, suffix: str, other: str) -> tuple:
    """The path of the leaf beside `key` whose name ends in `other` instead of `suffix`."""
    return (*key[:-1], key[-1].removesuffix(suffix) + other)


def take_seen(grads) -> tuple[object, dict]:
    """(the gradients with every `_amax_seen` entry zeroed, {history path: its counts}; {}
    without delayed scaling)."""
    flat = traverse.flatten_dict(grads)
    counts = {}
    for key, g in flat.items():
        if isinstance(key[-1], str) and key[-1].endswith(fp8.SEEN):
            counts[_sibling(key, fp8.SEEN, fp8.HISTORY)] = g
            flat[key] = jnp.zeros_like(g)
    return (traverse.unflatten_dict(flat) if counts else grads), counts


def advance_histories(params, before, counts: dict):
    """The updated `params` with each history of `counts` the one in the step's params
    `before`, advanced by the step's bounds (`fp8.advance`), and every seen leaf zero."""
    if not counts:
        return params
    flat, old = traverse.flatten_dict(params), traverse.flatten_dict(before)
    for key, c in counts.items():
        flat[key] = fp8.advance(old[key], c)
        seen_key = _sibling(key, fp8.HISTORY, fp8.SEEN)
        flat[seen_key] = jnp.zeros_like(flat[seen_key])
    return traverse.unflatten_dict(flat)
