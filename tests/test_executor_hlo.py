"""What the executor's tick loop executes, read from the compiled HLO: no copy of a gradient
accumulator, a backward branch without forward matmuls when residuals are stored, one ppermute
pair per tick without the ring-wrap send when v = 1; and the pullback split that keeps weights
out of the residual rings."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel import hlo_module
from jaxmeg.parallel.hlo import replica_groups
from jaxmeg.pipeline import residuals
from jaxmeg.training.pipeline_step import stage_functions
from jaxmeg.training.state import abstract_state
from jaxmeg.training.trainer import compile_step
from tests.helpers import trainable_for

pytestmark = pytest.mark.timeout(300)

MODEL = C.ModelConfig(
    vocab_size=500, hidden=32, layers=8, heads=4, seq_len=8, compute_dtype="float32"
)


def config(mesh, schedule="1f1b", chunks=1, remat="none", microbatches_per_stage=2):
    data, pipe, tensor = mesh
    return C.Config(
        model=dataclasses.replace(MODEL, remat=remat),
        parallel=C.ParallelConfig(
            data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks
        ),
        train=C.TrainConfig(global_batch=data * pipe * microbatches_per_stage, microbatch_size=1),
    )


@functools.cache
def compiled_module(mesh, schedule="1f1b", chunks=1, remat="none"):
    trainable = trainable_for(config(mesh, schedule, chunks, remat))
    text = compile_step(trainable)[0].as_text()
    return trainable, text, hlo_module.computations(text), hlo_module.tick_loop_body(text)


def accumulator_shapes(trainable) -> set[str]:
    """Per-device f32 shapes of the gradient accumulators: each param's shard, the stage
    layers' [v, 1, Lc, ...] seen as [v, Lc, ...] inside the loop."""
    params = abstract_state(trainable)["params"]
    shapes = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        shard = list(leaf.sharding.shard_shape(leaf.shape))
        if any(getattr(k, "key", None) == "blocks" for k in path):
            del shard[1]
        shapes.add("f32[" + ",".join(map(str, shard)) + "]")
    return shapes


@pytest.mark.parametrize(
    "mesh,schedule,chunks",
    [((1, 4, 2), "1f1b", 1), ((1, 2, 2), "interleaved_1f1b", 2), ((2, 1, 2), "1f1b", 1)],
)
def test_tick_loop_copies_no_gradient_accumulator(mesh, schedule, chunks):
    trainable, _, comps, body = compiled_module(mesh, schedule, chunks)
    copies = hlo_module.ops(comps[body], "copy")
    # the 0-or-1-trip slot loops copy their int32 trip counters; nothing else bigger
    arrays = [line for line in copies if not hlo_module.result_shape(line).startswith("s32[]")]
    assert len(arrays) <= 2, arrays
    shapes = accumulator_shapes(trainable)
    assert len(shapes) >= 5  # the check below has something to match
    copied = {hlo_module.result_shape(line) for line in copies}
    assert not copied & shapes, copied & shapes


def branch_matmuls(comps, body) -> list[list[int]]:
    """Dot counts of each branch of each conditional at the top of the tick loop, in order."""
    return [
        [hlo_module.count_ops(comps, branch, "dot") for branch in hlo_module.branches(line)]
        for line in hlo_module.ops(comps[body], "conditional")
    ]


def test_backward_branch_runs_only_the_backward_matmuls():
    """Stored residuals (`model.remat=none`): the B slot's chunk branch holds exactly twice the
    F slot's chunk matmuls (input and weight gradient of each), no forward. With `full` it holds
    three times as many: the recomputed forward, once."""
    _, _, comps, body = compiled_module((1, 4, 1), remat="none")
    (f_idle, f_first, f_middle, f_last), (b_idle, b_middle, b_first) = branch_matmuls(comps, body)
    assert f_idle == b_idle == 0
    assert f_middle > 0 and f_first == f_middle and f_last > f_middle  # + head forward/backward
    assert b_middle == b_first == 2 * f_middle

    _, _, comps, body = compiled_module((1, 4, 1), remat="full")
    (_, _, f_middle_full, _), (_, b_middle_full, _) = branch_matmuls(comps, body)
    assert f_middle_full == f_middle
    assert b_middle_full == 3 * f_middle


def pipe_pairs(trainable, line) -> list[tuple[int, int]]:
    """(source stage, target stage) of each pair of a collective-permute."""
    ids = [d.id for d in trainable.mesh.devices.flat]
    pipe_of = {
        device: np.unravel_index(i, trainable.mesh.devices.shape)[1] for i, device in enumerate(ids)
    }
    return [(int(pipe_of[a]), int(pipe_of[b])) for a, b in replica_groups(line)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_one_ppermute_pair_per_tick_and_no_ring_wrap_without_chunks(chunks):
    schedule = "interleaved_1f1b" if chunks > 1 else "1f1b"
    trainable, _, comps, body = compiled_module((1, 2, 2), schedule, chunks)
    permutes = hlo_module.ops(comps[body], "collective-permute")
    assert len(permutes) == 2, permutes
    pairs = {pair for line in permutes for pair in pipe_pairs(trainable, line)}
    wrap = {(1, 0), (0, 1)}  # p = 2: forward 0->1 and backward 1->0 are also the wrap's pairs
    if chunks == 1:
        # forward 0 -> 1 in one permute, backward 1 -> 0 in the other; no p-1 -> 0 forward.
        forward, backward = (set(pipe_pairs(trainable, line)) for line in permutes)
        assert forward == {(0, 1)} and backward == {(1, 0)}
    else:
        assert pairs == wrap
        assert all(len(set(pipe_pairs(trainable, line))) == 2 for line in permutes)


def test_pipe1_has_no_pipe_collectives():
    _, text, comps, body = compiled_module((2, 1, 2))
    assert not hlo_module.ops(comps[body], "collective-permute")
    assert not re.search(r"collective-permute(-start)?\(", text)


@pytest.mark.parametrize("remat", ["none", "selective"])
def test_pullback_split_keeps_weights_out_of_the_rings(remat):
    """The chunk's pullback holds its weights as the parameter tracers themselves (kept out of
    the rings); no stored residual has the shape of a parameter (e.g. a bf16 weight copy that
    would be stored once per microbatch). A JAX upgrade that changes this fails here."""
    cfg = config((1, 2, 1), remat=remat)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype="bfloat16"))
    trainable = trainable_for(cfg)
    fns = stage_functions(trainable)
    layers = abstract_state(trainable)["params"]["blocks"]["layers"]
    chunk_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), layers)
    x = jax.ShapeDtypeStruct((1, MODEL.seq_len, MODEL.hidden), np.dtype("bfloat16"))
    found = []

    def probe(params, x):
        split = residuals.trace_split(lambda p, x_: fns.chunk(p, x_, 0), params, x)
        found.append(split)
        return x

    with jax.set_mesh(trainable.mesh):
        jax.eval_shape(probe, chunk_params, x)
    (split,) = found
    kinds = [kind for kind, _ in split.sources]
    assert kinds.count(residuals.PARAM) >= 4  # the four weight matrices at least
    assert split.stored
    param_shapes = {tuple(a.shape) for a in jax.tree.leaves(chunk_params)}
    stored_shapes = {tuple(a.shape) for a in split.stored}
    assert not stored_shapes & param_shapes, stored_shapes & param_shapes
