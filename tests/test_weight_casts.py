"""`jaxmeg.pipeline.executor.casts`: the parameter leaves a function reads only in a narrower
dtype, which the executor casts once per step instead of in every microbatch's slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmeg.pipeline.executor import casts

BF16 = jnp.bfloat16


def test_a_leaf_read_only_through_slices_and_casts_is_cast_and_nothing_else_is():
    def fn(p, x):
        def layer(p, x):
            h = x @ p["w"][0].astype(BF16)  # sliced, then cast, inside a checkpoint
            h = h * p["scale"]  # fp32: not cast
            h = h + jnp.broadcast_to(p["b"], h.shape).astype(BF16)  # a broadcast sums: not cast
            return h + jnp.take(p["table"], jnp.array([0, 1, 2]), axis=0).astype(BF16)  # a gather

        unused = jax.checkpoint(lambda p, x: x)(p, x)  # a call whose body drops the leaves
        return jax.checkpoint(layer)(p, x) + unused

    p = {"w": jnp.ones((2, 4, 4)), "scale": jnp.ones((4,)), "b": jnp.ones((4,)),
         "table": jnp.ones((3, 4)), "steps": jnp.ones((), jnp.int32)}  # fmt: skip
    x = jnp.ones((3, 4), BF16)
    dtypes = casts.read_as(fn, p, x)
    assert dtypes == {"w": BF16, "scale": None, "b": None, "table": None, "steps": None}, dtypes
    cast = casts.cast(p, dtypes)
    assert cast["w"].dtype == BF16 and cast["scale"].dtype == np.float32

    # the same values and gradients (the fp32 gradient as the cast's transpose gave it)
    def loss(p):
        return fn(p, x).astype(jnp.float32).sum()

    g32 = jax.grad(loss, allow_int=True)(p)
    g16 = jax.grad(lambda q: loss({**p, "w": q}))(cast["w"])
    assert float(loss(p)) == float(loss({**p, "w": cast["w"]}))
    np.testing.assert_array_equal(np.asarray(g16, np.float32), np.asarray(g32["w"]))
