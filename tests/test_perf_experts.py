"""The performance model of mixture-of-experts layers (`jaxmeg.perf.experts`): parameters and
active parameters against Mixtral's published counts, the experts' memory split over the expert
ranks, the all-to-all bytes of jaxmeg's padded exchange against the routed rows, and the
planner's search over `expert`. The compiled step's all-to-all bytes are checked against
`bytes_per_step` in tests/test_moe_step.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from jaxmeg import config as C
from jaxmeg.perf.experts import expert_parameters
from jaxmeg.perf.hardware import load_hardware
from jaxmeg.perf.layout import Layout, config_layout
from jaxmeg.perf.memory import memory_per_gpu
from jaxmeg.perf.model import (
    active_parameters,
    busiest_stage_layers,
    flops_per_iteration,
    layer_seconds,
    parameter_count,
    params_per_gpu,
    step_time,
)
from jaxmeg.perf.planner import plan
from jaxmeg.perf.shape import Experts, Shape, shape_of
from jaxmeg.perf.traffic import bytes_per_step
from jaxmeg.pipeline.layout import LayoutError

# Mixtral 8x7B (Jiang et al., 2024): h 4096, 32 layers, 32 heads (8 key/value), f 14336, 8
# experts, top-2; 46.7B parameters, 12.9B active. The model counts multi-head attention
# (4 h^2 per layer where grouped-query attention has 2.5 h^2): 0.8B more in both; and eq. 2's
# tied embedding with learned positions, (V + s) h, where Mixtral's is untied with rotary
# positions, (2 V) h: 0.1B fewer.
MIXTRAL = Shape(
    hidden=4096, layers=32, heads=32, kv_heads=8, seq_len=4096, vocab=32000,
    experts=Experts(count=8, top_k=2, width=14336),
)  # fmt: skip
GQA_OVERCOUNT = 32 * 1.5 * 4096**2
H100 = load_hardware("h100_dgx")


def test_mixtral_parameters_and_active_parameters_are_the_published_ones():
    assert parameter_count(MIXTRAL) - GQA_OVERCOUNT == pytest.approx(46.7e9, rel=0.01)
    assert active_parameters(MIXTRAL) - GQA_OVERCOUNT == pytest.approx(12.9e9, rel=0.015)
    dense = dataclasses.replace(MIXTRAL, experts=None)
    assert active_parameters(dense) == parameter_count(dense)


def test_flops_count_k_experts_not_all():
    """Doubling E leaves the FLOPs but the router's (2 h E per token and pass); doubling k adds
    k's experts (2 M h f per token and pass)."""
    more = dataclasses.replace(MIXTRAL, experts=dataclasses.replace(MIXTRAL.experts, count=16))
    top3 = dataclasses.replace(MIXTRAL, experts=dataclasses.replace(MIXTRAL.experts, top_k=3))
    tokens = MIXTRAL.seq_len * MIXTRAL.layers * 3  # one sequence, 3 passes without recompute
    base = flops_per_iteration(MIXTRAL, 1, recompute=False)
    assert flops_per_iteration(more, 1, False) - base == pytest.approx(tokens * 2 * 4096 * 8)
    assert flops_per_iteration(top3, 1, False) - base == pytest.approx(tokens * 6 * 4096 * 14336)


def test_experts_split_over_the_expert_ranks_and_their_states_over_data():
    one = Layout(tensor=1, pipe=4, data=16, microbatches=4, recompute="selective", zero_stage=1)
    eight = dataclasses.replace(one, data=2, expert=8)
    assert one.gpus == eight.gpus == 64 and one.global_batch == eight.global_batch
    routed = MIXTRAL.layers // 4 * expert_parameters(MIXTRAL)
    assert params_per_gpu(MIXTRAL, one) - params_per_gpu(MIXTRAL, eight) == pytest.approx(
        routed * 7 / 8
    )
    # ZeRO-1: the dense weights' fp32 states over d e = 16 GPUs either way, the experts' over
    # d = 16 without expert parallelism and over d = 2 with it (each holds 1/8 of them)
    states = {
        e: memory_per_gpu(MIXTRAL, lay, H100).model_states for e, lay in ((1, one), (8, eight))
    }
    expert_states = {1: (6 + 12 / 16) * routed, 8: (6 + 12 / 2) * routed / 8}
    assert states[1] - states[8] == pytest.approx(expert_states[1] - expert_states[8])


def test_the_exchange_sends_its_bound_of_the_routed_rows():
    """jaxmeg's dropless exchange sends (e - 1) B h per all-to-all, B the bound a balanced
    step takes (1.25 T k / e, `exchange_block`); at its largest bound (every choice to one
    GPU, B = T k) e times a ragged one's (e - 1) / e T k h; 4 all-to-alls per layer and
    microbatch (dispatch and combine and their transposes), also with a capacity factor and in
    a pipeline; 6 where the backward reruns both: a capacity factor in a pipeline, and a
    dropless exchange whose bound is past the kept one (`moe.exchange_kept_bound` 1: buffers for
    the even load only); none without expert parallelism."""
    lay = Layout(tensor=1, pipe=1, data=1, expert=8, microbatch=1, microbatches=2, recompute="none")
    bounded = bytes_per_step(MIXTRAL, lay)
    padded = bytes_per_step(MIXTRAL, dataclasses.replace(lay, expert_exchange="padded"))
    routed = bytes_per_step(MIXTRAL, dataclasses.replace(lay, expert_exchange="routed"))
    rows = MIXTRAL.seq_len * 2  # T k
    assert bounded["expert_message"] == 7 * math.ceil(1.25 * rows / 8) * 4096 * 2
    assert padded["expert_message"] == 7 * rows * 4096 * 2
    assert routed["expert_message"] == pytest.approx(7 / 8 * rows * 4096 * 2)
    assert bounded["expert"] == 4 * 32 * 2 * bounded["expert_message"]
    piped = bytes_per_step(MIXTRAL, dataclasses.replace(lay, pipe=2))
    assert piped["expert"] == 4 * 16 * 2 * piped["expert_message"]
    rerun = bytes_per_step(MIXTRAL, dataclasses.replace(lay, pipe=2, exchange_kept_bound=1.0))
    assert rerun["expert"] == 6 * 16 * 2 * rerun["expert_message"]
    capped = dataclasses.replace(
        MIXTRAL, experts=dataclasses.replace(MIXTRAL.experts, capacity_factor=1.0)
    )
    capacity = bytes_per_step(capped, lay)
    assert capacity["expert"] == 4 * 32 * 2 * capacity["expert_message"]
    capacity_piped = bytes_per_step(capped, dataclasses.replace(lay, pipe=2))
    assert capacity_piped["expert"] == 6 * 16 * 2 * capacity_piped["expert_message"]
    # kept, the residuals cost memory; rerun, time
    kept_lay = dataclasses.replace(lay, pipe=2, recompute="selective")
    rerun_lay = dataclasses.replace(kept_lay, exchange_kept_bound=1.0)
    assert (
        memory_per_gpu(MIXTRAL, kept_lay, H100).total
        > memory_per_gpu(MIXTRAL, rerun_lay, H100).total
    )
    assert step_time(MIXTRAL, kept_lay, H100).total < step_time(MIXTRAL, rerun_lay, H100).total
    assert bytes_per_step(MIXTRAL, dataclasses.replace(lay, expert=1, data=8))["expert"] == 0
    # the padding also runs through the experts' GEMMs: the larger the bound, the slower
    times = [
        step_time(MIXTRAL, dataclasses.replace(lay, expert_exchange=how), H100).total
        for how in ("padded", "bounded", "routed")
    ]
    assert times == sorted(times, reverse=True) and len(set(times)) == 3


def test_planner_searches_the_expert_axis_and_refuses_what_cannot_split():
    plans = plan(MIXTRAL, 64, 256, H100, context=1, expert_exchange="routed")
    assert {p.layout.expert for p in plans} == {1, 2, 4, 8}
    assert all(p.layout.global_batch == 256 and p.layout.gpus == 64 for p in plans)
    assert {p.layout.expert for p in plan(MIXTRAL, 64, 256, H100, context=1, expert=4)} == {4}
    with pytest.raises(ValueError, match=r"expert = 3 .* experts \(8\) must be divisible"):
        plan(MIXTRAL, 48, 48, H100, expert=3)
    with pytest.raises(ValueError, match="compression is priced for dense models"):
        plan(MIXTRAL, 64, 256, H100, compression="on")


def test_a_moe_config_is_the_shape_and_layout_the_planner_prices():
    cfg = C.load(Path(__file__).resolve().parent.parent / "configs" / "mixtral_8x7b.yaml")
    shape = shape_of(dataclasses.replace(cfg.model, vocab_size=32000), cfg.moe)
    assert shape.experts == Experts(count=8, top_k=2, width=14336, gated=True)
    assert parameter_count(shape) == pytest.approx(parameter_count(MIXTRAL))
    lay = config_layout(C.validate(cfg, 32))
    assert lay.expert == cfg.parallel.expert and lay.gpus == 32
    assert lay.global_batch == cfg.train.global_batch


def test_dense_leading_layers_count_as_dense_ones_and_stay_out_of_the_stages():
    """`moe.first_dense` layers: eq. 2's dense layer in the parameters (none of the experts),
    the dense MLP's FLOPs, and the pipe splits only the MoE layers (32 - 2 = 30 here)."""
    lead = dataclasses.replace(
        MIXTRAL, experts=dataclasses.replace(MIXTRAL.experts, dense_layers=2)
    )
    dense = dataclasses.replace(MIXTRAL, experts=None)
    share = 2 / MIXTRAL.layers  # of what the experts add over the dense model
    for count in (parameter_count, active_parameters):
        moved = share * (count(MIXTRAL) - count(dense))
        assert count(lead) == pytest.approx(count(MIXTRAL) - moved, rel=1e-12)
    extra = flops_per_iteration(MIXTRAL, 1, False) - flops_per_iteration(dense, 1, False)
    assert flops_per_iteration(lead, 1, False) == pytest.approx(
        flops_per_iteration(MIXTRAL, 1, False) - share * extra, rel=1e-12
    )
    pipes = {p.layout.pipe for p in plan(lead, 64, 256, H100, context=1, expert=8)}
    assert pipes and all(30 % p == 0 for p in pipes) and 4 not in pipes
    model = C.ModelConfig(block="llama", hidden=64, layers=5, heads=4, vocab_size=256)
    moe = C.MoeConfig(experts=4, first_dense=1, every=2)
    shape = shape_of(model, moe)
    assert (shape.experts.dense_layers, shape.experts.unit) == (1, (False, True))
    assert (shape.stacked_layers, shape.moe_layers) == (2, 2)


def test_the_first_stage_pays_for_the_dense_leading_layers():
    """The first stage runs the `moe.first_dense` layers with the embedding and its backward
    recomputes them: a forward, a forward and a backward of a dense layer each per microbatch.
    Against the same 32 MoE layers on 4 stages, two dense leading layers add that to the
    pipeline's slowest stage where it outweighs the last stage's head, and to a single stage's
    head (the cluster model adds the same to the first stage's fixed work)."""
    from jaxmeg.perf.model import layer_seconds, leading_dense_seconds, logits_seconds

    lay = Layout(tensor=1, pipe=4, data=2, expert=8, microbatches=8, recompute="selective")
    lead = dataclasses.replace(
        MIXTRAL, layers=34, experts=dataclasses.replace(MIXTRAL.experts, dense_layers=2)
    )
    assert lead.stacked_layers == MIXTRAL.stacked_layers == 32
    dense = layer_seconds(dataclasses.replace(MIXTRAL, experts=None), lay, H100)
    forward, backward = leading_dense_seconds(lead, lay, H100)
    assert forward == pytest.approx(2 * dense.forward)
    assert backward == pytest.approx(2 * (dense.forward + dense.backward))
    logits = logits_seconds(MIXTRAL, lay, H100)
    assert forward + backward > 3 * logits  # here the first stage is the slowest end
    before, after = step_time(MIXTRAL, lay, H100), step_time(lead, lay, H100)
    assert after.forward - before.forward == pytest.approx(forward - logits)
    assert after.backward - before.backward == pytest.approx(backward - 2 * logits)
    # one stage is both ends: it runs the dense layers and the head
    one = dataclasses.replace(lay, pipe=1, data=8)
    forward, backward = leading_dense_seconds(lead, one, H100)
    before, after = step_time(MIXTRAL, one, H100), step_time(lead, one, H100)
    assert after.forward - before.forward == pytest.approx(forward)
    assert after.backward - before.backward == pytest.approx(backward)


def test_moe_every_other_layer_is_priced_halfway_between_dense_and_all_moe():
    """Half the layers MoE: parameters, FLOPs, the experts' all-to-all bytes and a stage's
    layer time halfway between the dense model's and the all-MoE one's; the stages split
    groups of two layers (16 here), and the tensor traffic is every layer's, as for both."""
    halves = dataclasses.replace(MIXTRAL.experts, unit=(False, True))
    every2 = dataclasses.replace(MIXTRAL, experts=halves)
    dense = dataclasses.replace(MIXTRAL, experts=None)
    assert (every2.moe_layers, every2.stacked_layers) == (16, 16)

    def halfway(fn, *args):
        return pytest.approx((fn(MIXTRAL, *args) + fn(dense, *args)) / 2, rel=1e-9)

    for count in (parameter_count, active_parameters):
        assert count(every2) == halfway(count)
    assert flops_per_iteration(every2, 1, False) == halfway(flops_per_iteration, 1, False)
    lay = Layout(tensor=8, pipe=4, data=2, expert=2, microbatch=1, microbatches=8)
    traffic = bytes_per_step(every2, lay)
    assert traffic["expert"] == pytest.approx(bytes_per_step(MIXTRAL, lay)["expert"] / 2)
    assert traffic["tensor"] == bytes_per_step(MIXTRAL, lay)["tensor"]
    assert layer_seconds(every2, lay, H100).forward == halfway(
        lambda shape: layer_seconds(shape, lay, H100).forward
    )
    assert busiest_stage_layers(every2, lay) == 8
    with pytest.raises(LayoutError, match=r"\(16\) must be divisible by parallel.pipe"):
        step_time(every2, dataclasses.replace(lay, pipe=32), H100)
