"""FP8 GEMMs (`model.fp8: current`, `jaxmeg/models/fp8.py`): the recipe's rounding and its three
GEMMs, the step on a pipeline x tensor mesh against one device, and the config's refusals. The
H100 program's cuBLASLt FP8 calls: tests/test_gpu_target.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.models import fp8
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import init_state, to_canonical_layout
from tests.helpers import put_batch, random_batch, run_checked, trainable_for

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


MODEL = C.ModelConfig(
    vocab_size=256, hidden=64, layers=4, heads=4, seq_len=16, compute_dtype="float32",
    fp8="current",
)  # fmt: skip


def _loss_and_grads(data, pipe, tensor, model=MODEL, microbatches=2, **parallel):
    cfg = C.Config(
        model=model,
        parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor, **parallel),
        train=C.TrainConfig(global_batch=2 * data * microbatches, microbatches=microbatches),
    )
    trainable = trainable_for(cfg)
    tokens = random_batch(dataclasses.replace(cfg, parallel=C.ParallelConfig()))
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
    loss, grads = run_checked(
        trainable, make_loss_and_grads(trainable), params, *put_batch(trainable, tokens)
    )
    grads = to_canonical_layout(jax.tree.map(np.asarray, grads), trainable.layout)
    return float(loss), grads


@functools.cache
def _one_device(fp8_recipe: str):
    return _loss_and_grads(1, 1, 1, dataclasses.replace(MODEL, fp8=fp8_recipe))


@pytest.mark.parametrize(
    "mesh,schedule",
    [((1, 2, 2), "1f1b"), ((1, 4, 1), "1f1b"), ((1, 2, 1), "zb_h1")],
    ids=["p2t2", "p4", "p2-zb_h1"],
)
def test_fp8_step_on_a_mesh_equals_one_device(mesh, schedule):
    """Per-tensor scales over the whole tensor (amax across tensor ranks), per microbatch: the
    pipelined, tensor-parallel FP8 step equals the FP8 step on one device with the same
    microbatches, far closer than FP8 is to 32-bit; with a split backward too (W reads X and dY
    through FP8 as the whole backward does)."""
    loss, grads = _loss_and_grads(*mesh, schedule=schedule)
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


def test_fp8_is_named_in_a_bad_config_and_on_a_gpu_without_it():
    cfg = C.apply_overrides(C.Config(), ["model.vocab_size=512", "model.fp8=delayed"])
    with pytest.raises(C.ConfigError, match="model.fp8"):
        C.validate(cfg, 1)


def test_gpt_tiny_trains_in_fp8_within_3_percent_of_32_bit(tmp_path, small_corpus):
    """scripts/train.py, gpt_tiny, 60 steps: with `model.fp8=current` the mean loss of the last
    10 steps is within 3% of the 32-bit run's, and the two differ (the rounding ran)."""
    from tests.test_train_cli import OPTIMIZED_ENV, train

    def losses(name, *sets):
        args = ["--steps", "60", *small_corpus, *[a for s in sets for a in ("--set", s)]]
        return np.array([r["loss"] for r in train(args, tmp_path, name, OPTIMIZED_ENV)])

    fp8_run, full = losses("fp8", "model.fp8=current"), losses("full")
    assert len(fp8_run) == len(full) == 60
    last, last_full = fp8_run[-10:].mean(), full[-10:].mean()
    assert abs(last - last_full) <= 0.03 * last_full, (last, last_full)
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
    from jaxmeg.perf.shape import Shape

    hw = load_hardware("h100_dgx")

    def ratio(shape, **layout):
        base = dict(data=1, pipe=1, microbatches=8, recompute="selective", **layout)
        fp8_time = model.step_time(shape, Layout(**base, fp8="current"), hw).total
        return fp8_time / model.step_time(shape, Layout(**base), hw).total

    gpt_1_3b = Shape(hidden=2048, layers=24, heads=16, seq_len=2048, vocab=51200, mlp_ratio=4)
    llama = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, seq_len=8192, vocab=128256,
                  mlp_ratio=3.5)  # fmt: skip
    small = Shape(hidden=512, layers=8, heads=8, seq_len=2048, vocab=51200, mlp_ratio=4)
    assert ratio(gpt_1_3b, tensor=1, microbatch=4) < 0.95
    assert ratio(llama, tensor=8, microbatch=1) > 1.0
    assert ratio(small, tensor=1, microbatch=4) > 0.98
    with pytest.raises(ValueError, match="--fp8 current needs FP8 GEMMs, which a100_dgx"):
        planner.plan(gpt_1_3b, 8, 32, load_hardware("a100_dgx"), fp8="current")


def test_an_fp8_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """`current` scaling keeps no state: a (1, 2, 2) FP8 run's checkpoint after one step,
    restored into a new run, gives the second step's loss and params bit for bit as the run that
    went on (the SIGTERM path of scripts/train.py saves and restores the same state:
    tests/test_operations.py)."""
    from tests.test_reshard import one_step, restore_step_1, train_one_step_and_save

    cfg = C.Config(
        model=MODEL, parallel=C.ParallelConfig(pipe=2, tensor=2),
        train=C.TrainConfig(global_batch=4, microbatches=2),
        optimizer=C.OptimizerConfig(lr=1e-3, warmup_steps=1),
    )  # fmt: skip
    source = trainable_for(cfg)
    meta = {"config": C.to_dict(source.cfg)}
    state, tokens, _ = train_one_step_and_save(source, tmp_path, meta)
    went_on = one_step(source, state, tokens)
    resumed = trainable_for(cfg)
    loss, params = one_step(resumed, restore_step_1(tmp_path, resumed), tokens)
    assert loss == went_on[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(went_on[1]), strict=True):
        np.testing.assert_array_equal(a, b)
