"""Load balancing of a router that starts skewed: configs/moe_tiny.yaml trained from a routing
bias that makes expert 0 every token's choice (top-2 of 8: 4 times its even share, max/mean
load 4), with DeepSeek-V3's bias update at two rates, with the balance loss alone (the bias
then stays), and with neither. Writes each run's metrics.jsonl under --work, the plot
(scripts/plot_expert_load.py) to --out, and one summary line per run: the mean over layers of
max/mean load at the first and last steps, and the first step where it is below 1.3.

python scripts/moe_balance.py --steps 200 --out docs/moe_balance.png --work runs/moe_balance
python scripts/moe_balance.py --runs "bias update 0.01" neither --out b.png --work runs/b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxmeg.cli import add_overrides, begin  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "bias update 0.01": ["moe.bias_update_rate=0.01", "moe.aux_loss=0.0"],
    "bias update 0.001": ["moe.bias_update_rate=0.001", "moe.aux_loss=0.0"],
    "balance loss 0.01": ["moe.bias_update_rate=0.0", "moe.aux_loss=0.01"],
    "neither": ["moe.bias_update_rate=0.0", "moe.aux_loss=0.0"],
}
SKEW = 0.1
"""Added to expert 0's routing bias in every layer: the router's probabilities at
initialisation differ by a few hundredths, so expert 0 is then in every token's top 2."""


def run(label: str, overrides: list[str], steps: int, work: Path) -> dict:
    import jax
    import numpy as np

    from jaxmeg import config as C
    from jaxmeg.training.trainer import Trainer

    cfg = C.load(ROOT / "configs" / "moe_tiny.yaml", [f"train.steps={steps}", *overrides])
    out = work / label.replace(" ", "_")
    trainer = Trainer(cfg, out_dir=str(out), resume=False, show_progress=False)
    trainer.start()
    experts = trainer.state["params"]["blocks"]["layers"]["moe"]
    with jax.set_mesh(trainer.trainable.mesh):
        experts["router_bias"] = experts["router_bias"].at[..., 0].add(SKEW)
    spreads = [float(np.mean(info.metrics["moe_load_spread"])) for info in trainer.steps()]
    trainer.close()
    below = next((i + 1 for i, s in enumerate(spreads) if s < 1.3), None)
    return {"run": label, "first": spreads[0], "last": spreads[-1], "first_below_1.3": below,
            "metrics": str(out / "metrics.jsonl")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", required=True, help="the plot (PNG)")
    parser.add_argument("--work", required=True, help="a directory for the runs")
    parser.add_argument("--runs", nargs="*", choices=list(SETTINGS), help="default: all")
    add_overrides(parser, "applied to every run, e.g. train.global_batch=8")
    args = parser.parse_args(argv)
    problem = None if args.steps >= 1 else f"--steps must be >= 1, got {args.steps}"
    if begin(problem):
        return 2
    import plot_expert_load

    work = Path(args.work)
    chosen = {k: v for k, v in SETTINGS.items() if not args.runs or k in args.runs}
    results = [
        run(label, [*sets, *args.overrides], args.steps, work) for label, sets in chosen.items()
    ]
    for result in results:
        print(json.dumps(result))
    plot_expert_load.plot({r["run"]: Path(r["metrics"]) for r in results}, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
