"""How the executor's tick runs a slot and moves what it sends, inside its `shard_map` (manual
over `data` and `pipe`, automatic over `tensor`).

- `run_if`: a slot's work as a loop of 0 or 1 trips. A `lax.switch` over slot kinds returned,
  from every branch, copies of every ring buffer it passed through (XLA copies a conditional's
  results), so an idle stage rewrote whole rings on every tick; a loop updates its carry in
  place, so an inactive slot writes nothing and an active one only what it fills.
- `send`: a `ppermute` over `pipe` on exactly the pairs that carry something in that tick, one
  ppermute per distinct set of pairs, chosen by an index that depends on the tick only
  (`columns.send_patterns`): every stage takes the same branch, so no stage waits in a
  collective that another skips. Or (`every_tick`) one ppermute on every pair the direction
  ever uses, outside any conditional, where a GPU's scheduler can overlap it with the compute
  beside it; what arrives where the tick's pattern sends nothing is left as it came (a stale
  message: `receive` writes only where the table's slot column says something arrives, which
  is where the pattern lands, as tests/test_cost_report.py checks for each schedule), or
  zeroed where the caller adds arrivals (`zero_idle`: a compressed link's two parts), so both
  give the same values wherever they are read. Zeroing every arrival was an elementwise pass
  over each message in every tick (gpt_1.3b (1,4,1) zb_h1 on H100s: 1.1 ms a step). With
  scatter/gather each tensor rank sends its slice of the sequence (a nested map, manual over
  `tensor`).
- `receive`: writes what arrived into its ring slot, all-gathering a split message over
  `tensor` there, on the receivers only (a tensor group shares its stage, so a `tensor`
  collective may sit under a stage-dependent loop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmeg.ordering import chained
from jaxmeg.pipeline import rings
from jaxmeg.pipeline.gradients import inside_manual_axes


def varying_everywhere(tree, axes=None):
    """pcast each leaf to varying over the `axes` it does not vary over yet (default: the
    executor's manual axes, `gradients.manual_axes`), so that loop carries and `lax.switch`
    branches keep one type."""
    if axes is None:
        axes = inside_manual_axes()

    def cast(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def switch(index, branches: Sequence[Callable]):
    """`lax.switch` over argument-less branches whose results are made varying alike."""
    typed = [lambda b=b: varying_everywhere(b()) for b in branches]
    return jax.lax.switch(index, typed)


ORDERED_SCOPE = "ordered"
"""The name scope of the one-trip loop a send runs in on an ordered tick (`ordered_tick`)."""


class _Chain:
    """The ordering token of the tick being traced (`ordered_tick`), or None."""

    token = None


_CHAIN = _Chain()


@contextlib.contextmanager
def ordered_tick(on: bool = True):
    """While one tick is traced (`on`: CPU devices, `Plan.ordered`): every `run_if` and
    `send` of the tick, in the order they are traced, reads its trip count from a token that
    the one before returns when its collectives have run (`jaxmeg.ordering`), so every device
    runs them in that order. Slot bodies are traced with the chain off: inside a slot data
    orders them, and `hlo_module.unordered_collectives` checks it."""
    if not on:
        yield
        return
    _CHAIN.token = jnp.zeros((), jnp.int32)
    try:
        yield
    finally:
        _CHAIN.token = None


@contextlib.contextmanager
def _chain_off():
    token, _CHAIN.token = _CHAIN.token, None
    try:
        yield
    finally:
        _CHAIN.token = token


def run_if(active, fn: Callable, state, scope: str, reads=()):
    """fn(state, *reads) where `active`, else `state` unchanged, as a loop of 0 or 1 trips
    named `scope` (what `jaxmeg.parallel.hlo_cost` weights it by). The state and `reads` pass
    an optimization barrier with the trip index, so XLA cannot hoist the slot's work out of the
    loop (and run it on every tick). On an ordered tick it runs after the tick's loop before
    it (`ordered_tick`)."""
    state = varying_everywhere(state)
    token = _CHAIN.token

    def body(i, carry):
        st, tok = carry
        _, (st, read) = jax.lax.optimization_barrier((i, (st, reads)))
        with _chain_off():
            st = fn(st, *read)
        return varying_everywhere(st), (None if tok is None else chained(tok, i))

    trips = active.astype(jnp.int32)
    with jax.named_scope(scope):
        if token is None:
            return jax.lax.fori_loop(0, trips, body, (state, None))[0]
        state, _CHAIN.token = jax.lax.fori_loop(
            0, trips + token, body, (state, varying_everywhere(token))
        )
        return state


def send(
    x, index, patterns, scope: str, split: bool = False, every_tick: bool = False,
    zero_idle: bool = False,
):  # fmt: skip
    """ppermute `x` over the pairs of `patterns[index - 1]`, zeros where index is 0 or where
    nothing arrives (`every_tick`: one ppermute on all the patterns' pairs, see the module
    docstring; what arrives where nothing is sent is then zeros only with `zero_idle`). With
    `split` (scatter/gather), x [b, s, h] goes as each tensor rank's slice of its b s rows, and
    what arrives, [b s, h], is split over `tensor` (`receive` gathers it along its major dim:
    the ring's layout as it is, where a split of the sequence dim made XLA transpose the ring)."""
    if not patterns:
        return jax.tree.map(jnp.zeros_like, x)
    if _CHAIN.token is not None:  # in a loop of one trip, ordered against the tick's others
        once = lambda _, x_: send(x_, index, patterns, scope, split, every_tick, zero_idle)  # noqa: E731
        with _chain_off():
            sent = jax.eval_shape(once, None, x)  # split: [b s, h]
        zeros = varying_everywhere(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), sent))
        return run_if(jnp.ones((), jnp.int32), once, zeros, ORDERED_SCOPE, (x,))
    permute = partial(_every_tick, zero_idle=zero_idle) if every_tick else _when_needed

    with jax.named_scope(scope):
        if not split:
            return varying_everywhere(permute(x, index, patterns, switch))

        # The result varies over the outer manual axes (data, pipe) too, which the nested
        # map's type check would count against out_specs.
        def per_rank(x_, i_):
            rank, parts = jax.lax.axis_index("tensor"), jax.lax.axis_size("tensor")
            rows = x_.reshape(-1, x_.shape[-1])  # [b s, h]
            size = rows.shape[0] // parts
            piece = jax.lax.dynamic_slice_in_dim(rows, rank * size, size, axis=0)
            with jax.named_scope(scope):
                return permute(piece, i_, patterns, jax.lax.switch)

        return jax.shard_map(
            per_rank,
            in_specs=(P(), P()),
            out_specs=P("tensor"),
            axis_names=frozenset({"tensor"}),
            check_vma=False,
        )(x, index)


def _when_needed(x, index, patterns, switch_fn):
    zeros = lambda: jax.tree.map(jnp.zeros_like, x)  # noqa: E731
    sends = [lambda pairs=pairs: jax.lax.ppermute(x, "pipe", pairs) for pairs in patterns]
    return switch_fn(index, [zeros, *sends])


def _every_tick(x, index, patterns, _switch_fn, zero_idle: bool = False):
    pairs = sorted({pair for pattern in patterns for pair in pattern})
    sources, targets = [s for s, _ in pairs], [d for _, d in pairs]
    assert len(set(sources)) == len(sources) and len(set(targets)) == len(targets), pairs
    arrived = jax.lax.ppermute(x, "pipe", pairs)
    if not zero_idle:
        return arrived
    lands = np.zeros((len(patterns) + 1, jax.lax.axis_size("pipe")), bool)
    for k, pattern in enumerate(patterns, start=1):
        lands[k, [d for _, d in pattern]] = True
    here = jnp.asarray(lands)[index, jax.lax.axis_index("pipe")]
    return jax.tree.map(lambda a: jnp.where(here, a, jnp.zeros_like(a)), arrived)


def receive(buffer, slot, value, scope: str, gather: bool = False):
    """buffer[slot] = value in the ticks where something arrives (slot >= 0); with `gather`
    the value (`send`'s rows, split over `tensor`) is made whole there."""

    def write(buf, val):
        if gather:
            val = jax.lax.with_sharding_constraint(val, P(*([None] * val.ndim)))
            val = val.reshape(buf.shape[1:])
        return rings.write(buf, jnp.maximum(slot, 0), val)

    return run_if(slot >= 0, write, buffer, scope, (value,))
