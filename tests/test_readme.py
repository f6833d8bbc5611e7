"""The README's commands in the order a user runs them, as written, in a fresh directory (its own
HOME, so the default corpus is built as on a new machine): each later command finds what the
earlier ones left (runs/gpt_tiny, hf/gpt2, runs/gpt2, data/c, ...). Long runs train 2 steps; the
GPT-3-sized config and the MoE example train 2-layer versions of themselves. What cannot run
here, the layout examples that other tests train through train.py, two runs whose program
another test trains, and a second evaluate.py and generate.py on a gpt_tiny run are skipped by
name, each with what covers it: every kind of command runs once."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train_cli import CLEAN_ENV, ROOT

SKIPPED = {
    "pip install": "installs (CI's .ci/run does)",
    "python -m pytest": "this suite",
    "sbatch": "a SLURM cluster",
    "scripts/launch_local.sh": "tests/test_multiprocess.py and tests/test_cluster_run.py",
    "--target": "tests/test_gpu_target.py compiles gpt_tiny-shaped steps for H100s",
    "configs/gpt_1.3b.yaml": "a GPU-sized model; tests/test_cli_errors.py validates its layout",
    "scripts/plan.py": "tests/test_cli_errors.py::test_every_plan_and_plot_example_runs",
}
TRAINED_ELSEWHERE = {  # no later command reads their runs
    "parallel.sequence_parallel=true": "tests/test_tensor_parallel.py",
    "parallel.schedule=interleaved_1f1b": "tests/test_train_cli.py (the same mesh and schedule)",
    "parallel.schedule=breadth_first": "tests/test_train_cli.py (breadth-first with ZeRO-3)",
    "compression.pipe_grad_rank": "tests/test_compression.py (train.py with compressed links)",
    "parallel.stage_layers=[5,3]": "tests/test_train_cli.py (uneven stages, then resumed)",
    "parallel.schedule=zbv": "tests/test_train_cli.py (zbv, resuming and resumed)",
    "parallel.schedule=dualpipev": "tests/test_train_cli.py (dualpipev, resuming and resumed)",
    "parallel.context=4": "tests/test_context_parallel.py (train.py at context 4)",
    "data.dataset=data/gpt2_text_document": "tests/test_megatron_dataset.py::"
    "test_train_cli_on_a_megatron_pair (train.py on a Megatron-LM .bin/.idx pair)",
    "--out runs/a ": "the first command (runs/gpt_tiny) trains the same gpt_tiny step; "
    "checkpoint.every and resuming: tests/test_operations.py",
}
"""The layout examples validate on their devices in test_cli_errors (every train and bench
example) and train through train.py, against one device, in the named test; the MoE example
runs here (its only train.py run). The other two train a program that another command here or
the named test runs through train.py already."""
ONCE_HERE = {  # a command of the same kind on the same kind of run runs here
    "scripts/evaluate.py --out runs/gpt_tiny": "evaluate.py --out runs/c (a gpt_tiny run with "
    "eval_fraction set; its --dataset and --batches given)",
    "scripts/generate.py --out runs/c ": "generate.py --out runs/gpt_tiny (a gpt_tiny run, the "
    "same prompt); sampling on a tensor mesh: generate.py --out runs/gpt2",
}
SMALLER = {  # a run too large for a CPU step (by config or command), made small, its layout kept
    "configs/gpt_125m.yaml": ["model.layers=2", "model.hidden=64", "model.heads=4",
                              "model.seq_len=128", "train.global_batch=8"],
    # 2 layers, one per pipeline stage: the expert-parallel layout is the example's
    "configs/moe_tiny.yaml": ["model.layers=2"],
    # the imported GPT-2's fine-tuning batch of 64 in bfloat16, which a CPU emulates: 16 rows
    "--out runs/gpt2 --set data.dataset=data/c": ["train.global_batch=16"],
}  # fmt: skip


def readme_commands() -> list[str]:
    """Each command line of the README's bash blocks, in order (continuations joined, `a && b`
    as two, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def as_run(command: str) -> list[str] | None:
    """The command as this test runs it (optional `[...]` arguments given, train.py for 2 steps
    without a progress bar), or None for a skipped one."""
    if any(key in command for key in (*SKIPPED, *TRAINED_ELSEWHERE, *ONCE_HERE)):
        return None
    words = shlex.split(command.replace("[", "").replace("]", ""))
    assert words[0] == "python" and words[1].startswith("scripts/"), command
    if words[1] == "scripts/train.py":
        if "--steps" in words:
            del words[words.index("--steps") : words.index("--steps") + 2]
        words += ["--steps", "2", "--no-progress"]
    if words[1] == "scripts/bench.py":
        words += ["--steps", "2", *(["--rounds", "1"] if "--compare-plain" in words else [])]
    for key, sets in SMALLER.items():
        if key in command:
            words += [arg for s in sets for arg in ("--set", s)]
    return [sys.executable, *words[1:]]


def user_files(home: Path) -> None:
    """What the README's reader brings: a JSONL corpus (its Megatron-LM dataset example is
    trained elsewhere: TRAINED_ELSEWHERE)."""
    from jaxmeg.data import default_corpus_files

    with open(home / "corpus.jsonl", "w") as f:
        for path in default_corpus_files(300_000):
            f.write(json.dumps({"text": path.read_text(errors="replace")}) + "\n")


@pytest.mark.timeout(1800)
def test_the_readme_commands_in_order(tmp_path):
    home = tmp_path
    for name in ("configs", "scripts"):
        (home / name).symlink_to(ROOT / name)
    user_files(home)
    env = {**CLEAN_ENV, "HOME": str(home)}
    ran, skipped = [], []
    for command in readme_commands():
        args = as_run(command)
        if args is None:
            skipped.append(command)
            continue
        result = subprocess.run(
            args, cwd=home, capture_output=True, text=True, timeout=600, env=env
        )
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        ran.append((command, result))

    outputs = {command: result.stdout for command, result in ran}
    assert (home / "runs" / "gpt_tiny" / "checkpoints").is_dir()
    assert (home / "hf" / "gpt2" / "tokenizer.json").is_file()
    assert (home / "hf" / "gpt2-tuned" / "model.safetensors").is_file()
    evaluated = [json.loads(out.splitlines()[-1]) for c, out in outputs.items() if "evaluate" in c]
    assert evaluated and all(r["loss"] > 0 and r["step"] == 2 for r in evaluated), evaluated
    generated = [out for c, out in outputs.items() if "generate.py" in c and "--prompt " in c]
    assert generated and all("def main(" in out for out in generated)
    assert len(ran) >= 15, (len(ran), skipped)
    unmatched = [
        key for key in {**TRAINED_ELSEWHERE, **ONCE_HERE} if not any(key in c for c in skipped)
    ]
    assert not unmatched, f"no README command holds {unmatched}: drop them from their dict"
