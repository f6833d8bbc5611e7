"""Does compression cost model quality? Trains gpt_tiny on mesh (2, 2, 2) with each compression
variant and several seeds, then writes the final-loss table and a loss-curve plot.

python scripts/compression_study.py --out runs/compression [--steps 300] [--seeds 0 1 2]
    [--variants baseline,backprop_lazy,...] [--plot docs/compression_loss.png]

Each run is `scripts/train.py --cpu-devices 8` in its own process (metrics in OUT/<variant>-s<seed>
.jsonl; a finished run is not repeated). The table reports, per variant, the mean and spread
(min to max over seeds) of the final loss (the mean over the last 10 steps).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MESH = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"]
BACKPROP = ["compression.pipe_grad_rank=4", "compression.pipe_grad_phase=epilogue"]
VARIANTS = {
    "baseline": [],
    "backprop_lazy": [*BACKPROP, "compression.pipe_error_feedback=lazy_flush"],
    "backprop_no_lazy": [*BACKPROP, "compression.pipe_error_feedback=none"],
    "backprop_lazy_fused": [*BACKPROP, "compression.pipe_error_feedback=lazy_flush",
                            "compression.fused_embedding_sync=true"],
    "backprop_lazy_fused_powersgd": [*BACKPROP, "compression.pipe_error_feedback=lazy_flush",
                                     "compression.fused_embedding_sync=true",
                                     "compression.data_grad_rank=4",
                                     "compression.data_grad_stages=1"],
}  # fmt: skip
TAIL = 10


def run(variant: str, seed: int, steps: int, out: Path, extra: list[str]) -> Path:
    metrics = out / f"{variant}-s{seed}.jsonl"
    done = metrics.is_file() and len(metrics.read_text().splitlines()) >= steps
    if not done:
        sets = [*MESH, *VARIANTS[variant], f"train.seed={seed}", *extra]
        command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--cpu-devices", "8",
                   "--steps", str(steps), "--no-progress", "--metrics-file", str(metrics),
                   *[arg for s in sets for arg in ("--set", s)]]  # fmt: skip
        print(f"{variant} seed {seed}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True)
    return metrics


def losses(path: Path) -> np.ndarray:
    return np.array([json.loads(line)["loss"] for line in path.read_text().splitlines()])


def table(curves: dict[str, list[np.ndarray]]) -> str:
    rows = ["| variant | seeds | final loss (mean) | spread (min - max) |", "|---|---|---|---|"]
    for name, runs in curves.items():
        finals = [float(c[-TAIL:].mean()) for c in runs]
        rows.append(
            f"| {name} | {len(finals)} | {np.mean(finals):.4f} | {min(finals):.4f} - "
            f"{max(finals):.4f} |"
        )
    return "\n".join(rows)


def plot(curves: dict[str, list[np.ndarray]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in curves.items():
        mean = np.mean(np.stack(runs), axis=0)
        ax.plot(np.arange(1, len(mean) + 1), mean, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over seeds)")
    ax.set_ylim(top=float(np.mean([r[0] for runs in curves.values() for r in runs])))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory for the runs' metrics")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--plot", help="write the loss curves to this PNG")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="more config overrides for every run")  # fmt: skip
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"error: unknown variants {unknown}; known: {list(VARIANTS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {
        name: [losses(run(name, seed, args.steps, out, args.extra))[: args.steps]
               for seed in args.seeds]
        for name in names
    }  # fmt: skip
    print(table(curves))
    if args.plot:
        plot(curves, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
