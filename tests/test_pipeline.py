"""The pipeline executor == the unpipelined model on one device (loss AND every gradient), for
every schedule on meshes that mix pipe with tensor and data, pipe = 1 included; bf16, every
`model.remat`, an untied head, sequence parallelism and uneven stages; memory flat in m for 1F1B.

The reference is `jaxmeg.training.reference`: plain `jax.value_and_grad` of the model per
microbatch on one device, which shares no code with the executor."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.models import gpt
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.reference import make_plain_loss_and_grads
from jaxmeg.training.state import (
    init_state,
    state_shardings,
    to_canonical_layout,
    to_stage_layout,
)
from jaxmeg.training.step import make_train_step
from jaxmeg.training.trainer import compile_step, memory_report
from tests.helpers import put_batch, random_batch, run_checked, trainable_for

pytestmark = pytest.mark.timeout(300)  # a deadlocked pipe collective aborts, never hangs

MODEL = C.ModelConfig(
    vocab_size=500, hidden=32, layers=8, heads=4, seq_len=8, compute_dtype="float32"
)
TOL = 1e-5  # fp32; relative, plus TOL x the largest entry of each gradient near zero
# bf16 compute: the reference rounds the same values in another order (whole batch at once, no
# pipeline); measured differences reach 1.4% of a gradient's largest entry.
BF16_TOL = 3e-2


# The schedule matrix, one case per behaviour: gpipe (which keeps every microbatch, the same
# rule on any mesh) on the 3D mesh, pipe-only in MORE_CASES (uneven-gpipe-full-p4, m = 4p);
# 1f1b with tensor 4 inside a stage and on the 3D mesh at m = 4p (again with Megatron's warm-up
# in EXTRA_CASES), pipe-only in MORE_CASES (uneven stages: m = p on pipe 4, 2p on pipe 2);
# interleaving at v = 4 on pipe 2 (m = 4p) and at v = 2 on the 3D mesh (m = p), beside tensor 2
# on pipe 4 in EXTRA_CASES (v = 3) and with tensor 4 in MORE_CASES (sequence parallelism).
# Data 2 x pipe 4 runs in the breadth-first and sharded-optimizer cases.
CASES = [
    pytest.param(
        mesh,
        schedule,
        chunks,
        factor,
        id="d{}p{}t{}-{}-v{}-m{}p".format(*mesh, schedule, chunks, factor),
    )
    for mesh, schedule, chunks, factor in [
        ((2, 2, 2), "gpipe", 1, 1),
        ((1, 2, 4), "1f1b", 1, 4),
        ((2, 2, 2), "1f1b", 1, 4),
        ((1, 2, 1), "interleaved_1f1b", 4, 4),
        ((2, 2, 2), "interleaved_1f1b", 2, 1),
    ]
]


def fewest_layers(pipe: int, chunks: int, stage_layers=None) -> int:
    """The case's layer count: what its stage_layers sum to, else one layer per chunk of every
    stage and at least 4 (compile time grows with the layers a chunk unrolls)."""
    return sum(stage_layers) if stage_layers else max(4, pipe * chunks)


def config(
    data, pipe, tensor, schedule="1f1b", chunks=1, microbatches=1, layers=None, model=None,
    microbatch_size=1, **parallel,
):  # fmt: skip
    model = model or MODEL
    layers = layers or fewest_layers(pipe, chunks, parallel.get("stage_layers"))
    return C.Config(
        model=dataclasses.replace(model, layers=layers),
        parallel=C.ParallelConfig(
            data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks, **parallel
        ),
        train=C.TrainConfig(
            global_batch=data * microbatches * microbatch_size, microbatch_size=microbatch_size
        ),
    )


@functools.cache
def reference(global_batch: int, layers: int = MODEL.layers, model: C.ModelConfig = MODEL):
    """Loss and gradients of the unpipelined model on one device, at the same init, canonical.
    (One microbatch: the mean over equal microbatches of their mean losses is the batch mean.)"""
    cfg = dataclasses.replace(
        config(1, 1, 1, layers=layers, model=model), train=C.TrainConfig(global_batch=global_batch)
    )
    trainable = trainable_for(cfg)
    tokens = random_batch(trainable.cfg)
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        loss, grads = jax.jit(make_plain_loss_and_grads(trainable))(
            params, *put_batch(trainable, tokens)
        )
    to_host = functools.partial(jax.tree.map, np.asarray)
    canonical = functools.partial(to_canonical_layout, layout=trainable.layout)
    return tokens, canonical(to_host(params)), float(loss), canonical(to_host(grads))


# Megatron's own 1F1B warm-up (the trainer defaults to min_bubble), and v = 3.
EXTRA_CASES = [
    pytest.param((2, 2, 2), "1f1b", 1, 4, "min_memory", id="d2p2t2-1f1b-min_memory-m4p"),
    pytest.param((1, 4, 2), "interleaved_1f1b", 3, 2, "min_bubble", id="d1p4t2-v3-m2p"),
]


# Layered gradient accumulation: v = L / p (modular pipeline, layer l on stage l mod p) on pipe
# 2 (on the 3D mesh with ZeRO-3 in ZERO_CASES) at m = 2p, v = 2 on data 2 x pipe 4 at m = 2p
# and on pipe 4 at m < p (breadth-first-m-below-p in MORE_CASES).
BREADTH_FIRST_CASES = [
    pytest.param(mesh, "breadth_first", v, factor, id="d{}p{}t{}-breadth_first-v{}-m{}p".format(
        *mesh, v, factor))
    for mesh, v, factor in [
        ((1, 2, 1), 4, 2), ((2, 4, 1), 2, 2),
    ]
]  # fmt: skip


@pytest.mark.parametrize("mesh,schedule,chunks,factor", CASES + BREADTH_FIRST_CASES)
def test_pipeline_matches_single_device(mesh, schedule, chunks, factor):
    check_against_single_device(mesh, schedule, chunks, factor)


@pytest.mark.parametrize("mesh,schedule,chunks,factor,warmup", EXTRA_CASES)
def test_pipeline_matches_single_device_more_orders(mesh, schedule, chunks, factor, warmup):
    check_against_single_device(mesh, schedule, chunks, factor, warmup)


def check_against_single_device(
    mesh, schedule, chunks, factor, warmup="min_bubble", layers=None, model=MODEL,
    tol=TOL, microbatch_size=1, **parallel,
):  # fmt: skip
    data, pipe, tensor = mesh
    layers = layers or fewest_layers(pipe, chunks, parallel.get("stage_layers"))
    microbatches = int(factor * pipe)
    cfg = config(
        data, pipe, tensor, schedule, chunks, microbatches, layers, model, microbatch_size,
        pipeline_warmup=warmup, **parallel,
    )  # fmt: skip
    trainable = trainable_for(cfg)
    tokens, ref_params, ref_loss, ref_grads = reference(
        data * microbatches * microbatch_size, layers, model
    )
    # The same initial params, in this run's stage layout and sharded for this mesh.
    params = jax.device_put(
        to_stage_layout(ref_params, trainable.layout), state_shardings(trainable)["params"]
    )
    loss, grads = run_checked(
        trainable, make_loss_and_grads(trainable), params, *put_batch(trainable, tokens)
    )
    grads = jax.tree.map(np.asarray, grads)
    assert_padding_is_zero(trainable, grads)
    grads = to_canonical_layout(grads, trainable.layout)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=tol)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    for (path, ref), got in zip(flat_ref, flat, strict=True):
        assert got.shape == ref.shape, jax.tree_util.keystr(path)
        atol = tol * float(np.abs(ref).max())
        np.testing.assert_allclose(
            got, ref, rtol=tol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def assert_padding_is_zero(trainable, tree) -> None:
    """Every padding slot of every layer leaf of `tree` (run layout) is exactly zero."""
    padding = trainable.layout.layer_index == -1  # [v, p, Lc]
    for leaf in jax.tree.leaves(tree["blocks"]):
        np.testing.assert_array_equal(np.asarray(leaf)[padding], 0)


BF16 = dataclasses.replace(MODEL, compute_dtype="bfloat16")
LLAMA = dataclasses.replace(MODEL, block="llama", tie_embeddings=False)
# Cases beyond the schedule matrix: the pipe = 1 path, bf16, every remat, an untied head,
# sequence parallelism, uneven stages. (mesh, schedule, v, m/p, model, tol, parallel overrides)
MORE_CASES = {
    "pipe1-d2t2-full": ((2, 1, 2), "1f1b", 1, 2, dataclasses.replace(MODEL, remat="full"), TOL, {}),
    "bf16-d2p2t2-v2-selective": (
        (2, 2, 2), "interleaved_1f1b", 2, 1, dataclasses.replace(BF16, remat="selective"),
        BF16_TOL, {},
    ),
    "llama-untied-selective-p2t2": (
        (1, 2, 2), "1f1b", 1, 2, dataclasses.replace(LLAMA, remat="selective"), TOL, {},
    ),
    # microbatches of 4 rows: the residual stream split over tensor on its rows (one each)
    "gpt-sequence-parallel-p2t4-v2": (
        (1, 2, 4), "interleaved_1f1b", 2, 1, MODEL, TOL,
        {"sequence_parallel": True, "microbatch_size": 4},
    ),
    # five layer slots: a scan whose padding slots a conditional skips (four or fewer unroll)
    "uneven-5-1-p2": ((1, 2, 1), "1f1b", 1, 2, MODEL, TOL, {"stage_layers": (5, 1)}),
    "uneven-1-3-2-2-p4": ((1, 4, 1), "1f1b", 1, 1, MODEL, TOL, {"stage_layers": (1, 3, 2, 2)}),
    "uneven-zero1-d2p2t2": (
        (2, 2, 2), "1f1b", 1, 1, MODEL, TOL, {"stage_layers": (3, 1), "zero_stage": 1},
    ),
    "zero3-full-d2p2t2-v2": (
        (2, 2, 2), "interleaved_1f1b", 2, 1, dataclasses.replace(MODEL, remat="full"), TOL,
        {"zero_stage": 3},
    ),
    "zero3-selective-d2p2": (
        (2, 2, 1), "breadth_first", 2, 1, dataclasses.replace(MODEL, remat="selective"), TOL,
        {"zero_stage": 3},
    ),
    "zero3-llama-untied-d2p2t2": ((2, 2, 2), "1f1b", 1, 1, LLAMA, TOL, {"zero_stage": 3}),
    "breadth-first-m-below-p": ((1, 4, 1), "breadth_first", 2, 0.5, MODEL, TOL, {}),
    # every-tick sends and late cotangents (a GPU's default): split sends over tensor 2; with
    # chunks of 2+ layers a chunk's last B reduces its layers but the first over data, that
    # one beside a later B slot (v 2) or alone in the next tick (1f1b), or in the whole
    # model's last B (pipe 1)
    "overlap-sends-d2p2t2-v2": (
        (2, 2, 2), "interleaved_1f1b", 2, 1, MODEL, TOL, {"overlap_sends": True, "layers": 8},
    ),
    "overlap-sends-d2p2-1f1b": ((2, 2, 1), "1f1b", 1, 2, MODEL, TOL, {"overlap_sends": True}),
    "overlap-sends-pipe1-d2t2": ((2, 1, 2), "1f1b", 1, 2, MODEL, TOL, {"overlap_sends": True}),
    # a sharded optimizer's reduce-scatter layer by layer in the last B slot
    "overlap-sends-zero1-d2p2": (
        (2, 2, 1), "1f1b", 1, 2, MODEL, TOL, {"overlap_sends": True, "zero_stage": 1},
    ),
    "overlap-sends-zero3-d2p2t2": (
        (2, 2, 2), "1f1b", 1, 2, MODEL, TOL, {"overlap_sends": True, "zero_stage": 3},
    ),
    "uneven-gpipe-full-p4": (
        (1, 4, 1), "gpipe", 1, 4, dataclasses.replace(MODEL, remat="full"), TOL,
        {"stage_layers": (3, 1, 2, 2)},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", MORE_CASES)
def test_more_layouts_match_single_device(case):
    mesh, schedule, chunks, factor, model, tol, parallel = MORE_CASES[case]
    check_against_single_device(mesh, schedule, chunks, factor, model=model, tol=tol, **parallel)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_per_part_accumulators_match_single_device(zero_stage, monkeypatch):
    """q, k, v from their own GEMMs, as beside cuDNN's attention: per-layer accumulators keep
    each part's weight gradient on its own (`accumulator.Parts`, split over tensor with the
    weight), through a chunk's last B reducing its second layer over data (a mean, or a sharded
    optimizer's reduce-scatter) and its first layer's mean in the next tick."""
    monkeypatch.setattr(gpt, "qkv_in_parts", lambda cfg: True)
    check_against_single_device(
        (2, 2, 2), "1f1b", 1, 2, layers=4, overlap_sends=True, zero_stage=zero_stage
    )


# Sharded optimizer: each schedule with each ZeRO stage once, over (2,2,2), (2,4,1) and, with
# one stage, (4,1,2); MORE_CASES hold 1f1b with ZeRO-1 on (2,2,2) (uneven-zero1-d2p2t2) and with
# ZeRO-3 (zero3-llama-untied-d2p2t2), interleaving with ZeRO-3 (zero3-full-d2p2t2-v2), and
# breadth-first ZeRO-3 with selective remat.
ZERO_CASES = [
    pytest.param(mesh, schedule, chunks, zero_stage, id="d{}p{}t{}-{}-v{}-zero{}".format(
        *mesh, schedule, chunks, zero_stage))
    for mesh, schedule, chunks, zero_stage in [
        ((2, 4, 1), "interleaved_1f1b", 2, 1),
        ((2, 2, 2), "breadth_first", 4, 3), ((2, 4, 1), "breadth_first", 2, 1),
        ((4, 1, 2), "1f1b", 1, 1), ((4, 1, 2), "breadth_first", 1, 3),
    ]
]  # fmt: skip


@pytest.mark.parametrize("mesh,schedule,chunks,zero_stage", ZERO_CASES)
def test_sharded_optimizer_matches_single_device(mesh, schedule, chunks, zero_stage):
    """Params arrive split over the data group (ZeRO-3) or whole (ZeRO-1); the gradients come
    back reduce-scattered, in the state's split: put together, they equal one device's."""
    check_against_single_device(mesh, schedule, chunks, 2, zero_stage=zero_stage)


def test_padding_layers_are_never_updated():
    """Uneven stages: after two AdamW steps every padding slot of the params and of the
    optimizer state is still exactly zero (zero gradients, zero moments, zero decay)."""
    trainable = trainable_for(config(1, 2, 1, microbatches=4, stage_layers=(1, 3)))
    step = make_train_step(trainable)
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, seed=0)
        for seed in range(2):
            state, metrics = step(state, *put_batch(trainable, random_batch(trainable.cfg, seed)))
            assert np.isfinite(float(metrics["loss"]))
    assert_padding_is_zero(trainable, state["params"])
    param_like = [
        tree
        for tree in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, dict))
        if isinstance(tree, dict) and "blocks" in tree
    ]
    assert len(param_like) == 2  # Adam's two moments
    for moments in param_like:
        assert_padding_is_zero(trainable, moments)


# Longer sequences for the memory checks, so a stored stage input (b s h fp32 = 32 KiB) is
# large against the bookkeeping around it.
MEMORY_MODEL = dataclasses.replace(MODEL, seq_len=256)
STAGE_INPUT_BYTES = 1 * 256 * 32 * 4


@functools.cache  # the remat cases of the two tests below share their m = p steps
def temp_bytes(schedule: str, chunks: int, microbatches: int, pipe: int = 4, remat="none") -> int:
    cfg = config(1, pipe, 1, schedule, chunks, microbatches)
    model = dataclasses.replace(MEMORY_MODEL, remat=remat)
    compiled, _ = compile_step(trainable_for(dataclasses.replace(cfg, model=model)))
    return memory_report(compiled)["temp_bytes"]


@pytest.mark.parametrize(
    "schedule,chunks,remat",
    [("1f1b", 1, "none"), ("1f1b", 1, "full"), ("interleaved_1f1b", 2, "none")],
)  # fmt: skip
def test_memory_flat_in_microbatches(schedule, chunks, remat):
    """The rings hold a bounded number of microbatches whatever m: with every residual stored
    (`none`; `selective` stores a subset of them in the same rings) and with only stage inputs
    (`full`), and with chunks."""
    p = 4
    small = temp_bytes(schedule, chunks, p, remat=remat)
    large = temp_bytes(schedule, chunks, 4 * p, remat=remat)
    assert large <= 1.05 * small, (small, large)
    # What grows is only the step's own token ids (m x b x s int32), not a stored stage input.
    assert large - small < STAGE_INPUT_BYTES, (small, large)


def test_stored_residuals_follow_remat():
    """The rings hold what the policy says: `none` keeps the matmul outputs of every in-flight
    microbatch, the attention scores (a s^2 b per layer) included, far more than `selective`
    (no attention scores) or `full` (only stage inputs, plus one chunk's residuals while the B
    slot recomputes it). Which of those two is larger depends on the shape: at s = 256, h = 32
    one chunk's attention scores outweigh the selective rings."""
    none, selective, full = (
        temp_bytes("1f1b", 1, 4, remat=r) for r in ("none", "selective", "full")
    )
    assert none > 2 * max(selective, full), (none, selective, full)


def test_gpipe_memory_grows_with_microbatches():
    p = 4
    small, large = temp_bytes("gpipe", 1, p), temp_bytes("gpipe", 1, 4 * p)
    # GPipe keeps every microbatch's stage input until its backward: 3p more of them.
    assert large - small >= 3 * p * STAGE_INPUT_BYTES, (small, large)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "breadth_first"])
def test_layer_gradients_are_reduced_inside_the_tick_loop_once_per_chunk(schedule):
    """Manual `data`: each chunk's layer gradients are reduced over `data` inside the tick loop,
    in the tick of the chunk's last backward (one chunk's bytes per reduction, v per stage and
    step: the `reduce_chunk` column), never per microbatch; after the loop only the shared
    gradients and the loss, in one all-reduce over pipe x data. Nothing grows with m."""
    from jaxmeg.parallel import hlo_module
    from jaxmeg.parallel.hlo import collectives
    from jaxmeg.pipeline.executor.columns import final_backward_chunks
    from jaxmeg.pipeline.tick_table import build_tick_table
    from jaxmeg.training.pipeline_step import build_schedule
    from jaxmeg.training.state import abstract_state

    def data_collectives(microbatches):
        trainable = trainable_for(config(2, 2, 2, schedule, 2, microbatches))
        text = compile_step(trainable)[0].as_text()
        found = collectives(text, trainable.mesh)
        (entry,) = re.findall(r"^ENTRY %?([\w.\-]+)", text, re.MULTILINE)
        loop = hlo_module.reachable(hlo_module.computations(text), hlo_module.tick_loop_body(text))
        in_loop = [c for c in found if "data" in c.axes and c.computation in loop]
        after = [c for c in found if "data" in c.axes and c.computation == entry]
        assert len(in_loop) + len(after) == len([c for c in found if "data" in c.axes])
        final = final_backward_chunks(build_tick_table(build_schedule(trainable)))
        for stage in range(2):  # each chunk's gradients become final exactly once per stage
            assert sorted(final[:, stage][final[:, stage] >= 0].tolist()) == [0, 1]
        layers = abstract_state(trainable)["params"]["blocks"]["layers"]
        chunk_bytes = sum(
            int(np.prod(a.sharding.shard_shape(a.shape))) * 4 // 2 for a in jax.tree.leaves(layers)
        )
        return in_loop, after, chunk_bytes

    for microbatches in (2, 8):
        in_loop, after, chunk_bytes = data_collectives(microbatches)
        assert in_loop and all(c.axes == {"data"} for c in in_loop)
        assert sum(c.bytes for c in in_loop) == chunk_bytes
        assert [c.axes for c in after] == [{"data", "pipe"}]
