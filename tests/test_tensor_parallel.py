"""Megatron tensor parallelism and data parallelism == one device (loss AND gradients), and the
collectives that prove the layout, counted in the compiled HLO."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxmeg.parallel.hlo import collectives, count
from jaxmeg.training.state import abstract_state, init_state
from jaxmeg.training.step import make_loss_and_grads, make_train_step
from tests.helpers import put_batch, random_batch, tiny_config, trainable_for

# fp32 compute; differences come only from the order of reductions across shards. At the
# initial params every gradient matches to 1e-5 (relative, plus 1e-5 x the largest entry of the
# same gradient for entries near zero). After two AdamW steps the match is 1e-3: Adam divides
# by |g|, so reduction-order noise in a near-zero gradient entry becomes a parameter difference
# of up to 2 lr in that entry, which the next gradients then carry.
INIT_TOL, AFTER_STEPS_TOL = 1e-5, 1e-3


def run_two_steps(data: int, tensor: int, sequence_parallel: bool):
    """Gradients at init, per-step losses of 2 optimizer steps, then loss and gradients at the
    updated params."""
    trainable = trainable_for(
        tiny_config(data=data, tensor=tensor, sequence_parallel=sequence_parallel)
    )
    batches = [random_batch(trainable.cfg, seed) for seed in range(3)]
    loss_and_grads = jax.jit(make_loss_and_grads(trainable))
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, seed=0)
        _, init_grads = loss_and_grads(state["params"], *put_batch(trainable, batches[0]))
        init_grads = jax.tree.map(np.asarray, init_grads)
        step = make_train_step(trainable)
        losses = []
        for tokens in batches[:2]:
            state, metrics = step(state, *put_batch(trainable, tokens))
            losses.append(float(metrics["loss"]))
        loss, grads = loss_and_grads(state["params"], *put_batch(trainable, batches[2]))
    return init_grads, losses, float(loss), jax.tree.map(np.asarray, grads)


def assert_trees_close(got_tree, ref_tree, tol: float) -> None:
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_tree)
    flat = jax.tree.leaves(got_tree)
    assert len(flat) == len(flat_ref)
    for (path, ref), got in zip(flat_ref, flat, strict=True):
        atol = tol * float(np.abs(ref).max())
        np.testing.assert_allclose(
            got, ref, rtol=tol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


@pytest.fixture(scope="module")
def reference():
    return run_two_steps(1, 1, False)


@pytest.mark.parametrize(
    "data,tensor,sequence_parallel",
    # data alone; tensor 2 (with data) with and without sequence parallelism, tensor 4 with it
    # (tensor 4 without it: tests/test_pipeline.py's d1p2t4 case, loss and gradients)
    [(2, 1, False), (2, 2, False), (2, 2, True), (1, 4, True)],
)
def test_matches_single_device(reference, data, tensor, sequence_parallel):
    ref_init_grads, ref_losses, ref_loss, ref_grads = reference
    init_grads, losses, loss, grads = run_two_steps(data, tensor, sequence_parallel)
    assert_trees_close(init_grads, ref_init_grads, INIT_TOL)
    np.testing.assert_allclose(losses, ref_losses, rtol=INIT_TOL)
    np.testing.assert_allclose(loss, ref_loss, rtol=AFTER_STEPS_TOL)
    assert_trees_close(grads, ref_grads, AFTER_STEPS_TOL)


def compiled_collectives(trainable):
    batch = jax.ShapeDtypeStruct(
        (trainable.cfg.train.global_batch, trainable.cfg.model.seq_len),
        np.int32,
        sharding=trainable.batch_sharding(),
    )
    with jax.set_mesh(trainable.mesh):
        compiled = (
            make_train_step(trainable).lower(abstract_state(trainable), batch, batch).compile()
        )
    return collectives(compiled.as_text(), trainable.mesh), compiled.as_text()


# A layer's ops: `.../Block/...` or, in the forward under `jax.vjp`, `.../jvp(Block)/...`.
LAYER = re.compile(r"Block\)?/")


def layer_collectives(found, backward: bool):
    return [c for c in found if LAYER.search(c.op_name) and ("transpose(" in c.op_name) == backward]


def layer_bodies(trainable) -> int:
    """How many layer bodies the HLO holds: one for a scan, each layer's for an unrolled chunk
    (`StageLayout.unrolled`), so counts divided by it are per layer."""
    layout = trainable.layout
    return layout.layers_per_chunk * layout.num_chunks if layout.unrolled else 1


def test_megatron_collectives_per_layer():
    trainable = trainable_for(tiny_config(data=2, tensor=2))
    found, _ = compiled_collectives(trainable)
    forward, backward = layer_collectives(found, False), layer_collectives(found, True)
    # Megatron's g (after each row-parallel matmul) in the forward, f in the backward.
    per_layer = [("all-reduce", {"tensor"})] * 2 * layer_bodies(trainable)
    assert [(c.kind, set(c.axes)) for c in forward] == per_layer
    assert [(c.kind, set(c.axes)) for c in backward] == per_layer
    # One data-parallel reduction of the layer gradients (in the tick loop, in the tick of the
    # last backward) and one of the embedding/head gradients with the loss, after the loop.
    data_reductions = [c for c in found if c.axes == {"data"}]
    assert [c.kind for c in data_reductions] == ["all-reduce"] * 2
    assert not any("pipe" in c.axes for c in found)


def test_sequence_parallel_collectives_per_layer():
    trainable = trainable_for(tiny_config(tensor=4, sequence_parallel=True))
    found, _ = compiled_collectives(trainable)
    forward = layer_collectives(found, False)
    bodies = layer_bodies(trainable)
    # Each column-parallel input is all-gathered (the residual stream stays split over tensor,
    # here on its rows: 4 per microbatch); each row-parallel output is reduced and scattered
    # back. XLA:CPU emits that reduction as an all-reduce plus a local slice (its pipeline
    # has no reduce-scatter fusion), so either kind is counted.
    assert count(forward, "all-gather", {"tensor"}) == 2 * bodies
    reductions = count(forward, "all-reduce", {"tensor"}) + count(
        forward, "reduce-scatter", {"tensor"}
    )
    assert reductions == 2 * bodies
    # Backward: the transposes swap the two (a gather's cotangent is reduce-scattered, a
    # scatter's is gathered), plus the gathers of the recomputed forward; all activation-sized.
    backward = layer_collectives(found, True)
    activation = max(c.bytes for c in forward)
    gathers = [c for c in backward if c.kind == "all-gather"]
    reductions = [c for c in backward if c.kind in ("all-reduce", "reduce-scatter")]
    assert len(gathers) >= 2 * bodies and all(c.bytes == activation for c in gathers)
    assert sum(c.bytes >= activation for c in reductions) >= 2 * bodies
    assert all(c.axes == {"tensor"} for c in found)


def test_full_logits_never_materialised():
    cfg = tiny_config(tensor=4)
    trainable = trainable_for(cfg)
    assert trainable.vocab == 512
    _, text = compiled_collectives(trainable)
    assert "128]" in text  # the local vocab shard [.., 512 / 4]
    assert ",512]" not in text and "[512]" not in text


def test_vocab_parallel_loss_equals_softmax_cross_entropy():
    import jax.numpy as jnp
    import optax

    from jaxmeg.models import cross_entropy

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 512)).astype(np.float32))
    targets = jnp.asarray(rng.integers(0, 500, (2, 5)).astype(np.int32))
    expected = optax.softmax_cross_entropy_with_integer_labels(logits[..., :500], targets).mean()
    np.testing.assert_allclose(cross_entropy(logits, targets, 500), expected, rtol=1e-6)
    # Padding rows past the vocabulary do not change the loss, whatever their values.
    padded = logits.at[..., 500:].set(1e4)
    np.testing.assert_allclose(cross_entropy(padded, targets, 500), expected, rtol=1e-6)
