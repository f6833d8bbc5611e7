"""What the executor's tick loop executes, read from the compiled HLO: no copy of a gradient
accumulator, no divide of one (the data mean's divide runs after the loop), a backward branch
without forward matmuls when residuals are stored, one ppermute pair per tick without the
ring-wrap send when v = 1, what overlapped sends bring not zeroed; and the pullback split that
keeps weights out of the residual rings."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel import hlo_module
from jaxmeg.parallel.hlo import collectives, replica_groups
from jaxmeg.pipeline.executor import residuals
from jaxmeg.training.pipeline_step import stage_functions
from jaxmeg.training.state import abstract_state
from jaxmeg.training.trainer import compile_step
from tests.helpers import trainable_for

pytestmark = pytest.mark.timeout(300)

# One layer per chunk on four stages (compile time grows with the layers a chunk unrolls); the
# split backward's batching over a chunk's layers is read at two per chunk.
MODEL = C.ModelConfig(
    vocab_size=500, hidden=32, layers=4, heads=4, seq_len=8, compute_dtype="float32"
)


def config(mesh, schedule="1f1b", chunks=1, remat="none", microbatches_per_stage=2, layers=None):
    data, pipe, tensor = mesh
    return C.Config(
        model=dataclasses.replace(MODEL, remat=remat, layers=layers or MODEL.layers),
        parallel=C.ParallelConfig(
            data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks
        ),
        train=C.TrainConfig(global_batch=data * pipe * microbatches_per_stage, microbatch_size=1),
    )


@functools.cache
def compiled_module(mesh, schedule="1f1b", chunks=1, remat="none", layers=None, **parallel):
    cfg = config(mesh, schedule, chunks, remat, layers=layers)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))
    trainable = trainable_for(cfg)
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


def test_data_mean_runs_beside_the_slots(monkeypatch, unordered_ticks):
    """data = 2: a chunk's gradient mean over `data` (an all-reduce in the `reduce_chunk` loop,
    the tick after the chunk's last backward) neither waits for that tick's slots nor holds
    them up; `reduce_write` puts it back after the B slot. In the program a GPU runs: on CPU
    devices a tick's loops run one after another (`slots.ordered_tick`), which this compile
    switches off (and with it the check that then names the pair)."""
    from jaxmeg.training import compilation

    monkeypatch.setattr(compilation, "check_hazards", lambda *args, **kwargs: None)
    trainable, text, comps, name = compiled_module((2, 1, 2))
    body = comps[name]
    loops = hlo_module.slot_loops(body)
    mean = loops["reduce_chunk"]
    inside = hlo_module.reachable(comps, re.search(r"\bbody=%?([\w.\-]+)", mean).group(1))
    found = collectives(text, trainable.mesh)
    assert [c for c in found if c.computation in inside and c.axes == {"data"}]
    for scope in ("f_embed", "b_whole"):
        slot = loops[scope]
        assert hlo_module.defined(slot) not in hlo_module.upstream(body, mean)
        assert hlo_module.defined(mean) not in hlo_module.upstream(body, slot)
    write = hlo_module.upstream(body, loops["reduce_write"])
    assert {hlo_module.defined(mean), hlo_module.defined(loops["b_whole"])} <= write


def test_data_reduction_in_the_loop_divides_nothing():
    """data = 2: the tick loop's reductions over `data` sum; the divide into the mean runs once
    after the loop, where the update reads the gradients (`Plan.sums_in_loop`): no divide of an
    accumulator's shape anywhere in the loop (XLA writes a divide by 2 as a multiply: the ops
    are found by jax's name for them, `div`; the update's own divides are after the loop)."""
    trainable, _, comps, body = compiled_module((2, 1, 2))
    stage = accumulator_shapes(trainable)  # [v, Lc, ...]; a chunk's [Lc, ...] with v = 1
    shapes = stage | {re.sub(r"^f32\[1,", "f32[", shape) for shape in stage}
    inside = divides(comps, hlo_module.reachable(comps, body))
    assert divides(comps, comps) & shapes  # the update's: the check below has something to match
    assert not inside & shapes, inside & shapes


def divides(comps, names) -> set[str]:
    """Result shapes of the instructions jax's `div` became in computations `names`."""
    return {
        hlo_module.result_shape(line)
        for c in names
        for line in comps[c]
        if re.search(r'op_name="[^"]*/div"', line)
    }


def slot_matmuls(comps, body) -> dict[str, int]:
    """Dot counts of each slot of the tick loop (its 0-or-1-trip loops, by name scope)."""
    return {
        scope: hlo_module.count_ops(comps, re.search(r"\bbody=%?([\w.\-]+)", line).group(1), "dot")
        for scope, line in hlo_module.slot_loops(comps[body]).items()
    }


def test_split_backward_slots_share_the_backward_matmuls_and_w_sends_nothing():
    """zb_h1, stored residuals: I holds the B slot's matmuls (twice the F slot's) less the
    weight gradients, which W holds (one dot per weight and layer, each adding into its layer's
    accumulator: `jaxmeg.pipeline.accumulator`; one per weight, batched over the layers, when the
    accumulator was stacked); W's loop holds no collective, so it waits for nothing and holds up
    no other stage."""
    layers = 2 * MODEL.layers
    trainable, text, comps, body = compiled_module((1, 4, 1), "zb_h1", layers=layers)
    dots = slot_matmuls(comps, body)
    weight_matmuls = 4 * (layers // 4)  # QKV, attention out, fc1, fc2 per layer
    assert dots["i_middle"] == dots["i_first"] == 2 * dots["f_middle"] - weight_matmuls, dots
    assert dots["w_chunk"] == weight_matmuls, dots  # one per weight and layer
    w_loop = hlo_module.slot_loops(comps[body])["w_chunk"]
    inside = hlo_module.reachable(comps, re.search(r"\bbody=%?([\w.\-]+)", w_loop).group(1))
    assert not [c for c in collectives(text, trainable.mesh) if c.computation in inside]


def test_backward_slot_runs_only_the_backward_matmuls():
    """Stored residuals (`model.remat=none`): the B slot of a chunk holds exactly twice the
    F slot's chunk matmuls (input and weight gradient of each), no forward; the last stage's F
    slot the head's three besides (logits, their input and weight gradients). With
    `overlap_sends` (GPUs) the last stage runs each microbatch's F and B in its B slot at once
    (`B_LAST`): the chunk's forward and backward and the head's three; its F slot nothing.
    With `full` the B slot holds three times the F slot's, less one: the recomputed forward,
    once; and the last stage's F and B stay apart (one `jax.vjp` would keep every layer's
    activations)."""
    _, _, comps, body = compiled_module((1, 4, 1), remat="none")
    dots = slot_matmuls(comps, body)
    assert dots["f_middle"] > 0 and dots["f_first"] == dots["f_middle"]
    assert dots["b_middle"] == dots["b_first"] == 2 * dots["f_middle"]
    assert dots["f_last"] == dots["f_middle"] + 3 and "b_last" not in dots, dots
    _, _, comps, body = compiled_module((1, 4, 1), remat="none", overlap_sends=True)
    at_once = slot_matmuls(comps, body)
    assert at_once["b_last"] == dots["f_middle"] + dots["b_middle"] + 3, at_once
    assert "f_last" not in at_once, at_once

    _, _, comps, body = compiled_module((1, 4, 1), remat="full", overlap_sends=True)
    full = slot_matmuls(comps, body)
    assert full["f_middle"] == dots["f_middle"]
    assert full["f_last"] == dots["f_middle"] + 3 and "b_last" not in full, full
    # the recomputed forward, less the last layer's fc2, whose output nothing reads
    assert full["b_middle"] == 3 * dots["f_middle"] - 1


def pipe_pairs(trainable, line) -> list[tuple[int, int]]:
    """(source stage, target stage) of each pair of a collective-permute."""
    ids = [d.id for d in trainable.mesh.devices.flat]
    pipe_of = {
        device: np.unravel_index(i, trainable.mesh.devices.shape)[1] for i, device in enumerate(ids)
    }
    return [(int(pipe_of[a]), int(pipe_of[b])) for a, b in replica_groups(line)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_ppermutes_go_one_stage_on_and_wrap_only_with_chunks(chunks):
    """Every ppermute the tick runs (one per distinct set of sending pairs, under the send
    switches) moves activations s -> s + 1 and cotangents s -> s - 1; the ring wrap (p - 1 -> 0
    forward, 0 -> p - 1 backward) only with chunks."""
    schedule = "interleaved_1f1b" if chunks > 1 else "1f1b"
    trainable, _, comps, body = compiled_module((1, 2, 2), schedule, chunks)
    sent = {"send_x": set(), "send_cot": set()}
    for name in hlo_module.reachable(comps, body):
        for line in hlo_module.ops(comps[name], "collective-permute"):
            kind = re.search(r'op_name="[^"]*/(send_\w+)/', line).group(1)
            sent[kind] |= set(pipe_pairs(trainable, line))
    if chunks == 1:
        assert sent == {"send_x": {(0, 1)}, "send_cot": {(1, 0)}}
    else:  # p = 2: the wrap's pairs are the other direction's
        assert sent == {"send_x": {(0, 1), (1, 0)}, "send_cot": {(1, 0), (0, 1)}}


def zeroed_arrivals(cfg: C.Config) -> set[str]:
    """The pipe sends (their name scopes) whose arrivals a select zeroes in `cfg`'s compiled
    step, and "ppermute" where it has one at all (the check has something to find)."""
    text = compile_step(trainable_for(cfg))[0].as_text()
    found = set(re.findall(r'op_name="[^"]*/(send_\w+)/select_n"', text))
    return found | ({"ppermute"} if re.search(r"collective-permute(-start)?\(", text) else set())


def test_overlapped_sends_leave_what_arrives_unzeroed():
    """`overlap_sends`: each tick's one ppermute per direction reaches `receive` as it arrived
    (zeroing where the tick's pattern sends nothing was an elementwise pass over every message
    in every tick); a compressed link, whose receiver adds its two parts, still zeroes them."""
    cfg = config((1, 2, 1))
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, overlap_sends=True))
    assert zeroed_arrivals(cfg) == {"ppermute"}
    compressed = dataclasses.replace(cfg, compression=C.CompressionConfig(pipe_grad_rank=2))
    assert {"ppermute", "send_whole", "send_factors"} <= zeroed_arrivals(compressed)


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
