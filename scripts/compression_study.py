"""Does compression cost model quality? Trains gpt_tiny with each compression variant of a study
and several paired seeds, then writes a table and a plot of the held-out loss.

python scripts/compression_study.py --out runs/compression_paper [--study paper] [--steps 300]
    [--seeds 0 1 2] [--variants baseline,backprop_r8_lazy,...] [--plot docs/compression_loss.png]

Studies:
  paper  the claim at the paper's ratios: mesh (1, 4, 1), 1F1B, 16 microbatches, compressed
         backpropagation on the epilogue sends (6 of 48 per step) at rank 8 and 16 (6% and 12.5%
         of the [128, 128] cotangent's smaller side), lazy error propagation against none;
         PowerSGD on stage 0's data-parallel reduction at rank 16 and 32 (12.5% and 25% of the
         weight matrices' smaller side) on mesh (2, 4, 1) after 30 uncompressed steps. The same
         model on (2, 4, 1) uncompressed is the same mathematics summed in another order: its
         distance to (1, 4, 1) is the noise floor.
  small  the first study (2026-11-24): mesh (2, 2, 2), rank 4, `lazy_flush`.
  ladder the defaults together on (2, 2, 2) (compressed backpropagation at rank 8 on the
         epilogue sends without error feedback, PowerSGD rank 32 on stage 0, the fused
         embedding sync), with PowerSGD's warm-up (`compression.warmup_steps`, plain reductions
         first, as torch's hook's `start_powerSGD_iter`) at 0, 10 and 30 steps; run with
         --steps 60.

Each run is `scripts/train.py` in its own process (metrics in OUT/<variant>-s<seed>.jsonl; a
finished run is not repeated). Seeds are paired: seed k sets the init and the data order of
every variant. The metric is the held-out loss (`train.eval_every`, `data.eval_fraction`) at
the last step; the training loss over the last 10 steps is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TAIL = 10
EVAL = ["data.eval_fraction=0.05", "train.eval_every=25", "train.eval_batches=8"]
EPILOGUE = ["compression.pipe_grad_phase=epilogue"]
MESH_141 = ["parallel.pipe=4", "train.microbatches=16"]
MESH_241 = ["parallel.data=2", "parallel.pipe=4", "train.microbatches=8"]
POWERSGD = ["compression.data_grad_stages=1", "compression.warmup_steps=30"]
SMALL_BACKPROP = ["compression.pipe_grad_rank=4", *EPILOGUE]
STUDIES = {
    "paper": {
        "baseline": [*MESH_141],
        "baseline_2x4": [*MESH_241],
        "backprop_r8_lazy": [*MESH_141, *EPILOGUE, "compression.pipe_grad_rank=8",
                             "compression.pipe_error_feedback=lazy"],
        "backprop_r8_none": [*MESH_141, *EPILOGUE, "compression.pipe_grad_rank=8",
                             "compression.pipe_error_feedback=none"],
        "backprop_r16_lazy": [*MESH_141, *EPILOGUE, "compression.pipe_grad_rank=16",
                              "compression.pipe_error_feedback=lazy"],
        "backprop_r16_none": [*MESH_141, *EPILOGUE, "compression.pipe_grad_rank=16",
                              "compression.pipe_error_feedback=none"],
        "powersgd_r16": [*MESH_241, *POWERSGD, "compression.data_grad_rank=16"],
        "powersgd_r32": [*MESH_241, *POWERSGD, "compression.data_grad_rank=32"],
    },
    "small": {
        "baseline": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"],
        "backprop_lazy": [*SMALL_BACKPROP, "compression.pipe_error_feedback=lazy_flush"],
        "backprop_no_lazy": [*SMALL_BACKPROP, "compression.pipe_error_feedback=none"],
        "backprop_lazy_fused": [*SMALL_BACKPROP, "compression.pipe_error_feedback=lazy_flush",
                                "compression.fused_embedding_sync=true"],
        "backprop_lazy_fused_powersgd": [*SMALL_BACKPROP,
                                         "compression.pipe_error_feedback=lazy_flush",
                                         "compression.fused_embedding_sync=true",
                                         "compression.data_grad_rank=4",
                                         "compression.data_grad_stages=1"],
    },
}  # fmt: skip
MESH_222 = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"]
LADDER = [*MESH_222, "compression.pipe_grad_rank=8", *EPILOGUE,
          "compression.pipe_error_feedback=none", "compression.data_grad_rank=32",
          "compression.data_grad_stages=1", "compression.fused_embedding_sync=true"]  # fmt: skip
STUDIES["ladder"] = {
    "baseline": MESH_222,
    "ladder": LADDER,
    "ladder_warmup10": [*LADDER, "compression.warmup_steps=10"],
    "ladder_warmup30": [*LADDER, "compression.warmup_steps=30"],
}
for _name, _sets in STUDIES["small"].items():
    if _name != "baseline":
        _sets[:0] = STUDIES["small"]["baseline"]
REFERENCE = {"powersgd_r16": "baseline_2x4", "powersgd_r32": "baseline_2x4"}
"""The uncompressed run a variant's per-seed differences are taken against (else `baseline`)."""


def devices(sets: list[str]) -> int:
    sizes = {s.split("=")[0]: int(s.split("=")[1]) for s in sets if s.startswith("parallel.")}
    return int(np.prod([sizes.get(f"parallel.{a}", 1) for a in ("data", "pipe", "tensor")]))


def run(study: str, variant: str, seed: int, steps: int, out: Path, extra: list[str]) -> Path:
    metrics = out / f"{variant}-s{seed}.jsonl"
    done = metrics.is_file() and len(metrics.read_text().splitlines()) >= steps
    if not done:
        sets = [*STUDIES[study][variant], f"train.seed={seed}", *extra]
        if study == "paper":
            sets = [*EVAL, *sets]
        command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--cpu-devices",
                   str(devices(sets)), "--steps", str(steps), "--no-progress",
                   "--metrics-file", str(metrics),
                   *[arg for s in sets for arg in ("--set", s)]]  # fmt: skip
        print(f"{variant} seed {seed}: {' '.join(command[1:])}", flush=True)
        metrics.unlink(missing_ok=True)
        subprocess.run(command, check=True)
    return metrics


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def curve(runs: list[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values [seeds, points]) of `key` where every run recorded it."""
    steps = sorted(set.intersection(*({r["step"] for r in rs if key in r} for rs in runs)))
    values = [[next(r[key] for r in rs if r["step"] == s) for s in steps] for rs in runs]
    return np.array(steps), np.array(values)


def table(results: dict[str, list[list[dict]]]) -> str:
    held_out = "eval_loss" in results[next(iter(results))][0][-1]
    key = "eval_loss" if held_out else "loss"
    metric = "held-out loss at the last step" if held_out else f"training loss, last {TAIL} steps"
    rows = [f"| variant | seeds | {metric} (mean) | spread (min - max) | minus reference, per "
            f"seed | training loss, last {TAIL} steps |", "|---|---|---|---|---|---|"]  # fmt: skip
    finals = {}
    for name, runs in results.items():
        finals[name] = (
            [rs[-1][key] for rs in runs]
            if held_out
            else [float(np.mean([r["loss"] for r in rs[-TAIL:]])) for rs in runs]
        )
    for name, values in finals.items():
        train = np.mean([np.mean([r["loss"] for r in rs[-TAIL:]]) for rs in results[name]])
        reference = REFERENCE.get(name, "baseline")
        delta = ""
        if name != reference and reference in finals:
            pairs = zip(values, finals[reference], strict=True)
            delta = ", ".join(f"{v - b:+.3f}" for v, b in pairs)
            delta += f" (vs {reference})" if reference != "baseline" else ""
        rows.append(
            f"| {name} | {len(values)} | {np.mean(values):.4f} | {min(values):.4f} - "
            f"{max(values):.4f} | {delta} | {train:.4f} |"
        )
    return "\n".join(rows)


def plot(results: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held_out = "eval_loss" in results[next(iter(results))][0][-1]
    key = "eval_loss" if held_out else "loss"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in results.items():
        steps, values = curve(runs, key)
        line = ax.plot(steps, values.mean(0), label=name, linewidth=1)[0]
        ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{'held-out' if held_out else 'training'} loss (mean, band = min - max)")
    first = [rs[0][key] for runs in results.values() for rs in runs if key in rs[0]]
    if first:
        ax.set_ylim(top=float(np.mean(first)))
    if held_out:
        late = [v for runs in results.values() for v in curve(runs, key)[1][:, 2:].ravel()]
        if late:  # the first evaluations are far above the rest
            ax.set_ylim(min(late) - 0.05, max(late) + 0.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory for the runs' metrics")
    parser.add_argument("--study", choices=list(STUDIES), default="paper")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", help="comma-separated subset of the study's variants")
    parser.add_argument("--plot", help="write the loss curves to this PNG")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="more config overrides for every run")  # fmt: skip
    args = parser.parse_args(argv)
    variants = STUDIES[args.study]
    names = args.variants.split(",") if args.variants else list(variants)
    unknown = [n for n in names if n not in variants]
    if unknown:
        print(f"error: unknown variants {unknown}; {args.study} has {list(variants)}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        (name, seed): run(args.study, name, seed, args.steps, out, args.extra)
        for seed in args.seeds
        for name in names
    }  # fmt: skip  (every variant, seed by seed)
    results = {
        name: [records(paths[name, seed])[: args.steps] for seed in args.seeds] for name in names
    }
    print(table(results))
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
