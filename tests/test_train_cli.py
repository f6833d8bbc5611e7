"""The README's main job and the CLI contract: scripts/train.py trains and its loss falls; the
(2,2,2) interleaved pipeline, uneven stages, ZB-V and breadth-first with ZeRO reproduce the
1-device losses, and a checkpoint moves between uneven, ZB-V, ZeRO-1 and unpipelined layouts;
--compile-only reports memory, once from two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import XLA_CACHE_VARIABLE

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(900)


def _subprocess_env() -> dict[str, str]:
    """The environment of the scripts the tests run: no device count (each script sets its own),
    the suite's fast-compile XLA flags (`conftest.py`), and one XLA compilation cache for the
    whole test run (every worker and script): most scripts compile a step another already did."""
    cache = Path(os.environ.get(XLA_CACHE_VARIABLE) or tempfile.mkdtemp(prefix="jaxmeg-xla-"))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "XLA_FLAGS": " ".join(flags), "JAX_COMPILATION_CACHE_DIR": str(cache)}


CLEAN_ENV = _subprocess_env()
OPTIMIZED_ENV = {
    **CLEAN_ENV,
    "XLA_FLAGS": " ".join(
        flag for flag in CLEAN_ENV["XLA_FLAGS"].split() if "optimization_level" not in flag
    ),
}
"""For a run of many steps: XLA's default backend optimization (the suite's level 0 compiles
about a third faster and runs gpt_tiny's step about 2.5x slower on the CPU)."""


def run_train(args: list[str], timeout: int = 800, env=None) -> subprocess.CompletedProcess:
    """scripts/train.py on gpt_tiny in a fresh process (its own device count)."""
    return subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "configs/gpt_tiny.yaml", "--no-progress",
         *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or CLEAN_ENV,
    )  # fmt: skip


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(args: list[str], tmp_path: Path, name: str, env=None) -> list[dict]:
    metrics = tmp_path / f"{name}.jsonl"
    result = run_train(["--metrics-file", str(metrics), *args], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics)


def test_main_job_loss_falls(tmp_path, small_corpus):
    """gpt_tiny as the README trains it, for its 30 warm-up steps and 5 of the decay after: the
    mean loss of the last 5 steps is more than 1 below that of the first 5."""
    records = train(["--steps", "35", *small_corpus], tmp_path, "main", OPTIMIZED_ENV)
    assert [r["step"] for r in records] == list(range(1, 36))
    for key in ("loss", "tokens_per_sec", "tflops_per_device", "mfu", "lr", "grad_norm"):
        assert key in records[0], key
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses


@pytest.fixture(scope="session")
def single_device_losses(tmp_path_factory, small_corpus) -> list[float]:
    """Per-step losses of 6 steps of gpt_tiny on one device."""
    records = train(
        ["--cpu-devices", "1", "--steps", "6", *small_corpus],
        tmp_path_factory.mktemp("single"),
        "single",
    )
    return [r["loss"] for r in records]


def test_interleaved_3d_mesh_matches_one_device(tmp_path, small_corpus, single_device_losses):
    mesh = [
        "--set", "parallel.data=2", "--set", "parallel.pipe=2", "--set", "parallel.tensor=2",
        "--set", "parallel.schedule=interleaved_1f1b", "--set", "parallel.chunks=2",
    ]  # fmt: skip
    parallel = train(["--cpu-devices", "8", *mesh, "--steps", "5", *small_corpus], tmp_path, "mesh")
    np.testing.assert_allclose([r["loss"] for r in parallel], single_device_losses[:5], rtol=1e-4)


UNEVEN = ["--cpu-devices", "2", "--set", "parallel.pipe=2", "--set", "parallel.stage_layers=[5,3]"]
ZBV = [
    "--cpu-devices", "4", "--set", "parallel.pipe=4", "--set", "parallel.schedule=zbv",
    "--set", "parallel.chunks=2", "--set", "train.microbatches=8",
]  # fmt: skip
LAYERED = [
    "--cpu-devices", "8", "--set", "parallel.schedule=breadth_first", "--set", "parallel.chunks=2",
    "--set", "train.microbatches=4",
]  # fmt: skip
ZERO1 = ["--set", "parallel.data=4", "--set", "parallel.pipe=2", "--set", "parallel.zero_stage=1"]
DUALPIPEV = [
    "--cpu-devices", "4", "--set", "parallel.pipe=2", "--set", "parallel.data=2",
    "--set", "parallel.schedule=dualpipev", "--set", "parallel.chunks=2",
    "--set", "train.microbatches=4",
]  # fmt: skip


def test_uneven_zbv_and_zero1_match_one_device_and_checkpoints_move_between_them(
    tmp_path, small_corpus, single_device_losses
):
    """One run through five layouts, each resuming the checkpoint the one before wrote: steps
    1-2 on uneven stages [5, 3], step 3 on ZB-V (its V placement is a stage layout), step 4 on
    DualPipeV (the README's: data 2 x pipe 2), step 5 on breadth-first with ZeRO-1 (data 4,
    pipe 2: Adam's moments split over data), step 6 on one device. Checkpoints are canonical,
    so every loss is one device's; a layout's update shows in the next step's loss (the uneven
    one's already in step 2), and every layout but the first reads a checkpoint and every one
    but the last writes one."""
    run = ["--out", str(tmp_path / "run"), *small_corpus]
    records = []
    for name, layout, steps in (
        ("uneven", UNEVEN, 2), ("zbv", ZBV, 3), ("dualpipev", DUALPIPEV, 4),
        ("zero1", [*LAYERED, *ZERO1], 5), ("one", ["--cpu-devices", "1"], 6),
    ):  # fmt: skip
        records += train([*layout, "--steps", str(steps), *run], tmp_path, name)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in records], single_device_losses, rtol=1e-4)


def test_breadth_first_with_zero3_matches_one_device(tmp_path, small_corpus, single_device_losses):
    """The README's breadth-first example: ZeRO-3 gathers each chunk's weights inside the tick
    loop (data 2, pipe 4). Breadth-first with ZeRO-1 through train.py: the test above."""
    zero3 = [
        "--set", "parallel.data=2", "--set", "parallel.pipe=4", "--set", "parallel.zero_stage=3",
    ]  # fmt: skip
    losses = train([*LAYERED, *zero3, "--steps", "5", *small_corpus], tmp_path, "zero")
    np.testing.assert_allclose([r["loss"] for r in losses], single_device_losses[:5], rtol=1e-4)


def train_main(*args: str, cwd: Path = ROOT) -> tuple[int, str]:
    """scripts/train.py's `main(args)` in this process, from `cwd`: (exit code, stderr). For
    refusals found before anything compiles; test_incomplete_process_group_is_one_clean_line
    runs the script as a process (exit code 2, one clean line)."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    err, here = io.StringIO(), Path.cwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stderr(err):
            code = module.main(list(args))
    finally:
        os.chdir(here)
    return code, err.getvalue()


def test_bad_config_is_reported_before_building_the_corpus(tmp_path):
    cache = tmp_path / "corpus-cache"
    code, stderr = train_main("--config", "configs/gpt_tiny.yaml", "--cpu-devices", "8", "--set",
                              "parallel.tensor=3", "--set", f"data.cache_dir={cache}")  # fmt: skip
    assert code == 2, stderr[-3000:]
    assert "parallel.data * parallel.pipe * parallel.tensor = 1 * 1 * 3 = 3" in stderr
    assert not cache.exists()  # no tokenizer trained, no corpus tokenized


def test_config_defaults_to_gpt_tiny(tmp_path):
    # from another directory, without --config: gpt_tiny's lr (3e-3) bounds min_lr (this
    # process has 8 devices: the data axis takes them)
    code, stderr = train_main("--compile-only", "--cpu-devices", "8", "--set", "parallel.data=8",
                              "--set", "optimizer.min_lr=0.005", cwd=tmp_path)  # fmt: skip
    assert code == 2, stderr[-3000:]
    assert "optimizer.min_lr must be in [0, lr=0.003]" in stderr


def test_incomplete_process_group_is_one_clean_line():
    result = run_train(["--coordinator", "127.0.0.1:1"], timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: multi-process runs need all three flags; missing --num-processes, --process-id"
    ]


def test_compile_only_prints_once_from_two_processes():
    result = subprocess.run(
        ["bash", "scripts/launch_local.sh", "2", "--config", "configs/gpt_tiny.yaml",
         "--compile-only", "--set", "model.vocab_size=512", "--set", "parallel.data=2",
         "--set", "parallel.tensor=4"],
        cwd=ROOT, env={**CLEAN_ENV, "PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, result.stdout
    report = json.loads(reports[0])
    assert report["compile_seconds"] > 0
    for key in ("temp_bytes", "argument_bytes", "output_bytes"):  # per-device memory
        assert report[key] > 0
