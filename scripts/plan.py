"""Plan a 3D-parallel layout: every (tensor, pipe, data, chunks, microbatch, recompute) that fits
in memory, ranked by the predicted step time (docs/planner.md explains the model).

  python scripts/plan.py --config configs/megatron_1t.yaml --gpus 3072 --batch 3072 \
      --hardware a100_dgx --tokens 450e9
  python scripts/plan.py --hidden 12288 --layers 96 --heads 96 --seq 2048 --vocab 51200 \
      --gpus 1536 --batch 1536 --tensor 8 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv):
    from jaxmeg.config import OUTER_AXES, REMAT_POLICIES

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    model = parser.add_argument_group("model (a config file, or the shape)")
    model.add_argument("--config")
    model.add_argument("--hidden", type=int)
    model.add_argument("--layers", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--seq", type=int)
    model.add_argument("--vocab", type=int)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    parser.add_argument("--hardware", default="a100_dgx", help="profile name or YAML path")
    parser.add_argument("--tokens", type=float, help="training tokens, for the days column")
    for pin in ("tensor", "pipe", "chunks", "microbatch"):
        parser.add_argument(f"--{pin}", type=int, help=f"pin {pin}")
    parser.add_argument("--recompute", choices=REMAT_POLICIES)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--outer-axis", choices=OUTER_AXES, default="pipe", help="slowest mesh axis (crosses nodes)"
    )
    parser.add_argument("--top", type=int, default=15, help="rows of the table")
    parser.add_argument(
        "--json", action="store_true", help="print the best plan as one JSON object"
    )
    return parser.parse_args(argv)


def model_shape(args):
    """The config's shape (`jaxmeg.perf.model.shape_of`) with the flags given on top, or the
    flags alone."""
    from jaxmeg.perf.model import Shape, shape_of

    flags = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
             "seq_len": args.seq, "vocab": args.vocab}  # fmt: skip
    given = {k: v for k, v in flags.items() if v is not None}
    if args.config:
        from jaxmeg import config

        model = config.load(args.config).model
        if model.vocab_size < 1:  # set from the dataset at training time; GPT-2's, padded
            model = dataclasses.replace(model, vocab_size=51200)
        return dataclasses.replace(shape_of(model), **given)
    missing = [k for k in ("hidden", "layers", "heads", "seq", "vocab") if getattr(args, k) is None]
    if missing:
        raise ValueError(f"give --config or all of --{', --'.join(missing)}")
    return Shape(**given)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxmeg.perf.hardware import load_hardware
    from jaxmeg.perf.model import parameter_count
    from jaxmeg.perf.planner import plan

    try:
        shape = model_shape(args)
        hw = load_hardware(args.hardware)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    pins = {k: getattr(args, k) for k in ("tensor", "pipe", "chunks", "microbatch")}
    if args.recompute:
        pins["recompute"] = (args.recompute,)
    try:
        plans = plan(
            shape, args.gpus, args.batch, hw, args.tokens,
            sequence_parallel=args.sequence_parallel, outer_axis=args.outer_axis, **pins,
        )  # fmt: skip
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not plans:
        print(
            f"error: no layout of {args.gpus} GPUs with batch {args.batch} fits in "
            f"{hw.memory_gb} GB per GPU with these pins",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(plans[0].as_dict()))
        return 0
    print(
        f"{parameter_count(shape) / 1e9:.1f}B parameters (eq. 2) on {args.gpus} x {hw.name}, "
        f"batch {args.batch} x {shape.seq_len}; {len(plans)} layouts fit, fastest first"
    )
    header = (
        f"{'t':>3} {'p':>3} {'d':>5} {'v':>2} {'b':>2} {'recomp':>9} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'step s':>8} {'mem GB':>7} {'bubble':>7} {'TP GB':>8} {'PP GB':>7} {'DP GB':>7}"
        + (f" {'days':>7} {'8TP/nX':>7}" if args.tokens else "")
    )
    print(header)
    for p in plans[: args.top]:
        lay, traffic = p.layout, p.bytes_per_step
        row = (
            f"{lay.tensor:>3} {lay.pipe:>3} {lay.data:>5} {lay.chunks:>2} {lay.microbatch:>2} "
            f"{lay.recompute:>9} {p.tflops_per_gpu:>8.1f} {p.percent_of_peak:>6.1f} "
            f"{p.step_time_s:>8.3f} {p.memory_per_gpu_gb:>7.1f} {p.bubble:>7.3f} "
            f"{traffic['tensor'] / 1e9:>8.2f} {traffic['pipe'] / 1e9:>7.2f} "
            f"{traffic['data'] / 1e9:>7.2f}"
        )
        if args.tokens:
            row += f" {p.training_days:>7.1f} {p.paper_days:>7.1f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
