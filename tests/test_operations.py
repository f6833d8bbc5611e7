"""Operations: exact resume, resharding checkpoints across meshes, SIGTERM, kill -9 during a
save, a corrupted latest checkpoint, non-finite steps, and multi-process runs."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.training.checkpoint import Checkpointer
from jaxmeg.training.state import init_state, to_canonical_layout
from jaxmeg.training.step import make_train_step
from jaxmeg.training.trainer import TrainingStopped, _handle_nonfinite
from tests.helpers import put_batch, random_batch, tiny_config, trainable_for
from tests.test_train_cli import CLEAN_ENV, ROOT, read_metrics, run_train

pytestmark = pytest.mark.timeout(900)
FAST = ["--set", "model.layers=4", "--set", "train.global_batch=8"]


def test_exact_resume(tmp_path, small_corpus):
    whole = run_train([*small_corpus, *FAST, "--steps", "6", "--metrics-file", str(tmp_path / "a")])
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "run"
    first = run_train([*small_corpus, *FAST, "--steps", "3", "--out", str(out)])
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_train([*small_corpus, *FAST, "--steps", "6", "--out", str(out)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 3" in second.stderr
    expected = [r["loss"] for r in read_metrics(tmp_path / "a")]
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == expected  # bit-exact, same mesh
    assert (out / "tensorboard").is_dir() and list((out / "tensorboard").iterdir())


def reshard_config(data, pipe, tensor, schedule="1f1b", chunks=1):
    cfg = tiny_config(data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks)
    model = dataclasses.replace(cfg.model, vocab_size=1024, layers=4, heads=8)
    return dataclasses.replace(
        cfg, model=model, train=C.TrainConfig(global_batch=16, microbatch_size=1)
    )


def one_step(trainable, state, tokens):
    with jax.set_mesh(trainable.mesh):
        state, metrics = make_train_step(trainable)(state, *put_batch(trainable, tokens))
    canonical = to_canonical_layout(state["params"], trainable.pipe)
    return float(metrics["loss"]), jax.tree.map(np.asarray, canonical)


def test_checkpoint_reshards_to_any_mesh(tmp_path):
    source = trainable_for(reshard_config(2, 2, 2, "interleaved_1f1b", 2))
    tokens = random_batch(source.cfg)
    with jax.set_mesh(source.mesh):
        state = init_state(source, seed=0)
        state, _ = make_train_step(source)(state, *put_batch(source, tokens))
    saved = jax.tree.map(np.asarray, to_canonical_layout(state, source.pipe))
    writer = Checkpointer(tmp_path, source)
    writer.save(1, state, {"padded_vocab": source.vocab}, wait=True)
    writer.close()
    ref_loss, ref_params = one_step(source, state, tokens)

    for mesh in [(1, 1, 8), (1, 4, 2), (8, 1, 1)]:
        target = trainable_for(reshard_config(*mesh))
        reader = Checkpointer(tmp_path, target)
        step, restored, _ = reader.restore_latest()
        reader.close()
        assert step == 1
        got = jax.tree.map(np.asarray, to_canonical_layout(restored, target.pipe))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(a, b)  # bit-identical
        # One more step from the restored state == the same step on the original mesh (fp32:
        # loss to 1e-5 relative, parameters to 1e-5 absolute; the AdamW update itself is
        # lr-sized, so this is far below one step's change).
        loss, params = one_step(target, restored, tokens)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def start_train(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "scripts/train.py", "--config", "configs/gpt_tiny.yaml", "--no-progress",
         *args],
        cwd=ROOT, env=CLEAN_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(condition, timeout: float = 300, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)


def metric_steps(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_checkpoints_current_step_and_exits_zero(tmp_path, small_corpus):
    out = tmp_path / "run"
    proc = start_train([*small_corpus, *FAST, "--steps", "1000", "--out", str(out)])
    wait_for(lambda: metric_steps(out / "metrics.jsonl") >= 2 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert "stopped by SIGTERM" in stderr
    assert (
        sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())[-1] == last
    )


def test_kill_during_async_save_resumes_from_complete_checkpoint(tmp_path, small_corpus):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    args = [*small_corpus, *FAST, "--set", "checkpoint.every=1", "--out", str(out)]
    proc = start_train([*args, "--steps", "1000"])
    in_flight: list[int] = []

    def saving_after_a_complete_one():
        if proc.poll() is not None or not ckpts.exists():
            return proc.poll() is not None
        names = os.listdir(ckpts)
        in_flight[:] = [int(n.split(".")[0]) for n in names if "tmp" in n]
        return any(n.isdigit() for n in names) and bool(in_flight)

    wait_for(saving_after_a_complete_one, interval=0.002)
    proc.kill()  # SIGKILL while a step's checkpoint is still a temporary directory
    proc.communicate(timeout=60)
    assert in_flight, "the run ended before a save was caught in flight"
    complete = max(int(n) for n in os.listdir(ckpts) if n.isdigit())
    assert complete < max(in_flight)  # the half-written step never became a checkpoint
    again = run_train([*args, "--steps", str(complete + 2)])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from step {complete}" in again.stderr
    assert "unreadable" not in again.stderr


def test_corrupt_latest_checkpoint_falls_back_with_message(tmp_path, small_corpus):
    out = tmp_path / "run"
    args = [*small_corpus, *FAST, "--set", "checkpoint.every=2", "--out", str(out)]
    first = run_train([*args, "--steps", "4"])
    assert first.returncode == 0, first.stderr[-2000:]
    for path in (out / "checkpoints" / "4").rglob("manifest.ocdbt"):
        path.write_bytes(b"not a manifest")
    again = run_train([*args, "--steps", "5"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"checkpoint of step 4 at {out / 'checkpoints' / '4'} is unreadable" in again.stderr
    assert "resumed from step 2" in again.stderr
    names = os.listdir(out / "checkpoints")
    assert any(n.startswith("4.unreadable") for n in names)  # kept for inspection, not deleted


def test_nonfinite_step_is_skipped_and_counted():
    trainable = trainable_for(tiny_config())
    tokens = random_batch(trainable.cfg)
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, seed=0)
        bias = state["params"]["head"]["final_norm"]["bias"]
        state["params"]["head"]["final_norm"]["bias"] = bias.at[0].set(jnp.nan)
        before = jax.tree.map(np.asarray, state["params"])
        state, metrics = make_train_step(trainable)(state, *put_batch(trainable, tokens))
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    after = jax.tree.map(np.asarray, state["params"])
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    cfg = C.Config(train=C.TrainConfig(max_nonfinite_in_row=3))
    _handle_nonfinite(cfg, 7, {"loss": float("nan"), "grad_norm": 1.0}, in_row=2)
    with pytest.raises(TrainingStopped, match="3 steps in a row skipped"):
        _handle_nonfinite(cfg, 8, {"loss": float("nan"), "grad_norm": 1.0}, in_row=3)
    stop = C.Config(train=C.TrainConfig(nonfinite="stop"))
    with pytest.raises(TrainingStopped, match="train.nonfinite=stop"):
        _handle_nonfinite(stop, 1, {"loss": float("inf"), "grad_norm": 1.0}, in_row=1)


MESH_222 = [
    "--set", "parallel.data=2", "--set", "parallel.pipe=2", "--set", "parallel.tensor=2",
    "--set", "parallel.schedule=interleaved_1f1b", "--set", "parallel.chunks=2",
]  # fmt: skip


def test_two_processes_match_one_process(tmp_path, small_corpus):
    common = [*small_corpus, *MESH_222, "--steps", "3", "--no-progress"]
    one = run_train(["--cpu-devices", "8", *common, "--metrics-file", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        ["bash", "scripts/launch_local.sh", "2", "--config", "configs/gpt_tiny.yaml", *common,
         "--metrics-file", str(tmp_path / "two")],
        cwd=ROOT, env={**CLEAN_ENV, "PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "in 2 process(es)" in two.stderr
    np.testing.assert_allclose(
        [r["loss"] for r in read_metrics(tmp_path / "two")],
        [r["loss"] for r in read_metrics(tmp_path / "one")],
        rtol=1e-6,
    )


def test_missing_peer_fails_within_timeout(small_corpus):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    result = run_train(
        ["--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", "0", "--init-timeout", "5", *small_corpus],
        timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "gave up after 5 s waiting for 2 processes to join at 127.0.0.1" in result.stderr
