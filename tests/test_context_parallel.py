"""Context parallelism: the sequence split over `context` (load-balanced), attention as a ring
of key/value blocks (an all-gather within the context group inside pipeline stages). Loss and
every gradient equal one device's on the whole sequence; the ring's sends and the memory it
saves read from the compiled program; bad layouts named before any compile; a checkpoint
written at context 4 resumes at context 1 and 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.parallel import context, make_mesh
from jaxmeg.parallel.hlo import collectives
from jaxmeg.training.compilation import compile_step, memory_report
from jaxmeg.training.state import Trainable, init_state, to_canonical_layout
from jaxmeg.training.step import make_loss_and_grads
from tests.helpers import put_batch, random_batch, replace_model, tiny_config, trainable_for
from tests.test_train_cli import CLEAN_ENV, ROOT

TOL = 1e-5  # fp32: only the order of reductions differs (relative, and x the largest entry)


def test_load_balanced_order_gives_every_rank_the_same_causal_work():
    assert context.load_balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    for c in (2, 4):
        table = context.load_balanced_order(32, c).reshape(c, -1)
        pairs = [int((rows[:, None] >= np.arange(32)[None, :]).sum()) for rows in table]
        assert len(set(pairs)) == 1, pairs  # (query, key) pairs under the causal mask
    with pytest.raises(ValueError, match="not divisible by 2 x context"):
        context.load_balanced_order(12, 4)


def loss_and_grads(block: str = "gpt", layers: int = 2, remat: str = "none",
                   dtype: str = "float32", hlo: list | None = None, **parallel):  # fmt: skip
    """Loss and canonical gradients of the step at the initial params on a random batch; the
    compiled step's text appended to `hlo` where given."""
    cfg = tiny_config(**parallel)
    cfg = replace_model(
        cfg, block=block, kv_heads=2 if block == "llama" else -1, layers=layers,
        remat=remat, compute_dtype=dtype, tie_embeddings=block == "gpt",
    )  # fmt: skip
    if parallel.get("schedule") == "interleaved_1f1b":
        cfg = C.apply_overrides(cfg, ["train.microbatches=4"])
    trainable = trainable_for(cfg)
    tokens = random_batch(trainable.cfg, 0)
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, seed=0)
        args = (state["params"], *put_batch(trainable, tokens))
        compiled = jax.jit(make_loss_and_grads(trainable)).lower(*args).compile()
        loss, grads = compiled(*args)
    if hlo is not None:
        hlo.append((compiled.as_text(), trainable.mesh))
    return float(loss), jax.tree.map(np.asarray, to_canonical_layout(grads, trainable.layout))


def assert_close(got, want, tol: float) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=tol)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want[1]),
                            jax.tree.leaves(got[1]), strict=True):  # fmt: skip
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * float(np.abs(w).max()),
                                   err_msg=jax.tree_util.keystr(path))  # fmt: skip


REFERENCES: dict = {}


def reference(block: str, layers: int, dtype: str = "float32"):
    """One device's loss and gradients, without rematerialization: a rematerialized step
    computes the same numbers."""
    key = (block, layers, dtype)
    if key not in REFERENCES:
        REFERENCES[key] = loss_and_grads(block, layers, dtype=dtype)
    return REFERENCES[key]


CASES = {  # block, (data, pipe, context, tensor) and what else the layout sets
    # the ring (no pipeline)
    "llama-1141": ("llama", dict(context=4)),
    "llama-1122_sp-selective": (
        "llama", dict(context=2, tensor=2, sequence_parallel=True, remat="selective")
    ),
    "llama-1122-full": ("llama", dict(context=2, tensor=2, remat="full")),
    "llama-1122-bf16": ("llama", dict(context=2, tensor=2, dtype="bfloat16")),
    "gpt-2122-zero1": ("gpt", dict(data=2, context=2, tensor=2, zero_stage=1)),
    "gpt-2122-zero3": ("gpt", dict(data=2, context=2, tensor=2, zero_stage=3)),
    # a GPU's schedule: the last microbatch's B reduces its second layer in the slot (the mean
    # over data x context; with ZeRO-1 the context ranks' sum, then the reduce-scatter)
    "gpt-1121-overlap-sends": ("gpt", dict(context=2, overlap_sends=True)),
    "gpt-2122-zero1-overlap-sends": (
        "gpt", dict(data=2, context=2, tensor=2, zero_stage=1, overlap_sends=True)
    ),
    # pipelines, the context group's key/value blocks gathered in each stage
    "gpt-1222-interleaved": (
        "gpt", dict(pipe=2, context=2, tensor=2, schedule="interleaved_1f1b", chunks=2)
    ),
    "llama-1221-selective": ("llama", dict(pipe=2, context=2, remat="selective")),
    "llama-1221-full": ("llama", dict(pipe=2, context=2, remat="full")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_one_device(name):
    """GPT (tied) and Llama (grouped-query attention, rotary, untied) on the ring and in
    pipelines (1F1B and interleaved, with tensor parallelism); on the ring with four ranks and
    with sequence parallelism; ZeRO-1 and ZeRO-3 over `data` with the context ranks' gradients
    summed first; every model.remat on the ring and on a pipeline; bf16 compute to bf16's
    precision on the ring (bf16 pipelines: tests/test_pipeline.py's bf16 case)."""
    block, parallel = CASES[name]
    layers = 4 if "interleaved" in name else 2
    dtype = parallel.get("dtype", "float32")
    tol = 2e-2 if dtype == "bfloat16" else TOL
    hlo = [] if name == "llama-1141" else None
    assert_close(loss_and_grads(block, layers, hlo=hlo, **parallel),
                 reference(block, layers, dtype), tol)  # fmt: skip
    if hlo:
        assert_ring_sends_blocks_and_never_gathers_the_sequence(*hlo[0])


def assert_ring_sends_blocks_and_never_gathers_the_sequence(text, mesh):
    """(1, 1, 4, 1), Llama of 2 layers: every collective over `context` is a
    collective-permute of one key or value block (or its gradient) [b, s / c, kv_heads,
    head_dim]; per layer at least the forward's c - 1 K and V sends and the backward's c dK and
    dV sends, at most those plus the backward's own c - 1 K and V sends; no all-gather over
    `context`."""
    found = [c for c in collectives(text, mesh) if "context" in c.axes]
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert {c.kind for c in found} <= {"collective-permute", "all-reduce"}, found
    # [b = 8 / 2 microbatches, s / c = 4, kv heads 2, head dim 16] fp32
    assert {c.bytes for c in permutes} == {4 * 4 * 2 * 16 * 4}, {c.bytes for c in permutes}
    c, layers = 4, 2
    least = 2 * (c - 1) + 2 * c
    assert least * layers <= len(permutes) <= (least + 2 * (c - 1)) * layers, len(permutes)


def test_attention_memory_per_device_at_context_4_is_a_quarter():
    """memory_analysis() of gpt_tiny's step at s = 4096, global batch 4 (microbatches of 1):
    temp bytes per device at context 4 on 4 devices <= 0.35 x context 1 on one (0.26 here)."""
    base = C.load(ROOT / "configs" / "gpt_tiny.yaml", [
        "model.seq_len=4096", "model.vocab_size=4096", "train.global_batch=4",
        "train.microbatches=4"])  # fmt: skip
    temp = {}
    for c in (1, 4):
        cfg = C.validate(C.apply_overrides(base, [f"parallel.context={c}"]), c)
        compiled, _ = compile_step(Trainable.create(cfg, make_mesh(cfg.parallel,
                                                                   jax.devices()[:c])))  # fmt: skip
        temp[c] = memory_report(compiled)["temp_bytes"]
    assert temp[4] <= 0.35 * temp[1], temp


@pytest.mark.parametrize(
    "sets,devices,message",
    [
        (["parallel.context=4", "model.seq_len=12"], 4,
         "model.seq_len (12) must be divisible by 8"),
        (["parallel.context=2", "model.attention=cudnn"], 2,
         "model.attention=cudnn does not return"),
        (["parallel.context=2", "parallel.pipe=2", "parallel.schedule=zb_h1"], 4,
         "not yet with parallel.schedule=zb_h1"),
        (["parallel.context=2", "parallel.data=2", "compression.data_grad_rank=4"], 4,
         "compression.data_grad_rank"),
        (["parallel.context=2", "parallel.tensor=4", "model.seq_len=12"], 8,
         "model.seq_len / context (6) divisible by parallel.tensor"),
        (["parallel.context=0"], 1, "parallel.context must be a positive integer, got 0"),
        (["parallel.context=2", "parallel.data=2"], 2,
         "parallel.data * parallel.pipe * parallel.context * parallel.tensor = 2 * 1 * 2 * 1"),
    ],
)  # fmt: skip
def test_bad_context_layouts_are_named(sets, devices, message):
    import re

    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.validate(C.apply_overrides(tiny_config(), sets), devices)


def test_a_cluster_places_each_context_group_on_one_host():
    """NIC-aware placement (Holmes) with context: a context group's c t devices sit on one host
    of one NIC type, as a tensor group's do; data groups stay within one NIC type."""
    from jaxmeg.parallel.placement import DeviceRecord, data_groups_across_groups, place

    types = ["roce", "ib", "ib", "roce"]  # hosts of 2 devices, NIC types out of order
    records = [DeviceRecord(i, f"h{i // 2}", types[i // 2]) for i in range(8)]
    placement = place(records, ["ib", "roce"], data=2, pipe=2, tensor=2 * 1, mode="auto")
    par = C.ParallelConfig(data=2, pipe=2, context=2)
    mesh = make_mesh(par, jax.devices()[:8], placement)
    assert mesh.devices.shape == (2, 2, 2, 1, 1)  # (data, pipe, context, expert, tensor)
    host = np.vectorize(lambda device: device.id // 2)(mesh.devices)
    assert (host.min(axis=2) == host.max(axis=2)).all()  # every context group on one host
    assert data_groups_across_groups(placement) == 0
    assert placement.stage_groups() == ["ib", "roce"]


def train(out, *args):
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "configs/gpt_tiny.yaml", "--no-progress",
         "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=CLEAN_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_train_py_at_context_4_equals_one_device_and_resumes_at_context_1_and_2(
    tmp_path, small_corpus
):
    """scripts/train.py on (1, 1, 4, 2): losses equal one device's; its checkpoint at step 3
    resumes at context 1 and 2 with the uninterrupted run's losses. (Two layers: what the claim
    needs, and each of the four processes compiles its step.)"""
    common = [*small_corpus, "--set", "model.seq_len=256", "--set", "model.layers=2",
              "--set", "train.global_batch=4"]  # fmt: skip
    one = train(tmp_path / "one", *common, "--steps", "5")
    four = train(tmp_path / "four", *common, "--steps", "3", "--cpu-devices", "8",
                 "--set", "parallel.context=4", "--set", "parallel.tensor=2")  # fmt: skip
    np.testing.assert_allclose(four, one[:3], rtol=1e-4)
    for c in (1, 2):
        run = tmp_path / f"resume{c}"
        shutil.copytree(tmp_path / "four", run)
        resumed = train(run, *common, "--steps", "5", "--cpu-devices", str(c),
                        "--set", f"parallel.context={c}")  # fmt: skip
        np.testing.assert_allclose(resumed, one, rtol=1e-4)  # steps 1-3 kept, 4-5 resumed
