"""Data dependencies that order collectives on XLA:CPU.

XLA:CPU runs the operations of a computation that no data orders in any order (and removes
`lax.optimization_barrier` before it runs them). A loop or conditional that holds a collective
and another collective beside it, with no data between them, may then start in one order on
one device and in the other on another: each waits in its collective for a device that waits
in the other, and the step hangs (`jaxmeg.parallel.hlo_module.unordered_collectives` finds
such pairs in a compiled step). These helpers make a dependency real: integer zeros computed
from a value, which XLA cannot fold, added to what the next collective reads. They read
values element by element (never one element of a split array, which would move it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros_from(x: jax.Array) -> jax.Array:
    """int32 zeros shaped like `x`, each read from its element: the population count of a
    32-bit word is at most 32, so shifted right by 6 it is 0, which XLA does not know."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        word = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    else:
        word = x.astype(jnp.int32)
    return jax.lax.shift_right_logical(jax.lax.population_count(word), jnp.int32(6))


def chained(token: jax.Array, step) -> jax.Array:
    """A new int32 zero token read from `token` and `step` (scalars)."""
    return zeros_from(token ^ jnp.asarray(step, jnp.int32))
