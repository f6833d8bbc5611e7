"""Context parallelism in the performance model and the planner: the ring's bytes by hand, its
overlap with the block steps, the placement of a context group, the gradient reduction over
data x context, memory per GPU against c, c = 1 pricing as before the axis existed, and
`plan.py`'s comparison of the best layouts with and without context parallelism."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxmeg.perf.collectives import ring_all_reduce_seconds
from jaxmeg.perf.context import (
    exposed_ring_seconds,
    ring_block_bytes,
    ring_buffer_bytes,
    ring_bytes_per_layer,
)
from jaxmeg.perf.hardware import load_hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.memory import memory_per_gpu
from jaxmeg.perf.model import (
    Shape,
    context_link,
    data_link,
    device_grid,
    layer_seconds,
    params_per_gpu,
    step_time,
    tflops_per_gpu,
)
from jaxmeg.perf.planner import context_sizes, plan
from jaxmeg.perf.traffic import bytes_per_step
from tests.helpers import run_script_main
from tests.test_train_cli import CLEAN_ENV, ROOT

H100 = load_hardware("h100_dgx")
GPT3 = Shape(hidden=12288, layers=96, heads=96, seq_len=2048, vocab=51200)
SHAPE_7B = Shape(hidden=4096, layers=32, heads=32, seq_len=4096, vocab=51200)
LONG_7B = Shape(hidden=4096, layers=36, heads=32, seq_len=32768, vocab=51200)
"""configs/megatron_7.5b.yaml at s = 32768, as docs/planner.md's command plans it."""
PLAN_7B = ["--config", "configs/megatron_7.5b.yaml", "--seq", "32768", "--gpus", "64",
           "--batch", "128", "--hardware", "h100_dgx", "--program", "megatron2021"]  # fmt: skip


def test_ring_bytes_per_layer_by_hand():
    """h 64, 8 heads of 8, s 64, b 2, t 2, c 4: a block is K and V of s / c = 16 tokens, 8 / 2
    heads of 8 per tensor rank, 2 bytes: 2 x 2 x 16 x 4 x 8 x 2 = 4096; the forward sends
    c - 1 = 3 blocks, the backward c - 1 of K, V and c of dK, dV, 7."""
    shape = Shape(hidden=64, layers=4, heads=8, seq_len=64, vocab=128)
    layout = Layout(tensor=2, pipe=1, context=4, data=1, microbatch=2, microbatches=3)
    ring = ring_bytes_per_layer(shape, layout)
    assert (ring.block, ring.forward, ring.backward) == (4096, 3 * 4096, 7 * 4096)
    assert ring.per_layer == 10 * 4096  # 3c - 2 blocks
    assert ring_bytes_per_layer(shape, layout, compute_bytes=4).block == 8192
    # Grouped-query attention: 2 kv heads split over t = 2 (1 per rank); over t = 4 they are
    # replicated, 2 per rank.
    gqa = dataclasses.replace(shape, kv_heads=2)
    assert ring_bytes_per_layer(gqa, layout).block == 1024
    assert ring_bytes_per_layer(gqa, dataclasses.replace(layout, tensor=4)).block == 2048
    # Per step: every layer (4) of every microbatch (3), the forward twice with full recompute.
    traffic = bytes_per_step(shape, layout)
    assert traffic["context_block"] == 4096 and traffic["context_per_layer"] == 10 * 4096
    assert traffic["context"] == 4 * 3 * (2 * 3 + 7) * 4096
    selective = bytes_per_step(shape, dataclasses.replace(layout, recompute="selective"))
    assert selective["context"] == 4 * 3 * (3 + 7) * 4096


def test_the_ring_waits_only_for_what_a_block_step_does_not_hide():
    """1 GB/s, no latency: a 4096-byte block takes 4.096 us. A block step of 1 us forward
    (2 us backward) leaves 3.096 us per forward step and 2 x 4.096 - 2 per backward step, plus
    the last send of dK, dV home; a 10 us step hides every send but that one."""
    shape = Shape(hidden=64, layers=4, heads=8, seq_len=64, vocab=128)
    layout = Layout(tensor=2, pipe=1, context=4, data=1, microbatch=2)
    link, send = (1.0, 0.0), 4096e-9
    forward, backward = exposed_ring_seconds(shape, layout, link, 1e-6)
    assert forward == pytest.approx(3 * (send - 1e-6))
    assert backward == pytest.approx(3 * (2 * send - 2e-6) + send)
    assert exposed_ring_seconds(shape, layout, link, 10e-6) == pytest.approx((0.0, send))
    single = dataclasses.replace(layout, context=1)
    assert exposed_ring_seconds(shape, single, link, 0.0) == (0.0, 0.0)


def test_a_context_group_uses_nvlink_while_c_t_fits_a_node():
    """7.5B at s = 32768: t 2, c 4 is one node's 8 GPUs, and its sends hide behind the block
    steps (only the last dK, dV send is left). t 2, c 8 spans two nodes: the 37.5 GB/s network
    takes 8x longer per byte, yet a block step of 4096 tokens (quadratic in s / c) still hides
    it; at c 16 (2048 tokens) it does not, and part of every step waits."""
    inside = Layout(tensor=2, pipe=1, context=4, data=8, microbatches=16, recompute="selective")
    across = dataclasses.replace(inside, context=8, data=4, microbatches=32)
    farther = dataclasses.replace(inside, context=16, data=2, microbatches=64)
    nvlink = H100.intra_node_gb_per_s * H100.collective_efficiency
    network = H100.inter_node_gb_per_s * H100.collective_efficiency
    assert context_link(inside, H100)[0] == nvlink
    assert context_link(across, H100)[0] == context_link(farther, H100)[0] == network
    for layout, link in ((inside, nvlink), (across, network)):
        layer, block = layer_seconds(LONG_7B, layout, H100), ring_block_bytes(LONG_7B, layout)
        latency = H100.intra_node_latency_us if link == nvlink else H100.inter_node_latency_us
        assert layer.ring_forward == 0.0
        assert layer.ring_backward == pytest.approx(block / (link * 1e9) + latency * 1e-6)
    far = layer_seconds(LONG_7B, farther, H100)
    last_send = ring_block_bytes(LONG_7B, farther) / (network * 1e9) + 8e-6
    assert far.ring_forward > 0 and far.ring_backward > last_send


@pytest.mark.parametrize("outer_axis", ["pipe", "data"])
def test_the_perf_models_device_order_is_the_meshs_with_context(outer_axis):
    from jaxmeg.config import ParallelConfig
    from jaxmeg.parallel.mesh import make_mesh

    for data, pipe in ((2, 1), (1, 2)):
        par = ParallelConfig(data=data, pipe=pipe, context=2, tensor=2, outer_axis=outer_axis)
        ranks = np.vectorize(lambda device: device.id)(make_mesh(par).devices)
        layout = Layout(tensor=2, pipe=pipe, context=2, data=data, outer_axis=outer_axis)
        np.testing.assert_array_equal(device_grid(layout), ranks)


def test_gradients_are_reduced_over_data_x_context():
    """Parameters are replicated over context: d 2, c 4 reduce as one ring of 8, the bytes and
    seconds of d 8 without context; ZeRO-1 shards the optimizer states over the 8."""
    layout = Layout(tensor=2, pipe=1, context=4, data=2, microbatches=8)
    params = params_per_gpu(LONG_7B, layout)
    assert bytes_per_step(LONG_7B, layout)["data"] == pytest.approx(2 * 7 / 8 * 2 * params)
    link = data_link(layout, H100)
    assert link[0] == H100.inter_node_gb_per_s * H100.collective_efficiency  # 16 GPUs
    assert step_time(LONG_7B, layout, H100).data_parallel == pytest.approx(
        ring_all_reduce_seconds(2 * params, 8, link)
    )
    plain = memory_per_gpu(LONG_7B, layout, H100).model_states
    assert plain == 16 * params  # replicated, whatever c
    zero = memory_per_gpu(LONG_7B, dataclasses.replace(layout, zero_stage=1), H100)
    assert zero.model_states == pytest.approx(6 * params + 12 * params / 8)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_memory_per_gpu_falls_with_c(recompute):
    """Every activation term is per token, so c GPUs per sequence keep 1 / c of it each, plus
    the ring's blocks; the model states stay (replicated over context)."""
    base = Layout(tensor=2, pipe=2, data=1, microbatches=8, recompute=recompute)
    one = memory_per_gpu(LONG_7B, base, H100)
    previous = one.total
    for c in (2, 4, 8, 16):
        layout = dataclasses.replace(base, context=c)
        mem = memory_per_gpu(LONG_7B, layout, H100)
        assert mem.model_states == one.model_states
        assert mem.activations == pytest.approx(
            one.activations / c + ring_buffer_bytes(LONG_7B, layout)
        )
        assert mem.total < previous
        previous = mem.total


# Figures of the model before the context axis existed (same layouts, no `context` field),
# which c = 1 must keep: step time, memory per GPU, bytes per link, TFLOP/s. The step times and
# TFLOP/s since the bubble carries no end's work (`perf.model.step_time`, 2026-12-02).
BEFORE_CONTEXT = [
    ("a100_dgx", GPT3,
     Layout(tensor=8, pipe=8, data=2, chunks=2, microbatches=8, schedule="interleaved_1f1b"),
     3.460386163567198, 50529833984.0, (52143587328.0, 201326592.0, 5643915264.0),
     106.0875065205361),
    ("h100_dgx", SHAPE_7B,
     Layout(tensor=2, pipe=4, data=16, microbatch=2, microbatches=8, recompute="selective",
            sequence_parallel=True, outer_axis="data", zero_stage=1),
     1.8831399167820881, 43020682240.0, (17179869184.0, 536870912.0, 3476828160.0),
     201.65460094544792),
    ("a100_ethernet", SHAPE_7B,
     Layout(tensor=1, pipe=4, data=16, chunks=2, microbatches=8, recompute="none",
            zero_stage=3, schedule="breadth_first"),
     11.457681113293622, 51687855104.0, (0.0, 1073741824.0, 11610132480.0),
     33.1431661160951),
]  # fmt: skip


@pytest.mark.parametrize("case", BEFORE_CONTEXT, ids=lambda c: c[0])
def test_context_1_prices_as_before_the_axis(case):
    hw_name, shape, layout, seconds, memory, traffic, tflops = case
    hw = load_hardware(hw_name)
    assert layout.context == 1 and layout == dataclasses.replace(layout, context=1)
    assert step_time(shape, layout, hw).total == pytest.approx(seconds, rel=1e-12)
    assert memory_per_gpu(shape, layout, hw).total == pytest.approx(memory, rel=1e-12)
    got = bytes_per_step(shape, layout)
    assert (got["tensor"], got["pipe"], got["data"]) == pytest.approx(traffic, rel=1e-12)
    assert got["context"] == got["context_per_layer"] == 0.0
    assert tflops_per_gpu(shape, layout, hw) == pytest.approx(tflops, rel=1e-12)
    layer = layer_seconds(shape, layout, hw)
    assert (layer.ring_forward, layer.ring_backward) == (0.0, 0.0)
    # The [d, p, t] grid of before, with context and expert axes of 1 between pipe and tensor.
    d, p, t = layout.data, layout.pipe, layout.tensor
    ranks = np.arange(layout.gpus)
    old = ranks.reshape(d, p, t) if layout.outer_axis == "data" else (
        ranks.reshape(p, d, t).transpose(1, 0, 2)
    )  # fmt: skip
    np.testing.assert_array_equal(device_grid(layout), old[:, :, None, None, :])


def test_the_search_tries_context_for_long_sequences_only():
    assert context_sizes(GPT3) == [1]  # s 2048: no rank would keep 2048 tokens
    assert context_sizes(LONG_7B) == [1, 2, 4, 8, 16]
    assert context_sizes(LONG_7B, 4) == [4]
    assert {p.layout.context for p in plan(GPT3, 1536, 1536, load_hardware("a100_dgx"))} == {1}
    with pytest.raises(ValueError, match="seq_len .32768. must be divisible by 6"):
        plan(LONG_7B, 64, 128, H100, context=3)
    with pytest.raises(ValueError, match="compression is priced without context"):
        plan(LONG_7B, 64, 128, H100, context=4, compression="on")
    assert {p.layout.context for p in plan(LONG_7B, 64, 128, H100, compression="on")} == {1}
    with pytest.raises(ValueError, match="context must be >= 1, got 0"):
        Layout(tensor=1, pipe=1, context=0, data=1)


def test_7b_at_32k_on_64_h100s_picks_context_parallelism():
    """Without context parallelism only full recompute fits: at s = 32768 no layout keeps a
    layer's residuals (selective or none) within 80 GB. Splitting the sequence over c GPUs
    lets a layout keep them all."""
    everything = ("full", "selective", "none")
    plans = plan(LONG_7B, 64, 128, H100, recompute=everything)
    best = plans[0]
    assert best.layout.context > 1 and best.layout.recompute == "none"
    assert best.layout.gpus == 64 and best.memory_per_gpu_gb <= H100.memory_gb
    without = [p for p in plans if p.layout.context == 1]
    assert {p.layout.recompute for p in without} == {"full"}
    assert without[0].step_time_s > 1.2 * best.step_time_s


def _plan(*flags):
    """plan.py's main in this process: what it decides and prints. The docs' example runs it as
    a process (`test_docs_context_example_is_what_plan_py_prints`)."""
    return run_script_main("plan", *flags)


def test_plan_py_prints_the_best_layout_with_and_without_context():
    result = _plan(*PLAN_7B, "--recompute", "full", "selective", "none", "--top", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["t", "p", "c", "d"] and lines[1].endswith("ring MB")
    best = lines[2].split()
    assert int(best[2]) > 1 and best[6] == "none"
    ring_mb = float(best[-1])
    assert ring_mb > 0
    at = next(i for i, line in enumerate(lines) if line.startswith("without context parallelism"))
    assert "no layout" not in lines[at] and "x the fastest plan's" in lines[at]
    without = lines[at + 2].split()
    assert int(without[2]) == 1 and without[6] == "full" and float(without[-1]) == 0.0

    as_json = _plan(*PLAN_7B, "--recompute", "full", "selective", "none", "--json")
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["context"] > 1
    assert out["context_bytes_per_layer"] / 1e6 == pytest.approx(ring_mb, abs=0.05)
    assert out["tensor"] * out["pipe"] * out["context"] * out["data"] == 64
    assert out["without_context"]["context"] == 1
    assert out["without_context"]["step_time_s"] > out["step_time_s"]


def test_plan_py_context_flag():
    forbidden = _plan(*PLAN_7B, "--context", "1", "--json")
    assert forbidden.returncode == 0, forbidden.stderr
    out = json.loads(forbidden.stdout)
    assert out["context"] == 1 and "without_context" not in out
    pinned = _plan(*PLAN_7B, "--context", "8", "--json")
    assert pinned.returncode == 0, pinned.stderr
    out = json.loads(pinned.stdout)  # and the fastest of a search at c = 1 beside it
    assert out["context"] == 8 and out["without_context"]["context"] == 1
    nothing = _plan(*PLAN_7B, "--context", "1", "--recompute", "selective", "none")
    assert nothing.returncode == 1 and "no layout" in nothing.stderr
    for bad in ("0", "two"):
        result = _plan(*PLAN_7B, "--context", bad)
        assert result.returncode == 2 and "--context" in result.stderr
    with_compression = _plan(*PLAN_7B, "--context", "4", "--compression", "on")
    assert with_compression.returncode == 2 and "--context" in with_compression.stderr


def test_docs_context_example_is_what_plan_py_prints():
    """docs/planner.md's context parallelism example, its command run as written."""
    text = (ROOT / "docs" / "planner.md").read_text()
    section = text[text.index("## Context parallelism") :]
    block = re.search(r"```\n\$ (python scripts/plan\.py.*?)```", section, re.S).group(1)
    command, _, printed = block.replace("\\\n", " ").partition("\n")
    result = subprocess.run(
        [sys.executable, "scripts/plan.py", *command.split()[2:]],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=CLEAN_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == printed
