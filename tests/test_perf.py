"""The performance model: paper formulas, the planner, and ties to the compiled system."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxmeg.perf.hardware import load_hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import Shape, flops_per_iteration, parameter_count
from jaxmeg.perf.planner import plan
from jaxmeg.pipeline.schedules import build
from jaxmeg.pipeline.tick_table import build_tick_table
from tests.helpers import run_script_main
from tests.test_train_cli import CLEAN_ENV, ROOT

GPT3 = Shape(hidden=12288, layers=96, heads=96, seq_len=2048, vocab=51200)
ONE_T = Shape(hidden=25600, layers=128, heads=160, seq_len=2048, vocab=51200)


def test_gpt3_parameters_by_eq2():
    assert abs(parameter_count(GPT3) - 174.6e9) < 0.5e9


def test_flops_by_eq3():
    # GPT-3 175B, batch 1536: 96 B s l h^2 (1 + s/6h + V/16lh) with recompute,
    # 72 B s l h^2 (1 + s/6h + V/12lh) without.
    base = 1536 * 2048 * 96 * 12288**2
    expected_recompute = 96 * base * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288))
    assert flops_per_iteration(GPT3, 1536, recompute=True) == pytest.approx(expected_recompute)
    assert flops_per_iteration(GPT3, 1536, recompute=True) == pytest.approx(4.5e18, rel=0.02)
    ratio = flops_per_iteration(GPT3, 1, True) / flops_per_iteration(GPT3, 1, False)
    assert 1.3 < ratio < 1.34  # one extra forward: about 4/3


def test_a_model_config_becomes_a_shape_in_one_place():
    from jaxmeg.config import ModelConfig
    from jaxmeg.perf.model import shape_of
    from jaxmeg.training.flops import model_flops_per_step

    model = ModelConfig(vocab_size=51200, hidden=12288, layers=96, heads=96, seq_len=2048)
    # a config's shape is priced as jaxmeg runs it on GPUs: cuDNN's fused attention (bf16
    # compute, `auto`), the backward's tensor collectives beside its weight-gradient GEMMs
    jaxmeg_gpu = dataclasses.replace(GPT3, flash_attention=True, backward_overlap=True)
    assert shape_of(model) == jaxmeg_gpu
    assert not shape_of(dataclasses.replace(model, attention="xla")).flash_attention
    assert not shape_of(dataclasses.replace(model, compute_dtype="float32")).flash_attention
    assert model_flops_per_step(model, 1536) == flops_per_iteration(GPT3, 1536, recompute=False)
    with pytest.raises(ValueError, match="model.vocab_size must be set"):
        shape_of(ModelConfig())


def test_plan_py_prices_whose_program_it_is_asked():
    """`--program`: a config's step as jaxmeg runs it (fused attention, the backward's tensor
    all-reduces overlapped) by default, as Megatron-LM 2021 ran with `megatron2021`; shape
    flags the other way round. gpt_1.3b on 8 H100s at t 2, p 2."""
    pins = ["--gpus", "8", "--batch", "32", "--tensor", "2", "--pipe", "2", "--microbatch", "4",
            "--recompute", "selective", "--hardware", "h100_dgx", "--json"]  # fmt: skip
    config = ["--config", "configs/gpt_1.3b.yaml", "--vocab", "51200"]
    flags = ["--hidden", "2048", "--layers", "24", "--heads", "16", "--seq", "2048",
             "--vocab", "51200"]  # fmt: skip

    def step(*argv):
        result = run_script_main("plan", *argv, *pins)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["step_time_s"]

    jaxmeg, megatron = step(*config), step(*config, "--program", "megatron2021")
    assert jaxmeg < 0.8 * megatron
    assert step(*flags) == pytest.approx(megatron)
    assert step(*flags, "--program", "jaxmeg") == pytest.approx(jaxmeg)


def test_planner_1t_on_3072_gpus_uses_every_gpu():
    result = subprocess.run(
        [sys.executable, "scripts/plan.py", "--config", "configs/megatron_1t.yaml", "--gpus",
         "3072", "--batch", "3072", "--hardware", "a100_dgx", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=CLEAN_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)
    assert best["tensor"] * best["pipe"] * best["data"] == 3072
    for key in (
        "chunks",
        "microbatch",
        "tflops_per_gpu",
        "step_time_s",
        "memory_per_gpu_gb",
        "bubble",
    ):
        assert key in best
    # Megatron's guidance, found without being told: tensor parallelism fills a node, the
    # pipeline crosses nodes.
    assert best["tensor"] == 8 and best["pipe"] > 1


# Narayanan et al., 2021, table 1 (A100 80GB, Selene): heads, hidden, layers, t, p, GPUs, global
# batch, achieved TFLOP/s per GPU (full recompute counted, sequence 2048, vocabulary 51200).
PUBLISHED = [
    (24, 2304, 24, 1, 1, 32, 512, 137),
    (32, 3072, 30, 2, 1, 64, 512, 138),
    (32, 4096, 36, 4, 1, 128, 512, 142),
    (48, 6144, 40, 8, 1, 256, 1024, 135),
    (64, 8192, 48, 8, 2, 512, 1536, 138),
    (80, 10240, 60, 8, 4, 1024, 1792, 140),
    (96, 12288, 80, 8, 8, 1536, 2304, 148),
    (128, 16384, 96, 8, 16, 1920, 2160, 155),
    (128, 20480, 105, 8, 35, 2520, 2520, 163),
    (160, 25600, 128, 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("row", PUBLISHED, ids=lambda r: f"h{r[1]}-t{r[3]}-p{r[4]}")
def test_prediction_within_10_percent_of_the_published_measurement(row):
    """The model is built from datasheets and first principles, not fitted to this table."""
    heads, hidden, layers, t, p, gpus, batch, published = row
    shape = Shape(hidden=hidden, layers=layers, heads=heads, seq_len=2048, vocab=51200)
    best = plan(shape, gpus, batch, load_hardware("a100_dgx"), tensor=t, pipe=p,
                recompute=("full",))[0]  # fmt: skip
    assert best.tflops_per_gpu == pytest.approx(published, rel=0.10)


def test_planner_prefers_data_parallelism_when_the_model_fits():
    small = Shape(hidden=2304, layers=24, heads=24, seq_len=2048, vocab=51200)
    best = plan(small, 32, 512, load_hardware("a100_dgx"))[0].layout
    assert (best.tensor, best.pipe, best.data) == (1, 1, 32)


def test_pins_are_respected_and_bad_pins_yield_nothing():
    hw = load_hardware("a100_dgx")
    plans = plan(GPT3, 1536, 1536, hw, tensor=8, pipe=8)
    assert plans and all(p.layout.tensor == 8 and p.layout.pipe == 8 for p in plans)
    assert plan(GPT3, 8, 8, hw) == []  # 175B does not fit on one node


def test_more_microbatches_shrink_the_bubble():
    from jaxmeg.perf.model import step_time

    hw = load_hardware("a100_dgx")
    few = step_time(GPT3, Layout(tensor=8, pipe=8, data=1, microbatches=8), hw)
    many = step_time(GPT3, Layout(tensor=8, pipe=8, data=1, microbatches=64), hw)
    assert few.bubble == pytest.approx(7 / 8) and many.bubble == pytest.approx(7 / 64)
    assert many.total / 64 < few.total / 8


@pytest.mark.parametrize(
    "kind,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA B200", 2250.0),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_a_gpus_peak_comes_from_the_profile_that_names_it(kind, peak):
    from types import SimpleNamespace

    from jaxmeg.training.flops import peak_tflops_per_device

    assert peak_tflops_per_device(SimpleNamespace(platform="gpu", device_kind=kind)) == peak


@pytest.mark.parametrize("outer_axis", ["pipe", "data"])
def test_the_perf_models_device_order_is_the_meshs(outer_axis):
    from jaxmeg.config import ParallelConfig
    from jaxmeg.parallel.mesh import make_mesh
    from jaxmeg.perf.model import device_grid

    mesh = make_mesh(ParallelConfig(data=2, pipe=2, tensor=2, outer_axis=outer_axis))
    ranks = np.vectorize(lambda device: device.id)(mesh.devices)
    layout = Layout(tensor=2, pipe=2, data=2, outer_axis=outer_axis)
    np.testing.assert_array_equal(device_grid(layout), ranks)


def test_outer_axis_decides_whether_pipe_or_data_crosses_nodes():
    """t 2, p 4, d 2 on nodes of 8: pipe outermost puts pipeline neighbours 4 GPUs apart (a
    group spans 13) and a data pair 2 apart; data outermost puts them 2 and 8 apart."""
    from jaxmeg.perf.model import data_link, pipe_link, step_time

    hw = load_hardware("a100_dgx")
    shape = Shape(hidden=4096, layers=32, heads=32, seq_len=2048, vocab=51200)
    pipe_out = Layout(tensor=2, pipe=4, data=2, microbatches=8, outer_axis="pipe")
    data_out = dataclasses.replace(pipe_out, outer_axis="data")
    nvlink = hw.intra_node_gb_per_s * hw.collective_efficiency
    infiniband = hw.inter_node_gb_per_s * hw.collective_efficiency
    assert pipe_link(pipe_out, hw)[0] == infiniband and data_link(pipe_out, hw)[0] == nvlink
    assert pipe_link(data_out, hw)[0] == nvlink and data_link(data_out, hw)[0] == infiniband
    pipe_first, data_first = step_time(shape, pipe_out, hw), step_time(shape, data_out, hw)
    assert pipe_first.p2p > data_first.p2p and pipe_first.data_parallel < data_first.data_parallel


def test_unknown_hardware_is_named():
    with pytest.raises(ValueError, match="unknown hardware 'tpu'; known profiles"):
        load_hardware("tpu")


@pytest.mark.parametrize(
    "schedule,v,warmup", [("1f1b", 1, "min_bubble"), ("1f1b", 1, "min_memory"),
                          ("interleaved_1f1b", 2, "min_bubble")],
)  # fmt: skip
def test_a_stage_keeps_its_schedules_input_ring_flat_in_m(schedule, v, warmup):
    from jaxmeg.perf.memory import stored_microbatches

    for m in (4, 8, 64):
        layout = Layout(tensor=1, pipe=4, data=1, chunks=v, microbatches=m, schedule=schedule,
                        warmup=warmup)  # fmt: skip
        ring = build_tick_table(build(schedule, 4, max(m, 8), v, warmup)).num_input_slots
        assert stored_microbatches(layout) == ring
    gpipe = Layout(tensor=1, pipe=4, data=1, microbatches=64, schedule="gpipe")
    assert stored_microbatches(gpipe) == 64


def test_remat_choice_sets_what_a_slot_keeps_and_what_the_backward_reruns():
    """full: the chunk input, one more forward; selective: all but the attention internals,
    which are rerun; none: everything, backward = 2 forwards (t = 1: no all-reduces)."""
    from jaxmeg.perf.memory import kept_bytes_per_microbatch, layer_activation_bytes, memory_per_gpu
    from jaxmeg.perf.model import layer_seconds, step_time

    hw = load_hardware("a100_dgx")
    shape = Shape(hidden=4096, layers=32, heads=32, seq_len=2048, vocab=51200)
    base = Layout(tensor=1, pipe=4, data=1, microbatches=16)
    full, selective, none = (dataclasses.replace(base, recompute=r)
                             for r in ("full", "selective", "none"))  # fmt: skip
    sbh = 2048 * 4096
    assert kept_bytes_per_microbatch(shape, full) == 2 * sbh
    assert kept_bytes_per_microbatch(shape, none) == 2 * sbh + 8 * layer_activation_bytes(
        shape, none
    )
    # selective differs from none by the s x s scores only, which flash attention (the
    # model's default) never keeps.
    assert (memory_per_gpu(shape, full, hw).activations
            < memory_per_gpu(shape, selective, hw).activations
            == memory_per_gpu(shape, none, hw).activations)  # fmt: skip
    layer = layer_seconds(shape, base, hw)
    assert layer.backward == pytest.approx(2 * layer.forward)
    times = {r.recompute: step_time(shape, r, hw) for r in (full, selective, none)}
    assert times["full"].backward - times["none"].backward == pytest.approx(8 * layer.forward)
    assert times["selective"].backward - times["none"].backward == pytest.approx(
        8 * layer.attention_core
    )
    assert 0 < layer.attention_core < layer.forward


def test_uneven_stages_count_the_busiest_stage_and_no_padding():
    """[5, 3] over 8 layers holds, keeps and runs what an even 10-layer model's stages do; its
    FLOPs (and so TFLOP/s) are the 8 real layers'."""
    from jaxmeg.perf.memory import memory_per_gpu
    from jaxmeg.perf.model import params_per_gpu, step_time, tflops_per_gpu

    hw = load_hardware("a100_dgx")
    eight = Shape(hidden=2048, layers=8, heads=16, seq_len=2048, vocab=51200)
    ten = dataclasses.replace(eight, layers=10)
    uneven = Layout(tensor=1, pipe=2, data=1, microbatches=8, stage_layers=(5, 3))
    even = dataclasses.replace(uneven, stage_layers=())
    assert params_per_gpu(eight, uneven) == params_per_gpu(ten, even)
    assert memory_per_gpu(eight, uneven, hw) == memory_per_gpu(ten, even, hw)
    assert step_time(eight, uneven, hw) == step_time(ten, even, hw)
    seconds = step_time(eight, uneven, hw).total
    assert tflops_per_gpu(eight, uneven, hw) == pytest.approx(
        flops_per_iteration(eight, 8, recompute=True) / seconds / 2 / 1e12
    )
    with pytest.raises(ValueError, match=r"parallel.stage_layers \[5, 2\] sums to 7"):
        step_time(eight, dataclasses.replace(uneven, stage_layers=(5, 2)), hw)


# Ties to the compiled system: 8 simulated CPU devices, fp32.
TIE_MODEL = dict(vocab_size=1024, hidden=128, layers=8, heads=8, seq_len=64)
TIE_CASES = [  # (data, pipe, tensor, schedule, chunks, microbatches, microbatch size, remat)
    (1, 1, 1, "1f1b", 1, 1, 2, "none"),
    (2, 1, 2, "1f1b", 1, 2, 2, "none"),
    (1, 4, 2, "1f1b", 1, 8, 1, "none"),
    (2, 2, 2, "interleaved_1f1b", 2, 4, 1, "none"),
    (1, 2, 1, "gpipe", 1, 4, 2, "none"),
    (1, 2, 1, "1f1b", 1, 4, 1, "full"),
    (2, 2, 2, "interleaved_1f1b", 2, 4, 1, "selective"),
]
"""Each schedule and recompute choice once, pipe 2 and 4 (neighbours on one or both sides):
1F1B without recompute on a pipeline is (1,4,2)'s, on two stages the full-recompute case's."""


@pytest.mark.parametrize("case", TIE_CASES, ids=lambda c: "d{}p{}t{}-{}-v{}-m{}-b{}-{}".format(*c))
def test_predicted_memory_and_bytes_match_the_compiled_step(case):
    from jaxmeg import config as C
    from jaxmeg.parallel.hlo import collectives
    from jaxmeg.parallel.hlo_cost import StepCost
    from jaxmeg.perf.jaxmeg_memory import jaxmeg_step_memory
    from jaxmeg.perf.traffic import bytes_per_step
    from jaxmeg.training.pipeline_step import make_loss_and_grads
    from jaxmeg.training.trainer import compile_step, memory_report
    from tests.helpers import trainable_for

    d, p, t, schedule, v, m, b, remat = case
    cfg = C.Config(
        model=C.ModelConfig(compute_dtype="float32", remat=remat, **TIE_MODEL),
        parallel=C.ParallelConfig(data=d, pipe=p, tensor=t, schedule=schedule, chunks=v),
        train=C.TrainConfig(global_batch=d * m * b, microbatch_size=b),
    )
    trainable = trainable_for(cfg)
    compiled, _ = compile_step(trainable)
    measured = memory_report(compiled)
    shape = Shape(hidden=128, layers=8, heads=8, seq_len=64, vocab=1024)
    par = cfg.parallel
    layout = Layout(
        tensor=t, pipe=p, data=d, chunks=v, microbatch=b, microbatches=m,
        recompute=cfg.model.remat, pipe_scatter_gather=par.uses_scatter_gather,
        schedule=par.schedule, warmup=par.pipeline_warmup, outer_axis=par.outer_axis,
        stage_layers=tuple(par.stage_layers),
    )  # fmt: skip
    loss_and_grads = make_loss_and_grads(trainable)
    table = loss_and_grads.program.table
    predicted = jaxmeg_step_memory(
        shape, layout, trainable.vocab, compute_bytes=4,
        input_slots=table.num_input_slots, cot_slots=table.num_cot_slots,
    )  # fmt: skip
    actual = measured["temp_bytes"] + measured["argument_bytes"]
    assert abs(predicted.total - actual) <= 0.15 * actual, (predicted, measured)

    traffic = bytes_per_step(shape, layout, compute_bytes=4)
    found = collectives(compiled.as_text(), trainable.mesh)
    # Megatron's f and g: all-reduces over `tensor` of the layer matmuls (forward and backward).
    layer_all_reduces = [
        c
        for c in found
        if c.kind == "all-reduce" and c.axes == {"tensor"} and "dot_general" in c.op_name
        and ("/attn/" in c.op_name or "/mlp/" in c.op_name)
    ]  # fmt: skip
    if t > 1:
        assert layer_all_reduces
        # where the last stage runs F and B at once (`B_LAST`, 1F1B-type schedules), XLA joins
        # one layer's all-reduce with the loss's (fp32 per token) in the one computation
        joined = traffic["tensor_message"] + b * shape.seq_len * 4
        assert traffic["tensor_message"] in {c.bytes for c in layer_all_reduces}
        assert {c.bytes for c in layer_all_reduces} <= {traffic["tensor_message"], joined}
    permutes = [c for c in found if c.kind == "collective-permute"]
    if p > 1:
        assert permutes and all(c.axes == {"pipe"} for c in permutes)
        assert {c.bytes for c in permutes} == {traffic["pipe_message"]}
        # executed, per stage: the planner's figure is a stage with neighbours on both sides
        columns = loss_and_grads.program.branch_columns
        counter = StepCost(compiled.as_text(), trainable.mesh, columns)
        sent = [c.collective_bytes[("collective-permute", ("pipe",))] for c in counter.per_stage()]
        assert max(sent) <= traffic["pipe"] * (1 + 1e-9)
        if p > 2:
            assert max(sent) == pytest.approx(traffic["pipe"])
    else:
        assert not permutes


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gpus=0, batch=8), "gpus must be >= 1, got 0"),
        (dict(gpus=8, batch=8, tensor=0), "tensor must be >= 1, got 0"),
        (dict(gpus=8, batch=8, shape=Shape(hidden=1000, layers=2, heads=16, seq_len=8, vocab=64)),
         r"hidden \(1000\) must be divisible by heads \(16\)"),
        (dict(gpus=8, batch=8, recompute=("some",)),
         r"recompute must be among \['none', 'selective', 'full'\], got \['some'\]"),
    ],
)  # fmt: skip
def test_impossible_planner_inputs_name_the_field(kwargs, message):
    shape = kwargs.pop("shape", GPT3)
    with pytest.raises(ValueError, match=message):
        plan(shape, hw=load_hardware("a100_dgx"), **kwargs)


# Shortest training time (Lamy-Poirier, 2021) at the critical batch (Kaplan et al., 2020).


def test_critical_batch_arithmetic_by_hand():
    from jaxmeg.perf import scaling

    # B_crit(2) = 2e8 / 2^(1/0.21) = 2e8 / 27.134 = 7.371e6 tokens.
    assert scaling.critical_batch_tokens(2.0) == pytest.approx(7.371e6, rel=1e-3)
    # At the critical batch S = 2 S_min and E = 2 E_min; at twice it, 1.5 S_min and 3 E_min.
    assert scaling.steps(1000, 5e6, 5e6) == 2000 and scaling.steps(1000, 1e7, 5e6) == 1500
    assert scaling.tokens(1e9, 5e6, 5e6) == 2e9 and scaling.tokens(1e9, 1e7, 5e6) == 3e9
    # N = 12 l h^2 = 12 x 128 x 25600^2 = 1.00663e12; (N_c / N)^0.076 = 87.42^0.076 = 1.4046;
    # S_min(2) = 2100 / (2 - 1.4046)^(1/0.76) = 2100 / 0.5954^1.3158 = 2100 / 0.5055 = 4154.
    n = scaling.non_embedding_parameters(25600, 128)
    assert n == 12 * 128 * 25600**2
    target = scaling.target_from_loss(2.0, n)
    assert target.min_steps == pytest.approx(4154, rel=1e-3)
    assert target.min_tokens == pytest.approx(7.371e6 * 4154, rel=2e-3)
    budget = scaling.target_from_tokens(450e9, n)
    assert budget.tokens(budget.critical_batch_tokens) == pytest.approx(450e9)
    with pytest.raises(ValueError, match="target loss 1.2 is not above 1.4046"):
        scaling.target_from_loss(1.2, n)


def test_zero_shards_states_and_breadth_first_gathers_once_per_chunk():
    from jaxmeg.perf.memory import memory_per_gpu
    from jaxmeg.perf.model import params_per_gpu
    from jaxmeg.perf.traffic import bytes_per_step

    hw = load_hardware("a100_dgx")
    base = Layout(tensor=8, pipe=8, data=4, chunks=2, microbatches=8, schedule="interleaved_1f1b")
    params = params_per_gpu(GPT3, base)
    states = {z: memory_per_gpu(GPT3, dataclasses.replace(base, zero_stage=z), hw).model_states
              for z in (0, 1, 3)}  # fmt: skip
    assert states[0] == 16 * params and states[1] == pytest.approx((6 + 12 / 4) * params)
    assert states[3] < states[1] < states[0]
    depth = bytes_per_step(GPT3, dataclasses.replace(base, zero_stage=3))["data"]
    breadth = dataclasses.replace(base, zero_stage=3, schedule="breadth_first")
    # Gathers 2 v m vs 2 v, reduce-scatters v m vs v: m times the bytes depth-first.
    assert depth == pytest.approx(8 * bytes_per_step(GPT3, breadth)["data"])
    with pytest.raises(ValueError, match=r"zero_stage must be one of \[0, 1, 3\], got 2"):
        dataclasses.replace(base, zero_stage=2)


def _plan(*flags, process=False):
    """plan.py on a 7B shape over 256 GPUs: its main in this process (what it decides and
    prints), or with `process` as a process of its own (its exit status)."""
    argv = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--seq", "2048", "--vocab",
            "51200", "--gpus", "256", *flags]  # fmt: skip
    if not process:
        return run_script_main("plan", *argv)
    return subprocess.run(
        [sys.executable, "scripts/plan.py", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=CLEAN_ENV,
    )  # fmt: skip


def test_shortest_time_plans_every_method():
    from jaxmeg.perf.planner import METHODS

    result = _plan("--objective", "shortest_time", "--target-loss", "2.5", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out["methods"]) == {m.name for m in METHODS}
    for run in out["methods"].values():
        assert run["days"] > 0 and run["gpus"] <= 256
        assert run["gpus"] == run["tensor"] * run["pipe"] * run["data"]
        for key in (
            "chunks",
            "microbatch",
            "microbatches",
            "memory_per_gpu_gb",
            "data_bytes_per_step",
        ):
            assert key in run


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--objective", "fastest", "--target-loss", "2.5"], "--objective"),
        (["--objective", "shortest_time", "--target-loss", "2.5", "--zero-stage", "2"],
         "--zero-stage"),
        (["--objective", "shortest_time", "--target-loss", "-1"], "--target-loss"),
        (["--objective", "shortest_time", "--target-loss", "0.5"], "--target-loss"),
    ],
)  # fmt: skip
def test_bad_shortest_time_inputs_exit_2_naming_the_flag(flags, named):
    """An argparse refusal (--objective) as a process: the exit status is the process's."""
    result = _plan(*flags, process=named == "--objective")
    assert result.returncode == 2 and named in result.stderr, result.stderr
