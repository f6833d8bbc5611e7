"""In-place writes into the executor's rings and accumulators, indexed by a traced slot.

`buf.at[i].set(v)` is a scatter that drops a write whose index falls outside `buf`; XLA lowers
its bounds check as a select between the new value and the slot's old one, so every such
write also reads the old slot (on the H100 program, a third of a ring write's bytes, on every
ring of every schedule). The tick table's slots are always in bounds: these write with one
dynamic-update-slice and nothing else (a negative index counts from the end, as with `.at`).
"""

from __future__ import annotations

import jax


def write(buf: jax.Array, index, value: jax.Array, start: int = 0) -> jax.Array:
    """buf[index] = value, or with `start` buf[index, start:start + len(value)] = value; value
    cast to buf's dtype."""
    value = value.astype(buf.dtype)
    if buf.shape[0] == 1 and not start and value.shape == buf.shape[1:]:
        return value[None]  # the only slot: the whole buffer
    if not start and value.ndim == buf.ndim - 1:
        return jax.lax.dynamic_update_index_in_dim(buf, value, index, 0)
    starts = (index, start, *(0,) * (buf.ndim - 2))
    return jax.lax.dynamic_update_slice(buf, value[None], starts)


def write_layers(buf: jax.Array, index, layers: list, start: int = 0) -> jax.Array:
    """buf[index, start + l] = layers[l] for each l: one in-place update per layer (writing
    them stacked, XLA first copies every layer into the stack, then the stack into `buf`)."""
    for l, value in enumerate(layers):
        starts = (index, start + l, *(0,) * (buf.ndim - 2))
        buf = jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype)[None, None], starts)
    return buf


def add(buf: jax.Array, index, value: jax.Array) -> jax.Array:
    """buf[index] += value (cast to buf's dtype). With one slot (one chunk per stage, the
    gradient accumulators' usual case) an elementwise add, which XLA fuses with the cast and
    runs in place: as a slice, an add and an update it was three passes over the stage's
    gradients per microbatch."""
    if buf.shape[0] == 1:
        return buf + value.astype(buf.dtype)[None]
    old = jax.lax.dynamic_index_in_dim(buf, index, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, old + value.astype(buf.dtype), index, 0)
