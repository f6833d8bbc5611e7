"""Rough edges a new user hit, each an `error:` line with exit code 2 and no traceback, before
anything compiles; and the README's notebook snippet and bench.py's docstring example hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmeg import config as C
from tests.test_train_cli import CLEAN_ENV, ROOT

pytestmark = pytest.mark.timeout(120)


def train_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--no-progress", *args],
        cwd=cwd, capture_output=True, text=True, timeout=100, env=CLEAN_ENV,
    )  # fmt: skip


def assert_clean_error(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("count", ["-2", "0"])
def test_cpu_devices_below_one_is_an_error(count):
    assert_clean_error(
        train_cli("--cpu-devices", count), f"error: --cpu-devices must be >= 1, got {count}"
    )


def test_out_pointing_at_a_file_is_an_error(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("keep me")
    assert_clean_error(train_cli("--out", str(path)), f"error: --out {path} is a file")
    assert path.read_text() == "keep me"


def test_read_only_out_is_an_error():
    if os.access("/proc/sys", os.W_OK):
        pytest.skip("no read-only directory on this machine")
    assert_clean_error(
        train_cli("--out", "/proc/sys/jaxmeg-run"), "error: --out /proc/sys/jaxmeg-run: /proc/sys"
    )


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden: 128\n  layers: [8\ntrain:\n  steps: 3\n")
    result = train_cli("--config", str(path))
    assert_clean_error(result, f"config error: config file '{path}' at line 4")


def test_config_directory_is_named_as_a_directory():
    result = train_cli("--config", "configs")
    assert_clean_error(result, "config error: config 'configs' is a directory; pass a YAML file")


def validate(path: Path, overrides: list[str], devices: int) -> None:
    """As the trainer does, with the vocabulary the tokenizer would give when none is set."""
    if not any(o.startswith("model.vocab_size") for o in overrides):
        overrides = [*overrides, "model.vocab_size=4096"]
    C.validate(C.load(path, overrides), devices)


def test_readme_notebook_snippet_validates_on_its_eight_devices():
    readme = (ROOT / "README.md").read_text()
    devices = int(re.search(r"simulate_cpu_devices\((\d+)\)", readme).group(1))
    load = re.search(r'config\.load\("([^"]+)", \[([^\]]*)\]\)', readme)
    overrides = re.findall(r'"([^"]+)"', load.group(2))
    validate(ROOT / load.group(1), overrides, devices)


def test_bench_docstring_examples_validate():
    doc = (ROOT / "scripts" / "bench.py").read_text().split('"""')[1].replace("\\\n", " ")
    examples = [line for line in doc.splitlines() if "scripts/bench.py" in line]
    assert len(examples) >= 3
    for line in examples:
        words = line.split()
        devices = int(words[words.index("--cpu-devices") + 1]) if "--cpu-devices" in words else 1
        config = words[words.index("--config") + 1]
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        validate(ROOT / config, sets, devices)
