"""Rough edges a new user hit, each an `error:` line with exit code 2 and no traceback, before
anything compiles; and the README's notebook snippet and bench.py's docstring example hold.

Each script's refusals run its `main` in this process (the message is the test); one refusal per
script runs it as a process, for the exit code and the clean stderr of the real command."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
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


@cache
def script(name: str):
    """scripts/NAME.py as a module, imported once."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Ran:
    """What `main` of a script returned and printed, in the shape of a CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def in_process(name: str, *args: str) -> Ran:
    """scripts/NAME.py's `main(args)` in this process, its stdout and stderr captured; an
    exception is a traceback in `stderr`, as the script would print it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = script(name).main(list(args))
        except Exception:
            import traceback

            traceback.print_exc()
            code = 1
    return Ran(code, out.getvalue(), err.getvalue())


def train_main(*args: str) -> Ran:
    return in_process("train", "--no-progress", *args)


def assert_clean_error(result, message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]


def test_cpu_devices_below_one_is_an_error():
    # the process: exit code 2 and one line, no traceback
    result = train_cli("--cpu-devices", "-2")
    assert_clean_error(result, "error: --cpu-devices must be >= 1, got -2")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert_clean_error(train_main("--cpu-devices", "0"), "error: --cpu-devices must be >= 1, got 0")


def test_out_pointing_at_a_file_is_an_error(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("keep me")
    assert_clean_error(train_main("--out", str(path)), f"error: --out {path} is a file")
    assert path.read_text() == "keep me"


def test_read_only_out_is_an_error():
    if os.access("/proc/sys", os.W_OK):
        pytest.skip("no read-only directory on this machine")
    assert_clean_error(
        train_main("--out", "/proc/sys/jaxmeg-run"), "error: --out /proc/sys/jaxmeg-run: /proc/sys"
    )


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden: 128\n  layers: [8\ntrain:\n  steps: 3\n")
    result = train_main("--config", str(path))
    assert_clean_error(result, f"config error: config file '{path}' at line 4")


def test_config_directory_is_named_as_a_directory():
    result = train_main("--config", "configs")
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


def command_examples() -> list[tuple[str, list[str]]]:
    """(where, words) of every command example in README's bash blocks and in the scripts'
    docstrings, continuation lines joined."""
    found = []
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    sources = [("README.md", b) for b in blocks]
    for script in sorted((ROOT / "scripts").glob("*.py")):
        doc = script.read_text().split('"""')[1]
        sources.append((script.name, doc))
    for where, text in sources:
        for line in text.replace("\\\n", " ").splitlines():
            words = line.split("#")[0].split()
            if "python" in words[:1] or (words and words[0].startswith("scripts/")):
                found.append((where, words))
    return found


def _devices(words: list[str]) -> int:
    if "--cpu-devices" in words:
        return int(words[words.index("--cpu-devices") + 1])
    if "--gpus" in words:  # --target: compile-only GPUs
        return int(words[words.index("--gpus") + 1])
    if words[0] == "scripts/launch_local.sh":
        return int(words[1]) * 4  # the launcher gives each process 4 CPU devices
    return 1


def test_every_train_and_bench_example_fits_its_devices():
    """The config of each train.py / bench.py / launch_local.sh example, with its --set
    overrides, validates on its device count (what failed as a traceback before)."""
    checked = 0
    for where, words in command_examples():
        runs_train = any(w.endswith(("train.py", "bench.py", "launch_local.sh")) for w in words)
        if not runs_train or "--config" not in words:
            continue  # --out RUN_DIR alone reads a run's config; tested in test_hf
        config = words[words.index("--config") + 1]
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        # stage_layers=auto|measured is resolved from the cluster first (test_cluster_run)
        sets = [s for s in sets if not s.startswith("parallel.stage_layers=")]
        try:
            validate(ROOT / config, sets, _devices(words))
        except C.ConfigError as err:
            raise AssertionError(f"{where}: {' '.join(words)}: {err}") from None
        checked += 1
    assert checked >= 12, checked


@pytest.mark.timeout(300)
def test_every_plan_and_plot_example_runs(tmp_path, monkeypatch):
    """Each distinct example's arguments through its script's `main`, in this process (the
    scripts' refusals as processes: test_bench_reports_config_errors_as_one_line and the
    others below)."""
    monkeypatch.chdir(ROOT)  # the examples' relative paths
    ran: set[tuple[str, ...]] = set()
    for where, words in command_examples():
        name = next((w for w in words if w.endswith(("plan.py", "plot_schedule.py"))), None)
        if name is None:
            continue
        args = words[words.index(name) + 1 :]
        if "--out" in args:
            args[args.index("--out") + 1] = str(tmp_path / "schedule.png")
        if (name, *args) in ran:
            continue  # README.md repeats a docstring's example
        result = in_process(Path(name).stem, *args)
        assert result.returncode == 0, f"{where}: {' '.join(words)}\n{result.stderr[-2000:]}"
        assert result.stdout.strip(), f"{where}: {' '.join(words)} printed nothing"
        ran.add((name, *args))
    assert len(ran) >= 4, ran


def _cpu_examples() -> list[tuple[str, list[str]]]:
    """The scripts' docstring train.py / bench.py examples on gpt_tiny (the ones meant for a
    CPU), each once, from the script name on; --cluster ones are launcher runs
    (test_cluster_run), the README's run in order in tests/test_readme.py."""
    readme = {" ".join(w[1:]) for where, w in command_examples() if where == "README.md"}
    found: dict[str, tuple[str, list[str]]] = {}
    for where, words in command_examples():
        if where == "README.md" or " ".join(words[1:]) in readme:
            continue
        script = next((w for w in words if w.endswith(("/train.py", "/bench.py"))), None)
        if script is None or "--cluster" in words:
            continue
        args = words[words.index(script) + 1 :]
        if any("[" in w or w in ("RUN_DIR", "runs/gpt2") for w in args):
            continue  # a usage line, or a run that an import made first (test_hf)
        config = args[args.index("--config") + 1] if "--config" in args else "configs/gpt_tiny.yaml"
        if config == "configs/gpt_tiny.yaml":
            found.setdefault(" ".join([script, *args]), (where, [script, *args]))
    return sorted(found.values(), key=lambda item: " ".join(item[1]))


CPU_EXAMPLES = _cpu_examples()
RESUMABLE = next((example for example in CPU_EXAMPLES if "--out" in example[1]), None)
"""train.py's example with --out: test_steps_at_the_checkpoint_say_so_and_compile_nothing runs
it, and runs it again."""


def _with_out(args: list[str], out: Path) -> list[str]:
    args = list(args)
    if "--out" in args:
        args[args.index("--out") + 1] = str(out)
    return args


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "where,words",
    [example for example in CPU_EXAMPLES if example is not RESUMABLE],
    ids=lambda x: x if isinstance(x, str) else " ".join(x[1:]),
)
def test_cpu_examples_run_for_a_step(where, words, tmp_path, small_corpus):
    """Each CPU example as written, with a small corpus and one step (two for bench.py); the one
    with --out: test_steps_at_the_checkpoint_say_so_and_compile_nothing. As a user starts it:
    no JAX_PLATFORMS, so where jax's CUDA plugin is installed (CI) and no GPU is, the plugin's
    failed CUDA start-up must not print its traceback (`--cpu-devices` keeps it off)."""
    script, args = Path(words[0]).name, _with_out(words[1:], tmp_path / "run")
    short = ["--steps", "1", "--no-progress"] if script == "train.py" else ["--steps", "2"]
    env = {k: v for k, v in CLEAN_ENV.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args, *short, *small_corpus],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"{where}: {' '.join(words)}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def script_cli(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=100, env=CLEAN_ENV,
    )  # fmt: skip


def test_a_malformed_set_value_is_one_line():
    assert_clean_error(
        train_main("--set", "model.hidden=[1,"),
        "config error: override 'model.hidden=[1,': the value is not valid YAML",
    )


def test_bench_reports_config_errors_as_one_line(monkeypatch):
    result = script_cli("bench", "--config", "no-such.yaml")  # the process
    assert_clean_error(result, "config error: config file 'no-such.yaml' does not exist")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    monkeypatch.chdir(ROOT)
    assert_clean_error(
        in_process("bench", "--config", "configs/gpt_tiny.yaml", "--set", "model.nope=1"),
        "config error: unknown config key model.nope",
    )


def test_export_to_a_file_or_from_a_typo_changes_nothing(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    typo = tmp_path / "TYPO"
    result = script_cli("convert_hf", "export", "--run", str(typo), "--to", str(tmp_path / "x"))
    assert_clean_error(result, f"error: {typo} holds no checkpoints to export")  # the process
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not typo.exists() and not (tmp_path / "x").exists()
    hf_run = tmp_path / "run"
    fixtures = ROOT / "tests" / "fixtures" / "hf" / "gpt2"
    imported = in_process("convert_hf", "import", "--from", str(fixtures), "--run", str(hf_run))
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert_clean_error(
        in_process("convert_hf", "export", "--run", str(hf_run), "--to", str(target)),
        f"error: {target} exists and is not a directory",
    )
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    "config_json,message",
    [
        ('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}', "has no 'n_embd'"),
        ("{not json", "config.json is not JSON"),
    ],
)
def test_import_of_a_broken_config_names_the_file_or_field(config_json, message, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "gpt2", hf_dir)
    (hf_dir / "config.json").write_text(config_json)
    result = in_process("convert_hf", "import", "--from", str(hf_dir), "--run", str(tmp_path / "r"))
    assert_clean_error(result, message)
    assert not (tmp_path / "r").exists()


def test_import_of_a_truncated_safetensors_names_it(tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "gpt2", hf_dir)
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    result = in_process("convert_hf", "import", "--from", str(hf_dir), "--run", str(tmp_path / "r"))
    assert_clean_error(result, f"{weights} is not a readable safetensors file")


def test_preprocess_with_a_garbage_tokenizer_is_one_line(tmp_path):
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("not a tokenizer")
    text = tmp_path / "a.txt"
    text.write_text("hello")
    out = str(tmp_path / "out")
    result = script_cli("preprocess_data", "--input", str(text), "--output-prefix", out,
                        "--tokenizer", str(garbage), "--no-progress")  # fmt: skip
    assert_clean_error(result, f"error: {garbage} is not a tokenizer.json")  # the process
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_metrics_file_on_a_directory_is_refused_before_compiling(tmp_path):
    result = train_main("--metrics-file", str(tmp_path))
    assert_clean_error(result, f"error: --metrics-file {tmp_path} is a directory")
    assert "compiled" not in result.stderr


@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_steps_at_the_checkpoint_say_so_and_compile_nothing(tmp_path, small_corpus):
    """train.py's docstring example with --out, as written with one step (as
    test_cpu_examples_run_for_a_step runs the others); then again at its checkpoint."""
    assert RESUMABLE, "train.py's docstring has no example with --out"
    where, words = RESUMABLE
    run = tmp_path / "run"
    args = [*_with_out(words[1:], run), "--steps", "1", *small_corpus]
    first = train_cli(*args)
    assert first.returncode == 0, f"{where}: {' '.join(words)}\n{first.stderr[-3000:]}"
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    result = train_cli(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the checkpoint is at step 1 and the run stops at step 1" in result.stderr
    assert "compiled" not in result.stderr.replace("nothing compiled", "")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_preprocess_refuses_a_csv_rather_than_read_it_as_one_document(tmp_path):
    """A .csv (or .json, .parquet, a compressed file) was tokenized as one plain-text document,
    commas and header included, without a word."""
    table = tmp_path / "corpus.csv"
    table.write_text("id,text\n1,hello world\n2,more text\n")
    result = in_process("preprocess_data", "--input", str(table), "--output-prefix",
                        str(tmp_path / "c"), "--no-progress")  # fmt: skip
    assert_clean_error(result, f"input file {str(table)!r}: a .csv file would be read as one")
    assert ".jsonl" in result.stderr and not list(tmp_path.glob("c.*"))


def test_preprocess_of_nothing_is_an_error_and_a_short_vocabulary_is_said(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = in_process("preprocess_data", "--input", str(empty), "--output-prefix",
                        str(tmp_path / "e"), "--no-progress")  # fmt: skip
    assert_clean_error(result, "hold no text (no document)")
    assert not list(tmp_path.glob("e.*"))
    one = tmp_path / "one.txt"
    one.write_text("hello world")
    prefix = str(tmp_path / "out") + "/"
    result = in_process("preprocess_data", "--input", str(one), "--output-prefix", prefix,
                        "--vocab-size", "32000", "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "tokens.bin").is_file()  # a directory prefix: files inside it
    assert "the BPE stopped at" in result.stderr and "of the --vocab-size 32000" in result.stderr
    assert result.stdout.count("\n") == 1, result.stdout


def test_without_the_cuda_plugin_the_target_commands_print_the_install_hint(monkeypatch):
    """A fresh machine (no `jax_plugins` package at all: `find_spec` of the dotted name
    raised there, and that traceback was all `--target` printed): the plugin counts as not
    installed, and train.py and bench.py print the install command in one line, exit 2."""
    import importlib.util as util

    from jaxmeg.parallel import gpu_target

    real = util.find_spec

    def no_plugins(name, *args, **kwargs):
        if name.split(".")[0] == "jax_plugins":
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(util, "find_spec", no_plugins)
    assert gpu_target.plugin_installed() is False
    hint = gpu_target.install_command()
    for name, args in (
        ("train", ("--compile-only", "--no-progress")),
        ("bench", ("--cost-report",)),
    ):
        ran = in_process(name, "--config", "configs/gpt_tiny.yaml", *args, "--target", "h100",
                         "--gpus", "1")  # fmt: skip
        lines = ran.stderr.strip().splitlines()
        assert ran.returncode == 2 and len(lines) == 1, (name, ran.stderr)
        assert lines[0].startswith("error: ") and hint in lines[0], (name, lines)
