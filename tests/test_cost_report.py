"""The cost report of the compiled step (`jaxmeg.training.cost_report`, `bench.py --cost-report`):
loops counted by their trip counts and the executor's slots by the tick table, so the matmul
FLOPs equal the model's; the pipe sends are exactly Megatron-LM's (a direction's ppermute runs
only on the pairs that carry something); scatter/gather halves them with tensor = 2; the
planner's FLOPs and per-GPU pipe bytes agree with the report."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.pipeline.executor import columns as tick_columns
from jaxmeg.pipeline.schedules import build
from jaxmeg.pipeline.tick_table import build_tick_table
from jaxmeg.training.cost_report import cost_report
from tests.helpers import trainable_for

pytestmark = pytest.mark.timeout(600)

MODEL = C.ModelConfig(
    vocab_size=512, hidden=64, layers=4, heads=4, seq_len=32, compute_dtype="float32"
)


@functools.cache
def report(mesh, schedule="1f1b", chunks=1, remat="none", microbatches=8, **parallel):
    data, pipe, tensor = mesh
    cfg = C.Config(
        model=dataclasses.replace(MODEL, remat=remat),
        parallel=C.ParallelConfig(
            data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks, **parallel
        ),
        train=C.TrainConfig(global_batch=data * microbatches, microbatches=microbatches),
    )
    return cost_report(trainable_for(cfg))


@pytest.mark.parametrize(
    "mesh,schedule,chunks",
    [((1, 4, 1), "1f1b", 1), ((1, 4, 1), "gpipe", 1), ((1, 2, 1), "breadth_first", 2),
     ((1, 1, 1), "1f1b", 1), ((2, 2, 1), "zb_h1", 1)],
)  # fmt: skip
def test_matmul_flops_equal_the_models_and_pipe_sends_megatrons(mesh, schedule, chunks):
    """(2,2,1) zb_h1: the idle tick after the table (the last chunk's mean) counts no W slot;
    its column was padded with the idle value of the table field of the same name (`w_chunk`,
    -1), and a W's GEMMs went uncounted (0.93 x the model's FLOPs)."""
    r = report(mesh, schedule, chunks)
    assert r["matmul_flops"] == pytest.approx(r["model_flops"], rel=1e-3)
    assert r["planner"]["flops"] == pytest.approx(r["matmul_flops"], rel=0.05)
    assert not r["unweighted_conditionals"], r["unweighted_conditionals"]
    if mesh[1] > 1:
        # every microbatch crosses each of the p v - 1 boundaries once each way, nothing more
        assert r["collective_bytes"]["pipe"] == pytest.approx(r["megatron_pipe_bytes"], rel=1e-6)
    else:
        assert r["collective_bytes"]["pipe"] == 0
    assert r["stored_bytes"] > 0 and r["written_bytes"] > 0
    json.dumps(r)  # the --json form


@pytest.mark.parametrize("mesh", [(1, 4, 1), (1, 4, 2)])
def test_middle_stage_links_match_the_planner(mesh):
    """A middle stage sends one activation and one cotangent per microbatch (split t ways with
    scatter/gather) and all-reduces four b s h messages per layer over `tensor`: the planner's
    per-GPU links."""
    r = report(mesh)
    planned = r["planner"]["collective_bytes_per_device"]
    middle = r["per_stage_collective_bytes"][1]
    assert middle["pipe"] == pytest.approx(planned["pipe"], rel=0.05)
    assert middle["tensor"] == pytest.approx(planned["tensor"], rel=0.05)


def test_data_reduction_matches_the_planner():
    """With one stage every gradient is reduced over `data` once per step (fp32 here; the
    planner's 2-byte wire, scaled by the report)."""
    r = report((2, 1, 2))
    planned = r["planner"]["collective_bytes_per_device"]["data"]
    assert r["per_device"]["collective_bytes"]["data"] == pytest.approx(planned, rel=0.05)


def test_scatter_gather_halves_the_pipe_bytes_with_tensor_2():
    whole = report((1, 2, 2), microbatches=4, scatter_gather=False)
    split = report((1, 2, 2), microbatches=4)  # the default with tensor > 1
    assert split["scatter_gather"] and not whole["scatter_gather"]
    assert split["collective_bytes"]["pipe"] == pytest.approx(
        whole["collective_bytes"]["pipe"] / 2, rel=1e-6
    )
    assert split["matmul_flops"] == pytest.approx(whole["matmul_flops"], rel=1e-6)
    # what the receivers gather back over `tensor`: (t - 1) / t of each message they receive
    gathered = split["collective_bytes"]["tensor"] - whole["collective_bytes"]["tensor"]
    assert gathered == pytest.approx(whole["collective_bytes"]["pipe"] / 2, rel=1e-6)


def test_sequence_parallel_sends_its_split_activation_without_another_gather():
    """With sequence parallelism the residual stream between stages is already split over
    `tensor`: the sends carry 1/t of it, as scatter/gather's do, and the executor adds no
    gather of its own (`parallel.scatter_gather` resolves to off)."""
    from jaxmeg.parallel.hlo import collectives
    from jaxmeg.training.compilation import compile_step

    whole = report((1, 2, 2), microbatches=4, scatter_gather=False)
    sp = report((1, 2, 2), microbatches=4, sequence_parallel=True)
    assert not sp["scatter_gather"]
    assert sp["collective_bytes"]["pipe"] == pytest.approx(
        whole["collective_bytes"]["pipe"] / 2, rel=1e-6
    )
    cfg = C.Config(
        model=MODEL,
        parallel=C.ParallelConfig(pipe=2, tensor=2, sequence_parallel=True),
        train=C.TrainConfig(global_batch=4, microbatches=4),
    )
    trainable = trainable_for(cfg)
    found = collectives(compile_step(trainable)[0].as_text(), trainable.mesh)
    assert not [c for c in found if c.kind == "all-gather" and "/send_" in c.op_name]


@pytest.mark.parametrize(
    "name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("breadth_first", 2)]
)
def test_send_patterns_are_the_same_on_every_stage_and_cover_exactly_the_senders(name, chunks):
    """A ppermute sits under a conditional whose index must be equal on every stage (else the
    stages that skip it deadlock the ones that run it): the index depends on the tick only,
    and its pairs are exactly the stages that send in that tick."""
    table = build_tick_table(build(name, 4, 8, chunks))
    for senders, step in (
        (tick_columns.forward_senders(table, chunks), 1),
        (tick_columns.backward_senders(table, chunks), -1),
    ):
        index, patterns = tick_columns.send_patterns(senders, step)
        assert (index == index[:, :1]).all()
        for t in range(table.num_ticks):
            pairs = set(patterns[index[t, 0] - 1]) if index[t, 0] else set()
            expected = {(s, (s + step) % 4) for s in np.flatnonzero(senders[t])}
            assert pairs == expected


@pytest.mark.parametrize(
    "name,chunks",
    [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("interleaved_zb", 2), ("zbv", 2),
     ("dualpipev", 2)],
)  # fmt: skip
def test_a_stage_receives_exactly_where_a_send_lands(name, chunks):
    """What an every-tick send (`parallel.overlap_sends`) brings where the tick's pattern sends
    nothing is left unzeroed (`slots._every_tick`), which is sound only if no receive slot
    reads it: in every tick a stage's receive slot of each way is set exactly where that way's
    pattern lands on it."""
    table = build_tick_table(build(name, 4, 8, chunks))
    cols = tick_columns.slot_columns(table, chunks)
    ways = {"send_x": "recv_act_slot", "send_cot": "recv_cot_slot"}
    if table.placement == "v":
        ways |= {"send_x_back": "recv_act_back_slot", "send_cot_back": "recv_cot_back_slot"}
    for send, slot in ways.items():
        index, patterns = cols.columns[send], cols.patterns[send]
        lands = np.zeros((table.num_ticks, 4), bool)
        for t in range(table.num_ticks):
            for _, dest in patterns[index[t, 0] - 1] if index[t, 0] else ():
                lands[t, dest] = True
        assert lands.any(), send
        np.testing.assert_array_equal(getattr(table, slot) >= 0, lands, err_msg=send)


def test_middle_stages_touch_no_shared_gradient_in_the_loop():
    """The embedding's gradient [V, h] is accumulated only where a first or last virtual stage
    produces it: on a middle stage the step's elementwise work on [V, h] arrays (the reduction
    and optimizer after the loop) does not grow with the number of microbatches, where it used
    to add a zero tree twice per tick."""
    from jaxmeg.parallel.hlo_cost import StepCost
    from jaxmeg.training.compilation import compile_step
    from jaxmeg.training.pipeline_step import make_loss_and_grads

    shape = f"f32[{MODEL.vocab_size},{MODEL.hidden}]"
    touched = {}
    for m in (4, 8):
        cfg = C.Config(
            model=MODEL,
            parallel=C.ParallelConfig(pipe=4),
            train=C.TrainConfig(global_batch=m, microbatches=m),
        )
        trainable = trainable_for(cfg)
        columns = make_loss_and_grads(trainable).program.branch_columns
        counter = StepCost(compile_step(trainable)[0].as_text(), trainable.mesh, columns)
        touched[m] = [c.elementwise_by_shape[shape] for c in counter.per_stage()]
    assert touched[4][1] == touched[8][1] and touched[4][2] == touched[8][2], touched
    assert touched[8][3] > touched[4][3], touched  # the head's gradient, once per microbatch


def test_a_residual_is_written_once_straight_into_its_ring():
    """(1,4,1) 1f1b, nothing recomputed: each stored residual is written once, by the forward,
    into its ring slot (dynamic-update-slice bytes == stored bytes): no stacked copy, no ring
    rewritten by an idle slot."""
    r = report((1, 4, 1))
    assert r["dynamic_update_slice_bytes"] == r["stored_bytes"], r
