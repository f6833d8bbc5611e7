"""The train step compiled for H100s without a GPU (`jaxmeg.parallel.gpu_target`): what the GPU
program executes, read from its HLO. Needs jax's CUDA plugin (XLA's GPU compiler); without it
these tests skip, except in CI (`CI=true`), which installs it and where its absence fails.

Each program is compiled once per module (a few seconds to ~20 s on 2 cores); models are
gpt_tiny-shaped, in bf16, where cuDNN attention is what `model.attention=auto` means on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmeg import config as C
from jaxmeg.parallel import gpu_target

ROOT = Path(__file__).resolve().parent.parent

if not gpu_target.plugin_installed():
    reason = f"jax's CUDA plugin is not installed: {gpu_target.install_command()}"
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(f"CI compiles for H100: {reason}")
    pytestmark = pytest.mark.skip(reason=reason)

MODEL = dict(vocab_size=8192, hidden=1024, layers=2, heads=8, seq_len=1024)
"""Two layers unless a test needs more (a pipeline's stages and chunks): each layer adds about
5 s to a GPU compile here."""


def gpu_config(
    data=1, pipe=1, tensor=1, remat="none", microbatches=2, parallel=None, **model
) -> C.Config:
    return C.Config(
        model=C.ModelConfig(compute_dtype="bfloat16", remat=remat, **{**MODEL, **model}),
        parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor, **(parallel or {})),
        train=C.TrainConfig(global_batch=4 * data * microbatches, microbatch_size=4),
    )


def report_for(cfg: C.Config):
    from jaxmeg.training.cost_report import cost_report
    from jaxmeg.training.trainer import prepare

    par = cfg.parallel
    gpus = par.data * par.pipe * par.tensor * par.context * par.expert
    target = gpu_target.load_target("h100", gpus)
    trainable = prepare(cfg, None, devices=target.devices)
    return trainable, cost_report(trainable, target)


def one_gpu():
    return report_for(gpu_config())


def data_two():
    """5 layers: more than a chunk unrolls for XLA attention (`pipeline_step.unrolls_layers`)."""
    return report_for(gpu_config(data=2, remat="selective", layers=5))


def tensor_two():
    return report_for(gpu_config(tensor=2))


def attention_flops(cfg: C.Config) -> float:
    """Megatron-LM's count of QK^T and AV over the whole s x s: forward 4 B s^2 h per layer,
    backward twice that."""
    m = cfg.model
    return 3 * 4 * cfg.train.global_batch * m.seq_len**2 * m.hidden * m.layers


# Each layout's program is compiled once, in one test that asserts every claim read from it
# (an H100 compile costs 15-45 s here, and a module fixture shared by several tests is built
# again on each pytest worker that runs one of them).


def assert_cudnn_once_per_layer_and_microbatch(trainable, report) -> None:
    """The layout compiles with cuDNN attention (jax's partitioner of it never runs: the kernel
    runs per tensor rank), one forward and one backward call per layer and microbatch; with
    selective recompute too (data_two, eight_gpus): the forward's output and statistics are
    kept, on (2,2,2) across ticks in the pipeline's residual rings."""
    cfg = trainable.cfg
    calls = cfg.model.layers * cfg.train.microbatches
    kernels = report["attention_kernels"]
    assert (kernels["forward_per_replica"], kernels["backward_per_replica"]) == (calls, calls)


def assert_planner_memory_within_15_percent(report) -> None:
    memory = report["memory"]
    assert abs(memory["planner"] - memory["device"]) <= 0.15 * memory["device"], memory


def assert_bounds_read_off_the_kernel_classes(report, copy_share=0.02) -> None:
    """The roofline is its kernel classes' sum (`hlo_gpu.kernel_class`) plus the exposed
    collectives; the schedule bound, which adds the ticks a stage idles, is never below it;
    copy kernels move at most `copy_share` of the kernel bytes."""
    classes = report["kernel_classes"]
    assert sum(classes.values()) == pytest.approx(report["roofline_seconds"], rel=1e-9), classes
    assert classes["gemm"] > 0 and classes["elementwise"] > 0, classes
    assert report["schedule_bound_seconds"] >= report["roofline_seconds"] * (1 - 1e-9)
    assert report["copy_share"] <= copy_share, report["copy_share"]


def assert_weight_gradients_accumulate_in_their_gemms(trainable, report) -> None:
    """Every microbatch's q, k, v, output projection, fc1 and fc2 weight gradients are cuBLAS
    GEMMs that add into their layer's fp32 accumulator (beta 1, `jaxmeg.pipeline.accumulator`;
    q, k and v's each into its own part of `w_qkv`'s, the output projection's into its [N H, D]
    matrix), not bf16 GEMMs followed by an elementwise pass over the stacked accumulator (0
    such GEMMs before; 2 per layer and microbatch before the parts, 5 before `w_out`'s matrix);
    and so does the head's into the shared gradients (the loss scale on the logits' cotangent,
    not after the GEMM; the embedding lookup's rows, where the same slot scatters them, in an
    accumulator of their own: `Carry.g_embed`), one more per microbatch."""
    cfg = trainable.cfg
    least = (6 * cfg.model.layers + 1) * cfg.train.microbatches
    calls = report["fp32_accumulating_gemm_calls"]  # weighted by how often each runs
    assert round(calls, 6) >= least, calls


def assert_qkv_input_gradients_add_in_their_gemms(trainable, report) -> None:
    """q, k and v's input gradients sum in their GEMMs: each layer and microbatch runs two bf16
    GEMMs that add into their output (cuBLAS beta 1; `parts.fan_out`), not one and an
    elementwise add of x's size (jax's order of the sum left the second to a kernel of its
    own). Other adds that fold (an input gradient into the residual stream's) only add to the
    count."""
    cfg = trainable.cfg
    least = 2 * cfg.model.layers * cfg.train.microbatches
    calls = report["adding_gemm_calls"].get("bf16", 0)  # weighted by how often each runs
    assert round(calls, 6) >= least, report["adding_gemm_calls"]


def test_one_h100_gemm_flops_are_the_models_and_cudnn_runs_once_per_layer():
    trainable, report = one_gpu()
    assert report["target"].startswith("1 x NVIDIA H100")
    assert trainable.model_cfg.attention == "cudnn"  # auto on a GPU target, not the host's xla
    attention = attention_flops(trainable.cfg)
    assert report["attention_kernels"]["flops"] == pytest.approx(attention)
    matmuls = report["model_flops"] - attention
    assert report["gemm_flops"] == pytest.approx(matmuls, rel=0.01)
    assert 0 < report["roofline_mfu"] < 1
    assert report["memory"]["fits"]
    assert_cudnn_once_per_layer_and_microbatch(trainable, report)
    assert_planner_memory_within_15_percent(report)
    assert_bounds_read_off_the_kernel_classes(report)
    # one stage: the bound with the bubble is the roofline
    assert report["schedule_bound_seconds"] == pytest.approx(report["roofline_seconds"])
    assert report["kernel_classes"]["loss"] > 0 and report["kernel_classes"]["optimizer"] > 0
    assert report["fp8_gemms"]["calls"] == 0  # the default: 16-bit GEMMs
    assert_weight_gradients_accumulate_in_their_gemms(trainable, report)
    assert_qkv_input_gradients_add_in_their_gemms(trainable, report)


def test_a_moe_report_gives_the_step_at_each_bound_of_the_exchange_on_two_h100():
    """expert 2, dropless top-2 over 4 experts: the report counts a balanced step (1.25x the
    even load) and gives the step at each bound of the exchange as well, what a skewed router
    costs: the larger the bound, the longer the roofline, the balanced bound's the report's,
    and the bounds up to `moe.exchange_kept_bound` (2x) keep their residuals. The rows go by
    ragged all-to-all (a GPU's `moe.exchange`), counted at the routed rows: a device's bytes
    are the planner's `routed` figure, (e - 1) / e T k h per all-to-all."""
    from jaxmeg.training.cost_report import EXPERT_KEY

    cfg = gpu_config(parallel={"expert": 2})
    # the first bounds only (fewer branches compile faster), and ragged GEMMs for the same reason
    moe = C.MoeConfig(experts=4, top_k=2, ffn_hidden=1024, grouped_gemm="ragged",
                      exchange_bounds=(1.0, 1.25))  # fmt: skip
    _, report = report_for(dataclasses.replace(cfg, moe=moe))
    bounds = report["exchange_bounds"]
    assert [b["load"] for b in bounds] == [1.0, 1.25, 2.0]  # 2 ranks: all choices at 2x
    assert all(b["kept"] for b in bounds)
    seconds = [b["roofline_seconds"] for b in bounds]
    assert seconds == sorted(seconds) and len(set(seconds)) == len(seconds)
    assert bounds[1]["roofline_seconds"] == pytest.approx(report["roofline_seconds"])
    assert report["expert_exchange_block"] == bounds[1]["rows"]
    assert set(report["collective_bytes_by_kind"]) >= {"ragged-all-to-all@expert"}
    assert "all-to-all@expert" not in report["collective_bytes_by_kind"]
    planned = report["planner"]["collective_bytes_per_device"][EXPERT_KEY]
    assert report["per_device"]["collective_bytes"][EXPERT_KEY] == pytest.approx(planned)


def test_the_grouped_gemm_kernels_run_the_routed_rows_on_one_h100():
    """Dropless, 8 experts on one H100 (one layer): XLA's GPU compiler makes each `ragged_dot`
    a dense GEMM over every expert (GEMM FLOPs about twice the model's here, 8x the experts');
    `moe.grouped_gemm: pallas` runs Triton kernels over each group's rows
    (`jaxmeg.models.grouped_kernels`), priced over every row of their buffers: at most the
    model's FLOPs and a shorter roofline."""
    import re

    from jaxmeg.training.compilation import compile_step

    moe = C.MoeConfig(experts=8, top_k=2, ffn_hidden=512)
    reports = {}
    for form in ("ragged", "pallas"):
        cfg = gpu_config(layers=1, microbatches=1, hidden=512, seq_len=512, vocab_size=4096)
        trainable, reports[form] = report_for(
            dataclasses.replace(cfg, moe=dataclasses.replace(moe, grouped_gemm=form))
        )
    ratio = {form: r["gemm_flops"] / r["model_flops"] for form, r in reports.items()}
    assert ratio["pallas"] <= 1.0 < 1.5 < ratio["ragged"], ratio
    assert reports["pallas"]["roofline_seconds"] < 0.8 * reports["ragged"]["roofline_seconds"]
    text = compile_step(trainable)[0].as_text()
    names = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "(\w+)"', text)
    # the forward's w_in and w_out, the rows' cotangents of both, the weights' gradients
    assert sorted(names) == ["grouped_gemm"] * 4 + ["grouped_gemm_weights"] * 2, names


def test_a_pipeline_slot_exchanges_each_microbatch_by_ragged_all_to_alls_on_eight_h100():
    """expert 4 x pipe 2 1f1b, 4 microbatches, dropless, bounds of 1x and 4x the even load (all T k
    = 2048 choices per block): on a GPU the rows go by ragged all-to-all (`moe.exchange: auto`), no
    all-to-all is left. Each F slot's exchange branches hold 2 (dispatch, combine), each B slot's
    the 2 transposes at the kept first bound and 3 at the largest (whose backward reruns the
    dispatch), the last stage's B_LAST both kinds: 4 per MoE layer and microbatch at a balanced
    route (the CPU step's count: tests/test_expert_exchange.py). At the first bound every one's
    operand and output are the device's T k routed rows: the buffers hold no padding. The expert ids
    travel nowhere: the counts' all-gather (E integers) stands in. The pipe sends leave as send and
    recv (the slots' collectives share a stream with a collective-permute), and 11 of 14 pipe bytes
    have a GEMM beside them: in the second copy of the tick loop, which XLA pipelines two ticks at a
    time, the scheduler posts the next activation's recv before the F slot and completes the
    cotangent's first (since the last stage runs each microbatch's F and B at once in its B slot,
    `B_LAST`; every byte before). The slots all-reduce nothing over `expert` but the bound's scalar
    max: the dense gradients are summed over it once per chunk and step, after the chunk's last
    backward (XLA's combined all-reduce, outside the slots)."""
    import re

    from jaxmeg.parallel import hlo, hlo_module
    from jaxmeg.parallel.hlo_cost import StepCost
    from jaxmeg.training.compilation import compile_step
    from jaxmeg.training.cost_report import link_overlap
    from jaxmeg.training.pipeline_step import make_loss_and_grads
    from jaxmeg.training.trainer import prepare

    cfg = gpu_config(
        pipe=2, microbatches=4, parallel={"expert": 4, "schedule": "1f1b"}, attention="xla"
    )
    moe = C.MoeConfig(experts=4, top_k=2, ffn_hidden=1024, exchange_bounds=(1.0,))
    trainable = prepare(dataclasses.replace(cfg, moe=moe), None,
                        devices=gpu_target.load_target("h100", 8).devices)  # fmt: skip
    assert trainable.moe_cfg.exchange == "ragged"
    loss_and_grads = make_loss_and_grads(trainable)
    compiled, _ = compile_step(trainable, loss_and_grads)
    text = compiled.as_text()
    columns = loss_and_grads.program.branch_columns
    overlap = link_overlap(StepCost(text, trainable.mesh, columns).total())
    assert overlap["pipe"] >= 11 / 14 - 1e-6, overlap
    over_expert = [
        c for c in hlo.collectives(text, trainable.mesh)
        if c.kind == "all-reduce" and "expert" in c.axes
    ]  # fmt: skip
    in_slots = [c for c in over_expert if re.search(r"/closed_call/[fbiw]_", c.op_name)]
    assert in_slots and all(c.bytes == 4 for c in in_slots), in_slots  # the bound's max
    assert any(c.bytes > 1e6 for c in over_expert if c not in in_slots), over_expert
    choices = 4 * 1024 // 4 * 2  # a microbatch's tokens on one expert rank, k = 2 each
    comps = hlo_module.computations(text)

    def reached(line):
        return set().union(*(hlo_module.reachable(comps, c) for c in hlo_module.called(line)))

    def ragged_rows(names):  # (operand rows, output rows) of each ragged all-to-all
        starts = [
            line for c in names for line in hlo_module.ops(comps[c], "ragged-all-to-all-start")
        ]
        return sorted(tuple(map(int, re.findall(r"bf16\[(\d+),", line)[:2])) for line in starts)

    slots = hlo_module.slot_loops(comps[hlo_module.tick_loop_body(text)])
    exchanged = {}
    for scope, line in slots.items():
        for cond in (c for n in reached(line) for c in hlo_module.ops(comps[n], "conditional")):
            arms = [ragged_rows(hlo_module.reachable(comps, b)) for b in hlo_module.branches(cond)]
            if any(arms):
                exchanged.setdefault(scope.removesuffix("_reducing"), []).append(arms)
    # the last stage runs each microbatch's F and B at once (`B_LAST`): both kinds of branches
    assert set(exchanged) == {"f_first", "b_first", "b_last"}, exchanged
    even, largest = (choices, choices), (choices, 4 * choices)
    forward = [[even, even], [largest, largest[::-1]]]
    backward = [[even, even], [largest, largest, largest[::-1]]]
    assert all(arms == forward for arms in exchanged["f_first"]), exchanged["f_first"]
    assert all(arms == backward for arms in exchanged["b_first"]), exchanged["b_first"]
    last = exchanged["b_last"]
    assert forward in last and backward in last, last
    assert all(arms in (forward, backward) for arms in last), last
    assert not any(hlo_module.ops(lines, "all-to-all-start") for lines in comps.values())


def test_fp8_runs_each_linears_three_gemms_as_cublaslt_fp8_on_one_h100():
    """`model.fp8=current`: the forward, input-gradient and weight-gradient GEMMs of each of a
    GPT block's 4 linears (qkv, out, fc1, fc2) per layer and microbatch are
    `__cublas$lt$matmul$f8` calls (48 for 2 layers x 2 microbatches); the LM head stays 16-bit.
    They count at the H100's FP8 peak, so the roofline falls. Delayed scaling: the next test's
    (2,2,2)."""
    trainable, report = report_for(gpu_config(fp8="current"))
    cfg = trainable.cfg
    assert report["fp8_gemms"]["calls"] == 3 * 4 * cfg.model.layers * cfg.train.microbatches
    assert 0 < report["fp8_gemms"]["flops"] < report["gemm_flops"]
    _, bf16 = one_gpu()
    assert report["gemm_flops"] == pytest.approx(bf16["gemm_flops"], rel=1e-6)
    assert report["kernel_classes"]["gemm"] < 0.8 * bf16["kernel_classes"]["gemm"]


@pytest.mark.parametrize(
    "layout",
    ["d2p2t2-sp-delayed", "expert4-dropless-shared-delayed"],
)
def test_fp8_gemms_with_sequence_parallelism_and_with_experts(layout):
    """(2,2,2) with sequence parallelism, delayed scaling: the split operands (a column-parallel
    linear's x, a row-parallel one's dy) go into FP8 before their all-gather, so all 12 GEMMs
    of a GPT layer per microbatch are FP8 on every GPU (8 x 1 layer x 2 microbatches x 12;
    gathered in 16 bits, 64 were); a dropless MoE stack on expert 4 with a shared expert:
    the attention's 2 linears, the shared expert's 2 and the routed experts' 2 ragged GEMMs
    (one scale over all experts, the amax reduced over the expert ranks; the exchange's
    written-out backward quantizes dY and the rows too), 4 x 2 layers x 2 microbatches x 6
    x 3 (one exchange bound), at delayed scales (each expert weight's own history; at current
    scales the same program compiled to the same 288 calls when this case had both, and
    tests/test_fp8.py checks both recipes' numbers on CPU)."""
    if layout.startswith("d2p2t2"):
        cfg = gpu_config(2, 2, 2, parallel={"sequence_parallel": True}, fp8="delayed")
        linears, layers = 4, 1
    else:
        cfg = gpu_config(parallel={"expert": 4}, fp8=layout.rsplit("-", 1)[1])
        moe = C.MoeConfig(
            experts=4, top_k=2, ffn_hidden=1024, shared_experts=1, exchange_bounds=()
        )  # one bound: one branch to compile
        cfg = dataclasses.replace(cfg, moe=moe)
        linears, layers = 6, 2
    trainable, report = report_for(cfg)
    devices, microbatches = trainable.mesh.size, trainable.cfg.train.microbatches
    calls = devices * layers * microbatches * linears * 3  # weighted by trip counts: a float
    assert report["fp8_gemms"]["calls"] == pytest.approx(calls, rel=1e-9)
    if layout.startswith("d2p2t2"):  # split on its rows, the residual stream is gathered and
        # scattered without transposes (`rules.activation_rules`; 11.7% on the sequence)
        assert report["copy_share"] <= 0.05, report["copy_share"]


def test_data_two_keeps_cudnn_once_per_layer_and_reduces_beside_the_backward():
    """Plain data parallelism (p v = 1, 5 layers): the last microbatch's B slot starts each
    layer's mean but the first's as that layer's backward ends, beside the backwards of the
    layers before it (`Plan.reduce_layers`): 70% of the data bytes overlap a GEMM (0% when
    the whole mean ran after the slot); the rest are the first layer's and the embedding's and
    head's, which no compute follows."""
    trainable, report = data_two()
    assert_cudnn_once_per_layer_and_microbatch(trainable, report)
    assert report["collective_bytes"]["data"] > 0
    assert report["collective_overlap"]["data"] == pytest.approx(0.696, abs=0.01)
    assert_planner_memory_within_15_percent(report)


def test_tensor_two_runs_cudnn_per_tensor_rank():
    trainable, report = tensor_two()
    assert_cudnn_once_per_layer_and_microbatch(trainable, report)
    assert_planner_memory_within_15_percent(report)


@pytest.mark.parametrize(
    "cfg",
    [
        gpu_config(2, 2, 2, "selective", parallel={"sequence_parallel": True}),
        gpu_config(tensor=8),
    ],
    ids=["d2p2t2-sequence_parallel-selective", "t8-none"],
)
def test_eight_h100_layouts_run_cudnn_once_per_layer_and_microbatch(cfg):
    """Sequence parallelism (the attention's input gathered over tensor, heads split) and
    tensor 8 (one head per rank): cuDNN per rank, jax's partitioner of it never runs."""
    trainable, report = report_for(cfg)
    assert trainable.model_cfg.attention == "cudnn"
    assert_cudnn_once_per_layer_and_microbatch(trainable, report)
    assert report["collective_bytes"]["tensor"] > 0
    assert report["memory"]["fits"]


def test_context_two_on_eight_h100_compiles_with_the_rings_own_kernel():
    """(data 1, pipe 2, context 2, tensor 2): the context ring's blocks keep the jnp kernel
    (cuDNN returns no log-sum-exp to merge blocks with), so the program holds no cuDNN call;
    keys and values travel over `context`."""
    _, report = report_for(gpu_config(pipe=2, tensor=2, parallel={"context": 2}))
    assert report["attention_kernels"]["forward_per_replica"] == 0
    by_kind = report["collective_bytes_by_kind"]
    assert sum(b for kind, b in by_kind.items() if kind.endswith("@context")) > 0, by_kind
    assert report["memory"]["fits"]


@pytest.mark.parametrize(
    "script", [["scripts/train.py", "--compile-only"], ["scripts/bench.py", "--cost-report"]]
)
def test_scripts_say_when_a_step_does_not_fit_and_exit_3(script):
    """A batch whose logits alone exceed 80 GB: compiled, measured, refused with exit 3, by
    train.py and by bench.py's cost report alike (which said it and exited 0)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, *script, "--config", "configs/gpt_tiny.yaml", "--target", "h100", "--gpus",
         "1", "--set", "model.vocab_size=65536", "--set", "model.compute_dtype=bfloat16",
         "--set", "model.layers=1",
         "--set", "train.global_batch=4096", "--set", "train.microbatches=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "does not fit" in proc.stderr + proc.stdout
    if script[0].endswith("train.py"):
        assert "1 x NVIDIA H100 80GB HBM3" in proc.stderr


def test_unknown_or_specless_targets_are_named():
    with pytest.raises(ValueError, match="unknown hardware 'h900'"):
        gpu_target.load_target("h900", 1)
    with pytest.raises(ValueError, match="names no XLA target spec"):
        gpu_target.load_target("cpu", 1)
    with pytest.raises(gpu_target.TargetError, match="whole number of h100_dgx nodes"):
        gpu_target.load_target("h100", 12).devices  # noqa: B018


def test_an_option_this_xla_lacks_is_dropped_and_said(capsys):
    """Another jax release may drop a GPU option (0.11.2's XLA has no pipelined all-gather,
    reduce-scatter or all-reduce options): on a GPU the step then compiles without it and says
    so on stderr, rather than failing every compile. XLA's CPU client refuses an unknown option
    with the same error a GPU's does, so the probe is checked here."""
    assert gpu_target._known_on_gpu("xla_gpu_enable_latency_hiding_scheduler", True)
    assert not gpu_target._known_on_gpu("xla_gpu_enable_no_such_thing", True)
    assert "has no option xla_gpu_enable_no_such_thing" in capsys.readouterr().err


def test_q_k_v_come_out_of_their_own_gemms_with_the_bias_on_one_h100():
    """A GPT layer's q, k and v are three cuBLAS GEMMs with the bias in their epilogue, kept
    after it for the backward (`parts.stacked_matmul`): no [B, S, 3, N, H] array is made, so no
    kernel slices q, k, v out of a joined output or joins their cotangents."""
    import jax
    import jax.numpy as jnp

    from jaxmeg.models.gpt import Attention
    from jaxmeg.models.remat import REMAT_POLICY

    model = C.ModelConfig(compute_dtype="bfloat16", attention="cudnn", **MODEL)
    attn = Attention(model)
    b, s, d = 4, model.seq_len, model.hidden
    x = jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16)
    made = jax.eval_shape(lambda: attn.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
    params = {"params": made["params"]}  # no split backward's taps

    def loss(p, x_):
        return attn.apply(p, x_).astype(jnp.float32).sum()

    step = jax.grad(jax.checkpoint(loss, policy=REMAT_POLICY["selective"]), argnums=(0, 1))
    device = jax.sharding.SingleDeviceSharding(gpu_target.load_target("h100", 1).devices[0])
    options = gpu_target.compiler_options("gpu")
    hlo = jax.jit(step, in_shardings=device).lower(params, x).compile(options).as_text()
    assert hlo.count('"epilogue":"BIAS"') == 3, hlo.count('"epilogue":"BIAS"')
    n, h = model.heads, model.head_dim
    assert f"[{b},{s},3,{n},{h}]" not in hlo and f"[{b * s},{3 * n * h}]" not in hlo
