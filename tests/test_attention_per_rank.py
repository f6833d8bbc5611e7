"""cuDNN attention runs per tensor rank under a map manual over the axes left automatic
(`jaxmeg.parallel.attention`). cuDNN is GPU-only: the GPU programs are checked compiled for
H100s (tests/test_gpu_target.py); here the same map runs XLA's kernel on CPU devices and must
equal attention over the whole heads, values and gradients, whatever the heads' split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmeg.parallel.attention import per_tensor_rank


@pytest.mark.parametrize("tensor, kv_heads", [(4, 8), (2, 2)])
def test_per_rank_attention_equals_whole_attention_and_its_gradients(tensor, kv_heads):
    """Multi-head on 4 ranks; grouped-query (8 query heads reading 2) on 2, a key/value head
    per rank with its 4 query heads, as the sharding rules split them."""
    devices = np.array(jax.devices()[:tensor]).reshape(1, 1, 1, tensor)
    mesh = Mesh(devices, ("data", "pipe", "context", "tensor"), axis_types=(AxisType.Auto,) * 4)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 8, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 16, kv_heads, 8)), jnp.float32) for _ in range(2))
    heads = NamedSharding(mesh, P(None, None, "tensor", None))

    def loss(attend, q, k, v):
        o = attend(q, k, v)
        return jnp.sum(o * jnp.cos(o)), o

    def whole(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    expected = jax.value_and_grad(lambda *a: loss(whole, *a), argnums=(0, 1, 2), has_aux=True)
    mapped = jax.jit(
        jax.value_and_grad(
            lambda *a: loss(per_tensor_rank("xla"), *a), argnums=(0, 1, 2), has_aux=True
        ),
        in_shardings=(heads, heads, heads),
    )
    with jax.set_mesh(mesh):
        (got_loss, got_o), got_grads = mapped(q, k, v)
        text = mapped.lower(q, k, v).compile().as_text()
    (want_loss, want_o), want_grads = expected(q, k, v)
    np.testing.assert_allclose(got_o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # each rank attends with its own heads: nothing is gathered or reduced for attention
    assert "all-gather" not in text and "all-to-all" not in text
