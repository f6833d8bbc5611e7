"""Checkpoints are canonical: a run on one layout saves arrays that a run on any other layout
reads bit for bit (params and optimizer state), and its next step equals the source's. Dense:
meshes, ZeRO stages and vocabulary padding. A mixture of experts: a matrix over the axes in
pairs, not their product (expert, data, pipe, tensor, ZeRO, schedules with one and two chunks
per stage, V placements, uneven stages). Context parallelism: tests/test_context_parallel.py
(a context-4 run resumed at context 1 and 2); compression state: tests/test_compression.py and
tests/test_data_compression.py."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.training.checkpoint import Checkpointer
from jaxmeg.training.state import NO_VOCAB_DIM, init_state, to_canonical_layout, vocab_dims
from jaxmeg.training.step import make_train_step
from tests.helpers import put_batch, random_batch, tiny_config, trainable_for

pytestmark = pytest.mark.timeout(600)


def reshard_config(data, pipe, tensor, schedule="1f1b", chunks=1, zero_stage=0):
    cfg = tiny_config(
        data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks, zero_stage=zero_stage
    )
    model = dataclasses.replace(cfg.model, vocab_size=1024, layers=4, heads=8)
    return dataclasses.replace(
        cfg, model=model, train=C.TrainConfig(global_batch=16, microbatch_size=1)
    )


def one_step(trainable, state, tokens):
    with jax.set_mesh(trainable.mesh):
        state, metrics = make_train_step(trainable)(state, *put_batch(trainable, tokens))
    canonical = to_canonical_layout(state["params"], trainable.layout)
    return float(metrics["loss"]), jax.tree.map(np.asarray, canonical)


def train_one_step_and_save(source, directory, meta):
    """Init, one train step, a checkpoint of step 1; returns (state, tokens, host canonical)."""
    tokens = random_batch(source.cfg)
    with jax.set_mesh(source.mesh):
        state = init_state(source, seed=0)
        state, _ = make_train_step(source)(state, *put_batch(source, tokens))
    saved = jax.tree.map(np.asarray, to_canonical_layout(state, source.layout))
    writer = Checkpointer(directory, source)
    writer.save(1, state, meta, wait=True)
    writer.close()
    return state, tokens, saved


def padded_vocab_config(data, pipe, tensor, schedule="1f1b", chunks=1, zero_stage=0):
    """V = 500 pads to 512 rows at tensor <= 4 and to 1024 at tensor = 8; untied, so both the
    embedding rows and the unembedding columns change."""
    cfg = reshard_config(data, pipe, tensor, schedule, chunks, zero_stage)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=500, tie_embeddings=False)
    )


def real_rows(leaf: np.ndarray, dim: int) -> np.ndarray:
    """A leaf's 500 real vocabulary rows (columns) along its vocabulary dim, or the whole leaf."""
    return leaf if dim == NO_VOCAB_DIM else np.take(leaf, range(500), dim)


def assert_restored_exactly(target, restored, saved) -> None:
    """Every restored leaf (params and optimizer state) equals the saved one bit for bit in
    its real vocabulary rows, and the padding rows of `target`'s vocabulary are zeros."""
    got = jax.tree.map(np.asarray, to_canonical_layout(restored, target.layout))
    flat_saved = jax.tree_util.tree_leaves_with_path(saved)
    dims = jax.tree.leaves(vocab_dims(target))
    assert len(jax.tree.leaves(got)) == len(flat_saved) == len(dims)
    for (path, b), a, dim in zip(flat_saved, jax.tree.leaves(got), dims, strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(real_rows(a, dim), real_rows(b, dim), err_msg=name)
        if dim != NO_VOCAB_DIM:
            assert not np.take(a, range(500, target.vocab), dim).any(), name


def assert_next_step_equal(target, params, ref_params) -> None:
    """The params after the next step equal the source's in their real vocabulary rows, to
    float32 round-off (1e-5 absolute; the AdamW update itself is lr-sized)."""
    dims = jax.tree.leaves(vocab_dims(target)["params"])
    for a, b, dim in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), dims, strict=True):
        np.testing.assert_allclose(real_rows(a, dim), real_rows(b, dim), rtol=0, atol=1e-5)


def restore_step_1(directory, target):
    """The latest checkpoint in `directory` read for `target`: step 1's state."""
    reader = Checkpointer(directory, target)
    step, restored, _ = reader.restore_latest()
    reader.close()
    assert step == 1
    return restored


def assert_resharded(directory, target, tokens, saved, reference) -> None:
    """Step 1's checkpoint restored on `target` equals `saved` (`assert_restored_exactly`),
    and one more step from it equals the source's next step, `reference` (loss, params):
    float32, the loss to 1e-5 relative, the params to 1e-5 absolute (the AdamW update itself is
    lr-sized, so this is far below one step's change)."""
    restored = restore_step_1(directory, target)
    assert_restored_exactly(target, restored, saved)
    loss, params = one_step(target, restored, tokens)
    np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
    assert_next_step_equal(target, params, reference[1])


def test_checkpoint_reshards_to_any_mesh_zero_stage_and_vocab_padding(tmp_path):
    """A ZeRO-3 interleaved (2, 2, 2) run's checkpoint is canonical: runs on other meshes, with
    ZeRO-1 or none, read the same arrays bit for bit, and their next step equals the source's.
    The checkpoint holds the 500 real vocabulary rows; a reader pads them with zeros, to 512
    rows at tensor 2 and to 1024 on (1, 1, 8) (params and Adam moments, embedding rows and
    unembedding columns)."""
    source = trainable_for(padded_vocab_config(2, 2, 2, "interleaved_1f1b", 2, zero_stage=3))
    state, tokens, saved = train_one_step_and_save(
        source, tmp_path, {"config": C.to_dict(source.cfg)}
    )
    ref_loss, ref_params = one_step(source, state, tokens)

    for mesh, zero_stage in [((4, 1, 2), 1), ((1, 4, 2), 0), ((1, 1, 8), 0)]:
        target = trainable_for(padded_vocab_config(*mesh, zero_stage=zero_stage))
        assert (source.vocab, target.vocab) == (512, 1024 if mesh[2] == 8 else 512)
        assert_resharded(tmp_path, target, tokens, saved, (ref_loss, ref_params))


# A mixture of experts: 4 layers of 4 experts (top-2, a shared expert with its gate), dropless.
MOE_LAYOUTS = {
    # name: (data, pipe, tensor, expert, schedule, chunks, zero_stage, other parallel fields)
    "d2e2p2-dualpipev-zero1": (2, 2, 1, 2, "dualpipev", 2, 1, {}),
    "one-device": (1, 1, 1, 1, "1f1b", 1, 0, {}),
    "d2p2t2-interleaved-zero3": (2, 2, 2, 1, "interleaved_1f1b", 2, 3, {}),
    "e2p2t2-zbv": (1, 2, 2, 2, "zbv", 2, 0, {}),
    "e2p4-zb_h1": (1, 4, 1, 2, "zb_h1", 1, 0, {}),
    "e4p2-uneven-3-1": (1, 2, 1, 4, "1f1b", 1, 0, {"stage_layers": (3, 1)}),
}
"""Every axis in two or more layouts and every pair of them somewhere; the first is the source."""


def moe_config(name: str) -> C.Config:
    data, pipe, tensor, expert, schedule, chunks, zero_stage, more = MOE_LAYOUTS[name]
    cfg = tiny_config(
        data=data, pipe=pipe, tensor=tensor, expert=expert, schedule=schedule, chunks=chunks,
        zero_stage=zero_stage, **more,
    )  # fmt: skip
    model = dataclasses.replace(
        cfg.model, block="llama", hidden=32, heads=4, layers=4, tie_embeddings=False
    )
    moe = C.MoeConfig(
        experts=4, top_k=2, ffn_hidden=16, shared_experts=1, shared_gate=True, aux_loss=0.01
    )
    train = C.TrainConfig(global_batch=16, microbatches=4)
    return dataclasses.replace(cfg, model=model, moe=moe, train=train)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    """The source run: one step on d2e2p2 dualpipev with ZeRO-1, saved; its next step."""
    directory = tmp_path_factory.mktemp("moe-reshard")
    source = trainable_for(moe_config(next(iter(MOE_LAYOUTS))))
    state, tokens, saved = train_one_step_and_save(
        source, directory, {"config": C.to_dict(source.cfg)}
    )
    return directory, tokens, saved, one_step(source, state, tokens)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS)[1:])
def test_a_moe_checkpoint_reshards_over_every_axis(name, moe_source):
    """The d2e2p2 dualpipev ZeRO-1 checkpoint restored on each other layout: params and AdamW
    moments bit-identical (the checkpoint is canonical: whole experts, whole layers in model
    order, unpadded), and the next step's loss and params equal the source's next step within
    float32 round-off (the reductions' order differs between layouts: 1e-5)."""
    directory, tokens, saved, reference = moe_source
    assert_resharded(directory, target=trainable_for(moe_config(name)), tokens=tokens,
                     saved=saved, reference=reference)  # fmt: skip
