"""What a stage keeps between a chunk's forward and its backward.

`jax.vjp(chunk, params, x)` returns a pullback that is a pytree: its leaves are the residuals
of the forward. Some leaves are the chunk's parameters or its stage input themselves (the very
tracers passed in), or a split backward's zero taps (`forward_split`: a checkpointed layer's
pullback keeps its inputs, the taps among them); those are at hand in the backward anyway, so
only the others are kept per microbatch, in rings. The split is read once from a trace whose
result is dropped, and checked again in every traced forward: if a JAX upgrade changes the
pullback's structure, or starts storing parameter copies, `ResidualSplit.check` and the tests
fail loudly instead of a stage silently storing its weights once per microbatch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

PARAM, INPUT, TAP, STORED = "param", "input", "tap", "stored"


@dataclasses.dataclass(frozen=True)
class ResidualSplit:
    """For each pullback leaf, where it comes from: (PARAM, i) the i-th parameter leaf,
    (INPUT, 0) the stage input, (TAP, i) the i-th zero tap, (STORED, j) the j-th stored
    residual."""

    treedef: jax.tree_util.PyTreeDef
    sources: tuple[tuple[str, int], ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]

    def check(self, other: ResidualSplit) -> None:
        """Raises unless `other` (another trace of the same function) splits the same way. The
        treedefs themselves differ between traces (they hold each trace's backward function)."""
        if other.sources != self.sources or other.stored != self.stored:
            raise RuntimeError(
                "the chunk's pullback changed structure between two traces of the same function; "
                f"expected sources {self.sources}, got {other.sources}"
            )

    @property
    def stored_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.stored)


def _split(pullback, params, x, taps=None) -> tuple[ResidualSplit, list]:
    leaves, treedef = jax.tree.flatten(pullback)
    param_leaves, tap_leaves = jax.tree.leaves(params), jax.tree.leaves(taps)
    sources, stored = [], []
    for leaf in leaves:
        where = next((i for i, p in enumerate(param_leaves) if leaf is p), None)
        tap = next((i for i, t in enumerate(tap_leaves) if leaf is t), None)
        if where is not None:
            sources.append((PARAM, where))
        elif tap is not None:
            sources.append((TAP, tap))
        elif leaf is x:
            sources.append((INPUT, 0))
        else:
            sources.append((STORED, len(stored)))
            stored.append(leaf)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stored)
    return ResidualSplit(treedef, tuple(sources), avals), stored


def forward(fn: Callable, params, x) -> tuple[jax.Array, ResidualSplit, list]:
    """y = fn(params, x), the split of its pullback, and the leaves to store."""
    y, pullback = jax.vjp(fn, params, x)
    split, stored = _split(pullback, params, x)
    return y, split, stored


def trace_split(fn: Callable, params, x) -> ResidualSplit:
    """The split of fn's pullback. Traces fn on the given (traced) values and drops the result,
    which XLA then removes as dead code; the values must carry the same manual-axis types as
    the real calls, because those types decide some of the residuals."""
    return forward(fn, params, x)[1]


def backward(split: ResidualSplit, params, x, stored, cot, taps=None) -> tuple:
    """(d_params, d_x) from the pullback rebuilt out of params, x, the taps and the stored
    leaves."""
    param_leaves = jax.tree.leaves(params)
    pick = {PARAM: param_leaves, INPUT: [x], TAP: jax.tree.leaves(taps), STORED: list(stored)}
    leaves = [pick[kind][i] for kind, i in split.sources]
    pullback = jax.tree.unflatten(split.treedef, leaves)
    return pullback(cot)


def forward_split(fn: Callable, weights, rest, x, taps) -> tuple:
    """A split backward's forward (`jaxmeg.models.split_backward`): fn(weights, rest, x, taps)
    -> (y, matmul inputs) differentiated w.r.t. (rest, x, taps), the matmul weights held. Returns
    y, the pullback's split (weights and rest count as params), the leaves to store, and the
    matmul inputs. The taps are zeros that the backward makes again, not kept."""
    y, pullback, inputs = jax.vjp(
        lambda r, x_, t: fn(weights, r, x_, t), rest, x, taps, has_aux=True
    )
    split, stored = _split(pullback, (weights, rest), x, taps)
    return y, split, stored, inputs


def backward_split(split: ResidualSplit, weights, rest, x, stored, cot, taps) -> tuple:
    """(d_rest, d_x, d_taps) from `forward_split`'s stored leaves and the same zero taps: I of
    a split backward."""
    return backward(split, (weights, rest), x, stored, cot, taps)
