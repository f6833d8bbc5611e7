"""`parallel.zero_stage`: what the split saves (per-device memory from `memory_analysis()`) and
the collectives that do it, read from the compiled HLO. Equivalence with one device is in
tests/test_pipeline.py (`test_sharded_optimizer_matches_single_device`) and, through the CLI with
the optimizer, in tests/test_train_cli.py."""

from __future__ import annotations

import functools
import re

import pytest

from jaxmeg import config as C
from jaxmeg.parallel import hlo_module
from jaxmeg.parallel.hlo import collectives
from jaxmeg.pipeline import schedules
from jaxmeg.pipeline.executor.columns import gather_columns
from jaxmeg.pipeline.tick_table import build_tick_table
from jaxmeg.training.pipeline_step import build_schedule
from jaxmeg.training.trainer import compile_step, memory_report
from tests.helpers import trainable_for

pytestmark = pytest.mark.timeout(300)


def gpt_tiny(mesh, zero_stage, schedule="breadth_first", chunks=4, microbatches=4):
    data, pipe, tensor = mesh
    cfg = C.load(
        "configs/gpt_tiny.yaml",
        [
            "model.vocab_size=4096",
            f"parallel.data={data}",
            f"parallel.pipe={pipe}",
            f"parallel.tensor={tensor}",
            f"parallel.schedule={schedule}",
            f"parallel.chunks={chunks}",
            f"parallel.zero_stage={zero_stage}",
            f"train.microbatches={microbatches}",
            f"train.global_batch={data * microbatches}",
        ],
    )
    return trainable_for(cfg)


@functools.cache
def compiled(mesh, zero_stage, microbatches=4):
    trainable = gpt_tiny(mesh, zero_stage, microbatches=microbatches)
    compiled_step, _ = compile_step(trainable)
    return trainable, compiled_step


def test_split_optimizer_state_cuts_argument_bytes():
    """d = 4: ZeRO-1 keeps 1/4 of the fp32 master weights and Adam moments per device (the
    arguments are the train state and the batch); ZeRO-3 holds the same state and, with the
    weights split in the loop too, needs less temporary memory than ZeRO-1."""
    reports = {z: memory_report(compiled((4, 2, 1), z)[1]) for z in (0, 1, 3)}
    args = {z: r["argument_bytes"] for z, r in reports.items()}
    assert args[1] <= 0.55 * args[0], args
    assert args[3] == args[1], args
    assert reports[3]["temp_bytes"] < reports[1]["temp_bytes"], reports


@pytest.mark.parametrize("microbatches", [4, 8])
def test_zero3_breadth_first_gathers_each_chunk_twice_per_step(microbatches):
    """ZeRO-3 + breadth_first (p = 2, v = 4): each stage all-gathers a chunk's weights once for
    its forwards and once for its backwards, 2 v = 8 gathers per step whatever m (interleaved
    1F1B switches chunk every p microbatches, so its count grows with m; m = 4 is the step the
    other tests here compile already, m = 8 a second m); the gathers and the
    gradient reduce-scatters over `data` all sit in the tick loop, none outside it (outside:
    only the embedding/head over pipe x data and the grad norm's scalars)."""
    trainable, step = compiled((4, 2, 1), 3, microbatches)
    forward, backward = gather_columns(build_tick_table(build_schedule(trainable)))
    assert (forward.sum(axis=0) + backward.sum(axis=0)).tolist() == [2 * 4, 2 * 4]
    interleaved = build_tick_table(schedules.build("interleaved_1f1b", 2, microbatches, 4))
    assert sum(c.sum() for c in gather_columns(interleaved)) == 2 * 2 * 4 * microbatches // 2

    text = step.as_text()
    loop = hlo_module.reachable(hlo_module.computations(text), hlo_module.tick_loop_body(text))
    data_only = [c for c in collectives(text, trainable.mesh) if c.axes == {"data"}]
    in_loop = [c for c in data_only if c.computation in loop]
    outside = [c for c in data_only if c.computation not in loop]
    assert {c.kind for c in in_loop} >= {"all-gather", "reduce-scatter"}
    assert not [c for c in outside if c.kind in ("all-gather", "reduce-scatter")], outside
    assert all(c.bytes < 1024 for c in outside), outside  # the grad norm's partial sums


def test_zero3_slots_take_weights_gathered_in_an_earlier_tick(monkeypatch, unordered_ticks):
    """ZeRO-3 gathers ahead: a slot whose chunk changes takes the weights from its second
    buffer (the `f_gather` / `b_gather` loops), which then all-gathers the chunk it takes next
    (the `f_fetch` / `b_fetch` loops, over `data`); no slot of the tick waits for that. In the
    program a GPU runs: CPU ticks run their loops one after another (`slots.ordered_tick`),
    which this compile switches off (and with it the check that then names the pairs)."""
    from jaxmeg.training import compilation

    monkeypatch.setattr(compilation, "check_hazards", lambda *args, **kwargs: None)
    trainable, step = compiled.__wrapped__((4, 2, 1), 3)  # traced here, not the cached one
    text = step.as_text()
    comps = hlo_module.computations(text)
    body = comps[hlo_module.tick_loop_body(text)]
    loops = hlo_module.slot_loops(body)
    found = collectives(text, trainable.mesh)
    slot_scopes = {"f": ("f_first", "f_middle", "f_last"), "b": ("b_middle", "b_first")}
    for slot, scopes in slot_scopes.items():
        fetch = loops[f"{slot}_fetch"]
        inside = hlo_module.reachable(comps, re.search(r"\bbody=%?([\w.\-]+)", fetch).group(1))
        assert [c for c in found if c.computation in inside and c.kind == "all-gather"]
        for scope in scopes:
            reads = hlo_module.upstream(body, loops[scope])
            assert hlo_module.defined(loops[f"{slot}_gather"]) in reads, scope
            assert hlo_module.defined(fetch) not in reads, scope


def test_zero1_gathers_the_weights_before_the_loop_and_scatters_gradients_in_it():
    trainable, step = compiled((4, 2, 1), 1)
    text = step.as_text()
    loop = hlo_module.reachable(hlo_module.computations(text), hlo_module.tick_loop_body(text))
    data_only = [c for c in collectives(text, trainable.mesh) if c.axes == {"data"}]
    gathers = [c for c in data_only if c.kind == "all-gather"]
    scatters = [c for c in data_only if c.kind == "reduce-scatter"]
    assert gathers and not [c for c in gathers if c.computation in loop]
    assert scatters and all(c.computation in loop for c in scatters)
    # Each in-loop reduce-scatter leaves one chunk's gradient shard: the four chunks' shards
    # are the quarter (d = 4) of the layer weights that the gathers before the loop rebuild.
    layer_gathers = sum(c.bytes for c in gathers if c.bytes >= 2048)
    assert 4 * sum(c.bytes for c in scatters) == pytest.approx(layer_gathers / 4, rel=0.05)


def test_the_data_group_moves_a_tensor_ranks_block_not_the_whole_leaf():
    """With `tensor` > 1 each reduce-scatter and all-gather over the data group runs on a
    device's block of the automatic axes that split the leaf (`gradients.on_blocks`): before,
    XLA all-gathered each leaf over `tensor`, reduce-scattered (or gathered) the whole leaf and
    sliced its block back out. ZeRO-3 on (2,2,2): no all-gather over `tensor` but the ones the
    step has without a sharded optimizer, and the reduce-scatters over `data` carry half (d = 2)
    of what the unsharded step all-reduces over `data`."""

    def by_kind(zero_stage):
        trainable, step = compiled((2, 2, 2), zero_stage)
        totals = {}
        for c in collectives(step.as_text(), trainable.mesh):
            key = (c.kind, tuple(sorted(c.axes)))
            totals[key] = totals.get(key, 0) + c.bytes
        return totals

    plain, split = by_kind(0), by_kind(3)
    assert split[("all-gather", ("tensor",))] == plain[("all-gather", ("tensor",))]
    scattered = plain[("all-reduce", ("data",))] - split[("all-reduce", ("data",))]
    assert 2 * split[("reduce-scatter", ("data",))] == pytest.approx(scattered, rel=0.01)
