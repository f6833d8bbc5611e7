"""A ring whose slot holds one of several trees, one after another: in a zero-bubble table a
microbatch's stored residuals live from its F to its I, and the output cotangents dY its W reads
from its I to its W, so both take the slot the microbatch holds from F to W (`f_x_slot` to
`w_x_slot`, `TickTable.num_x_slots`) instead of two rings of their own. A stage holds p - s
microbatches' residuals and s + 1 microbatches' dY at most (ZB-H1), but a program's rings are
the same on every stage, so two rings would take p slots each.

The slot is a flat run of elements per dtype: a ring [N, n] for each dtype the trees hold, n the
larger tree's elements of it; a leaf is a dynamic slice of its slot at a fixed offset, reshaped
(no copy: a row-major reshape is a bitcast), and written by one in-place update.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each tree's leaves sit in a slot: per tree name, its treedef and per leaf (dtype
    name, offset, shape); `sizes`: the slot's elements per dtype."""

    trees: dict
    sizes: dict

    def ring(self, slots: int, fill=jnp.zeros) -> dict:
        """The ring of `slots` slots, {dtype name: [slots, n]}, made by `fill(shape, dtype)`."""
        return {dt: fill((slots, n), jnp.dtype(dt)) for dt, n in self.sizes.items()}

    def write(self, pool: dict, name: str, slot, tree) -> dict:
        """pool with `tree` (laid out as `name`) in slot `slot`, each leaf in place."""
        treedef, leaves = self.trees[name]
        pool = dict(pool)
        for leaf, (dt, offset, shape) in zip(treedef.flatten_up_to(tree), leaves, strict=True):
            flat = leaf.astype(dt).reshape(1, math.prod(shape))
            pool[dt] = jax.lax.dynamic_update_slice(pool[dt], flat, (slot, offset))
        return pool

    def read(self, pool: dict, name: str, slot):
        """The tree `name` from slot `slot`."""
        treedef, leaves = self.trees[name]
        out = [
            jax.lax.dynamic_slice(pool[dt], (slot, offset), (1, math.prod(shape))).reshape(shape)
            for dt, offset, shape in leaves
        ]
        return treedef.unflatten(out)


def layout(**trees) -> Layout:
    """The layout of trees of arrays (or `jax.ShapeDtypeStruct`s) that share a slot."""
    placed, sizes = {}, {}
    for name, tree in trees.items():
        leaves, treedef = jax.tree.flatten(tree)
        offsets: dict[str, int] = {}
        where = []
        for leaf in leaves:
            dt = jnp.dtype(leaf.dtype).name
            where.append((dt, offsets.get(dt, 0), tuple(leaf.shape)))
            offsets[dt] = offsets.get(dt, 0) + math.prod(leaf.shape)
        placed[name] = (treedef, tuple(where))
        for dt, n in offsets.items():
            sizes[dt] = max(sizes.get(dt, 0), n)
    return Layout(placed, sizes)
