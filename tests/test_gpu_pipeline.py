"""The pipeline's schedules compiled for H100s without a GPU: pipe sends, in-loop data
reductions, zero-bubble against 1F1B, uneven stages and the sharded optimizer's collectives,
read from the compiled program by the cost report. Helpers and the plugin check:
tests/test_gpu_target.py."""

from __future__ import annotations

import dataclasses

import pytest
import test_gpu_target
from test_gpu_target import (
    assert_bounds_read_off_the_kernel_classes,
    assert_cudnn_once_per_layer_and_microbatch,
    assert_qkv_input_gradients_add_in_their_gemms,
    assert_weight_gradients_accumulate_in_their_gemms,
    gpu_config,
    report_for,
)

pytestmark = getattr(test_gpu_target, "pytestmark", [])


def eight_gpus():
    """(2,2,2) 1f1b with selective recompute: the slots hold tensor all-reduces, and cuDNN's
    kept output and statistics cross ticks in the pipeline's residual rings. Four layers: two
    per stage, so that a stage's last B slot has a layer's mean to run beside the other's
    backward."""
    cfg = gpu_config(data=2, pipe=2, tensor=2, microbatches=4, remat="selective", layers=4)
    return report_for(cfg)


def four_stages(schedule: str, chunks: int = 1) -> dict:
    """(1, 4, 1), 4 microbatches, one layer per chunk, and what every such report shows: each
    tick's sends leave outside any conditional (`parallel.overlap_sends`, on for GPUs): F's
    output travels beside the B slot (I and W with zb_h1), B's cotangent beside the next tick's
    F (inside a conditional, overlap_sends false, no send overlaps anything); each stage idles
    in some ticks (4 microbatches on 4 stages), so the bubble costs time."""
    cfg = gpu_config(pipe=4, microbatches=4, layers=4 * chunks)
    parallel = dataclasses.replace(cfg.parallel, schedule=schedule, chunks=chunks)
    trainable, report = report_for(dataclasses.replace(cfg, parallel=parallel))
    assert report["collective_overlap"]["pipe"] == 1.0, report["collective_overlap"]
    assert_bounds_read_off_the_kernel_classes(report)
    assert report["schedule_bound_seconds"] > 1.1 * report["roofline_seconds"], report
    if chunks == 1:  # one chunk per stage: per-layer accumulators
        assert_weight_gradients_accumulate_in_their_gemms(trainable, report)
        assert_qkv_input_gradients_add_in_their_gemms(trainable, report)
    return report


def test_every_pipe_send_overlaps_a_gemm_on_four_h100_interleaved():
    four_stages("interleaved_1f1b", chunks=2)


def test_uneven_stages_run_cudnn_unrolled_and_skip_their_padding_on_two_h100():
    """stage_layers (2, 1): a shorter stage's padding slot is a conditional in the unrolled
    chunk (`layout.PADDING_SLOT`), so uneven stages keep cuDNN attention (before: XLA's
    attention in a scan of conditionals, gpt_1.3b (2,2,2) [13, 11] 2.2x the roofline of the
    even split); the report counts each stage's real layers only (cuDNN once per layer and
    microbatch), and the stage with more layers is the busiest. zb_h1 on the same layout runs
    1F1B's GEMMs: its W slot skips the padding slot as F and I do."""
    cfg = gpu_config(pipe=2, layers=3, parallel={"stage_layers": (2, 1)})
    trainable, report = report_for(cfg)
    assert trainable.model_cfg.attention == "cudnn"
    assert_cudnn_once_per_layer_and_microbatch(trainable, report)
    assert not report["unweighted_conditionals"], report["unweighted_conditionals"]
    assert report["roofline_stage"] == 0
    # zb_h1's W skips the padding slot too (it ran X^T dY of the zeros the slot keeps): its
    # GEMMs are 1F1B's, each padding conditional weighed per stage
    zb = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, schedule="zb_h1"))
    _, zb_report = report_for(zb)
    assert not zb_report["unweighted_conditionals"], zb_report["unweighted_conditionals"]
    assert zb_report["gemm_flops"] == report["gemm_flops"], (zb_report["gemm_flops"], report)


def test_zb_h1_fills_the_bubble_1f1b_leaves_on_four_h100():
    """Zero-bubble fills the bubble: its W slots run where 1F1B's stages idle, so its step bound
    is a smaller multiple of its kernels' roofline, and here below 1F1B's. Its kernels cost
    more than 1F1B's (1.23x, then 1.13x: W copies X and dY out of their ring slots for cuBLAS,
    docs/schedules.md); it holds no more (0.97x since a microbatch's residuals and then its dY
    share the slot it holds from F to W, `executor.pool`). When 1F1B's last stage ran each
    microbatch's F and B at once (`B_LAST`: nothing it keeps crosses a ring), zb_h1's roofline
    went to 1.21x 1F1B's and its bound to 1.01x; since its own last stage keeps what its F
    keeps for its I in one buffer (`I_LAST`, `Carry.last_kept`), and its I, not its F, writes
    the matmul inputs into their ring (`Plan.x_after_i`), they are 1.16x and 0.978x
    (temporaries 0.95x; gpt_1.3b (1,4,1): 1.13x and 0.999x, docs/benchmarks.md). The planner's
    step for the same layouts (the report's `planner_step_seconds`) ranks them the same way
    (0.87x)."""
    one_f_one_b, zb_h1 = four_stages("1f1b"), four_stages("zb_h1")

    def bubble(r):
        return r["schedule_bound_seconds"] / r["roofline_seconds"]

    assert bubble(zb_h1) < 0.85 * bubble(one_f_one_b), (bubble(zb_h1), bubble(one_f_one_b))
    assert zb_h1["schedule_bound_seconds"] < one_f_one_b["schedule_bound_seconds"]
    assert zb_h1["roofline_seconds"] <= 1.2 * one_f_one_b["roofline_seconds"]
    assert zb_h1["temp_bytes"] <= one_f_one_b["temp_bytes"]
    assert zb_h1["planner_step_seconds"] < one_f_one_b["planner_step_seconds"]


def test_dualpipev_with_data_and_tensor_compiles_on_eight_h100():
    """(2,2,2) DualPipeV: with its pipe sends as send and recv, XLA 0.10.2's latency-hiding
    scheduler could not place the tick loop ("kExceedsOverlapLimit") and the compile failed;
    they stay collective-permutes there (`pipeline_step.sends_point_to_point`)."""
    from jaxmeg.training.pipeline_step import make_loss_and_grads, sends_point_to_point

    cfg = gpu_config(data=2, pipe=2, tensor=2, microbatches=4, layers=4,
                     parallel={"schedule": "dualpipev", "chunks": 2})  # fmt: skip
    trainable, report = report_for(cfg)
    assert not sends_point_to_point(trainable, make_loss_and_grads(trainable).program)
    sent = report["collective_bytes"]
    assert sent["pipe"] > 0 and sent["data"] > 0 and sent["tensor"] > 0, sent


def test_pipe_sends_and_data_means_beside_tensor_parallel_slots_overlap_a_gemm_on_8_h100():
    """(2,2,2) 1f1b: the slots hold tensor all-reduces, which share the collective stream with
    a collective-permute, so no pipe send could stay in flight across one (0% before). As a
    send and a recv (`gpu_target.POINT_TO_POINT_OPTIONS`) each does; the compile says so. A
    stage's last B slot reduces its second layer over `data` beside the first's backward:
    half of the in-loop data bytes overlap a GEMM (0% before, when the whole mean ran in the
    tick after). The other half, each stage's first layer, runs in the tick after, beside the
    other stage's last backward (stage 1; the bubble) or after the table (stage 0). The same
    program runs cuDNN once per layer and microbatch, its output kept across ticks."""
    from jaxmeg.training import pipeline_step

    trainable, report = eight_gpus()
    assert_cudnn_once_per_layer_and_microbatch(trainable, report)
    assert pipeline_step.sends_point_to_point(trainable)
    assert report["collective_bytes"]["pipe"] > 0
    overlap = report["collective_overlap"]
    assert overlap["pipe"] == 1.0, overlap
    assert overlap["data"] == 0.5, overlap
    assert_bounds_read_off_the_kernel_classes(report)


def test_a_sharded_optimizer_moves_no_whole_accumulator_on_eight_h100():
    """(2,2,2) ZeRO-1: copy kernels at most 2% of the kernel bytes (6.1% before: the split dim
    of fc2 and the attention's out-projection, behind their tensor-split dim, made XLA lay the
    whole accumulator out with it major and transpose it into and out of every B slot's loop;
    `jaxmeg.parallel.zero` now splits a leaf's first own dim or its layer slots). That the data
    group moves a tensor rank's block: tests/test_sharded_optimizer.py."""
    cfg = gpu_config(data=2, pipe=2, tensor=2, microbatches=4, remat="selective", layers=4)
    zero = dataclasses.replace(cfg.parallel, zero_stage=1)
    _, report = report_for(dataclasses.replace(cfg, parallel=zero))
    assert_bounds_read_off_the_kernel_classes(report)


@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("zb_h1", 0), ("1f1b", 1)])
def test_data_reductions_in_the_last_slots_leave_pipe_sends_overlapped_on_four_h100(schedule, zero):
    """(2,2,1), two layers per stage: each stage's last B slot (last W with zb_h1) reduces its
    second layer over `data` beside the first's backward (its dW): half of the data bytes
    overlap a GEMM (0% before); with ZeRO-1 the reduce-scatters likewise, but for the leaves
    the optimizer splits along the layers (the fc1 bias here), scattered whole after the slot.
    Those collectives in the slot's loop kept F's collective-permute from staying in flight
    across it (1f1b: 79% of pipe bytes overlapped); sent as a send and a recv, as beside tensor
    all-reduces (`pipeline_step.sends_point_to_point`), every pipe byte overlaps a GEMM."""
    from jaxmeg.training import pipeline_step
    from jaxmeg.training.pipeline_step import make_loss_and_grads

    cfg = gpu_config(data=2, pipe=2, microbatches=4, layers=4)
    parallel = dataclasses.replace(cfg.parallel, schedule=schedule, zero_stage=zero)
    trainable, report = report_for(dataclasses.replace(cfg, parallel=parallel))
    assert pipeline_step.sends_point_to_point(trainable, make_loss_and_grads(trainable).program)
    overlap = report["collective_overlap"]
    assert overlap["pipe"] == 1.0, overlap
    assert overlap["data"] == pytest.approx(0.5, abs=0.001), overlap


def test_a_data_mean_due_beside_a_backward_overlaps_it_on_four_h100():
    """(2,2,1) interleaved, v = 2: chunk 1's mean is due while chunk 0's backwards still run,
    and goes in one loop with that tick's B slot (`reduce_beside_b`), which a GPU overlaps;
    chunk 0's is due in the idle tick after the table, with no B slot left: half of the bytes.
    (Before: none. With 1f1b a stage's only chunk finishes with its last backward, so its
    mean has no B slot after it on that stage; with tensor > 1 XLA's scheduler does not start
    it before a B loop that holds tensor all-reduces of its own.)"""
    cfg = gpu_config(data=2, pipe=2, microbatches=4, layers=4)
    parallel = dataclasses.replace(cfg.parallel, schedule="interleaved_1f1b", chunks=2)
    _, report = report_for(dataclasses.replace(cfg, parallel=parallel))
    assert report["collective_bytes"]["data"] > 0
    assert report["collective_overlap"]["data"] == 0.5, report["collective_overlap"]
