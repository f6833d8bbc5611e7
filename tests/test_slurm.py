"""scripts/slurm/train.sbatch under a real SLURM: submitted with `sbatch` to a one-node
cluster on this machine (scripts/slurm/one_node.sh; CI installs Debian's packages and starts it,
with SLURM_CONF exported), its GPU directives overridden on the command line, two tasks of four
CPU devices each join one jax.distributed run from SLURM's variables alone and train as one
process of eight devices does. Elsewhere these tests skip, naming what is missing; in CI
(`CI=true`) a missing cluster fails them."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_train_cli import CLEAN_ENV, ROOT, read_metrics, train


def _missing() -> str | None:
    """Why no SLURM cluster can take a job here, or None."""
    if shutil.which("sbatch") is None:
        return (
            "SLURM is not installed: apt-get install slurmctld slurmd slurm-client munge, then "
            "scripts/slurm/one_node.sh start and export SLURM_CONF=/tmp/jaxmeg-slurm/slurm.conf"
        )
    try:
        nodes = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s"
    down = ("down", "drain", "fail", "unk", "inval", "no_resp")
    states = [state.rstrip("*~#$@^-!%") for state in nodes.stdout.split()]
    if nodes.returncode or not [state for state in states if not state.startswith(down)]:
        return (
            f"no SLURM cluster answers (sinfo: {(nodes.stderr or nodes.stdout).strip()[:200]}): "
            f"scripts/slurm/one_node.sh start, and export SLURM_CONF"
        )
    return None


MISSING = _missing()
if MISSING:
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(f"CI runs the SLURM tests: {MISSING}")
    pytestmark = pytest.mark.skip(reason=MISSING)
else:
    pytestmark = pytest.mark.timeout(900)

MESH = [
    "--set", "parallel.data=2", "--set", "parallel.pipe=2", "--set", "parallel.tensor=2",
    "--set", "model.layers=2",
]  # fmt: skip
"""(2,2,2) on gpt_tiny at one layer per stage: what these tests prove is the job around the
step (SLURM's variables, signals, resuming), and 2 layers compile in about half the time of 8."""
TASKS = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
"""The sbatch options that fit train.sbatch's GPU job to one CPU node: 2 tasks, no GPUs."""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, small_corpus) -> list[float]:
    """The losses of 6 steps of gpt_tiny (`MESH`) in one process of 8 CPU devices."""
    tmp = tmp_path_factory.mktemp("one")
    records = train(["--cpu-devices", "8", "--steps", "6", *MESH, *small_corpus], tmp, "one")
    return [r["loss"] for r in records]


def submit(tmp_path: Path, out: Path, *args: str) -> str:
    """`sbatch` of scripts/slurm/train.sbatch on gpt_tiny, 4 CPU devices per task, the run
    directory `out` (JAXMEG_OUT), metrics to tmp_path/metrics.jsonl: the job's id."""
    env = {**CLEAN_ENV, "JAXMEG_OUT": str(out)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", *TASKS, f"--output={tmp_path}/slurm-%j.out",
         "scripts/slurm/train.sbatch", "configs/gpt_tiny.yaml", "--cpu-devices", "4",
         "--no-progress", "--metrics-file", str(tmp_path / "metrics.jsonl"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=True,
    )  # fmt: skip
    return submitted.stdout.strip().split(";")[0]


def wait(job: str, timeout: float = 800) -> tuple[str, int]:
    """The job's final state and exit code, polled every 0.2 s from the controller (`sbatch
    --wait` returned up to ~30 s after a job's end here)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30
        ).stdout
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        state = fields.get("JobState", "")
        if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state, int(fields["ExitCode"].split(":")[0])
        assert time.monotonic() < deadline, f"job {job} {state or 'unknown'} after {timeout} s"
        time.sleep(0.2)


def wait_for_steps(metrics: Path, steps: int, timeout: float = 600) -> None:
    """Until the job's metrics file holds `steps` steps."""
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert time.monotonic() < deadline, f"the job logged no {steps} step(s) in {timeout} s"
        time.sleep(0.2)


def slurm_logs(directory: Path) -> str:
    """The jobs' outputs in `directory`."""
    return "\n".join(p.read_text() for p in sorted(directory.glob("slurm-*.out")))


def sbatch(tmp_path: Path, out: Path, *args: str) -> int:
    """`submit`, then `wait`: the job's exit code."""
    return wait(submit(tmp_path, out, *args))[1]


def test_two_slurm_tasks_of_four_devices_train_as_one_process_of_eight(
    tmp_path, small_corpus, one_process
):
    code = sbatch(tmp_path, tmp_path / "run", "--steps", "3", *MESH, *small_corpus)
    logs = slurm_logs(tmp_path)
    assert code == 0, logs[-3000:]
    assert "8 x cpu in 2 process(es), mesh data=2 pipe=2 tensor=2" in logs, logs[-3000:]
    slurm = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert len(slurm) == 3
    np.testing.assert_allclose(slurm, one_process[:3], rtol=1e-5)


def test_a_job_stopped_by_sigterm_checkpoints_and_the_next_job_resumes(
    tmp_path, small_corpus, one_process
):
    """`scancel --signal=TERM` while the job trains (to its step's tasks, as preemption and the
    time limit send it; `--full` would also signal the batch shell and srun, which then kills
    the tasks before they checkpoint): the step in flight finishes, the checkpoint is written
    and the job ends cleanly; a job submitted again with the same run directory resumes there,
    and the losses of the two equal one uninterrupted run's."""
    out, steps = tmp_path / "run", ["--steps", "6", *MESH, *small_corpus]
    first = tmp_path / "first"
    first.mkdir()
    job = submit(first, out, *steps)
    metrics = first / "metrics.jsonl"
    wait_for_steps(metrics, 1)
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=60)
    assert wait(job, timeout=600) == ("COMPLETED", 0), slurm_logs(first)[-3000:]
    stopped = [r["step"] for r in read_metrics(metrics)]
    assert stopped[-1] < 6, f"the job ended ({stopped}) before SIGTERM reached it"
    assert (out / "checkpoints").is_dir()
    assert sbatch(tmp_path, out, *steps) == 0, slurm_logs(tmp_path)[-3000:]
    second = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in second] == list(range(stopped[-1] + 1, 7))
    losses = [r["loss"] for r in read_metrics(metrics)] + [r["loss"] for r in second]
    np.testing.assert_allclose(losses, one_process, rtol=1e-5)


def test_a_task_killed_ends_the_job_and_the_next_resumes_from_the_last_checkpoint(
    tmp_path, small_corpus, one_process
):
    """One task SIGKILLed mid-run (a lost node): srun ends the other within seconds
    (`--kill-on-bad-exit`) and says which task died; nothing half-written is read back: the
    job submitted again resumes from the last complete checkpoint and ends with the
    uninterrupted run's losses."""
    import re

    out = tmp_path / "run"
    steps = ["--steps", "6", "--set", "checkpoint.every=1", *MESH, *small_corpus]
    first = tmp_path / "first"
    first.mkdir()
    job = submit(first, out, *steps)
    metrics = first / "metrics.jsonl"
    wait_for_steps(metrics, 2)
    tasks = subprocess.run(
        ["pgrep", "-f", f"^[^ ]*python[^ ]* scripts/train.py .*{re.escape(str(out))}"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert len(tasks) == 2, tasks
    os.kill(int(tasks[-1]), 9)
    wait(job, timeout=120)  # srun ends the other task within it
    log = slurm_logs(first)
    assert re.search(r"task \d: Killed", log), log[-2000:]
    done = [r["step"] for r in read_metrics(metrics)]
    assert done[-1] < 6, f"the job ended ({done}) before the kill"
    assert sbatch(tmp_path, out, *steps) == 0, slurm_logs(tmp_path)[-3000:]
    second = read_metrics(tmp_path / "metrics.jsonl")
    assert second and second[-1]["step"] == 6
    # the first run's records up to the checkpoint the second resumed from, then the second's
    losses = {r["step"]: r["loss"] for r in read_metrics(metrics)}
    losses.update({r["step"]: r["loss"] for r in second})
    np.testing.assert_allclose([losses[s] for s in range(1, 7)], one_process, rtol=1e-5)
