"""FP8 for the routed experts' grouped GEMMs (`model.fp8`, `jaxmeg.models.grouped_gemm`):
current and delayed scales on expert x tensor and pipelined layouts against one device. The
recipes themselves and the dense linears: tests/test_fp8.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.models import fp8
from jaxmeg.training.amax_history import take_seen
from tests.helpers import without_bound_counts
from tests.test_fp8 import MODEL, _histories_after, _run

EXPERTS = C.MoeConfig(experts=4, top_k=2, ffn_hidden=32, capacity_factor=1.0)
"""A capacity factor: the experts run batched GEMMs, in FP8 with `model.fp8`; dropless
(capacity factor 0), ragged ones."""


@functools.cache
def _moe_loss_and_grads(
    fp8_recipe, global_batch, expert=1, pipe=1, tensor=1, schedule="1f1b", capacity=1.0,
    warm=False,
):  # fmt: skip
    """`warm` (delayed scaling): the histories after one device's first step set first."""
    cfg = C.Config(
        model=dataclasses.replace(MODEL, block="llama", layers=2, fp8=fp8_recipe, fp8_history=4),
        moe=dataclasses.replace(EXPERTS, capacity_factor=capacity),
        parallel=C.ParallelConfig(pipe=pipe, tensor=tensor, expert=expert, schedule=schedule),
        train=C.TrainConfig(global_batch=global_batch, microbatches=2),
    )
    histories = None
    if warm:
        first = _moe_loss_and_grads(fp8_recipe, global_batch, capacity=capacity)[1]
        histories = _histories_after(first, cfg.model.fp8_history)
    loss, grads = _run(cfg, histories)
    return loss, without_bound_counts(grads)


@pytest.mark.parametrize(
    "layout",
    [
        dict(expert=2, tensor=2),
        dict(pipe=2, schedule="zb_h1", capacity=0.0),
        dict(expert=2, pipe=2, schedule="zb_h1", capacity=0.0),
    ],
    ids=["e2t2", "p2-zb_h1-dropless", "e2p2-zb_h1-dropless"],
)  # the delayed test below runs dropless expert x tensor (the amaxes reduced over both)
def test_the_experts_grouped_gemms_in_fp8_equal_one_device(layout):
    """The experts' grouped GEMMs run on FP8 operands too, one scale per operand over all
    experts (`grouped_gemm.fp8_grouped`): with a capacity factor batched GEMMs, dropless the
    ragged ones, whose exchange's written-out backward and a split backward's W quantize dY and
    the rows as the whole backward does. Split over expert x tensor ranks each amax is reduced
    over them; loss and gradients equal one device running the same microbatches, far closer
    than the experts' FP8 is to 16/32-bit."""
    batch = 4 * layout.get("expert", 1)  # 2 microbatches of 2 sequences per expert rank
    capacity = layout.get("capacity", 1.0)
    loss, grads = _moe_loss_and_grads("current", batch, **layout)
    ref_loss, ref_grads = _moe_loss_and_grads("current", batch, capacity=capacity)
    _, full_grads = _moe_loss_and_grads("none", batch, capacity=capacity)
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    for (path, ref), got in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        scale = float(np.abs(ref).max()) or 1.0
        # 1e-4: e2t2's attention out-projection differs by 5.9e-5 on an AMD EPYC host (XLA:CPU's
        # sum order follows the host), under 1e-5 on CI's; the experts' FP8 rounds by > 1e-2
        assert float(np.abs(got - ref).max()) / scale < 1e-4, jax.tree_util.keystr(path)
    experts, full = ref_grads["blocks"]["layers"]["moe"], full_grads["blocks"]["layers"]["moe"]
    for name in ("w_in", "w_out", "w_gate"):  # the experts' FP8 did round
        assert float(np.abs(experts[name] - full[name]).max()) > 1e-2 * np.abs(full[name]).max()


@pytest.mark.parametrize(
    "layout",
    [
        dict(expert=2, tensor=2),
        dict(expert=2, tensor=2, capacity=0.0),
        dict(pipe=2, schedule="zb_h1", capacity=0.0),
        dict(expert=2, pipe=2, schedule="zb_h1", capacity=0.0),
    ],
    ids=["e2t2", "e2t2-dropless", "p2-zb_h1-dropless", "e2p2-zb_h1-dropless"],
)
def test_the_experts_delayed_fp8_scales_equal_one_device(layout):
    """Delayed scaling for the experts' grouped GEMMs too: each expert weight keeps its amax
    history and seen bins (one scale per operand over all experts); the exchange's written-out
    backward reports x's, w's and dY's amaxes over expert x tensor ranks, and a split
    backward's W rounds at the forward's scales. From histories of one device's first step,
    loss, gradients and the bounds each expert GEMM saw equal one device's, and the history's
    scales are the ones used (the gradients differ from a step at empty histories)."""
    batch = 4 * layout.get("expert", 1)
    capacity = layout.get("capacity", 1.0)
    loss, grads = _moe_loss_and_grads("delayed", batch, warm=True, **layout)
    ref_loss, ref_grads = _moe_loss_and_grads("delayed", batch, capacity=capacity, warm=True)
    _, cold_grads = _moe_loss_and_grads("delayed", batch, capacity=capacity)
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    grads, counts = take_seen(grads)
    ref_grads, ref_counts = take_seen(ref_grads)
    moe = ("blocks", "layers", "moe")
    experts = {(*moe, name + fp8.HISTORY) for name in ("w_in", "w_out", "w_gate")}
    assert experts <= counts.keys() == ref_counts.keys()
    for key, c in counts.items():
        np.testing.assert_array_equal(fp8.bound(c), fp8.bound(ref_counts[key]), key)
        assert fp8.bound(c).min() > 0
    for (path, ref), got in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        scale = float(np.abs(ref).max()) or 1.0
        assert float(np.abs(got - ref).max()) / scale < 1e-5, jax.tree_util.keystr(path)
    warm, cold = ref_grads["blocks"]["layers"]["moe"], take_seen(cold_grads)[0]
    for name in ("w_in", "w_out", "w_gate"):
        cold_w = cold["blocks"]["layers"]["moe"][name]
        assert float(np.abs(warm[name] - cold_w).max()) > 1e-3 * np.abs(cold_w).max(), name
