"""Multi-process operations: 2 processes x 4 devices == 1 x 8 (and == one device, placed on two
NIC groups of a cluster file), a stop agreed across processes, a missing peer, the local
launcher's signal handling, and where the process group comes from."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxmeg.parallel import distributed
from tests.test_operations import StderrLines, checkpoint_names, metric_steps, wait_for
from tests.test_train_cli import (
    CLEAN_ENV,
    ROOT,
    read_metrics,
    run_train,
    single_device_losses,  # noqa: F401  (a fixture)
)

pytestmark = pytest.mark.timeout(900)
MESH_222 = ["--set", "parallel.data=2", "--set", "parallel.pipe=2", "--set", "parallel.tensor=2"]


TWO_NIC_GROUPS = [
    "--cluster", "configs/clusters/local_2x4.yaml", "--set", "parallel.outer_axis=data",
    "--set", "parallel.placement=auto",
]  # fmt: skip
"""Process 0 the `ib` group, process 1 the `roce` one. With outer_axis=data Megatron's order
would put each data group across the two processes; the NIC-aware placement puts the pipe
axis across them instead."""


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, small_corpus) -> tuple[Path, int, str]:
    """(run directory, launcher exit code, launcher stdout + stderr) of scripts/launch_local.sh 2
    on MESH_222 and TWO_NIC_GROUPS for up to 1000 steps, whose process 1 alone got SIGTERM after
    step 3. One run serves the multi-process, signal and cluster tests below."""
    out = tmp_path_factory.mktemp("two-processes") / "run"
    launcher = subprocess.Popen(
        ["bash", "scripts/launch_local.sh", "2", "--config", "configs/gpt_tiny.yaml",
         *small_corpus, *MESH_222, *TWO_NIC_GROUPS, "--steps", "1000", "--no-progress",
         "--out", str(out)],
        cwd=ROOT, env={**CLEAN_ENV, "PYTHON": sys.executable}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = StderrLines(launcher, launcher.stdout)
    try:
        wait_for(lambda: metric_steps(out / "metrics.jsonl") >= 3 or launcher.poll() is not None)
        second = [
            pid
            for pid in child_pids(launcher.pid)
            if "--process-id\x001\x00" in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        assert len(second) == 1, output.text()[-3000:]
        os.kill(second[0], signal.SIGTERM)  # process 1 only: process 0 must stop with it
        code = launcher.wait(timeout=300)
    finally:
        launcher.kill()
    return out, code, output.text()


def test_two_processes_match_one_process(tmp_path, small_corpus, two_process_run):
    out, code, output = two_process_run
    assert code == 0, output[-3000:]
    assert "in 2 process(es)" in output
    assert "Gloo" not in output, output[:500]  # its connection lines
    common = [*small_corpus, *MESH_222, *TWO_NIC_GROUPS, "--steps", "3", "--no-progress"]
    one = run_train(["--cpu-devices", "8", *common, "--metrics-file", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    np.testing.assert_allclose(
        [r["loss"] for r in read_metrics(out / "metrics.jsonl")[:3]],
        [r["loss"] for r in read_metrics(tmp_path / "one")],
        rtol=1e-6,
    )


def test_two_nic_groups_on_two_processes_match_one_device(
    two_process_run,
    single_device_losses,  # noqa: F811
):
    """Each process names its group's NCCL settings, the pipe axis crosses the groups, and the
    steps before the stop equal one device's."""
    out, code, output = two_process_run
    assert code == 0, output[-3000:]
    assert "ib (infiniband): processes 0 (local0); NCCL_NET=IB" in output
    assert (
        "roce (roce): processes 1 (local1); NCCL_NET=IB NCCL_IB_DISABLE=0 NCCL_IB_GID_INDEX=3"
        in output
    )
    assert "  stage 0: ib (local0)\n  stage 1: roce (local1)\n" in output
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")[:3]]
    np.testing.assert_allclose(losses, single_device_losses[:3], rtol=1e-4)


def test_gloo_pieces_are_dropped_and_other_lines_kept():
    from jaxmeg.parallel.native_output import is_gloo_noise

    interleaved = [
        "[Gloo] Rank 0 is connected to [Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. "
        "Expected number of connected peer ranks is : 1",
        "1 peer ranks. Expected number of connected peer ranks is : 1",
        "0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    ]
    assert all(is_gloo_noise(line) for line in interleaved)
    assert not any(is_gloo_noise(line) for line in ["", "step 3 loss 4.2", '{"ids": [1]}'])


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def test_sigterm_to_one_process_stops_all_at_the_same_step(two_process_run):
    out, code, output = two_process_run
    assert code == 0, output[-3000:]
    assert "stopped by a signal to another process" in output
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert last >= 3
    assert max(int(n) for n in checkpoint_names(out) if n.isdigit()) == last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_killed_without_the_launcher_is_named_and_ends_the_run(tmp_path, small_corpus):
    # Process 1: killing process 0 takes the coordination service with it, whose client thread
    # then aborts the survivors at once, before Python runs (see jaxmeg.parallel.distributed).
    victim = 1
    port, metrics = free_port(), tmp_path / "m.jsonl"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "scripts/train.py",
                "--config",
                "configs/gpt_tiny.yaml",
                "--cpu-devices",
                "4",
                *small_corpus,
                *MESH_222,
                "--steps",
                "1000",
                "--no-progress",
                "--metrics-file",
                str(metrics),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            cwd=ROOT,
            env=CLEAN_ENV,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    survivor = procs[1 - victim]
    stderr = StderrLines(survivor)
    try:
        wait_for(lambda: metric_steps(metrics) >= 2 or survivor.poll() is not None)
        procs[victim].kill()
        start = time.monotonic()
        code = survivor.wait(timeout=120)
    finally:
        for proc in procs:
            proc.kill()
    assert code == distributed.PEER_LOSS_EXIT, stderr.text()[-3000:]
    assert time.monotonic() - start < 60
    text = stderr.text()
    # a collective that fails names it; one that waits for the dead peer ends by PeerWatch
    assert f"jaxmeg: process {1 - victim} of 2 lost process {victim}: " in text
    assert "Traceback" not in text and "Check failure stack trace" not in text, text[-3000:]


def test_missing_peer_fails_within_timeout(small_corpus):
    """Process 0 of 2 alone, from the flags and from SLURM's variables (run side by side: each
    waits out its --init-timeout), gives up in time and names what it waited for."""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_STEP_NODELIST": "127.0.0.1",
             "JAX_COORDINATOR_PORT": str(free_port())}  # fmt: skip
    flags = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
             "--process-id", "0"]  # fmt: skip
    start = time.monotonic()
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "scripts/train.py",
                "--config",
                "configs/gpt_tiny.yaml",
                "--cpu-devices",
                "4",
                "--init-timeout",
                "5",
                "--no-progress",
                *small_corpus,
                *args,
            ],
            cwd=ROOT,
            env={**CLEAN_ENV, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, args, env in (("flags", flags, {}), ("slurm", [], slurm))
    }
    try:
        stderr = {name: proc.communicate(timeout=120)[1] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    assert time.monotonic() - start < 60
    for name, proc in procs.items():
        assert proc.returncode != 0, (name, stderr[name][-3000:])
    assert "gave up after 5 s waiting for 2 processes to join at 127.0.0.1" in stderr["flags"]
    assert "process 0 gave up after 5 s waiting for 2 processes" in stderr["slurm"]


FAKE_TRAIN = """\
import os, signal, sys, time
if sys.argv[1] == "-c":  # the launcher's free-port probe
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
rank = int(sys.argv[sys.argv.index("--process-id") + 1])
mode, log = os.environ["FAKE_MODE"], os.environ["FAKE_LOG"]

def note(text):
    with open(log, "a") as f:
        f.write(f"{rank} {text}\\n")

def checkpoint_and_exit(*_):
    time.sleep(1)  # a checkpoint takes a while: the launcher must wait for it
    note("exited")
    sys.exit(0)

signal.signal(signal.SIGTERM, checkpoint_and_exit)
if mode == "stubborn" and rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # e.g. stuck in a collective
note("started")
if mode in ("fail", "stubborn") and rank == 1:
    time.sleep(0.5)
    sys.exit(3)
while True:
    time.sleep(0.05)
"""


def launch_fake(tmp_path: Path, mode: str, grace: int) -> tuple[subprocess.Popen, Path]:
    """scripts/launch_local.sh 2 with a stand-in for python that plays a training process."""
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_TRAIN}")
    fake.chmod(0o755)
    log = tmp_path / "log"
    env = {**CLEAN_ENV, "PYTHON": str(fake), "FAKE_MODE": mode, "FAKE_LOG": str(log),
           "JAXMEG_KILL_GRACE": str(grace)}  # fmt: skip
    proc = subprocess.Popen(["bash", "scripts/launch_local.sh", "2"], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    return proc, log


def logged(log: Path) -> list[str]:
    return sorted(log.read_text().splitlines()) if log.exists() else []


def test_launch_local_forwards_sigterm_and_waits_for_the_processes(tmp_path):
    proc, log = launch_fake(tmp_path, "graceful", grace=1)
    wait_for(lambda: len(logged(log)) == 2, timeout=30)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert logged(log) == ["0 exited", "0 started", "1 exited", "1 started"]  # no KILL


def test_launch_local_stops_the_others_when_one_fails(tmp_path):
    proc, log = launch_fake(tmp_path, "fail", grace=20)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3, stderr
    assert "process 1 exited with 3; stopping the others" in stderr
    assert "0 exited" in logged(log)  # got TERM and finished


def test_launch_local_kills_a_process_that_ignores_term(tmp_path):
    proc, _ = launch_fake(tmp_path, "stubborn", grace=1)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3, stderr
    assert "sending KILL" in stderr
    assert time.monotonic() - start < 15


def test_cluster_spec_sources():
    env = {"JAXMEG_COORDINATOR": "h:1", "JAXMEG_NUM_PROCESSES": "2", "JAXMEG_PROCESS_ID": "1"}
    assert distributed.cluster_spec(env=env).process_id == 1
    with pytest.raises(ValueError, match="missing JAXMEG_PROCESS_ID"):
        distributed.cluster_spec(env={k: v for k, v in env.items() if k != "JAXMEG_PROCESS_ID"})
    with pytest.raises(ValueError, match="missing --num-processes, --process-id"):
        distributed.cluster_spec("h:1", env={})
    slurm_job = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    assert distributed.cluster_spec(env=slurm_job) is None  # the batch script: one process
    step = {**slurm_job, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # fmt: skip
    spec = distributed.cluster_spec(env=step)
    assert (spec.num_processes, spec.process_id, spec.source) == (2, 1, "slurm")
    assert spec.local_device_ids == (0, 1, 2, 3)  # one task per node drives all its GPUs
    per_gpu = distributed.cluster_spec(env={**step, "SLURM_STEP_TASKS_PER_NODE": "4"})
    assert per_gpu.local_device_ids is None  # jax's own choice: the GPU of SLURM_LOCALID
    # --ntasks-per-node=4 --gpus-per-task=1: SLURM shows each task its own GPU only, which jax's
    # choice (SLURM_LOCALID = 3) would miss; two per task: both
    bound = {**step, "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_LOCALID": "3"}
    own = distributed.cluster_spec(env={**bound, "CUDA_VISIBLE_DEVICES": "3"})
    assert own.local_device_ids == (0,)
    pair = distributed.cluster_spec(env={**bound, "CUDA_VISIBLE_DEVICES": "6,7"})
    assert pair.local_device_ids == (0, 1)
    # one task per node without CUDA_VISIBLE_DEVICES: the GPUs SLURM gave the node
    no_list = {k: v for k, v in step.items() if k != "CUDA_VISIBLE_DEVICES"}
    assert distributed.cluster_spec(
        env={**no_list, "SLURM_GPUS_ON_NODE": "8"}
    ).local_device_ids == tuple(range(8))
    assert distributed.cluster_spec(env=no_list).local_device_ids is None  # CPU nodes
