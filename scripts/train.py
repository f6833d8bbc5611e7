"""Train a GPT with jaxmeg.

  python scripts/train.py --config configs/gpt_tiny.yaml [--set section.key=value ...]
  python scripts/train.py --config configs/gpt_tiny.yaml --cpu-devices 8 \
      --set parallel.data=2 --set parallel.tensor=4
  python scripts/train.py --config configs/gpt_1.3b.yaml --compile-only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable)",
    )
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--cpu-devices", type=int, help="simulate N CPU devices")
    parser.add_argument("--metrics-file", help="append one JSON line of metrics per step")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the train step, print compile time and per-device memory as JSON, exit",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--out", help="run directory: checkpoints, metrics.jsonl, tensorboard/; resumes from it"
    )
    parser.add_argument(
        "--no-resume", action="store_true", help="refuse to start if --out holds checkpoints"
    )
    group = parser.add_argument_group("multi-process (also from JAXMEG_* or SLURM variables)")
    group.add_argument("--coordinator", help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int)
    group.add_argument("--process-id", type=int)
    group.add_argument(
        "--init-timeout", type=int, default=300, help="seconds to wait for every process to join"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:
        from jaxmeg.parallel import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    from jaxmeg.parallel import distributed

    distributed.initialize(
        distributed.cluster_spec(args.coordinator, args.num_processes, args.process_id),
        args.init_timeout,
    )
    from jaxmeg import config
    from jaxmeg.training import trainer

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    try:
        cfg = config.load(args.config, overrides)
        if args.compile_only:
            print(json.dumps(trainer.compile_only(cfg)))
            return 0
        trainer.train(
            cfg,
            out_dir=args.out,
            resume=not args.no_resume,
            metrics_file=args.metrics_file,
            show_progress=not args.no_progress,
        )
    except config.ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except trainer.TrainingStopped as err:
        print(f"jaxmeg: stopped: {err}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
