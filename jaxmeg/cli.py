"""What the scripts share on the command line: `--set` overrides, `--cpu-devices`, and turning
the errors a user can fix into one `error:` line and exit code 2. Imports no jax at module
level, so `--cpu-devices` can still take effect after parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help=help,
    )  # fmt: skip


def add_cpu_devices(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-devices", type=int, help="simulate N CPU devices")


def cpu_devices_problem(count: int | None) -> str | None:
    if count is not None and count < 1:
        return f"--cpu-devices must be >= 1, got {count}"
    return None


def count_problems(counts: dict[str, tuple[int | None, int]]) -> str | None:
    """'FLAG must be >= LOW, got N' for the first flag whose value (None: not given) is below
    its least value, else None."""
    for flag, (value, low) in counts.items():
        if value is not None and value < low:
            return f"{flag} must be >= {low}, got {value}"
    return None


def begin(problem: str | None, cpu_devices: int | None = None, devices: bool = True) -> int | None:
    """The scripts' preamble, after parsing and checking their arguments: a problem found
    before anything starts is one `error:` line and exit code 2 (returned); otherwise the
    devices start (`start_devices`, unless `devices` is False) and None is returned."""
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if devices:
        start_devices(cpu_devices)
    return None


def start_devices(count: int | None) -> None:
    """Simulates `count` CPU devices (before any jax computation); for None, the machine's
    devices: on NVIDIA GPUs jax may take `gpu_target.GPU_MEMORY_FRACTION` of their memory (the
    share `--target` checks against), and a machine with jax's CUDA plugin but no NVIDIA GPU
    (one that compiles for `--target`) starts on its CPU without the plugin's failed CUDA
    start-up traceback."""
    import os

    if count:
        from jaxmeg.parallel import simulate_cpu_devices

        simulate_cpu_devices(count)
    elif any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/proc/driver/nvidia")):
        from jaxmeg.parallel.gpu_target import GPU_MEMORY_FRACTION

        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(GPU_MEMORY_FRACTION))
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        metavar="NAME",
        help="compile for GPUs this machine does not have: a hardware profile with an XLA\n"
        "target spec (h100, a100: configs/hardware/); needs jax's CUDA plugin",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="with --target: how many GPUs (default: the product of the configured mesh axes)",
    )


def target_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --target / --gpus before jax starts, or None."""
    if args.target is None:
        return "--gpus needs --target" if args.gpus is not None else None
    if getattr(args, "cpu_devices", None):
        return "--target compiles for GPUs; --cpu-devices simulates CPUs: give one of them"
    if args.gpus is not None and args.gpus < 1:
        return f"--gpus must be >= 1, got {args.gpus}"
    return None


def start_target(args: argparse.Namespace) -> None:
    """With --target, before jax starts: CPU backend only, so the CUDA plugin compiles for the
    target without looking for a GPU."""
    if args.target is not None:
        from jaxmeg.parallel.gpu_target import keep_cuda_off

        keep_cuda_off()


def load_target(args: argparse.Namespace, cfg):
    """The `GpuTarget` of --target and --gpus (default: the config's mesh product), or None."""
    if args.target is None:
        return None
    from jaxmeg.config import MESH_AXES, ConfigError
    from jaxmeg.parallel import gpu_target

    gpus = args.gpus
    if gpus is None:
        sizes = {axis: getattr(cfg.parallel, axis) for axis in MESH_AXES}
        if any(size < 1 for size in sizes.values()):
            raise ConfigError(f"--target without --gpus needs every mesh axis set, got {sizes}")
        gpus = 1
        for size in sizes.values():
            gpus *= size
    target = gpu_target.load_target(args.target, gpus)
    if cfg.model.fp8 != "none" and not target.hardware.fp8_peak_tflops:
        raise ConfigError(
            f"model.fp8={cfg.model.fp8} needs FP8 GEMMs, which {target.hardware.name} does not "
            f"have (fp8_peak_tflops in configs/hardware/{target.hardware.name}.yaml); use "
            f"model.fp8=none, or an H100 or newer target"
        )
    return target


def add_overwrite(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--overwrite", action="store_true", help=help)


def run_paths_problem(out: str | None, metrics_file: str | None, overwrite: bool) -> str | None:
    """What keeps a training run from writing its run directory and metrics file, or None."""
    from jaxmeg import paths

    if out is not None:
        problem = paths.run_directory_problem(out, overwrite)
        if problem:
            return problem
    if metrics_file is not None:
        return paths.file_problem(
            metrics_file, "--metrics-file", overwrite, ours=paths.is_metrics_file
        )
    return None


def run_directory_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a script that reads a run directory (generate, evaluate): `--out RUN_DIR`,
    `--cpu-devices`, `--set` on the run's config."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="run directory (its newest checkpoint)")
    add_cpu_devices(parser)
    add_overrides(parser, "override a value of the run's config, e.g. parallel.tensor=4")
    return parser


def run_directory_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a run-directory script's --cpu-devices and --out, or None."""
    from pathlib import Path

    if cpu_devices_problem(args.cpu_devices):
        return cpu_devices_problem(args.cpu_devices)
    if not Path(args.out).is_dir():
        return f"--out {args.out} is not a run directory"
    return None


def run_reporting_errors(action: Callable[[], object], report=None) -> int:
    """Runs `action`; a config error, a bad value, a missing file or an unusable checkpoint
    becomes one line on stderr (through `report`, default print) and exit code 2. Else the
    exit code `action` returns (None: 0)."""
    from jaxmeg.config import ConfigError
    from jaxmeg.parallel.gpu_target import TargetError
    from jaxmeg.training.checkpoint import UnreadableCheckpoint
    from jaxmeg.training.checkpoint_meta import IncompatibleCheckpoint

    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        code = action()
    except ConfigError as err:
        report(f"config error: {err}")
        return 2
    except (
        ValueError,
        FileNotFoundError,
        IncompatibleCheckpoint,
        UnreadableCheckpoint,
        TargetError,
    ) as err:
        report(f"error: {err}")
        return 2
    return code if isinstance(code, int) else 0
