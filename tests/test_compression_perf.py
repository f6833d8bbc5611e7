"""Communication compression in the performance model (`jaxmeg.perf.compression`): bytes per
link per step of each technique, the compute it adds, the step time, and the planner's choice."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from jaxmeg.config import CompressionConfig, ConfigError
from jaxmeg.perf import compression as cc
from jaxmeg.perf.collectives import WIRE_BYTES
from jaxmeg.perf.hardware import load_hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import Shape, shared_parameters_per_gpu, step_time
from jaxmeg.perf.planner import evaluate, plan
from jaxmeg.perf.traffic import bytes_per_step
from jaxmeg.pipeline import critical_path, schedules
from tests.test_train_cli import CLEAN_ENV, ROOT

GPT3 = Shape(hidden=12288, layers=96, heads=96, seq_len=2048, vocab=51200)
# GPT-3 175B on 1024 GPUs: t 8 in a node, p 16 across nodes, d 8; batch 1536 (m 192).
GPT3_LAYOUT = Layout(tensor=8, pipe=16, data=8, microbatch=1, microbatches=192)
GPT3_PINS = {"tensor": 8, "pipe": 16, "chunks": 1, "microbatch": 1, "recompute": ("full",)}
DGX, ETHERNET = load_hardware("a100_dgx"), load_hardware("a100_ethernet")


@pytest.mark.parametrize(
    "changes",
    [{}, {"microbatch": 2}, {"sequence_parallel": True}, {"pipe_scatter_gather": False}],
)
def test_compressed_ppermute_shrinks_by_the_element_ratio_times_the_dtype_ratio(changes):
    layout = dataclasses.replace(GPT3_LAYOUT, **changes)
    rank = 16
    cost = cc.pipe_grad_cost(GPT3, layout, DGX, CompressionConfig(pipe_grad_rank=rank))
    n, m = cost.detail["matrix"]
    t = layout.tensor
    assert (n, m) == (GPT3.seq_len * layout.microbatch // (t if layout.sequence_parallel else 1),
                      GPT3.hidden)  # fmt: skip
    # The dense message is the planner's (bytes_per_step), the compressed one P [n, r] + Q [m, r]
    # in fp32 split the same way: n m / (r (n + m)) fewer elements, 2 / 4 bytes each.
    assert cost.detail["message_bytes"] == bytes_per_step(GPT3, layout)["pipe_message"]
    ratio = cost.detail["message_bytes"] / cost.detail["compressed_message_bytes"]
    assert ratio == pytest.approx(n * m / (rank * (n + m)) * WIRE_BYTES / cc.FACTOR_BYTES)


def test_a_rank_at_or_above_the_smaller_side_sends_the_matrix_whole():
    assert cc.matrix_bytes(100, 300, 100) == cc.matrix_bytes(100, 300, 0) == 2 * 100 * 300
    assert cc.matrix_bytes(100, 300, 99) == 4 * 99 * 400
    whole = CompressionConfig(pipe_grad_rank=GPT3.hidden, data_grad_rank=GPT3.hidden)
    cost = cc.compression_cost(GPT3, GPT3_LAYOUT, ETHERNET, whole)
    for technique in (cost.pipe_grad, cost.data_grad):
        assert not technique.on and technique.saved_s == 0
        assert technique.per_gpu_bytes[0] == technique.per_gpu_bytes[1]


def test_epilogue_compresses_p_minus_s_minus_1_per_link_for_1f1b_and_all_compresses_m():
    p, m = 4, 8
    layout = Layout(tensor=1, pipe=p, data=1, microbatches=m)
    epilogue = cc.phase_counts(layout, "epilogue")
    assert epilogue.per_link == {(s + 1, s): p - s - 1 for s in range(p - 1)}
    assert cc.phase_counts(layout, "all").per_link == {(s + 1, s): m for s in range(p - 1)}
    # The lockstep executor saves a tick only where every send in it is compressed: the p - 1
    # cool-down ticks of the m + p - 2 that send.
    assert epilogue.whole == pytest.approx((p - 1) / (m + p - 2)) and epilogue.mixed == 0


@pytest.mark.parametrize(
    "schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1), ("breadth_first", 2)]
)
def test_the_models_counts_are_the_critical_path_analysis(schedule, v):
    layout = Layout(tensor=1, pipe=4, data=1, chunks=v, microbatches=8, schedule=schedule)
    built = schedules.build(schedule, 4, 8, v, layout.warmup)
    for phase in ("all", "epilogue"):
        expected = critical_path.compressed_per_link(built, phase)
        assert cc.phase_counts(layout, phase).per_link == expected


def test_epilogue_saves_its_share_of_what_all_saves_and_lazy_costs_compute_not_bytes():
    def cost(**fields):
        comp = CompressionConfig(pipe_grad_rank=16, **fields)
        return cc.pipe_grad_cost(GPT3, GPT3_LAYOUT, ETHERNET, comp)

    every, epilogue = cost(pipe_grad_phase="all"), cost(pipe_grad_phase="epilogue")
    share = cc.phase_counts(GPT3_LAYOUT, "epilogue").whole
    assert epilogue.saved_s == pytest.approx(share * every.saved_s)
    assert every.per_gpu_bytes[1] < epilogue.per_gpu_bytes[1] < epilogue.per_gpu_bytes[0]
    lazy, none = (
        cost(pipe_grad_phase="all", pipe_error_feedback="lazy"),
        cost(pipe_grad_phase="all", pipe_error_feedback="none"),
    )
    assert lazy.per_gpu_bytes == none.per_gpu_bytes and lazy.total_bytes == none.total_bytes
    assert lazy.compute_s > none.compute_s > 0 and lazy.saved_s < none.saved_s


def test_fused_sync_reduces_over_first_and_last_stage_only():
    layout, t, p, d = GPT3_LAYOUT, 8, 16, 8
    unfused = cc.embedding_sync_cost(GPT3, layout, ETHERNET, CompressionConfig())
    fused = cc.embedding_sync_cost(
        GPT3, layout, ETHERNET, CompressionConfig(fused_embedding_sync=True)
    )
    shared = WIRE_BYTES * shared_parameters_per_gpu(GPT3, t)
    # Every GPU in a ring of p d today; fused, the 2 d t GPUs of the first and last stage in a
    # ring of 2 d, then each middle GPU receives the result once (3 rounds for 14 stages).
    assert unfused.total_bytes[0] == pytest.approx(p * d * t * 2 * (p * d - 1) / (p * d) * shared)
    ring = 2 * d * t * 2 * (2 * d - 1) / (2 * d) * shared
    assert fused.total_bytes[1] == pytest.approx(ring + (p - 2) * d * t * shared)
    assert fused.detail["middle_rounds"] == 3
    assert fused.per_gpu_bytes[1] == pytest.approx(2 * (2 * d - 1) / (2 * d) * shared)
    assert fused.detail["ring_after"] == 2 * d
    # The rounds to the middle stages run after the all-reduce: on 16 stages the fused sync
    # moves 0.56x the bytes but takes longer than the one all-reduce over pipe x data.
    assert fused.total_bytes[1] < 0.6 * unfused.total_bytes[0] and fused.saved_s < 0
    # Today's sync moves about 20x the bytes of Megatron-LM's (the word embedding's all-reduce
    # between the first and last stage) for GPT-3 175B on 16 stages; fused, about 12x (the
    # middle stages' replicas, which Megatron-LM does not keep, take most of it).
    megatron = fused.detail["megatron_total_bytes"]
    assert megatron == pytest.approx(2 * d * t * WIRE_BYTES * GPT3.vocab * GPT3.hidden / t)
    assert 19 < unfused.total_bytes[0] / megatron < 22
    assert 11 < fused.total_bytes[1] / megatron < 12.5
    single = cc.embedding_sync_cost(
        GPT3, dataclasses.replace(layout, pipe=1), DGX, CompressionConfig(fused_embedding_sync=True)
    )
    assert not single.on and single.saved_s == 0


def test_powersgd_bytes_by_hand():
    shape = Shape(hidden=64, layers=4, heads=4, seq_len=32, vocab=128)
    rank, t, d = 4, 2, 4
    layout = Layout(tensor=t, pipe=2, data=d, microbatches=4)
    comp = CompressionConfig(data_grad_rank=rank)
    cost = cc.data_grad_cost(shape, layout, DGX, comp, step_time(shape, layout, DGX))
    matrices = [(64, 96), (32, 64), (64, 128), (128, 64)]  # QKV, out, fc1, fc2 over t = 2
    assert cc.layer_matrices(shape, t) == matrices
    layers = 2
    params = layers * (12 * 64 * 64 + 13 * 64) / t + shared_parameters_per_gpu(shape, t)
    whole = params - layers * sum(n * m for n, m in matrices)  # vectors and shared params
    ring = 2 * (d - 1) / d
    p_bytes = 4 * rank * layers * sum(n for n, _ in matrices)
    q_bytes = 4 * rank * layers * sum(m for _, m in matrices)
    assert cost.per_gpu_bytes[0] == pytest.approx(ring * 2 * params)
    assert cost.per_gpu_bytes[1] == pytest.approx(ring * (2 * whole + p_bytes + q_bytes))
    assert cost.total_bytes[1] == pytest.approx(2 * d * t * cost.per_gpu_bytes[1])
    assert cost.compute_s > 0
    with pytest.raises(ValueError, match="zero_stage 3"):
        cc.data_grad_cost(shape, dataclasses.replace(layout, zero_stage=3), DGX, comp,
                          step_time(shape, layout, DGX))  # fmt: skip


def test_selective_stages_save_what_the_later_stages_cool_down_hides():
    timing = step_time(GPT3, GPT3_LAYOUT, DGX)

    def saved(stages):
        comp = CompressionConfig(data_grad_rank=16, data_grad_stages=stages)
        return cc.data_grad_cost(GPT3, GPT3_LAYOUT, DGX, comp, timing)

    every = saved(-1)
    dense, small = every.detail["exposed_dense_s"], every.detail["exposed_compressed_s"]
    b = every.detail["stage_slack_s"]
    assert b == timing.backward and dense > small
    assert every.saved_s == pytest.approx(dense - small)
    savings = [saved(k).saved_s for k in range(1, 16)]
    for k, s in enumerate(savings, start=1):
        assert s == pytest.approx(dense - max(small, dense - k * b))
    assert savings == sorted(savings)
    k = cc.fewest_stages(every, GPT3_LAYOUT.pipe)
    assert 1 <= k < 16 and savings[k - 1] == pytest.approx(every.saved_s)
    assert savings[k - 2] < every.saved_s
    assert saved(k).total_bytes[1] > every.total_bytes[1]  # fewer stages compress


def test_step_time_is_the_models_less_the_savings_and_off_changes_nothing():
    comp = cc.choose(GPT3, GPT3_LAYOUT, ETHERNET, "on")
    cost = cc.compression_cost(GPT3, GPT3_LAYOUT, ETHERNET, comp)
    base = step_time(GPT3, GPT3_LAYOUT, ETHERNET).total
    assert cost.base_step_s == base
    assert cost.step_s == pytest.approx(base - sum(t.saved_s for t in cost.techniques))
    assert cost.on == ["pipe_grad", "embedding_sync", "data_grad"]
    planned = evaluate(GPT3, GPT3_LAYOUT, ETHERNET, compression=comp)
    assert planned.step_time_s == cost.step_s
    assert planned.as_dict()["compression"]["on"] == cost.on
    off = cc.compression_cost(GPT3, GPT3_LAYOUT, ETHERNET, CompressionConfig())
    assert off.on == [] and off.step_s == base
    assert plan(GPT3, 1024, 1536, DGX, compression="off", **GPT3_PINS) == plan(
        GPT3, 1024, 1536, DGX, **GPT3_PINS
    )
    assert "compression" not in evaluate(GPT3, GPT3_LAYOUT, DGX).as_dict()


def test_auto_turns_compression_on_for_ethernet_and_less_on_dgx():
    ethernet = plan(GPT3, 1024, 1536, ETHERNET, compression="auto", **GPT3_PINS)[0].compression
    dgx = plan(GPT3, 1024, 1536, DGX, compression="auto", **GPT3_PINS)[0].compression
    # the fused sync saves bytes but not time on 16 stages (its rounds to the middle stages)
    assert ethernet.on == ["pipe_grad", "data_grad"]
    assert ethernet.saved_s / ethernet.base_step_s > 0.1
    assert ethernet.pipe_grad.total_bytes[1] < 0.6 * ethernet.pipe_grad.total_bytes[0]
    assert ethernet.data_grad.per_gpu_bytes[1] < 0.1 * ethernet.data_grad.per_gpu_bytes[0]
    # On InfiniBand the lossy techniques save under AUTO_MIN_SAVING of the step: none is on.
    assert dgx.on == []
    assert dgx.saved_s / dgx.base_step_s < cc.AUTO_MIN_SAVING


def test_bad_compression_inputs_are_named():
    with pytest.raises(ConfigError, match="compression.pipe_grad_rank must be >= 0"):
        cc.compression_cost(GPT3, GPT3_LAYOUT, DGX, CompressionConfig(pipe_grad_rank=-1))
    with pytest.raises(ConfigError, match="compression.pipe_grad_phase must be one of"):
        cc.compression_cost(GPT3, GPT3_LAYOUT, DGX, CompressionConfig(pipe_grad_phase="late"))
    with pytest.raises(ConfigError, match=r"data_grad_stages must be -1 \(all\) or"):
        cc.compression_cost(GPT3, GPT3_LAYOUT, DGX, CompressionConfig(data_grad_stages=17))
    # A technique that does not apply to the layout is off.
    one_stage = dataclasses.replace(GPT3_LAYOUT, pipe=1)
    cost = cc.compression_cost(GPT3, one_stage, DGX, CompressionConfig(pipe_grad_rank=4))
    assert cost.on == [] and cost.step_s == step_time(GPT3, one_stage, DGX).total
    with pytest.raises(ValueError, match="compression must be one of"):
        plan(GPT3, 1024, 1536, DGX, compression="sometimes", **GPT3_PINS)
    with pytest.raises(ValueError, match="compression rank must be >= 1"):
        plan(GPT3, 1024, 1536, DGX, compression="on", compression_rank=0, **GPT3_PINS)


GPT3_FLAGS = (
    "--hidden 12288 --layers 96 --heads 96 --seq 2048 --vocab 51200 --gpus 1024 --batch 1536 "
    "--tensor 8 --pipe 16 --chunks 1 --microbatch 1 --recompute full"
).split()


def _plan_cli(*flags):
    return subprocess.run(
        [sys.executable, "scripts/plan.py", *GPT3_FLAGS, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=CLEAN_ENV,
    )  # fmt: skip


def test_plan_cli_says_which_techniques_are_on_and_what_they_save():
    result = _plan_cli(
        "--hardware", "a100_ethernet", "--compression", "auto", "--pipe-grad-phase", "all", "--json"
    )
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)["compression"]
    assert best["on"] == ["pipe_grad", "data_grad"]
    assert best["saved_s"] > 0 and best["step_time_s"] < best["base_step_time_s"]
    for name in best["on"]:
        technique = best[name]
        assert technique["total_bytes_after"] < technique["total_bytes_before"]
        assert technique["saved_s"] > 0
    text = _plan_cli("--hardware", "a100_ethernet", "--compression", "on",
                     "--pipe-grad-phase", "epilogue")  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "compression of the fastest plan" in text.stdout
    assert "rank 16, epilogue, no error feedback" in text.stdout
    bad = _plan_cli("--compression", "on", "--objective", "shortest_time", "--tokens", "1e9")
    assert bad.returncode == 2 and "--compression applies to" in bad.stderr
    bad = _plan_cli("--compression", "on", "--compression-rank", "0")
    assert bad.returncode == 2 and "compression rank must be >= 1" in bad.stderr
