"""Compressed backward pipeline links (Optimus-CC): the low-rank step and lazy error propagation
in fp64, the executor with compression equal to without at full rank (loss and every gradient),
the bytes the backward ppermute carries in the compiled HLO, and the links' state across a
checkpoint and a reshard."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel.hlo import collectives
from jaxmeg.pipeline import compression
from jaxmeg.training import links
from jaxmeg.training.pipeline_step import build_schedule, make_loss_and_grads
from jaxmeg.training.state import init_state, initial_link_state
from jaxmeg.training.trainer import compile_step
from tests.helpers import put_batch, random_batch, trainable_for
from tests.test_train_cli import single_device_losses  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(300)

MODEL = C.ModelConfig(
    vocab_size=500, hidden=32, layers=4, heads=4, seq_len=8, compute_dtype="float32"
)
ROWS, COLS = 8, 32  # a cotangent [b = 1, s = 8, h = 32] as a matrix


def config(mesh, rank=0, schedule="1f1b", chunks=1, **comp) -> C.Config:
    data, pipe, tensor = mesh
    return C.Config(
        model=MODEL,
        parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor, schedule=schedule,
                                  chunks=chunks),
        train=C.TrainConfig(global_batch=data * pipe * 2, microbatch_size=1),
        compression=C.CompressionConfig(pipe_grad_rank=rank, **comp),
    )  # fmt: skip


def test_lazy_error_propagation_telescopes_in_fp64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        grads = [jnp.asarray(rng.normal(size=(12, 20))) for _ in range(8)]
        error = e0 = jnp.asarray(rng.normal(size=(12, 20)) * 0.1)
        q = jnp.asarray(rng.normal(size=(20, 3)))
        received = jnp.zeros((12, 20))
        for g in grads:
            p, q, error = compression.compress_with_feedback(g, error, q)
            received = received + compression.rebuild(p, q)
        assert received.dtype == jnp.float64
        np.testing.assert_allclose(received, sum(grads) + e0 - error, rtol=0, atol=1e-12)
        assert float(jnp.abs(error).max()) > 1e-3  # rank 3 of 12 x 20 really loses something


def test_a_rank_at_or_above_the_matrix_rank_rebuilds_it_exactly():
    rng = np.random.default_rng(1)
    m = jnp.asarray(rng.normal(size=(16, 2)) @ rng.normal(size=(2, 24)), jnp.float32)  # rank 2
    p, q = compression.power_step(m, jnp.asarray(rng.normal(size=(24, 3)), jnp.float32))
    np.testing.assert_allclose(compression.rebuild(p, q), m, atol=1e-5)
    assert compression.worth_compressing(3, 16, 24) and not compression.worth_compressing(
        16, 16, 24
    )


def loss_grads_links(cfg, tokens):
    trainable = trainable_for(cfg)
    state = init_state(trainable, seed=0)
    extra = (state["links"],) if "links" in state else ()
    with jax.set_mesh(trainable.mesh):
        out = jax.jit(make_loss_and_grads(trainable))(
            state["params"], *put_batch(trainable, tokens), *extra
        )
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 4, 1)])
@pytest.mark.parametrize(
    "comp",
    [dict(pipe_error_feedback="lazy"),
     dict(pipe_error_feedback="none", pipe_grad_phase="epilogue")],
    ids=["lazy-all", "none-epilogue"],
)  # fmt: skip
def test_compressed_links_at_full_rank_equal_uncompressed(mesh, comp, monkeypatch):
    tokens = random_batch(config(mesh), seed=3)
    loss, grads = loss_grads_links(config(mesh), tokens)
    # Run the factor path at rank = the matrix's smaller side, where it is exact in exact
    # arithmetic (a rank that high normally sends the matrix whole).
    monkeypatch.setattr(compression, "worth_compressing", lambda rank, rows, cols: rank > 0)
    got_loss, got_grads, state = loss_grads_links(config(mesh, rank=ROWS, **comp), tokens)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
    for path, ref in jax.tree_util.tree_leaves_with_path(grads):
        got = dict(jax.tree_util.tree_leaves_with_path(got_grads))[path]
        np.testing.assert_allclose(
            got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=jax.tree_util.keystr(path)
        )
    if "error" in state:
        assert np.abs(state["error"]).max() < 1e-5 * max(
            np.abs(g).max() for g in jax.tree.leaves(grads)
        )


def test_low_rank_links_change_the_gradients_and_keep_state():
    mesh = (1, 4, 1)
    tokens = random_batch(config(mesh), seed=3)
    _, grads = loss_grads_links(config(mesh), tokens)
    _, got, state = loss_grads_links(config(mesh, rank=1), tokens)
    first = np.asarray(jax.tree.leaves(grads["blocks"])[0])
    assert not np.allclose(np.asarray(jax.tree.leaves(got["blocks"])[0]), first, rtol=1e-3)
    assert state["q"].shape == (4, 1, 1, COLS, 1) and state["error"].shape == (4, 1, 1, ROWS, COLS)
    assert np.abs(state["error"][1:]).max() > 0  # stages 1..3 send backward
    assert not state["error"][0].any()  # stage 0 sends nothing


def pipe_permute_bytes(cfg) -> dict[str, set[int]]:
    """Bytes of the pipe collective-permutes by the send they belong to (`send_x`: the
    activations; `send_cot`, `send_whole`, `send_factors`: the cotangents). A send is one
    ppermute per distinct set of sending pairs, so each kind may appear several times."""
    trainable = trainable_for(cfg)
    text = compile_step(trainable)[0].as_text()
    found = collectives(text, trainable.mesh)
    sends: dict[str, set[int]] = {}
    for c in found:
        if c.kind == "collective-permute" and c.axes == {"pipe"}:
            kind = re.search(r"/(send_\w+)/", c.op_name).group(1)
            sends.setdefault(kind, set()).add(c.bytes)
    return sends


def test_hlo_backward_ppermute_bytes_drop_by_the_element_ratio():
    mesh, rank = (1, 4, 1), 2
    whole = ROWS * COLS * 4
    plain = pipe_permute_bytes(config(mesh))
    assert plain == {"send_x": {whole}, "send_cot": {whole}}  # activations, cotangents
    compressed = pipe_permute_bytes(config(mesh, rank=rank))
    factors = rank * (ROWS + COLS) * 4
    # only the forward activations go whole; the cotangents as P [b s, r] and Q [h, r]
    assert compressed == {"send_x": {whole}, "send_factors": {rank * ROWS * 4, rank * COLS * 4}}
    assert whole / factors == ROWS * COLS / (rank * (ROWS + COLS))
    # epilogue: the backward link keeps a whole send for the steady state, besides the factors
    epilogue = pipe_permute_bytes(config(mesh, rank=rank, pipe_grad_phase="epilogue"))
    assert epilogue == {
        "send_x": {whole},
        "send_whole": {whole},
        "send_factors": compressed["send_factors"],
    }
    # a rank at or above min(b s, h) sends the matrix whole: no factors anywhere
    assert pipe_permute_bytes(config(mesh, rank=ROWS)) == plain


def test_epilogue_column_marks_p_minus_s_minus_1_sends_per_link():
    cfg = C.validate(config((1, 4, 1), rank=2, pipe_grad_phase="epilogue"), 4)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=8))
    from jaxmeg.pipeline.tick_table import build_tick_table

    table = build_tick_table(links.build_schedule(cfg, 4))
    pc = links.pipe_compression(cfg, table)
    per_sender = pc.compress.sum(axis=0)
    assert per_sender.tolist() == [0, 3, 2, 1]  # sender s + 1 -> s: p - s - 1
    every = links.pipe_compression(
        dataclasses.replace(
            cfg, compression=dataclasses.replace(cfg.compression, pipe_grad_phase="all")
        ),
        table,
    )
    assert ((every.compress & (table.b_mb >= 0)).sum(axis=0)[1:] == 8).all()  # fmt: skip
    assert build_schedule  # the executor's schedule and this one come from the same place


def test_link_state_survives_a_checkpoint_and_a_reshard(tmp_path, capsys):
    from jaxmeg.config import to_dict
    from jaxmeg.training.checkpoint import Checkpointer

    saved_on = trainable_for(config((1, 2, 2), rank=2))
    state = init_state(saved_on, seed=0)
    rng = np.random.default_rng(0)
    state["links"] = {
        k: jax.device_put(rng.normal(size=v.shape).astype(np.float32), v.sharding)
        for k, v in state["links"].items()
    }
    expected = jax.tree.map(np.asarray, state["links"])
    writer = Checkpointer(tmp_path, saved_on)
    writer.save(1, state, {"config": to_dict(saved_on.cfg)}, wait=True)
    writer.close()
    for mesh in [(1, 2, 2), (1, 2, 1)]:  # the same links on another tensor size
        reader = Checkpointer(tmp_path, trainable_for(config(mesh, rank=2)))
        _, restored, _ = reader.restore_latest()
        reader.close()
        for key, value in expected.items():
            np.testing.assert_array_equal(np.asarray(restored["links"][key]), value, err_msg=key)
    other = trainable_for(config((1, 4, 1), rank=2))  # other links: they start afresh
    reader = Checkpointer(tmp_path, other)
    _, restored, _ = reader.restore_latest()
    reader.close()
    assert "compressed pipeline links start afresh" in capsys.readouterr().err
    assert not np.asarray(restored["links"]["error"]).any()
    fresh = initial_link_state(other)
    np.testing.assert_array_equal(np.asarray(restored["links"]["q"]), np.asarray(fresh["q"]))


def test_cli_trains_with_compressed_links_like_the_baseline(
    tmp_path,
    small_corpus,
    single_device_losses,  # noqa: F811
):
    from tests.test_train_cli import train

    sets = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
            "compression.pipe_grad_rank=4", "compression.pipe_grad_phase=epilogue",
            "compression.pipe_error_feedback=lazy", "compression.fused_embedding_sync=true",
            "compression.data_grad_rank=4", "compression.data_grad_stages=1"]  # fmt: skip
    records = train(
        ["--cpu-devices", "8", *[a for s in sets for a in ("--set", s)], "--steps", "5",
         *small_corpus], tmp_path, "compressed",
    )  # fmt: skip
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.1, losses
    np.testing.assert_allclose(losses, single_device_losses, rtol=2e-2)
