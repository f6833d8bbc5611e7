"""Held-out loss and perplexity of a run directory's newest checkpoint, as one JSON line.

python scripts/evaluate.py --out runs/a                    # the run's held-out split
python scripts/evaluate.py --out runs/a --dataset data/valid --batches 16
python scripts/evaluate.py --out runs/a --cpu-devices 8 --set parallel.data=2 \\
    --set parallel.tensor=4

Without --dataset it evaluates the samples the run held out of training (data.eval_fraction > 0);
--dataset PREFIX evaluates every sample of another token file, from its start. Batches of
train.global_batch, at most --batches of them (default train.eval_batches). Prints {"loss",
"perplexity" (= exp(loss)), "batches", "tokens", "step"}. The config is RUN_DIR/config.yaml if
present, else the one the newest checkpoint was saved with; --set changes it (any mesh).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.run_directory_parser(__doc__)
    parser.add_argument("--dataset", metavar="PREFIX", help="token file to evaluate on instead")
    parser.add_argument("--batches", type=int, metavar="N", help="at most N global batches")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = cli.run_directory_problem(args)
    if problem is None and args.batches is not None and args.batches < 1:
        problem = f"--batches must be >= 1, got {args.batches}"
    if (code := cli.begin(problem, args.cpu_devices)) is not None:
        return code

    def evaluate() -> None:
        from jaxmeg.training.evaluation import evaluate_run

        print(json.dumps(evaluate_run(args.out, args.dataset, args.batches, args.overrides)))

    return cli.run_reporting_errors(evaluate)


if __name__ == "__main__":
    sys.exit(main())
