"""The mixture-of-experts block's functions (`jaxmeg.models.moe`) against a dense reference that
runs every expert on every token and weighs the results by the routing: the same outputs and
the same gradients (tokens, router, expert weights), for top-1 and top-2, both routers, gated
and plain experts, and a router that sends every token to one expert (the others get none)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg.models import experts_ffn, grouped_gemm, grouped_kernels, router

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


def loss_of(ffn, top_k, router_name, bias=None):
    def loss(w):
        routing = router.route(w["x"] @ w["router"], top_k, router_name, bias=bias)
        y = ffn(w["x"], routing, w["w_in"], w["w_out"], w.get("w_gate"))
        aux = router.load_balancing_loss(routing, E) + 1e-3 * router.z_loss(routing)
        return jnp.sum(y * w["target"]) + 0.01 * aux

    return loss


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("router_name", ["softmax", "sigmoid"])
@pytest.mark.parametrize("gated", [True, False])
def test_grouped_experts_equal_the_dense_reference(top_k, router_name, gated):
    w = weights(top_k, gated)
    grouped = jax.jit(jax.value_and_grad(loss_of(experts_ffn.experts_ffn, top_k, router_name)))
    reference = jax.jit(jax.value_and_grad(loss_of(dense, top_k, router_name)))
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
    grouped = jax.value_and_grad(loss_of(experts_ffn.experts_ffn, 1, "softmax", bias))
    reference = jax.value_and_grad(loss_of(dense, 1, "softmax", bias))
    (loss, grads), (ref_loss, ref_grads) = grouped(w), reference(w)
    routing = router.route(w["x"] @ w["router"], 1, bias=bias)
    assert np.asarray(router.expert_load(routing, E)).tolist() == [0, 0, T, 0]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads["w_in"], ref_grads["w_in"], rtol=1e-4, atol=1e-5)
    others = np.delete(np.asarray(grads["w_in"]), 2, axis=0)
    assert not others.any() and np.asarray(grads["w_in"][2]).any()


def test_routing_weights_and_balance_loss():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))
    routing = router.route(logits, 2)  # softmax, renormalised over the two chosen
    assert np.asarray(routing.experts).tolist() == [[3, 2], [0, 1]]
    np.testing.assert_allclose(routing.weights, [[4 / 7, 3 / 7], [4 / 7, 3 / 7]], rtol=1e-6)
    kept = router.route(logits, 2, normalize=False)
    np.testing.assert_allclose(kept.weights, [[0.4, 0.3], [0.4, 0.3]], rtol=1e-6)
    uniform = router.route(jnp.zeros((8, E)).at[jnp.arange(8), jnp.arange(8) % E].set(1e-3), 1)
    np.testing.assert_allclose(router.load_balancing_loss(uniform, E), 1.0, rtol=1e-3)
    skewed = router.route(jnp.zeros((8, E)).at[:, 0].set(5.0), 1)
    assert float(router.load_balancing_loss(skewed, E)) > 3.0  # all load on one expert


def test_group_limited_routing_chooses_within_each_tokens_best_groups():
    """DeepSeek-V3's group-limited routing, against a loop written from its definition: 8
    experts in 4 groups of 2, a group scored by the sum of its two (biased) scores, each token's
    2 best groups kept and its top 3 chosen among their 4 experts; the weights the unbiased
    scores of the chosen ones, normalised, times the routed scaling factor."""
    tokens, experts, groups, keep, k, scale = 16, 8, 4, 2, 3, 2.5
    keys = jax.random.split(jax.random.key(5), 2)
    logits = np.asarray(jax.random.normal(keys[0], (tokens, experts)))
    bias = np.asarray(jax.random.normal(keys[1], (experts,))) * 0.1
    got = router.route(jnp.asarray(logits), k, "sigmoid", bias=jnp.asarray(bias), groups=groups,
                       group_topk=keep, scaling=scale)  # fmt: skip
    scores = 1 / (1 + np.exp(-logits))
    for t in range(tokens):
        biased = (scores[t] + bias).reshape(groups, -1)
        best = np.argsort(-np.sort(biased, axis=1)[:, -2:].sum(axis=1), kind="stable")[:keep]
        allowed = np.concatenate([np.arange(g * 2, g * 2 + 2) for g in best])
        chosen = allowed[np.argsort(-(scores[t] + bias)[allowed], kind="stable")[:k]]
        assert sorted(np.asarray(got.experts[t]).tolist()) == sorted(chosen.tolist()), t
        want = scores[t][chosen] / scores[t][chosen].sum() * scale
        np.testing.assert_allclose(np.sort(np.asarray(got.weights[t])), np.sort(want), rtol=1e-5)
    # every token's choices lie in at most `keep` groups; one group: the same as no groups
    assert max(len(set((np.asarray(got.experts[t]) // 2).tolist())) for t in range(tokens)) <= keep
    plain = router.route(jnp.asarray(logits), k, "sigmoid", bias=jnp.asarray(bias))
    one = router.route(jnp.asarray(logits), k, "sigmoid", bias=jnp.asarray(bias), groups=1)
    np.testing.assert_array_equal(plain.experts, one.experts)


def test_the_balance_loss_is_deepseek_v3s_sequence_wise_one():
    """`sequence_balance_loss` with a sigmoid router is DeepSeek-V3's sequence-wise balance loss
    (its eq. 17-20): per sequence, sum_i f_i P_i with f_i = E / (k T) x the count of tokens
    choosing i and P_i the mean over tokens of the scores normalised per token; averaged over
    the sequences."""
    sequences, per, k = 3, 8, 2
    logits = jax.random.normal(jax.random.key(7), (sequences * per, E))
    routing = router.route(logits, k, "sigmoid")
    got = router.sequence_balance_loss(routing, sequences, "sigmoid")
    scores = np.asarray(jax.nn.sigmoid(logits)).reshape(sequences, per, E)
    chosen = np.asarray(routing.experts).reshape(sequences, per, k)
    want = []
    for n in range(sequences):
        f = E / (k * per) * np.bincount(chosen[n].reshape(-1), minlength=E)
        p = (scores[n] / scores[n].sum(axis=1, keepdims=True)).mean(axis=0)
        want.append(np.sum(f * p))
    np.testing.assert_allclose(got, np.mean(want), rtol=1e-5)


@pytest.mark.parametrize(
    "top_k, router_name, message",
    [(5, "softmax", "top_k must be between 1 and the 4 experts, got 5"),
     (0, "softmax", "top_k must be between 1 and the 4 experts, got 0"),
     (1, "relu", "router must be one of ['softmax', 'sigmoid'], got 'relu'")],
)  # fmt: skip
def test_bad_routing_is_named(top_k, router_name, message):
    with pytest.raises(ValueError) as error:
        router.route(jnp.zeros((2, E)), top_k, router_name)
    assert str(error.value) == message


@pytest.mark.parametrize("sizes", [(10, 0, 23, 3), (0, 0, 40, 0), (10, 10, 10, 10), (0, 0, 0, 0)])
def test_the_grouped_gemm_kernels_equal_ragged_dot(sizes):
    """`kernel_ragged_dot` (`moe.grouped_gemm: pallas`: Pallas kernels that run only each
    group's rows, interpreted here) gives `jax.lax.ragged_dot`'s outputs and both cotangents,
    for empty groups, rows past the groups (zero), tiles that start anywhere and blocks that
    would run past the rows; the exchange's written-out gradients are the same kernels."""
    keys = jax.random.split(jax.random.key(4), 3)
    rows = jax.random.normal(keys[0], (40, 32))
    w = jax.random.normal(keys[1], (E, 32, 16))
    cot = jax.random.normal(keys[2], (40, 16))
    group = jnp.asarray(sizes, jnp.int32)
    assert grouped_kernels.runs(40, 32, 16) and grouped_kernels.block(16, 128) == 16

    def pulled(ragged):
        y, pullback = jax.vjp(lambda r, w_: ragged(r, w_, group), rows, w)
        return (y, *pullback(cot))

    want = pulled(jax.lax.ragged_dot)
    for got, expected in zip(pulled(grouped_gemm.kernel_ragged_dot), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    written_out = (
        grouped_gemm.kernel_input_gradient("w_in", cot, w, group),
        grouped_gemm.kernel_weight_gradient("w_in", rows, group, cot),
    )
    for got, expected in zip(written_out, want[1:], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_grouped_gemm_kernels_take_their_blocks_in_grouped_order():
    """More row tiles than a swizzle group and several column blocks (600 rows in 128-row
    tiles, 48 columns in blocks of 16): every block is computed once, as `ragged_dot`'s."""
    keys = jax.random.split(jax.random.key(5), 3)
    rows = jax.random.normal(keys[0], (600, 32))
    w = jax.random.normal(keys[1], (E, 32, 48))
    cot = jax.random.normal(keys[2], (600, 48))
    group = jnp.asarray([200, 0, 263, 100], jnp.int32)
    tiles = grouped_kernels.tile_table(group, 600, 128)[0].shape[0]
    assert tiles > grouped_kernels.SWIZZLE and grouped_kernels.block(48, 128) == 16
    want = jax.vjp(lambda r, w_: jax.lax.ragged_dot(r, w_, group), rows, w)
    got = jax.vjp(lambda r, w_: grouped_gemm.kernel_ragged_dot(r, w_, group), rows, w)
    for a, b in zip((got[0], *got[1](cot)), (want[0], *want[1](cot)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


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
