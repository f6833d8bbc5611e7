"""Draws the expert load of MoE runs over their steps: each MoE layer's max / mean tokens per
expert (`moe_load_spread` in metrics.jsonl; 1 = even), the mean over layers as a thick line.

python scripts/plot_expert_load.py runs/moe/metrics.jsonl --out expert_load.png
python scripts/plot_expert_load.py a/metrics.jsonl b/metrics.jsonl --label bias --label aux \
    --out load.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxmeg.cli import begin  # noqa: E402


def read_spread(path: Path) -> tuple[list[int], list[list[float]]]:
    """(steps, per-layer spreads) of a metrics.jsonl; ValueError naming the file when it holds
    no `moe_load_spread` (not a MoE run)."""
    steps, spreads = [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "moe_load_spread" in record:
            steps.append(record["step"])
            spreads.append(record["moe_load_spread"])
    if not steps:
        raise ValueError(f"{path} has no moe_load_spread records: not a MoE run's metrics")
    return steps, spreads


def plot(runs: dict[str, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, path) in enumerate(runs.items()):
        steps, spreads = read_spread(path)
        layers = np.asarray(spreads)
        color = f"C{i}"
        ax.plot(steps, layers, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, layers.mean(axis=1), color=color, linewidth=2, label=label)
    ax.axhline(1.3, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert")
    ax.set_title("expert load per MoE layer (thin) and their mean (thick)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files of MoE runs")
    parser.add_argument("--label", action="append", help="one per file (default: the names)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    labels = args.label or [str(Path(m).parent.name or m) for m in args.metrics]
    out = Path(args.out)
    problem = None
    if len(labels) != len(args.metrics):
        problem = f"{len(labels)} --label for {len(args.metrics)} metrics files"
    elif not out.parent.is_dir():
        problem = f"--out {out}: {out.parent} is not a directory"
    if begin(problem, devices=False):
        return 2
    try:
        plot(dict(zip(labels, map(Path, args.metrics), strict=True)), out)
    except (OSError, ValueError) as err:
        return begin(str(err), devices=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
