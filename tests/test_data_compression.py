"""Optimus-CC's data-parallel techniques: the fused embedding sync (exact, one all-reduce over
{first, last stage} x data read from the HLO) and PowerSGD on selected stages (equal to the plain
mean at full rank, only on stages < k, not during the warm-up, its state across a checkpoint and
a tensor reshard)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel.hlo import replica_groups
from jaxmeg.pipeline import powersgd
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import init_state
from tests.helpers import (
    factors_at_any_rank,
    put_batch,
    random_batch,
    run_checked_text,
    trainable_for,
)

pytestmark = pytest.mark.timeout(300)

MODEL = C.ModelConfig(
    vocab_size=500, hidden=32, layers=4, heads=4, seq_len=8, compute_dtype="float32"
)


def config(mesh, **comp) -> C.Config:
    data, pipe, tensor = mesh
    return C.Config(
        model=MODEL,
        parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor),
        train=C.TrainConfig(global_batch=data * pipe * 2, microbatch_size=1),
        compression=C.CompressionConfig(**comp),
    )


RUNS: dict = {}


def run(mesh, step=0, exact=False, **comp):
    """((loss, grads, compression state or None) as numpy, cross-stage psums) of the compiled
    loss-and-grads of `config(mesh, **comp)` at `step`, at the initial params on one random
    batch (the same for every layout), once per worker. `exact` runs the factor path at any
    rank > 0, where a rank at the matrices' smaller side (hidden 32) is exact in exact
    arithmetic (that rank normally sends the matrix whole). The psums: per all-reduce of the
    executor's reductions (`psum` in its op name) that spans pipeline stages, the stages of each
    of its groups (singleton groups left out)."""
    key = (mesh, step, exact, tuple(sorted(comp.items())))
    if key in RUNS:
        return RUNS[key]
    with factors_at_any_rank(exact):
        trainable = trainable_for(config(mesh, **comp))
        state = init_state(trainable, seed=0)
        extra = (state["links"],) if "links" in state else ()
        tokens = put_batch(trainable, random_batch(config(mesh), seed=5))
        fn = make_loss_and_grads(trainable)
        out, text = run_checked_text(
            trainable, lambda *a: fn(*a, step=step), state["params"], *tokens, *extra
        )
    out = jax.tree.map(np.asarray, out)
    shape = trainable.mesh.devices.shape  # members are positions in the mesh (`parallel.hlo`)
    psums = []
    for line in text.splitlines():
        if ("all-reduce(" in line or "all-reduce-start(" in line) and "shard_map/psum" in line:
            groups = [g for g in replica_groups(line) if len(g) > 1]
            stages = [{int(np.unravel_index(i, shape)[1]) for i in g} for g in groups]
            if any(len(s) > 1 for s in stages):
                psums.append(stages)
    RUNS[key] = ((*out, None) if len(out) == 2 else out), psums
    return RUNS[key]


def assert_grads_close(got, ref, rtol=1e-5):
    flat = dict(jax.tree_util.tree_leaves_with_path(got))
    for path, want in jax.tree_util.tree_leaves_with_path(ref):
        np.testing.assert_allclose(
            flat[path], want, rtol=rtol, atol=rtol * np.abs(want).max(),
            err_msg=jax.tree_util.keystr(path),
        )  # fmt: skip


def stage_leaf(grads, stage):
    """The attention QKV weight gradient of pipeline stage `stage` ([v, p, Lc, ...] layout)."""
    return grads["blocks"]["layers"]["attn"]["w_qkv"][:, stage]


@pytest.mark.parametrize("mesh", [(2, 4, 1)])  # (2, 2, 2): the CLI test in test_compression
def test_fused_embedding_sync_is_exact_and_one_all_reduce_of_first_and_last(mesh):
    (loss, grads, _), plain = run(mesh)
    (got_loss, got_grads, _), fused = run(mesh, fused_embedding_sync=True)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    assert_grads_close(got_grads, grads, rtol=1e-6)
    # exactly one cross-stage all-reduce, whose groups hold first- and last-stage devices only
    ends = {0, mesh[1] - 1}
    assert len(fused) == 1 and all(s == ends for s in fused[0]), fused
    if mesh[1] > 2:  # without it, the middle stages join the reduction
        (plain,) = plain
        assert all(s == set(range(mesh[1])) for s in plain), plain


@pytest.mark.parametrize("mesh", [(2, 2, 2), (2, 4, 1)])
def test_powersgd_at_full_rank_equals_the_plain_mean(mesh):
    (loss, grads, _), _ = run(mesh)
    (got_loss, got_grads, state), _ = run(mesh, exact=True, data_grad_rank=MODEL.hidden)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    assert_grads_close(got_grads, grads)
    qs = state["data"]["q"]
    assert set(qs) == {"attn/w_qkv", "attn/w_out", "mlp/w_in", "mlp/w_out"}  # no vectors
    for key, q in qs.items():  # Q [p, d, v, Lc, m, r] is the same on every data replica
        np.testing.assert_array_equal(q[:, 0], q[:, 1], err_msg=key)
    # the error keeps each replica's deviation from the mean: nonzero, and summing to zero
    error = state["data"]["error"]["mlp/w_in"]
    assert np.abs(error).max() > 1e-4
    np.testing.assert_allclose(error.sum(axis=1), 0, atol=1e-5)


def test_powersgd_compresses_only_stages_below_k_and_not_in_the_warm_up():
    mesh = (2, 2, 1)
    (_, grads, _), _ = run(mesh)
    (_, low, state), _ = run(mesh, data_grad_rank=2, data_grad_stages=1)
    assert not np.allclose(stage_leaf(low, 0), stage_leaf(grads, 0), rtol=1e-3)
    np.testing.assert_allclose(stage_leaf(low, 1), stage_leaf(grads, 1), rtol=1e-5, atol=1e-7)
    error = state["data"]["error"]["attn/w_qkv"]
    assert np.abs(error[0]).max() > 0 and not error[1].any()  # stage 1 keeps no error
    # during the warm-up nothing is compressed, on any stage
    comp = dict(data_grad_rank=2, warmup_steps=3)
    (_, warm, state), _ = run(mesh, step=2, **comp)
    assert_grads_close(warm, grads)
    assert not state["data"]["error"]["attn/w_qkv"].any()
    (_, after, _), _ = run(mesh, step=3, **comp)
    assert not np.allclose(stage_leaf(after, 1), stage_leaf(grads, 1), rtol=1e-3)


def test_powersgd_runs_at_ranks_on_both_sides_of_every_smaller_side():
    """(2,2,2), PowerSGD on stage 0 only: ranks around each matrix's smaller side, whole (32)
    and per tensor shard (attn/w_out's 16). Rank 32 on gpt_tiny hung this mesh: the QR's LAPACK
    call waited for threads that stage 1's devices held in a collective (`run`, as
    `tests.helpers.run_checked`, fails any step with a LAPACK call or a pipe collective in its
    tick loop). At 32 every matrix goes whole: the plain mean."""
    mesh = (2, 2, 2)
    (_, grads, _), _ = run(mesh)
    for rank in (15, 17, 32):
        (_, got, state), _ = run(mesh, data_grad_rank=rank, data_grad_stages=1)
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(got)), rank
        np.testing.assert_allclose(stage_leaf(got, 1), stage_leaf(grads, 1), rtol=1e-5, atol=1e-7)
        if rank < MODEL.hidden:
            assert set(state["data"]["q"]) == {"attn/w_qkv", "attn/w_out", "mlp/w_in", "mlp/w_out"}
        else:
            assert state is None or not state["data"]["q"]
            assert_grads_close(got, grads)


def test_a_rank_at_the_smaller_side_sends_matrices_whole():
    shapes = {"attn/w_qkv": (32, 3, 4, 8), "attn/b_qkv": (3, 4, 8), "ln1/scale": (32,),
              "attn/w_out": (4, 8, 32), "mlp/w_out": (128, 32)}  # fmt: skip
    assert powersgd.compressed_matrices(shapes, 32, 4) == {
        "attn/w_qkv": 0, "attn/w_out": 2, "mlp/w_out": 1
    }  # fmt: skip
    assert powersgd.compressed_matrices(shapes, 32, 32) == {}
    assert powersgd.matrix_shape((4, 8, 32), 2) == (32, 32)


def test_powersgd_state_survives_a_checkpoint_and_a_tensor_reshard(tmp_path):
    from jaxmeg.config import to_dict
    from jaxmeg.training.checkpoint import Checkpointer

    comp = dict(data_grad_rank=2, pipe_grad_rank=2)
    saved_on = trainable_for(config((2, 2, 2), **comp))
    state = init_state(saved_on, seed=0)
    rng = np.random.default_rng(0)
    state["links"] = jax.tree.map(
        lambda v: jax.device_put(rng.normal(size=v.shape).astype(np.float32), v.sharding),
        state["links"],
    )
    expected = jax.tree.map(np.asarray, state["links"])
    writer = Checkpointer(tmp_path, saved_on)
    writer.save(1, state, {"config": to_dict(saved_on.cfg)}, wait=True)
    writer.close()
    reader = Checkpointer(tmp_path, trainable_for(config((2, 2, 1), **comp)))
    _, restored, _ = reader.restore_latest()
    reader.close()
    restored = jax.tree.map(np.asarray, restored["links"])
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, restored, expected)
