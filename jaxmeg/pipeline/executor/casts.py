"""Which parameter leaves a function only ever reads in one narrower dtype.

A model keeps fp32 master weights and casts each to its compute dtype where it uses it. The
executor runs a chunk once per microbatch and slot; on a GPU XLA then converts (and slices per
layer) every fp32 weight of the stage again in each of those runs: gpt_1.3b on one H100, 8
microbatches, 2.3 ms of weight conversion per microbatch. `read_as` reads the traced function
(its jaxpr, through nested calls, checkpoints, maps and conditionals) and finds, per leaf, the
one dtype every use converts it to, possibly after ops that only move data (`MOVES_DATA`: a
slice, a squeeze); the executor casts those leaves once per step, before its tick loop. The
values and the gradients are the ones the function gives on the fp32 leaves: the model's own
cast becomes a no-op, and the cast's transpose was the cotangent's cast back to fp32, which the
gradient accumulator does (`accumulator.add_at`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.extend import core

MOVES_DATA = frozenset(
    {"slice", "squeeze", "reshape", "transpose", "dynamic_slice", "copy", "copy_p"}
)
"""Ops whose result holds some of their first operand's elements, each once and unchanged, so
that their transpose sums nothing: a gather's or a broadcast's would add cotangents up, in the
narrower dtype once the leaf is cast first, so a leaf read through one is not cast."""


def read_as(fn: Callable, params, *args):
    """A tree like `params`: for each floating leaf, the narrower dtype that every use of it
    in `fn(params, *args)` converts it to, else None."""
    closed = jax.make_jaxpr(fn)(params, *args)
    leaves, treedef = jax.tree.flatten(params)
    invars = closed.jaxpr.invars[: len(leaves)]
    found = []
    for leaf, var in zip(leaves, invars, strict=True):
        dtype = _only_cast(closed.jaxpr, var) if _floating(leaf) else None
        dtype = None if dtype is UNUSED else dtype
        narrower = dtype is not None and np.dtype(dtype).itemsize < np.dtype(leaf.dtype).itemsize
        found.append(dtype if narrower else None)
    return jax.tree.unflatten(treedef, found)


def cast(params, dtypes):
    """`params` with each leaf whose `read_as` dtype is set cast to it."""
    return jax.tree.map(lambda a, d: a if d is None else a.astype(d), params, dtypes)


UNUSED = object()
"""What `_only_cast` finds for a variable nothing reads (a call's operand its body drops)."""


def _floating(leaf) -> bool:
    return np.issubdtype(np.dtype(leaf.dtype), np.floating)


def _only_cast(jaxpr, var):
    """The one dtype every use of `var` in `jaxpr` converts it to (through data moves and into
    nested jaxprs), or None."""
    if any(out is var for out in jaxpr.outvars):
        return None
    found = set()
    for eqn in jaxpr.eqns:
        for position, used in enumerate(eqn.invars):
            if used is var:
                found.add(_use(jaxpr, eqn, position))
    found.discard(UNUSED)
    if not found:
        return UNUSED
    return found.pop() if len(found) == 1 and None not in found else None


def _use(jaxpr, eqn, position):
    """What one use of an operand converts it to: a cast's dtype; through a data move, what its
    result's uses convert to; into a call's bodies, what the body's uses convert to."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        return eqn.params["new_dtype"]
    if name in MOVES_DATA and position == 0:
        return _same(_only_cast(jaxpr, out) for out in eqn.outvars)
    inner = _inner_vars(eqn, position)
    if inner is None:
        return None
    return _same(_only_cast(body, v) for body, v in inner)


def _same(dtypes):
    found = set(dtypes) - {UNUSED}
    if not found:
        return UNUSED
    return found.pop() if len(found) == 1 and None not in found else None


def _inner_vars(eqn, position) -> list | None:
    """(jaxpr, var) pairs where operand `position` of a call-like `eqn` enters its bodies."""
    params = eqn.params
    if eqn.primitive.name == "cond":  # operand 0 is the branch index
        if position == 0:
            return None
        return [(_open(b), _open(b).invars[position - 1]) for b in params["branches"]]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = params.get(key)
        if body is None:
            continue
        body = _open(body)
        if isinstance(body, core.Jaxpr) and len(body.invars) == len(eqn.invars):
            return [(body, body.invars[position])]
    return None


def _open(body):
    return body.jaxpr if hasattr(body, "jaxpr") and not isinstance(body, core.Jaxpr) else body
