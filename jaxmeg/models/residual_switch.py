"""`jax.lax.switch` whose branches share one set of residual buffers.

Differentiated by jax, a `switch` keeps the residuals of every branch, each filled with zeros
but the one taken: memory for all of them at once. Here the forward runs the taken branch under
`jax.vjp` and keeps its pullback's residuals: the switch's own inputs by reference (a
conditional's outputs would copy them), the rest as they are where every branch keeps residuals
of the same shapes, else packed into flat buffers, one per dtype and set of varying manual
axes, each as large as the largest branch needs; the backward switches again and unpacks its
branch's residuals. The residuals cost what the costliest branch keeps, not their sum: what
the bounded exchange of `jaxmeg.models.experts_ffn.experts_ffn_exchanged` needs, whose branches
are the same computation at fixed shapes of different sizes.

Each branch is `branch(const, diff) -> out`: `const` a pytree without gradients (integers: row
indices), `diff` the pytree it is differentiated in. The backward ignores the cotangents of
outputs that are integers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp

Branch = Callable[[object, object], object]


def _varying(v) -> frozenset:
    return frozenset(jax.typeof(v).manual_axis_type.varying)


def _key(v) -> tuple:
    """A residual's buffer: its dtype and the manual axes it varies over."""
    return (jnp.dtype(v.dtype).name, tuple(sorted(_varying(v))))


def _inputs_kept(leaves, const, diff) -> list[int | None]:
    """For each residual, the position among the leaves of (const, diff) of the input it is
    (the pullback keeps some inputs as they are), else None."""
    inputs = jax.tree.leaves((const, diff))
    return [next((k for k, v in enumerate(inputs) if v is r), None) for r in leaves]


def _layouts(branches: Sequence[Branch], const, diff) -> tuple[list[list[tuple]], dict]:
    """Per branch, each residual's (key, offset, shape), or ("input", k) for an input it
    keeps as it is; and each key's buffer size, the most any branch packs in it. Read from an
    abstract trace of every branch's `jax.vjp`."""
    layouts = []
    for branch in branches:
        seen = []

        def probe(c, d, branch=branch, seen=seen):
            out, pullback, ints = jax.vjp(_floats_out(branch, c), d, has_aux=True)
            leaves = jax.tree.leaves(pullback)
            kept = _inputs_kept(leaves, c, d)
            seen.extend(("input", k, None) if k is not None else (_key(r), None, r.shape)
                        for r, k in zip(leaves, kept, strict=True))  # fmt: skip
            return out, ints

        jax.eval_shape(probe, const, diff)
        offsets: dict[tuple, int] = {}
        layout = []
        for key, k, shape in seen:
            if key == "input":
                layout.append((key, k, None))
                continue
            layout.append((key, offsets.get(key, 0), shape))
            offsets[key] = offsets.get(key, 0) + math.prod(shape)
        layouts.append(layout)
    sizes: dict[tuple, int] = {}
    for layout in layouts:
        for key, offset, shape in layout:
            if key != "input":
                sizes[key] = max(sizes.get(key, 0), offset + math.prod(shape))
    return layouts, sizes


def _integer(v) -> bool:
    return jnp.issubdtype(v.dtype, jnp.integer) or jnp.issubdtype(v.dtype, jnp.bool_)


def _floats_out(branch: Branch, const, structure: list | None = None) -> Callable:
    """diff -> (the branch's floating outputs, its integer ones): what `jax.vjp` differentiates
    and what it carries along (`has_aux`), so no cotangent of an integer is ever made. Appends
    (the outputs' tree, which leaves are integers) to `structure`."""

    def run(diff):
        leaves, tree = jax.tree.flatten(branch(const, diff))
        integer = [_integer(v) for v in leaves]
        if structure is not None:
            structure.append((tree, integer))
        floats = [v for v, i in zip(leaves, integer, strict=True) if not i]
        return floats, [v for v, i in zip(leaves, integer, strict=True) if i]

    return run


def _shapes(layout) -> list[tuple]:
    return [(key, offset if key == "input" else shape) for key, offset, shape in layout]


def _empty(key: tuple, size: int) -> jax.Array:
    dtype, axes = key
    zeros = jnp.zeros((size,), dtype)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def _pack(leaves, layout, sizes: dict, same: bool):
    """The residuals a branch returns: those that are not its inputs, as they are (`same`) or
    packed into one flat buffer per key."""
    own = [(leaf, entry) for leaf, entry in zip(leaves, layout, strict=True) if entry[0] != "input"]
    if same:
        return [leaf for leaf, _ in own]
    parts: dict[tuple, list] = {key: [] for key in sizes}
    for leaf, (key, _, _) in own:
        parts[key].append(leaf.reshape(-1))
    buffers = {}
    for key, size in sizes.items():
        used = sum(p.shape[0] for p in parts[key])
        filler = [_empty(key, size - used)] if size > used else []
        buffers[key] = jnp.concatenate(parts[key] + filler) if parts[key] else _empty(key, size)
    return buffers


def _unpack(buffers, layout, inputs: list, same: bool) -> list:
    """`_pack`'s residuals and the inputs kept as they are, in the pullback's order."""
    own = iter(buffers) if same else None
    leaves = []
    for key, offset, shape in layout:
        if key == "input":
            leaves.append(inputs[offset])
        elif same:
            leaves.append(next(own))
        else:
            leaves.append(buffers[key][offset : offset + math.prod(shape)].reshape(shape))
    return leaves


def switch(index: jax.Array, branches: Sequence[Branch], const, diff, name: str | None = None):
    """`branches[index](const, diff)`, differentiable in `diff`, keeping one set of residual
    buffers for all branches (the module docstring). `index` must be the same on every device
    a branch's collectives meet. `name`: the name scope of the forward's and the backward's
    conditionals in the compiled program (`jaxmeg.parallel.hlo_cost.StepCost`'s
    `chosen_branches`)."""
    return _switch(tuple(branches), name, index, const, diff)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _switch(branches, name, index, const, diff):
    with _scope(name):
        return jax.lax.switch(index, branches, const, diff)


def _scope(name: str | None):
    return jax.named_scope(name) if name else contextlib.nullcontext()


def _switch_fwd(branches, name, index, const, diff):
    layouts, sizes = _layouts(branches, const, diff)
    treedefs: list = [None] * len(branches)
    structure: list = []
    same = all(_shapes(layout) == _shapes(layouts[0]) for layout in layouts)

    def keeping(j):
        def run(c, d):
            split = _floats_out(branches[j], c, structure)
            floats, pullback, ints = jax.vjp(split, d, has_aux=True)
            leaves, treedefs[j] = jax.tree.flatten(pullback)
            return (floats, ints), _pack(leaves, layouts[j], sizes, same)

        return run

    with _scope(name):
        (floats, ints), buffers = jax.lax.switch(
            index, [keeping(j) for j in range(len(branches))], const, diff
        )
    tree, integer = structure[0]
    it_f, it_i = iter(floats), iter(ints)
    out = jax.tree.unflatten(tree, [next(it_i) if i else next(it_f) for i in integer])
    pullbacks = jax.tree_util.Partial(_Pullbacks(tuple(treedefs), tuple(layouts), same, integer))
    return out, (index, const, diff, buffers, pullbacks)


class _Pullbacks:
    """The branches' pullback structures, static data carried through the residuals."""

    def __init__(self, treedefs, layouts, same: bool, integer: list[bool]):
        self.treedefs, self.layouts, self.same = treedefs, layouts, same
        self.integer = integer

    def __call__(self, j: int, buffers, inputs: list):
        leaves = _unpack(buffers, self.layouts[j], inputs, self.same)
        return jax.tree.unflatten(self.treedefs[j], leaves)


def _switch_bwd(branches, name, residuals, g):
    index, const, diff, buffers, pullbacks = residuals

    # the integer outputs' cotangents (float0) were never asked for (`_floats_out`)
    integer = pullbacks.func.integer
    floats = [v for v, i in zip(jax.tree.leaves(g), integer, strict=True) if not i]

    def backward(j):
        def run(bufs, inputs, floats_):
            (d_diff,) = pullbacks.func(j, bufs, inputs)(floats_)
            return d_diff

        return run

    inputs = jax.tree.leaves((const, diff))
    with _scope(name):
        d_diff = jax.lax.switch(
            index, [backward(j) for j in range(len(branches))], buffers, inputs, floats
        )
    return None, None, d_diff


_switch.defvjp(_switch_fwd, _switch_bwd)
