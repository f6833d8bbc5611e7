"""Operations in one process: exact resume, SIGTERM, kill -9 during a save, a corrupted latest
checkpoint, non-finite steps (multi-process runs: test_multiprocess.py; resharding checkpoints
across layouts: test_reshard.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.training.checkpoint_meta import schedule_changes, schedule_of
from jaxmeg.training.hooks import TrainingStopped, check_finite
from jaxmeg.training.run_log import drop_records_after
from jaxmeg.training.state import init_state
from jaxmeg.training.step import make_train_step
from tests.helpers import put_batch, random_batch, tiny_config, trainable_for
from tests.test_train_cli import CLEAN_ENV, ROOT, read_metrics, run_train

pytestmark = pytest.mark.timeout(900)
FAST = ["--set", "model.layers=4", "--set", "train.global_batch=8", "--set",
        "optimizer.warmup_steps=2"]  # fmt: skip
"""The runs' small model; every run that changes nothing else compiles the same step (one XLA
cache entry). Warm-up ends at step 2, so the steps after it run on the cosine decay."""
EVERY_2 = ["--set", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, small_corpus) -> Path:
    """A run directory of 4 FAST steps with checkpoint.every=2 (checkpoints 2 and 4); tests that
    change a run work on a copy (`copy_run`)."""
    out = tmp_path_factory.mktemp("four-steps") / "run"
    first = run_train([*small_corpus, *FAST, *EVERY_2, "--steps", "4", "--out", str(out)])
    assert first.returncode == 0, first.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


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


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory, small_corpus) -> tuple[Path, int, str]:
    """(run directory, exit code, stderr) of an uninterrupted FAST run of 1000 steps (no periodic
    checkpoints) that got SIGTERM after its 6th step: the reference of `test_exact_resume`."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    proc = start_train([*small_corpus, *FAST, "--steps", "1000", "--out", str(out)])
    wait_for(lambda: metric_steps(out / "metrics.jsonl") >= 6 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    return out, proc.returncode, stderr


def test_exact_resume(tmp_path, small_corpus, four_steps, sigterm_run):
    # The first half stopped at step 4 (`--steps 4`) must not have shortened the schedule: its
    # resumed steps 5-6 match the uninterrupted run (`--steps 1000`), on the cosine decay.
    whole, code, stderr = sigterm_run
    assert code == 0, stderr[-2000:]
    out = copy_run(four_steps, tmp_path)
    second = run_train([*small_corpus, *FAST, *EVERY_2, "--steps", "6", "--out", str(out)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stderr
    assert "learning-rate schedule differs" not in second.stderr
    expected = read_metrics(whole / "metrics.jsonl")[:6]
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in expected]
    assert expected[4]["lr"] < expected[3]["lr"] < expected[2]["lr"]  # past warm-up: decaying
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]  # bit-exact, same mesh
    assert (out / "tensorboard").is_dir() and list((out / "tensorboard").iterdir())


def test_schedule_change_on_resume_is_named():
    cfg = C.validate(C.Config(model=C.ModelConfig(vocab_size=512)), 1)
    meta = {"schedule": schedule_of(cfg)}
    assert schedule_changes(meta, cfg) == []
    other = C.with_steps(C.apply_overrides(cfg, ["optimizer.lr=0.5"]), 10)
    longer = C.validate(C.Config(model=cfg.model, train=C.TrainConfig(steps=600)), 1)
    assert schedule_changes(meta, other) == ["optimizer.lr 0.001 -> 0.5"]
    assert schedule_changes(meta, longer) == ["optimizer.decay_steps 280 -> 580"]


def test_incompatible_config_is_refused_and_checkpoint_kept(tmp_path, small_corpus, four_steps):
    out = copy_run(four_steps, tmp_path)
    before = sorted(os.listdir(out / "checkpoints"))
    again = run_train([*small_corpus, *FAST, "--set", "model.layers=2", "--out", str(out)])
    assert again.returncode == 2
    assert f"checkpoint {out / 'checkpoints' / '4'} was written for another model" in again.stderr
    assert "model.layers is 4 there, 2 here" in again.stderr
    assert "unreadable" not in again.stderr
    assert sorted(os.listdir(out / "checkpoints")) == before  # nothing moved or deleted


def corrupt(step_dir: Path) -> None:
    for path in step_dir.rglob("manifest.ocdbt"):
        path.write_bytes(b"not a manifest")


def test_nonfinite_run_counts_skips_across_resume_and_stops(tmp_path, small_corpus):
    # A learning rate of 1e30 blows the weights up in the first update: every later loss is NaN.
    out = tmp_path / "run"
    args = [*small_corpus, *FAST, "--set", "optimizer.lr=1e30", "--set", "optimizer.warmup_steps=0",
            "--set", "train.max_nonfinite_in_row=2", "--out", str(out)]  # fmt: skip
    first = run_train([*args, "--steps", "2"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert "non-finite loss or gradient at step 2" in first.stderr
    # resumed with one skip in a row already counted: the next skip is the second in a row
    second = run_train([*args, "--steps", "10"])
    assert second.returncode == 1, second.stderr[-2000:]
    assert "jaxmeg: stopped: non-finite loss or gradient at step 3" in second.stderr
    assert "2 steps in a row skipped" in second.stderr
    records = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 0), (2, 1), (3, 2)]
    # train.nonfinite=stop: test_nonfinite_step_is_skipped_and_counted (the same check_finite)


def test_resume_on_a_mesh_with_another_vocab_padding(tmp_path, small_corpus):
    """train.py resumes a run whose vocabulary padding changes with the mesh: tokenizer_vocab =
    512 pads to 512 rows at tensor = 2 and to 1024 at tensor = 8. (From an interleaved ZeRO-3
    (2, 2, 2) checkpoint, array by array: test_checkpoint_reshards_to_any_mesh_zero_stage_and_
    vocab_padding.)"""
    out = tmp_path / "run"
    common = [*small_corpus, *FAST, "--set", "model.heads=8", "--set", "train.microbatches=4",
              "--out", str(out)]  # fmt: skip
    first = run_train([*common, "--cpu-devices", "2", "--set", "parallel.tensor=2", "--steps", "1"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert "(padded 512)" in first.stderr
    again = run_train([*common, "--cpu-devices", "8", "--set", "parallel.tensor=8", "--steps", "2"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(padded 1024)" in again.stderr and "resumed from step 1" in again.stderr
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert np.isfinite(records[-1]["loss"])


def test_sigterm_checkpoints_current_step_and_exits_zero(sigterm_run):
    out, code, stderr = sigterm_run
    assert code == 0, stderr[-2000:]
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert last >= 6
    assert "stopped by SIGTERM" in stderr
    # checkpoint.every is 0: the one checkpoint is the one SIGTERM wrote
    assert [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()] == [last]


class StderrLines:
    """Collects a child's stderr lines (or `stream`'s) as they come (a pipe that nobody reads
    can fill up)."""

    def __init__(self, proc: subprocess.Popen, stream=None):
        self.lines: list[str] = []
        stream = proc.stderr if stream is None else stream
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def text(self) -> str:
        self._thread.join(timeout=60)
        return "".join(self.lines)


def checkpoint_names(out: Path) -> list[str]:
    return sorted(os.listdir(out / "checkpoints"))


def test_sigterm_during_start_up_exits_zero_and_keeps_checkpoints(
    tmp_path, small_corpus, four_steps
):
    out = copy_run(four_steps, tmp_path)
    before = checkpoint_names(out)
    proc = start_train([*small_corpus, *FAST, "--steps", "1000", "--out", str(out)])
    stderr = StderrLines(proc)
    wait_for(lambda: stderr.has("mesh data=") or proc.poll() is not None, interval=0.01)
    proc.send_signal(signal.SIGTERM)  # while it restores and compiles: before the first step
    assert proc.wait(timeout=300) == 0, stderr.text()[-2000:]
    assert "stopped by SIGTERM" in stderr.text()
    assert checkpoint_names(out) == before
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_sigterm_during_start_up_of_a_fresh_run_writes_nothing(tmp_path, small_corpus):
    # Without --out the announcement says "then exiting (no --out)":
    # test_sigterm_announcement_is_not_lost_when_the_run_ends_first.
    out, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    proc = start_train([*small_corpus, *FAST, "--steps", "1000", "--out", str(out),
                        "--metrics-file", str(metrics)])  # fmt: skip
    stderr = StderrLines(proc)
    wait_for(lambda: stderr.has("mesh data=") or proc.poll() is not None, interval=0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, stderr.text()[-2000:]
    text = stderr.text()
    assert "stopped by SIGTERM" in text and "no step trained (at step 0)" in text
    assert "then checkpointing and exiting" in text
    # no checkpoint directory, metrics file or TensorBoard events
    assert not out.exists(), sorted(out.rglob("*"))
    assert not metrics.exists()


def test_sigterm_announcement_is_not_lost_when_the_run_ends_first(monkeypatch):
    # A watcher that is slow to announce (as on a loaded machine) must still announce before the
    # `with` block lets the process go on to exit; the old code left it to a daemon thread.
    from jaxmeg.training import signals as S

    said: list[str] = []

    def slow_say(message: str) -> None:
        time.sleep(0.5)
        said.append(message)

    monkeypatch.setattr(S, "say", slow_say)
    with S.StopSignals(checkpointing=False) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stop.received is not None, timeout=10, interval=0.001)
    assert said and said[0].startswith("SIGTERM: finishing the steps already started")
    assert "then exiting (no --out)" in said[0]
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # the handlers were put back
    assert not stop._watcher.is_alive()  # the watcher ended at the pipe's end-of-file


def test_second_sigterm_stops_at_once(tmp_path, small_corpus):
    out = tmp_path / "run"
    # Long steps (a big batch), so that both signals arrive while XLA runs one: the main thread
    # is busy in C++ then, and only the watcher of the signal wake-up fd sees the second signal.
    proc = start_train([*small_corpus, *FAST, "--set", "train.global_batch=64", "--steps", "1000",
                        "--out", str(out)])  # fmt: skip
    stderr = StderrLines(proc)
    wait_for(lambda: metric_steps(out / "metrics.jsonl") >= 1 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), stderr.text()[-2000:]
    # The first signal reached the run's handling (a process without it would also die of the
    # signal); the second ended it without the checkpoint-and-exit path.
    assert "SIGTERM: finishing the steps already started" in stderr.text(), stderr.text()[-2000:]
    assert "stopped by SIGTERM" not in stderr.text()


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


def test_corrupt_latest_checkpoint_falls_back_with_message(tmp_path, small_corpus, four_steps):
    out = copy_run(four_steps, tmp_path)
    args = [*small_corpus, *FAST, *EVERY_2, "--out", str(out)]
    corrupt(out / "checkpoints" / "4")
    again = run_train([*args, "--steps", "5"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"checkpoint of step 4 at {out / 'checkpoints' / '4'} is unreadable" in again.stderr
    assert "resumed from step 2" in again.stderr
    # one clear line: no TensorStore spec reprs, no tracebacks from the failed reads
    assert "TensorStore(" not in again.stderr and "Traceback" not in again.stderr
    assert len(again.stderr.splitlines()) < 12, again.stderr[-3000:]
    names = os.listdir(out / "checkpoints")
    assert any(n.startswith("4.unreadable") for n in names)  # kept for inspection, not deleted
    # steps 3 and 4 were trained again: metrics.jsonl holds each step once
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # With every checkpoint unreadable: the newest is moved aside, the oldest is kept in place,
    # and the run stops with an error instead of starting again from step 0.
    steps = sorted(int(n) for n in checkpoint_names(out) if n.isdigit())
    assert steps == [2, 4, 5]
    for step in steps:
        corrupt(out / "checkpoints" / str(step))
    last = run_train([*args, "--steps", "6"])
    assert last.returncode == 2
    assert f"step 2 at {out / 'checkpoints' / '2'} is unreadable" in last.stderr
    assert "no older checkpoint to fall back to; it was left in place" in last.stderr
    assert sorted(int(n) for n in checkpoint_names(out) if n.isdigit()) == [2]


def test_resumed_metrics_drop_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {i}, "loss": 1.0}}\n' for i in range(1, 6)) + '{"st')
    drop_records_after(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    drop_records_after(path, 0)
    assert path.read_text() == ""


def test_a_fresh_run_starts_its_metrics_file_empty(tmp_path):
    from jaxmeg.training.run_log import RunLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n')
    log = RunLog(2, 0, str(path), None, progress=False)
    log.record({"step": 1, "loss": 1.0})
    log.close()
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]


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
    check_finite(cfg, 7, {"loss": float("nan"), "grad_norm": 1.0}, in_row=2)
    with pytest.raises(TrainingStopped, match="3 steps in a row skipped"):
        check_finite(cfg, 8, {"loss": float("nan"), "grad_norm": 1.0}, in_row=3)
    stop = C.Config(train=C.TrainConfig(nonfinite="stop"))
    with pytest.raises(TrainingStopped, match="train.nonfinite=stop"):
        check_finite(stop, 1, {"loss": float("inf"), "grad_norm": 1.0}, in_row=1)


def test_a_stop_signal_finishes_the_steps_started_records_them_and_saves_the_last(
    tmp_path, small_corpus
):
    """The loop starts each step before it reads the one before (the host does not wait for
    the devices between steps): a signal while step k runs lets k and the step queued behind
    it finish, at most 2 steps past the last recorded when it came. Each is in metrics.jsonl,
    and the checkpoint is of the last."""
    import signal as signal_module

    from jaxmeg import config
    from jaxmeg.training import Trainer
    from jaxmeg.training.signals import StopSignals

    overrides = [small_corpus[i + 1] for i in range(0, len(small_corpus), 2)]
    sets = ["model.layers=2", "parallel.data=8", "train.global_batch=8", "train.steps=50"]
    cfg = config.load(ROOT / "configs" / "gpt_tiny.yaml", [*overrides, *sets])
    out = tmp_path / "run"
    with StopSignals(checkpointing=True) as signals:
        trainer = Trainer(cfg, out_dir=str(out), show_progress=False, signals=signals)
        recorded_at_signal = []

        def signal_at_3(info):
            if info.step == 3:
                recorded_at_signal.append(info.step)
                os.kill(os.getpid(), signal_module.SIGTERM)

        trainer.add_hook(signal_at_3)
        summary = trainer.run()
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert summary["stopped_by"] == "SIGTERM" and recorded_at_signal == [3]
    assert steps == list(range(1, steps[-1] + 1)) and 3 < steps[-1] <= 3 + 2, steps
    assert summary["checkpoints"] == [steps[-1]] == [summary["last_step"]]
    assert checkpoint_names(out) == [str(steps[-1])]


def test_trainer_as_a_library_steps_with_hooks(tmp_path, small_corpus):
    from jaxmeg import config
    from jaxmeg.training import StepInfo, Trainer

    overrides = [small_corpus[i + 1] for i in range(0, len(small_corpus), 2)]
    sets = ["model.layers=2", "parallel.data=8", "train.global_batch=8", "train.steps=5",
            "checkpoint.every=2"]  # fmt: skip
    cfg = config.load(ROOT / "configs" / "gpt_tiny.yaml", [*overrides, *sets])
    trainer = Trainer(cfg, out_dir=str(tmp_path / "run"), show_progress=False)
    seen, states = [], []
    trainer.add_hook(lambda info: seen.append(info.step), every=2)
    trainer.add_hook(lambda info: states.append(info.state is not None), every=5, needs_state=True)
    assert trainer.start() and trainer.log is None  # compiled; the progress bar and the
    # metrics sinks open at the first step, so the ETA never counts the compile
    infos = list(trainer.steps())
    assert all(isinstance(i, StepInfo) for i in infos) and [i.step for i in infos] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert seen == [2, 4] and states == [True]
    assert all(np.isfinite(i.metrics["loss"]) and i.metrics["step_seconds"] > 0 for i in infos)
    trainer.close()
    # the checkpoint hook (checkpoint.every=2) saved steps 2 and 4 with their own states
    assert trainer.progress.checkpoints == [2, 4]
