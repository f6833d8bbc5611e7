"""FP8 GEMMs (`model.fp8: current | delayed`, `jaxmeg/models/fp8.py`): the recipes' rounding and
their three GEMMs, delayed scaling's amax bins and history, the step on a pipeline x tensor
(x data) mesh against one device, and the config's refusals. The H100 program's cuBLASLt FP8
calls: tests/test_gpu_target.py."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import flax.traverse_util as traverse
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.models import fp8
from jaxmeg.training.amax_history import take_seen
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import init_state, to_canonical_layout, to_stage_layout
from tests.helpers import (
    put_batch,
    random_batch,
    run_checked,
    trainable_for,
)

ROOT = Path(__file__).resolve().parent.parent
SPEC = "bsd,df->bsf"


def _operands():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2, 8, 16))
    w = 0.1 * jax.random.normal(keys[1], (16, 32))
    dy = jax.random.normal(keys[2], (2, 8, 32))
    return x, w, dy


def test_round_trip_fills_the_format_and_keeps_zero():
    """The scale maps the amax onto the format's largest value; a zero tensor stays zero."""
    x = jnp.array([0.0, -3.0, 0.5, 1e-3, 2.0])
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, scale = fp8.quantize(x, dtype)
        assert float(jnp.abs(q.astype(jnp.float32)).max()) == float(jnp.finfo(dtype).max)
        np.testing.assert_allclose(float(scale), 3.0 / float(jnp.finfo(dtype).max), rtol=1e-6)
    np.testing.assert_array_equal(fp8.round_trip(jnp.zeros(4), fp8.E4M3), 0.0)
    # E4M3 keeps 3 mantissa bits: every value within 1/16 of itself
    x = jax.random.normal(jax.random.key(1), (1000,))
    np.testing.assert_array_less(jnp.abs(fp8.round_trip(x, fp8.E4M3) - x), jnp.abs(x) / 16 + 1e-3)


def test_the_three_gemms_read_fp8_operands():
    """Forward on E4M3 x and w; the input and weight gradients on the E5M2 cotangent against
    the E4M3 w and x: each equals the 16/32-bit GEMM of the rounded operands, and all are within
    FP8's precision of the unrounded GEMMs."""
    x, w, dy = _operands()
    rx, rw, rdy = (
        fp8.round_trip(x, fp8.E4M3),
        fp8.round_trip(w, fp8.E4M3),
        fp8.round_trip(dy, fp8.E5M2),
    )
    y, pullback = jax.vjp(functools.partial(fp8.einsum, SPEC), x, w)
    dx, dw = pullback(dy)
    want_y, want_pullback = jax.vjp(functools.partial(jnp.einsum, SPEC), rx, rw)
    want_dx, want_dw = want_pullback(rdy)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    exact_y, exact_pullback = jax.vjp(functools.partial(jnp.einsum, SPEC), x, w)
    for got, exact in ((y, exact_y), *zip((dx, dw), exact_pullback(dy), strict=True)):
        error = float(jnp.abs(got - exact).max() / jnp.abs(exact).max())
        assert 1e-4 < error < 0.15, error  # rounded, but by FP8's steps only


def test_delayed_scaling_bins_each_amax_by_its_power_of_two_and_keeps_a_history():
    """An amax counts in the bin of the smallest power of two at or above it; the bound of
    summed bins is the largest amax's; the history takes it first; scales are powers of two
    that map the history's amax into the format (x 2^margin), 1 while it is empty."""
    for amax, e in ((1.0, 0), (1.5, 1), (0.5, -1), (3.0, 2), (1e-3, -9), (448.0, 9)):
        assert int(fp8.exponent(jnp.float32(amax))) == e, amax
    counts = fp8.seen(jnp.float32(0.3)) + 2 * fp8.seen(jnp.float32(5.0)) + fp8.seen(0.0)
    assert float(counts.sum()) == 3 and float(fp8.bound(counts)) == 8.0
    assert float(fp8.bound(jnp.zeros(fp8.BINS))) == 0.0
    history = jnp.array([[1.0, 2.0, 4.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    step = jnp.stack([fp8.seen(jnp.float32(a)) for a in (0.3, 0.0, 6.0)])
    np.testing.assert_array_equal(
        fp8.advance(history, step), [[0.5, 1.0, 2.0], [0.0, 0.0, 0.0], [8.0, 0.5, 0.0]]
    )
    np.testing.assert_array_equal(fp8.delayed_scales(history), [4 / 256, 1.0, 0.5 / 32768])
    np.testing.assert_array_equal(fp8.delayed_scales(history, 2), [16 / 256, 1.0, 2 / 32768])


def test_the_delayed_gemms_read_operands_at_the_historys_scales_and_report_their_amaxes():
    """Forward and both backward GEMMs on operands divided by the given scales, saturated at the
    format's largest value and rounded; the seen leaf's cotangent is the bins of x's, w's and
    dy's amaxes, the scales' zero."""
    x, w, dy = _operands()
    scales = jnp.array([2.0**-8, 2.0**-9, 2.0**-14])  # x saturates: |x| > 448 / 256
    counts = jnp.zeros((3, fp8.BINS))

    y, pullback = jax.vjp(functools.partial(fp8.delayed_einsum, SPEC), x, w, scales, counts)
    dx, dw, d_scales, d_counts = pullback(dy)
    rx, rw = (
        fp8.round_trip_scaled(x, scales[0], fp8.E4M3),
        fp8.round_trip_scaled(w, scales[1], fp8.E4M3),
    )
    assert float(jnp.abs(rx).max()) == 448 * 2.0**-8 < float(jnp.abs(x).max())
    want_y, want_pullback = jax.vjp(functools.partial(jnp.einsum, SPEC), rx, rw)
    want_dx, want_dw = want_pullback(fp8.round_trip_scaled(dy, scales[2], fp8.E5M2))
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    want_counts = jnp.stack([fp8.seen(jnp.abs(a).max()) for a in (x, w, dy)])
    np.testing.assert_array_equal(d_counts, want_counts)
    np.testing.assert_array_equal(d_scales, 0.0)


def test_the_delayed_ragged_dot_rounds_every_group_at_one_scale_and_reports_its_amaxes():
    """The experts' grouped GEMM at delayed scales: each group's rows times its expert's
    weight on operands rounded at the given scales (one per operand over all groups), dY too;
    the seen leaf's cotangent is the bins of the rows', the weights' and dY's amaxes."""
    rows = jax.random.normal(jax.random.key(1), (12, 8)) * 3.0
    w = jax.random.normal(jax.random.key(2), (3, 8, 5)) * 0.05
    dy = jax.random.normal(jax.random.key(3), (12, 5)) * 1e-3
    sizes = jnp.array([5, 0, 6], jnp.int32)  # an empty group; the last row in none
    scales = jnp.array([2.0**-7, 2.0**-12, 2.0**-24])
    counts = jnp.zeros((3, fp8.BINS))

    def delayed(r, w_, s, c):
        return fp8.delayed_ragged_dot(r, w_, sizes, s, c)

    y, pullback = jax.vjp(delayed, rows, w, scales, counts)
    d_rows, d_w, d_scales, d_counts = pullback(dy)
    rr, rw = (fp8.round_trip_scaled(a, scales[i], fp8.E4M3) for i, a in enumerate((rows, w)))
    want_y, want_pullback = jax.vjp(lambda r, w_: jax.lax.ragged_dot(r, w_, sizes), rr, rw)
    for got, want in zip((y, d_rows, d_w),
                         (want_y, *want_pullback(fp8.round_trip_scaled(dy, scales[2], fp8.E5M2))),
                         strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(y - jax.lax.ragged_dot(rows, w, sizes)).max()) > 1e-3  # it rounded
    want_counts = fp8.seen(jnp.stack([jnp.abs(a).max() for a in (rows, w, dy)]))
    np.testing.assert_array_equal(d_counts, want_counts)
    np.testing.assert_array_equal(d_scales, 0.0)


MODEL = C.ModelConfig(
    vocab_size=256, hidden=64, layers=4, heads=4, seq_len=16, compute_dtype="float32",
    fp8="current",
)  # fmt: skip


def _loss_and_grads(
    data, pipe, tensor, model=MODEL, microbatches=2, histories=None, **parallel
):  # fmt: skip
    """(loss, canonical grads) of the FP8 step; `histories`: {canonical path: amax history}
    set into the params first."""
    cfg = C.Config(
        model=model,
        parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor, **parallel),
        train=C.TrainConfig(global_batch=2 * data * microbatches, microbatches=microbatches),
    )
    return _run(cfg, histories)


def _run(cfg: C.Config, histories=None):
    """(loss, canonical grads) of cfg's step from seed 0's params, `histories` set first."""
    trainable = trainable_for(cfg)
    tokens = random_batch(dataclasses.replace(cfg, parallel=C.ParallelConfig()))
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        if histories:
            shardings = jax.tree.map(lambda a: a.sharding, params)
            canonical = traverse.flatten_dict(to_canonical_layout(params, trainable.layout))
            canonical.update(histories)
            params = to_stage_layout(traverse.unflatten_dict(canonical), trainable.layout)
            params = jax.device_put(params, shardings)
    loss, grads = run_checked(
        trainable, make_loss_and_grads(trainable), params, *put_batch(trainable, tokens)
    )
    grads = to_canonical_layout(jax.tree.map(np.asarray, grads), trainable.layout)
    return float(loss), grads


@functools.cache
def _one_device(fp8_recipe: str):
    return _loss_and_grads(1, 1, 1, dataclasses.replace(MODEL, fp8=fp8_recipe))


def test_fp8_step_on_a_pipe_x_tensor_mesh_equals_one_device():
    """Per-tensor scales over the whole tensor (amax across tensor ranks), per microbatch: the
    (1, 2, 2) FP8 step equals the FP8 step on one device with the same microbatches, far closer
    than FP8 is to 32-bit. A split backward's W reads X and dY through FP8 as the whole backward
    does: the p2-zb_h1 case of tests/test_fp8_experts.py (the attention's linears and the
    experts')."""
    loss, grads = _loss_and_grads(1, 2, 2)
    ref_loss, ref_grads = _one_device("current")
    full_loss, full_grads = _one_device("none")
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    assert abs(ref_loss - full_loss) > 1e-5 * abs(full_loss)  # FP8 did round
    for (path, ref), got in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        scale = float(np.abs(ref).max()) or 1.0
        layout_error = float(np.abs(got - ref).max()) / scale
        assert layout_error < 1e-5, (jax.tree_util.keystr(path), layout_error)
    fp8_error = max(
        float(np.abs(a - b).max()) / (float(np.abs(b).max()) or 1.0)
        for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(full_grads), strict=True)
    )
    assert fp8_error > 1e-2, fp8_error


DELAYED = dataclasses.replace(MODEL, fp8="delayed", fp8_history=4)


def _histories_after(grads, length: int) -> dict:
    """{canonical path: history} after a step whose gradients are `grads`, from empty
    histories (scales of 1), so a step that starts there scales by real amaxes."""
    _, counts = take_seen(grads)
    zeros = lambda c: np.zeros((*c.shape[:-1], length), np.float32)  # noqa: E731
    return {key: np.asarray(fp8.advance(zeros(c), c)) for key, c in counts.items()}


@functools.cache
def _first_histories():
    return _histories_after(_loss_and_grads(1, 1, 1, DELAYED)[1], DELAYED.fp8_history)


@functools.cache
def _one_device_delayed(microbatches: int):
    return _loss_and_grads(1, 1, 1, DELAYED, microbatches, histories=_first_histories())


@pytest.mark.parametrize(
    "mesh,schedule,sequence_parallel",
    [((2, 2, 1), "1f1b", False), ((1, 2, 2), "zb_h1", True)],
    ids=["d2p2", "p2t2-sp-zb_h1"],
)
def test_delayed_fp8_step_on_a_mesh_equals_one_device(mesh, schedule, sequence_parallel):
    """Delayed scales come from the history, the same on every replica, microbatch and tensor
    rank: a data x pipe (or pipe x tensor, with W's split backward at the forward's scales)
    FP8 step equals one device running all its microbatches: loss, gradients and the amax
    bounds the step saw (the largest over microbatches and replicas; dy's relative to the
    loss each replica differentiates). With sequence parallelism the split operands are put
    into FP8 split and gathered as FP8 (`fp8.Layouts`)."""
    data = mesh[0]
    histories = _first_histories()
    assert all(h[..., 0].min() > 0 for h in histories.values())  # the scales are the history's
    loss, grads = _loss_and_grads(
        *mesh, DELAYED, histories=histories, schedule=schedule,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    ref_loss, ref_grads = _one_device_delayed(2 * data)
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    grads, counts = take_seen(grads)
    ref_grads, ref_counts = take_seen(ref_grads)
    assert counts.keys() == ref_counts.keys() and len(counts) == 4  # qkv, out, fc1, fc2
    # a replica's loss is the mean over its own tokens: its dy are `data` x one device's
    relative = np.array([1.0, 1.0, data])
    for key, c in counts.items():
        np.testing.assert_array_equal(fp8.bound(c), fp8.bound(ref_counts[key]) * relative, key)
        assert fp8.bound(c).min() > 0
    for (path, ref), got in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        scale = float(np.abs(ref).max()) or 1.0
        assert float(np.abs(got - ref).max()) / scale < 1e-5, jax.tree_util.keystr(path)


def test_fp8_is_named_in_a_bad_config_and_on_a_gpu_without_it():
    blocked = "moe.experts=4 moe.grouped_gemm=blocked model.fp8=current"
    kernels = "moe.experts=4 moe.grouped_gemm=pallas model.fp8=delayed"
    for bad, field in (("model.fp8=delayd", "model.fp8"), ("model.fp8_history=0", "fp8_history"),
                       ("model.fp8_margin=-1", "fp8_margin"),
                       (blocked, "moe.grouped_gemm = blocked has no FP8 form"),
                       (kernels, "moe.grouped_gemm = pallas has no FP8 form")):  # fmt: skip
        cfg = C.apply_overrides(C.Config(), ["model.vocab_size=512", *bad.split()])
        with pytest.raises(C.ConfigError, match=field):
            C.validate(cfg, 1)


def test_gpt_tiny_trains_in_fp8_within_3_percent_of_32_bit(tmp_path, small_corpus):
    """scripts/train.py, gpt_tiny at 4 layers, 64 tokens and batch 8, 60 steps: with
    `model.fp8=current` and with `model.fp8=delayed` the mean loss of the last 10 steps is
    within 3% of the 32-bit run's, and each differs from it (the rounding ran)."""
    from tests.test_train_cli import OPTIMIZED_ENV, train

    def losses(name, *sets):
        sets = ("model.layers=4", "model.seq_len=64", "train.global_batch=8", *sets)
        args = ["--steps", "60", *small_corpus, *[a for s in sets for a in ("--set", s)]]
        return np.array([r["loss"] for r in train(args, tmp_path, name, OPTIMIZED_ENV)])

    full = losses("full")
    last_full = full[-10:].mean()
    for recipe in ("current", "delayed"):
        fp8_run = losses(recipe, f"model.fp8={recipe}")
        assert len(fp8_run) == len(full) == 60
        last = fp8_run[-10:].mean()
        assert abs(last - last_full) <= 0.03 * last_full, (recipe, last, last_full)
        assert not np.allclose(fp8_run, full, rtol=1e-6)
        assert last < fp8_run[:10].mean() - 1.0  # it trained


def test_the_planner_prices_fp8_where_it_pays():
    """`plan.py --fp8 current` prices the linears' GEMMs at the FP8 peak plus current scaling's
    passes and amax all-reduces: gpt_1.3b on one H100 gains (the compiled program's roofline:
    0.944x), a Llama-3-8B-shaped layer on tensor 8 does not (the compiled program: 1.018x), nor
    does a small layer (h 512, the scaling passes outweigh the GEMMs); an A100 has no FP8."""
    from jaxmeg.perf import model, planner
    from jaxmeg.perf.hardware import load_hardware
    from jaxmeg.perf.layout import Layout
    from jaxmeg.perf.shape import Shape, shape_of

    hw = load_hardware("h100_dgx")

    def ratio(shape, recipe="current", **layout):
        base = dict(data=1, pipe=1, microbatches=8, recompute="selective", **layout)
        fp8_time = model.step_time(shape, Layout(**base, fp8=recipe), hw).total
        return fp8_time / model.step_time(shape, Layout(**base), hw).total

    gpt_1_3b = Shape(hidden=2048, layers=24, heads=16, seq_len=2048, vocab=51200, mlp_ratio=4)
    llama = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, seq_len=8192, vocab=128256,
                  mlp_ratio=3.5)  # fmt: skip
    small = Shape(hidden=512, layers=8, heads=8, seq_len=2048, vocab=51200, mlp_ratio=4)
    assert ratio(gpt_1_3b, tensor=1, microbatch=4) < 0.95
    assert ratio(llama, tensor=8, microbatch=1) > 1.0
    # delayed scaling: the same passes, no amax all-reduce on the way (one GPU: the same)
    delayed = ratio(llama, "delayed", tensor=8, microbatch=1)
    assert delayed < ratio(llama, tensor=8, microbatch=1)
    assert ratio(gpt_1_3b, "delayed", tensor=1, microbatch=4) == ratio(gpt_1_3b, tensor=1,
                                                                        microbatch=4)  # fmt: skip
    assert ratio(small, tensor=1, microbatch=4) > 0.98
    # a Mixtral-shaped MoE stack: its routed experts in FP8 with a capacity factor and dropless
    mixtral = C.load(ROOT / "configs" / "mixtral_8x7b.yaml")
    moe_layout = dict(data=1, pipe=1, tensor=1, expert=8, microbatches=1, microbatch=1)

    def moe_ratio(capacity_factor):
        moe = dataclasses.replace(mixtral.moe, capacity_factor=capacity_factor)
        shape = shape_of(dataclasses.replace(mixtral.model, layers=4), moe)
        step = [model.step_time(shape, Layout(**moe_layout, fp8=r), hw).total
                for r in ("current", "none")]  # fmt: skip
        return step[0] / step[1]

    assert moe_ratio(1.0) < 0.85 and moe_ratio(0.0) < 0.85
    with pytest.raises(ValueError, match="--fp8 current needs FP8 GEMMs, which a100_dgx"):
        planner.plan(gpt_1_3b, 8, 32, load_hardware("a100_dgx"), fp8="current")


def test_a_delayed_fp8_checkpoint_reshards_onto_another_mesh_and_schedule(tmp_path):
    """Delayed scaling's amax histories are train state: a (1, 2, 2) run's checkpoint after one
    step (the histories filled by it), restored on (1, 4, 1) zb_h1, reads the same arrays (Adam
    moments and histories included) and its next step equals the source's (histories included:
    both steps' bounds). Resuming on the same layout bit for bit, through SIGTERM:
    `test_a_delayed_fp8_run_stopped_by_sigterm_resumes_bit_for_bit`."""
    from tests.test_reshard import one_step, restore_step_1, train_one_step_and_save

    cfg = C.Config(
        model=DELAYED, parallel=C.ParallelConfig(pipe=2, tensor=2),
        train=C.TrainConfig(global_batch=4, microbatches=2),
        optimizer=C.OptimizerConfig(lr=1e-3, warmup_steps=1),
    )  # fmt: skip
    source = trainable_for(cfg)
    meta = {"config": C.to_dict(source.cfg)}
    state, tokens, saved = train_one_step_and_save(source, tmp_path, meta)
    went_on = one_step(source, state, tokens)
    other = trainable_for(
        dataclasses.replace(cfg, parallel=C.ParallelConfig(pipe=4, schedule="zb_h1"))
    )
    restored = restore_step_1(tmp_path, other)
    got = jax.tree.leaves(to_canonical_layout(restored, other.layout))
    for a, b in zip(got, jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    loss, params = one_step(other, restored, tokens)
    np.testing.assert_allclose(loss, went_on[0], rtol=1e-5)
    histories = 0
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(went_on[1]), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        if jax.tree_util.keystr(path).endswith(fp8.HISTORY + "']"):
            histories += 1
            assert np.all(np.asarray(a)[..., :2] > 0)  # both steps' bounds
    assert histories == 4


def test_a_checkpoint_resumes_only_with_the_same_amax_state():
    """Delayed scaling on or off, or another history length, changes the saved tree: the
    checkpoint's meta names the field before any read; current scaling keeps no state."""
    from jaxmeg.training.checkpoint_meta import shape_mismatches

    def cfg(**model):
        return C.Config(model=dataclasses.replace(MODEL, **model))

    def saved(**model):
        return {"config": C.to_dict(cfg(**model))}

    assert shape_mismatches(saved(fp8="none"), cfg(fp8="current")) == []
    assert shape_mismatches(saved(fp8="current"), cfg(fp8="delayed")) == [
        ("model.fp8", "current", "delayed")
    ]
    assert shape_mismatches(saved(fp8="delayed"), cfg(fp8="none")) == [
        ("model.fp8", "delayed", "none")
    ]
    assert shape_mismatches(saved(fp8="delayed"), cfg(fp8="delayed", fp8_history=16)) == [
        ("model.fp8_history", 1024, 16)
    ]
    assert shape_mismatches({"config": {"model": {}}}, cfg(fp8="delayed"))[0][1] == "none"


def test_a_delayed_fp8_run_stopped_by_sigterm_resumes_bit_for_bit(tmp_path, small_corpus):
    """scripts/train.py with `model.fp8=delayed`: SIGTERM mid-run checkpoints the step (amax
    histories included), the run started again resumes there, and its next two steps' losses
    equal, bit for bit, those of a run that went through without a stop."""
    import signal

    from tests.test_operations import FAST, metric_steps, start_train, wait_for
    from tests.test_train_cli import read_metrics, run_train

    fp8_args = [*small_corpus, *FAST, "--set", "model.fp8=delayed", "--set", "model.fp8_history=4"]
    out = tmp_path / "stopped"
    proc = start_train([*fp8_args, "--steps", "1000", "--out", str(out)])
    wait_for(lambda: metric_steps(out / "metrics.jsonl") >= 3 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "stopped by SIGTERM" in stderr, stderr[-2000:]
    stopped = len(read_metrics(out / "metrics.jsonl"))
    resumed = run_train([*fp8_args, "--steps", str(stopped + 2), "--out", str(out)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {stopped}" in resumed.stderr
    whole = run_train([*fp8_args, "--steps", str(stopped + 2), "--out", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr[-2000:]
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert len(losses) == stopped + 2
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
