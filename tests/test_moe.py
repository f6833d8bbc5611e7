"""The mixture-of-experts block's functions (`jaxmeg.models.moe`) against a dense reference that
runs every expert on every token and weighs the results by the routing: the same outputs and
the same gradients (tokens, router, expert weights), for top-1 and top-2, both routers, gated
and plain experts, and a router that sends every token to one expert (the others get none)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg.models import grouped_gemm, moe

T, H, F, E = 24, 16, 8, 4


def dense(x, routing, w_in, w_out, w_gate=None):
    """Every expert on every token, combined by the routing's weights (zero where not chosen)."""
    combine = jnp.zeros((x.shape[0], w_in.shape[0]))
    combine = combine.at[jnp.arange(x.shape[0])[:, None], routing.experts].add(routing.weights)
    hidden = jnp.einsum("th,ehf->tef", x, w_in)
    if w_gate is not None:
        hidden = jax.nn.silu(jnp.einsum("th,ehf->tef", x, w_gate)) * hidden
    else:
        hidden = jax.nn.gelu(hidden)
    return jnp.einsum("te,teh->th", combine, jnp.einsum("tef,efh->teh", hidden, w_out))


def weights(seed, gated):
    keys = jax.random.split(jax.random.key(seed), 6)
    w = {
        "x": jax.random.normal(keys[0], (T, H)),
        "router": jax.random.normal(keys[1], (H, E)) * 0.5,
        "w_in": jax.random.normal(keys[2], (E, H, F)) * 0.3,
        "w_out": jax.random.normal(keys[3], (E, F, H)) * 0.3,
        "target": jax.random.normal(keys[4], (T, H)),
    }
    if gated:
        w["w_gate"] = jax.random.normal(keys[5], (E, H, F)) * 0.3
    return w


def loss_of(ffn, top_k, router, bias=None):
    def loss(w):
        routing = moe.route(w["x"] @ w["router"], top_k, router, bias=bias)
        y = ffn(w["x"], routing, w["w_in"], w["w_out"], w.get("w_gate"))
        aux = moe.load_balancing_loss(routing, E) + 1e-3 * moe.z_loss(routing)
        return jnp.sum(y * w["target"]) + 0.01 * aux

    return loss


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("gated", [True, False])
def test_grouped_experts_equal_the_dense_reference(top_k, router, gated):
    w = weights(top_k, gated)
    grouped = jax.jit(jax.value_and_grad(loss_of(moe.experts_ffn, top_k, router)))
    reference = jax.jit(jax.value_and_grad(loss_of(dense, top_k, router)))
    (loss, grads), (ref_loss, ref_grads) = grouped(w), reference(w)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in ("x", "router", "w_in", "w_out"):
        np.testing.assert_allclose(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert np.abs(grads["router"]).max() > 0  # the router learns through the weights and aux


def test_every_token_to_one_expert_leaves_the_others_untouched():
    """A bias that makes expert 2 every token's choice: groups of 0 rows for the rest, whose
    weights then get exactly zero gradient; the output is that one expert's FFN."""
    w = weights(7, gated=True)
    bias = jnp.zeros(E).at[2].set(100.0)
    grouped = jax.value_and_grad(loss_of(moe.experts_ffn, 1, "softmax", bias))
    reference = jax.value_and_grad(loss_of(dense, 1, "softmax", bias))
    (loss, grads), (ref_loss, ref_grads) = grouped(w), reference(w)
    routing = moe.route(w["x"] @ w["router"], 1, bias=bias)
    assert np.asarray(moe.expert_load(routing, E)).tolist() == [0, 0, T, 0]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads["w_in"], ref_grads["w_in"], rtol=1e-4, atol=1e-5)
    others = np.delete(np.asarray(grads["w_in"]), 2, axis=0)
    assert not others.any() and np.asarray(grads["w_in"][2]).any()


def test_routing_weights_and_balance_loss():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))
    routing = moe.route(logits, 2)  # softmax, renormalised over the two chosen
    assert np.asarray(routing.experts).tolist() == [[3, 2], [0, 1]]
    np.testing.assert_allclose(routing.weights, [[4 / 7, 3 / 7], [4 / 7, 3 / 7]], rtol=1e-6)
    kept = moe.route(logits, 2, normalize=False)
    np.testing.assert_allclose(kept.weights, [[0.4, 0.3], [0.4, 0.3]], rtol=1e-6)
    uniform = moe.route(jnp.zeros((8, E)).at[jnp.arange(8), jnp.arange(8) % E].set(1e-3), 1)
    np.testing.assert_allclose(moe.load_balancing_loss(uniform, E), 1.0, rtol=1e-3)
    skewed = moe.route(jnp.zeros((8, E)).at[:, 0].set(5.0), 1)
    assert float(moe.load_balancing_loss(skewed, E)) > 3.0  # all load on one expert


@pytest.mark.parametrize(
    "top_k, router, message",
    [(5, "softmax", "top_k must be between 1 and the 4 experts, got 5"),
     (0, "softmax", "top_k must be between 1 and the 4 experts, got 0"),
     (1, "relu", "router must be one of ['softmax', 'sigmoid'], got 'relu'")],
)  # fmt: skip
def test_bad_routing_is_named(top_k, router, message):
    with pytest.raises(ValueError) as error:
        moe.route(jnp.zeros((2, E)), top_k, router)
    assert str(error.value) == message


@pytest.mark.parametrize("sizes", [(10, 0, 15, 3), (0, 0, 28, 0), (7, 7, 7, 7), (0, 0, 0, 0)])
def test_blocked_grouped_gemm_equals_ragged_dot(sizes, monkeypatch):
    """`blocked_ragged_dot` (the GPU's grouped GEMM: dense GEMMs over blocks of each group's
    rows) gives `jax.lax.ragged_dot`'s outputs and both cotangents, for empty groups, rows past
    the groups and blocks that straddle two groups (blocks of 4 rows here)."""
    monkeypatch.setattr(grouped_gemm, "BLOCK_ROWS", 4)
    keys = jax.random.split(jax.random.key(3), 3)
    rows = jax.random.normal(keys[0], (30, H))
    w = jax.random.normal(keys[1], (E, H, F))
    cot = jax.random.normal(keys[2], (30, F))
    group = jnp.asarray(sizes, jnp.int32)

    def pulled(ragged):
        y, pullback = jax.vjp(lambda r, w_: ragged(r, w_, group), rows, w)
        return (y, *pullback(cot))

    for got, want in zip(
        pulled(grouped_gemm.blocked_ragged_dot), pulled(jax.lax.ragged_dot), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
