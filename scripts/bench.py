"""Time the train step of a config: warm-up excluded, median of N steps, printed as JSON.

  python scripts/bench.py --config configs/gpt_1.3b.yaml --steps 10 --set model.vocab_size=51200
  python scripts/bench.py --config configs/gpt_tiny.yaml --cpu-devices 8 \
      --set parallel.data=4 --set parallel.pipe=2
  python scripts/bench.py --config configs/gpt_tiny.yaml --cpu-devices 1 --compare-plain
  python scripts/bench.py --config configs/gpt_tiny.yaml --cpu-devices 4 --cost-report \
      --set parallel.pipe=4 --set train.microbatches=8
  python scripts/bench.py --config configs/gpt_1.3b.yaml --cost-report --target h100 --gpus 1 \
      --set model.vocab_size=51200

`--cost-report` compiles the step and counts what it executes, from its HLO (FLOPs, bytes
written, bytes per link), against the model's needs and the planner's prediction; nothing runs.
With `--target h100` it compiles for H100s this machine does not have (jax's CUDA plugin) and
adds what the GPU program shows: memory against the GPU's, cuBLAS GEMM and cuDNN attention
FLOPs and calls, kernel bytes, each link's overlap with GEMMs, and a roofline bound on the step.

Batches are random tokens (the step's cost does not depend on them), so no dataset is needed;
the vocabulary is `model.vocab_size`, else `data.tokenizer_vocab`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxmeg import cli  # noqa: E402  (no jax: --cpu-devices and --target come first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument("--cpu-devices", type=int)
    parser.add_argument(
        "--compare-plain",
        action="store_true",
        help="one device: time the one step path against the plain autodiff step, alternating",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="with --compare-plain: rounds of --steps timed steps of each path, alternating",
    )
    parser.add_argument(
        "--cost-report",
        action="store_true",
        help="compile only: what the step executes, counted from its HLO (text, or --json)",
    )
    parser.add_argument("--json", action="store_true", help="with --cost-report: one JSON object")
    cli.add_target(parser)
    args = parser.parse_args(argv)
    problem = cli.target_problem(args) or cli.count_problems(
        {"--cpu-devices": (args.cpu_devices, 1), "--steps": (args.steps, 1),
         "--warmup": (args.warmup, 0), "--rounds": (args.rounds, 1)}
    )  # fmt: skip
    if args.target and not args.cost_report:
        problem = problem or "--target compiles only: add --cost-report"
    if (code := cli.begin(problem, args.cpu_devices)) is not None:
        return code
    cli.start_target(args)
    from jaxmeg import config
    from jaxmeg.cli import run_reporting_errors
    from jaxmeg.training.benchmark import benchmark, compare_with_plain

    def run() -> int | None:
        cfg = config.load(args.config, args.overrides)
        if args.cost_report:
            from jaxmeg.training.cost_report import cost_report, format_report
            from jaxmeg.training.trainer import prepare

            target = cli.load_target(args, cfg)
            devices = target.devices if target else None
            report = cost_report(prepare(cfg, dataset=None, devices=devices), target)
            print(json.dumps(report) if args.json else format_report(report))
            if target is not None and not report["memory"]["fits"]:
                from jaxmeg.training.fit import NOT_FIT_EXIT

                return NOT_FIT_EXIT  # as train.py --compile-only --target
        elif args.compare_plain:
            print(json.dumps(compare_with_plain(cfg, steps=args.steps, rounds=args.rounds)))
        else:
            print(json.dumps(benchmark(cfg, steps=args.steps, warmup=args.warmup)))

    return run_reporting_errors(run)


if __name__ == "__main__":
    sys.exit(main())
