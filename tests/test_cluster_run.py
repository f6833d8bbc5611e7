"""Runs on a cluster file: the measured partition is saved and reused; bad clusters are named
errors before anything compiles. (Two processes on two NIC groups: tests/test_multiprocess.py,
which shares one launcher run between its tests.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.test_train_cli import (
    CLEAN_ENV,
    ROOT,
    read_metrics,
    run_train,
    train_main,
)

pytestmark = pytest.mark.timeout(900)


def write_cluster(tmp_path, groups: list[dict], name: str = "c") -> str:
    links = [{"groups": [a["name"], b["name"]], "nic": "ethernet", "gbps": 25}
             for a, b in zip(groups, groups[1:], strict=False)]  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "groups": groups, "links": links}))
    return str(path)


def group(name: str, nic: str, nodes: int = 1, gpus: int = 1, **extra) -> dict:
    return {"name": name, "nodes": nodes, "gpus_per_node": gpus, "gpu": "a100_dgx", "nic": nic,
            "nic_gbps": 100, **extra}  # fmt: skip


def test_measured_partition_is_saved_and_reused(tmp_path, small_corpus):
    cluster = write_cluster(tmp_path, [group("fast", "infiniband"), group("slow", "ethernet")])
    out = tmp_path / "run"
    args = ["--cpu-devices", "2", "--cluster", cluster, "--set", "parallel.pipe=2", "--set",
            "parallel.stage_layers=measured", "--out", str(out), *small_corpus]  # fmt: skip
    first = run_train([*args, "--steps", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "stage_probe.json").is_file()
    chosen = re.search(r"stage_layers=measured: (\[[0-9, ]+\]) from the probe", first.stderr)
    assert chosen, first.stderr[-3000:]
    second = run_train([*args, "--steps", "2"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"stage_layers=measured: {chosen[1]} from the saved probe" in second.stderr
    assert "resumed from step 1" in second.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_unknown_nic_is_named_before_compile(tmp_path, small_corpus):
    """The process: exit code 2 and a named error, no traceback, nothing compiled."""
    cluster = write_cluster(tmp_path, [group("a", "omnipath", gpus=2)])
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--cpu-devices", "4", "--cluster", cluster,
         "--no-progress", *small_corpus],
        cwd=ROOT, env=CLEAN_ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "unknown NIC type 'omnipath'" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "compiled" not in result.stderr


@pytest.mark.parametrize(
    "groups, args, message",
    [
        ([group("a", "infiniband", gpus=1), group("b", "roce", gpus=7)],
         ["--set", "parallel.data=2", "--set", "parallel.pipe=4"],
         "node group 'a' has 1 GPUs, which do not split into whole pipeline stages of "
         r"parallel.data \* parallel.tensor = 2 \* 1 = 2 GPUs"),
        ([group("a", "infiniband", gpus=4, hosts=["gpu01"]),
          group("b", "roce", gpus=4, hosts=["gpu02"])],
         ["--set", "parallel.data=4", "--set", "parallel.pipe=2"],
         "host 'elsewhere' is in no group"),
        ([group("a", "infiniband", gpus=2), group("b", "roce", gpus=4)],
         ["--set", "parallel.data=4", "--set", "parallel.pipe=2"],
         r"has 6 GPUs \(a 1 x 2 \+ b 1 x 4\), but the job has 8 devices"),
    ],
    ids=["group-too-small", "host-in-no-group", "gpu-total"],
)  # fmt: skip
def test_bad_clusters_are_named_before_compile(
    tmp_path, small_corpus, monkeypatch, groups, args, message
):
    """scripts/train.py's `main` in this process (its 8 devices); a cluster that passed would
    train one step and fail the test."""
    cluster = write_cluster(tmp_path, groups)
    monkeypatch.setenv("JAXMEG_NODE_NAME", "elsewhere")
    environ = dict(os.environ)  # a group's NCCL variables, set by the run, are put back
    try:
        code, stderr = train_main("--cpu-devices", "8", "--cluster", cluster, *args, "--steps",
                                  "1", "--no-progress", *small_corpus)  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert code == 2, stderr[-3000:]
    assert re.search(message, stderr), stderr[-3000:]
    assert "Traceback" not in stderr
    assert "compiled" not in stderr
