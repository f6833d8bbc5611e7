"""Train a GPT with jaxmeg.

python scripts/train.py [--config configs/gpt_tiny.yaml] [--set section.key=value ...]
python scripts/train.py --cpu-devices 8 --set parallel.data=2 --set parallel.tensor=4
python scripts/train.py --config configs/gpt_1.3b.yaml --compile-only
python scripts/train.py --config configs/gpt_1.3b.yaml --compile-only --target h100 --gpus 8 \
    --set parallel.data=2 --set parallel.pipe=2 --set parallel.tensor=2    # will it fit?
python scripts/train.py --out runs/a --steps 100    # later: --steps 300 resumes at 100
python scripts/train.py --out runs/gpt2    # reads runs/gpt2/config.yaml (scripts/convert_hf.py)
python scripts/train.py --cpu-devices 8 --cluster configs/clusters/local_2x4.yaml \
    --set parallel.pipe=2 --set parallel.data=2 --set parallel.tensor=2 \
    --set parallel.stage_layers=auto
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_CONFIG = ROOT / "configs" / "gpt_tiny.yaml"

from jaxmeg import cli  # noqa: E402  (neither imports jax: --cpu-devices comes first)
from jaxmeg.config import RUN_CONFIG  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--config",
        help=f"YAML config file (default: OUT/{RUN_CONFIG} when --out holds one, else\n"
        f"{DEFAULT_CONFIG.relative_to(ROOT)})",
    )
    cli.add_overrides(parser, "override a config value (repeatable)")
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="train until step N (default: train.steps). Only where to stop: the learning-rate\n"
        "schedule still decays over train.steps from the config and --set, so a run stopped\n"
        "with --steps and resumed later follows the same schedule as one uninterrupted run",
    )
    cli.add_cpu_devices(parser)
    parser.add_argument(
        "--metrics-file",
        help="one JSON line of metrics per step (a fresh run starts the file empty; a resumed "
        "run keeps the records up to its checkpoint; default with --out: OUT/metrics.jsonl)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the train step, print compile time and per-device memory as JSON, exit;\n"
        "with --target, also whether it fits the GPU (exit 3 when it does not)",
    )
    cli.add_target(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--out", help="run directory: checkpoints, metrics.jsonl, tensorboard/; resumes from it"
    )
    parser.add_argument(
        "--no-resume", action="store_true", help="refuse to start if --out holds checkpoints"
    )
    cli.add_overwrite(
        parser, "replace a --metrics-file or OUT/metrics.jsonl that jaxmeg did not write"
    )
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster file (configs/clusters/*.yaml, or a name there): node groups by NIC type;\n"
        "sets each process's NCCL variables and, with parallel.placement=auto, keeps data-\n"
        "parallel groups inside one group and crosses groups only between pipeline stages",
    )
    group = parser.add_argument_group("multi-process (also from JAXMEG_* or SLURM variables)")
    group.add_argument("--coordinator", help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int)
    group.add_argument("--process-id", type=int)
    group.add_argument(
        "--init-timeout", type=int, default=300, help="seconds to wait for every process to join"
    )
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace):
    """The config from the file and --set; --steps changes where to stop, not the schedule."""
    from jaxmeg import config

    path = args.config or DEFAULT_CONFIG
    if args.config is None and args.out and (Path(args.out) / RUN_CONFIG).is_file():
        path = Path(args.out) / RUN_CONFIG
    cfg = config.load(path, args.overrides)
    return cfg if args.steps is None else config.with_steps(cfg, args.steps)


def is_lead() -> bool:
    """Process 0 prints results and errors (every process of a job has the same ones)."""
    import jax

    return jax.process_index() == 0


def report_error(message: str) -> None:
    if is_lead():
        print(message, file=sys.stderr, flush=True)


def join_process_group(args: argparse.Namespace):
    """Joins the processes; with --cluster, first sets this process's NCCL variables for its
    node group's NIC, and afterwards shares every process's group (a ClusterJob, else None)."""
    from jaxmeg.parallel import distributed

    spec = distributed.cluster_spec(args.coordinator, args.num_processes, args.process_id)
    job = None
    if args.cluster:
        from jaxmeg.parallel.cluster import load_cluster
        from jaxmeg.parallel.cluster_job import ClusterJob

        process_id, processes = (spec.process_id, spec.num_processes) if spec else (0, 1)
        job = ClusterJob.start(load_cluster(args.cluster), process_id, processes)
    distributed.initialize(spec, args.init_timeout)
    return job.exchange() if job else None


def check_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line's numbers and paths (before jax starts), or None."""
    if cli.cpu_devices_problem(args.cpu_devices):
        return cli.cpu_devices_problem(args.cpu_devices)
    if cli.target_problem(args):
        return cli.target_problem(args)
    if args.target and not args.compile_only:
        return "--target compiles for GPUs this machine does not have: add --compile-only"
    return cli.run_paths_problem(args.out, args.metrics_file, args.overwrite)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_paths(args)
    if (code := cli.begin(problem, args.cpu_devices)) is not None:
        return code
    cli.start_target(args)
    try:
        cluster_job = join_process_group(args)
    except ValueError as err:  # before the group exists, each process reports its own error
        print(f"error: {err}", file=sys.stderr)
        return 2
    from jaxmeg import config
    from jaxmeg.parallel.gpu_target import TargetError
    from jaxmeg.training import checkpoint, trainer

    try:
        cfg = load_config(args)
        if args.compile_only:
            target = cli.load_target(args, cfg)
            report = trainer.compile_only(cfg, cluster_job, target)
            if is_lead():
                print(json.dumps(report))
            if target is None:
                return 0
            from jaxmeg.training.fit import NOT_FIT_EXIT, describe_fit

            report_error(describe_fit(report))
            return 0 if report["fits"] else NOT_FIT_EXIT
        trainer.train(
            cfg,
            out_dir=args.out,
            resume=not args.no_resume,
            metrics_file=args.metrics_file,
            show_progress=not args.no_progress,
            cluster_job=cluster_job,
        )
    except config.ConfigError as err:
        report_error(f"config error: {err}")
        return 2
    except trainer.TrainingStopped as err:
        report_error(f"jaxmeg: stopped: {err}")
        return 1
    except (ValueError, FileNotFoundError, checkpoint.UnreadableCheckpoint, TargetError) as err:
        report_error(f"error: {err}")
        return 2
    except Exception as err:
        from jaxmeg.parallel import distributed

        if distributed.is_peer_loss(err):
            distributed.exit_on_peer_loss(err)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
