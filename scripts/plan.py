"""Plan a 3D-parallel layout: every (tensor, pipe, context, expert, data, chunks, microbatch,
recompute) that fits in memory, ranked by the predicted step time (--objective step_time, the
default); or, per pipeline method, the layout of up to --gpus GPUs that reaches a target loss
soonest at the critical batch (--objective shortest_time). With --cluster FILE
(configs/clusters/), the layouts of that cluster of node groups with different NICs, each with
its NIC-aware placement and self-adapting partition, next to Megatron's placement and even
split. --compression on | auto adds pipeline-aware communication compression (the `compression`
config section) to the step-time ranking: every technique, or each where the model predicts it
saves, and what it saves. --context auto (the default) also searches context parallelism for
long sequences (c GPUs per sequence, a ring of key/value blocks), --context N pins it, --context
1 forbids it; when the fastest plan splits the sequence, the fastest without context parallelism
follows the table. A config with a moe section also searches expert parallelism (--expert pins
it), priced as jaxmeg exchanges tokens (--expert-exchange bounded: at a balanced load), at the
exchange's largest bound (padded) or with the routed rows only (routed). A config is priced as
jaxmeg runs it on GPUs (--program jaxmeg: cuDNN's fused attention where model.attention runs
it, the backward's tensor collectives beside its weight-gradient GEMMs), a shape given by flags
as the Megatron-LM 2021 measurements ran (--program megatron2021). docs/planner.md explains the
models.

  python scripts/plan.py --config configs/megatron_1t.yaml --gpus 3072 --batch 3072 \
      --hardware a100_dgx --tokens 450e9
  python scripts/plan.py --config configs/megatron_1t.yaml --gpus 65536 \
      --objective shortest_time --tokens 450e9
  python scripts/plan.py --hidden 12288 --layers 96 --heads 96 --seq 2048 --vocab 51200 \
      --gpus 1536 --batch 1536 --tensor 8 --json
  python scripts/plan.py --config configs/megatron_7.5b.yaml --cluster holmes_ib_roce --json
  python scripts/plan.py --hidden 12288 --layers 96 --heads 96 --seq 2048 --vocab 51200 \
      --gpus 1024 --batch 1536 --hardware a100_ethernet --compression auto
  python scripts/plan.py --config configs/megatron_7.5b.yaml --seq 32768 --gpus 64 --batch 128 \
      --hardware h100_dgx --recompute full selective none --top 5
  python scripts/plan.py --config configs/mixtral_8x7b.yaml --gpus 64 --batch 256 \
      --hardware h100_dgx --top 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


OBJECTIVES = ("step_time", "shortest_time")
PROGRAMS = ("jaxmeg", "megatron2021")
"""Whose step `--program` prices (`Shape.flash_attention`, `Shape.backward_overlap`)."""


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def context_size(text: str) -> int | None:
    """`auto` (None: search) or a context size >= 1."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be auto or an integer >= 1, got {text}")
    return value


def parse_args(argv):
    from jaxmeg.config import (
        FP8_RECIPES,
        OUTER_AXES,
        PIPE_GRAD_PHASES,
        REMAT_POLICIES,
        ZERO_STAGES,
    )
    from jaxmeg.perf.compression import DEFAULT_RANK, MODES
    from jaxmeg.perf.layout import EXPERT_EXCHANGES
    from jaxmeg.pipeline.schedules import NAMES as SCHEDULES

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
    parser.add_argument(
        "--gpus", type=int, help="GPUs (shortest_time: at most); with --cluster, its GPUs"
    )
    parser.add_argument(
        "--batch", type=int,
        help="global batch in sequences (step_time); with --cluster, default the config's",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", metavar="FILE",
        help="a cluster file or name (configs/clusters/): rank its layouts, placements (auto vs "
        "megatron) and partitions",
    )  # fmt: skip
    parser.add_argument("--hardware", default="a100_dgx", help="profile name or YAML path")
    parser.add_argument("--objective", choices=OBJECTIVES, default="step_time")
    parser.add_argument(
        "--tokens", type=positive_float,
        help="training tokens: the days column (step_time); the budget of a run at the "
        "critical batch (shortest_time)",
    )  # fmt: skip
    parser.add_argument(
        "--target-loss", type=positive_float, help="nats per token to reach (shortest_time)"
    )
    parser.add_argument(
        "--zero-stage", type=int, choices=ZERO_STAGES,
        help="ZeRO stage of every layout (shortest_time: of every method)",
    )  # fmt: skip
    parser.add_argument(
        "--fp8", choices=FP8_RECIPES, default="none",
        help="price the linears' GEMMs in FP8 (model.fp8): at the GPU's FP8 peak, with the "
        "passes scaling adds and, for current scaling, its amax reductions on the way",
    )  # fmt: skip
    for pin in ("tensor", "pipe", "chunks", "microbatch"):
        parser.add_argument(f"--{pin}", type=int, help=f"pin {pin}")
    parser.add_argument(
        "--expert", type=int,
        help="pin expert parallelism (a config with a moe section, step_time; default: search "
        "every divisor of the experts)",
    )  # fmt: skip
    parser.add_argument(
        "--expert-exchange", choices=EXPERT_EXCHANGES, default="bounded",
        help="how tokens reach their experts: bounded, jaxmeg's dropless all-to-all at a balanced "
        "load (default); padded, at its largest bound (every choice to one GPU); routed, the "
        "routed rows only (a ragged all-to-all, moe.exchange: ragged, jaxmeg's on a GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--capacity-factor", type=float,
        help="the experts' capacity factor (moe.capacity_factor; default the config's): fixed "
        "buffers of cf times the routed rows, whatever --expert-exchange says",
    )  # fmt: skip
    parser.add_argument(
        "--context", type=context_size, metavar="auto|N",
        help="context parallelism (step_time): auto, search it for long sequences (default); N, "
        "pin c = N; 1, forbid it",
    )  # fmt: skip
    parser.add_argument(
        "--recompute", choices=REMAT_POLICIES, nargs="+",
        help="the recompute choices to search (default full and selective)",
    )  # fmt: skip
    parser.add_argument(
        "--schedule", choices=(*SCHEDULES, "any"),
        help="pipeline schedule of every layout where its chunks allow (default Megatron's: "
        "1f1b, interleaved_1f1b with chunks); a zero-bubble one: zb_h1, interleaved_zb, zbv; "
        "dualpipev; or any: every schedule that runs the layout, the fastest ranked first",
    )  # fmt: skip
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--program", choices=PROGRAMS,
        help="whose step to price: jaxmeg, as it runs the config on GPUs (attention as cuDNN's "
        "fused kernel where model.attention runs it, a whole backward's tensor collectives "
        "beside its weight-gradient GEMMs); megatron2021, as the Megatron-LM 2021 measurements "
        "ran (unfused softmax, no overlap). Default: jaxmeg with --config, megatron2021 with "
        "the shape given by flags",
    )  # fmt: skip
    parser.add_argument(
        "--outer-axis", choices=OUTER_AXES, default="pipe", help="slowest mesh axis (crosses nodes)"
    )
    parser.add_argument(
        "--compression", choices=MODES, default="off",
        help="communication compression (step_time): off; on, every technique that applies; "
        "auto, each where it predicts a saving",
    )  # fmt: skip
    parser.add_argument(
        "--compression-rank", type=int, default=DEFAULT_RANK,
        help="rank of the compressed pipeline and data-parallel gradients",
    )  # fmt: skip
    parser.add_argument(
        "--pipe-grad-phase", choices=PIPE_GRAD_PHASES, default="epilogue",
        help="which backward pipeline transfers are compressed (compression.pipe_grad_phase)",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=15, help="rows of the table")
    parser.add_argument(
        "--json", action="store_true", help="print the best plan (per method) as JSON"
    )
    args = parser.parse_args(argv)
    if args.compression != "off" and (args.cluster or args.objective != "step_time"):
        parser.error("--compression applies to --objective step_time without --cluster")
    if (args.context or 1) > 1 and (
        args.cluster or args.objective != "step_time" or args.compression != "off"
    ):
        parser.error(
            "--context N > 1 applies to --objective step_time without --cluster or --compression"
        )
    if args.cluster:
        if args.objective != "step_time":
            parser.error("--cluster ranks by step time; it takes no --objective shortest_time")
        if args.batch is None and not args.config:
            parser.error("--cluster needs --batch or a --config with train.global_batch")
        return args
    if args.gpus is None:
        parser.error("--gpus is required (without --cluster)")
    if args.objective == "step_time" and args.batch is None:
        parser.error("--batch is required with --objective step_time")
    if args.objective == "shortest_time" and (args.target_loss is None) == (args.tokens is None):
        parser.error("--objective shortest_time takes one of --target-loss and --tokens")
    return args


def model_shape(args):
    """The config's shape (`jaxmeg.perf.model.shape_of`) with the flags given on top, or the
    flags alone; `--program` over either (`PROGRAMS`)."""
    from jaxmeg.perf.model import Shape, shape_of

    flags = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
             "seq_len": args.seq, "vocab": args.vocab}  # fmt: skip
    given = {k: v for k, v in flags.items() if v is not None}
    if args.config:
        from jaxmeg import config

        cfg = config.load(args.config)
        model = cfg.model
        if model.vocab_size < 1:  # set from the dataset at training time; GPT-2's, padded
            model = dataclasses.replace(model, vocab_size=51200)
        shape = dataclasses.replace(shape_of(model, cfg.moe), **given)
    else:
        missing = [
            k for k in ("hidden", "layers", "heads", "seq", "vocab") if getattr(args, k) is None
        ]
        if missing:
            raise ValueError(f"give --config or all of --{', --'.join(missing)}")
        shape = Shape(**given)
    if args.program == "megatron2021":
        shape = dataclasses.replace(shape, flash_attention=False, backward_overlap=False)
    elif args.program == "jaxmeg" and not args.config:  # the default model config's attention
        shape = dataclasses.replace(shape, flash_attention=True, backward_overlap=True)
    return shape


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxmeg.config_validation import pinned_layout_problem
    from jaxmeg.perf.hardware import load_hardware
    from jaxmeg.perf.model import active_parameters, parameter_count
    from jaxmeg.perf.plan_reports import cluster_report, shortest_time_report
    from jaxmeg.perf.planner import context_sizes, plan

    try:
        shape = model_shape(args)
        hw = load_hardware(args.hardware)
        problem = pinned_layout_problem(shape.heads, args.tensor, args.pipe, args.chunks,
                                        args.schedule, args.context, args.gpus)  # fmt: skip
        if problem or args.top < 1:
            raise ValueError(problem or f"--top must be >= 1, got {args.top}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    pins = {k: getattr(args, k) for k in ("tensor", "pipe", "chunks", "microbatch")}
    if args.recompute:
        pins["recompute"] = tuple(dict.fromkeys(args.recompute))
    if shape.experts and (args.cluster or args.objective != "step_time"):
        what = "--cluster" if args.cluster else "--objective shortest_time"
        print(f"error: {what} prices dense models; this config has {shape.experts.count} "
              f"experts (plan it by step time, without --cluster)", file=sys.stderr)  # fmt: skip
        return 2
    if (args.expert is not None or args.capacity_factor is not None) and not shape.experts:
        print("error: --expert and --capacity-factor are a mixture of experts'; give a --config "
              "with a moe section", file=sys.stderr)  # fmt: skip
        return 2
    if args.capacity_factor is not None:
        if args.capacity_factor < 0:
            print(f"error: --capacity-factor must be >= 0 (0 = dropless), got "
                  f"{args.capacity_factor}", file=sys.stderr)  # fmt: skip
            return 2
        experts = dataclasses.replace(shape.experts, capacity_factor=args.capacity_factor)
        shape = dataclasses.replace(shape, experts=experts)
    if args.cluster:
        return cluster_report(args, shape, pins)
    if args.objective == "shortest_time":
        return shortest_time_report(args, shape, hw, pins)
    if shape.experts:
        pins.update(expert=args.expert, expert_exchange=args.expert_exchange)
    if args.zero_stage is not None:
        pins["zero_stage"] = args.zero_stage
    if args.fp8 != "none":
        pins["fp8"] = args.fp8
    if args.schedule:
        pins["schedule"] = args.schedule
    options = {
        "sequence_parallel": args.sequence_parallel, "outer_axis": args.outer_axis,
        "compression": args.compression, "compression_rank": args.compression_rank,
        "pipe_grad_phase": args.pipe_grad_phase,
    }  # fmt: skip
    try:
        plans = plan(
            shape, args.gpus, args.batch, hw, args.tokens, **options, **pins, context=args.context
        )
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
    # With c > 1 in the search (compression plans c = 1), the table shows c and the ring; when
    # the fastest plan splits the sequence, the fastest without context parallelism follows:
    # from the same plans when c was searched, from a search at c = 1 when it was pinned.
    searched = args.compression == "off" and context_sizes(shape, args.context) != [1]
    compare = searched and plans[0].layout.context > 1
    without = None
    if compare:
        pool = plans
        if args.context is not None:
            pool = plan(shape, args.gpus, args.batch, hw, args.tokens, **options, **pins, context=1)
        without = next((p for p in pool if p.layout.context == 1), None)
    if args.json:
        best = plans[0].as_dict()
        if compare:
            best["without_context"] = None if without is None else without.as_dict()
        print(json.dumps(best))
        return 0
    active = ""
    if shape.experts:
        cf = shape.experts.capacity_factor
        how = f"capacity factor {cf:g}" if cf else f"{args.expert_exchange} exchange"
        active = f", {active_parameters(shape) / 1e9:.1f}B active ({how})"
    print(
        f"{parameter_count(shape) / 1e9:.1f}B parameters (eq. 2{active}) on {args.gpus} x "
        f"{hw.name}, batch {args.batch} x {shape.seq_len}; {len(plans)} layouts fit, fastest first"
    )
    experts = shape.experts is not None
    print(_header(args, searched, experts))
    for p in plans[: args.top]:
        print(_row(p, args, searched, experts))
    if compare:
        print_without_context(plans[0], without, args, experts)
    if plans[0].compression is not None:
        print_compression(plans[0].compression)
    return 0


def _header(args, context: bool, experts: bool = False) -> str:
    """The step-time table's header; `context` adds c and the ring's MB per layer."""
    return (
        f"{'t':>3} {'p':>3}" + (f" {'c':>2}" if context else "") + (f" {'e':>2}" if experts else "")
        + f" {'d':>5} {'v':>2} {'b':>2} {'recomp':>9} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'step s':>8} {'mem GB':>7} {'bubble':>7} {'TP GB':>8} {'PP GB':>7} {'DP GB':>7}"
        + (f" {'ring MB':>7}" if context else "")
        + (f" {'EP GB':>7} {'EP keep':>7}" if experts else "")
        + (f" {'days':>7} {'8TP/nX':>7}" if args.tokens else "")
        + (f" {'saved s':>7} {'compressed':<10}" if args.compression != "off" else "")
        + (f" {'schedule':<16}" if args.schedule == "any" else "")
    )  # fmt: skip


def _kept(p) -> str:
    """EP keep: the dropless exchange's kept bound (`moe.exchange_kept_bound`) as priced; 1x
    reruns a balanced step's exchange in the backward; "-" where none is read (a capacity
    factor, e = 1)."""
    kept = p.layout.exchange_kept_bound
    return "-" if kept is None else f"{kept:g}x"


def _row(p, args, context: bool, experts: bool = False) -> str:
    """A plan's row of the step-time table (`_header`). ring MB: what one GPU sends around the
    context ring per layer per microbatch, forward and backward; EP GB: its all-to-alls per step.
    b: sequences per GPU in a microbatch (train.microbatch_size is e b)."""
    lay, traffic = p.layout, p.bytes_per_step
    row = (
        f"{lay.tensor:>3} {lay.pipe:>3}" + (f" {lay.context:>2}" if context else "")
        + (f" {lay.expert:>2}" if experts else "")
        + f" {lay.data:>5} {lay.chunks:>2} {lay.microbatch:>2} "
        f"{lay.recompute:>9} {p.tflops_per_gpu:>8.1f} {p.percent_of_peak:>6.1f} "
        f"{p.step_time_s:>8.3f} {p.memory_per_gpu_gb:>7.1f} {p.bubble:>7.3f} "
        f"{traffic['tensor'] / 1e9:>8.2f} {traffic['pipe'] / 1e9:>7.2f} "
        f"{traffic['data'] / 1e9:>7.2f}"
        + (f" {traffic['context_per_layer'] / 1e6:>7.1f}" if context else "")
        + (f" {traffic['expert'] / 1e9:>7.2f} {_kept(p):>7}" if experts else "")
    )  # fmt: skip
    if args.tokens:
        row += f" {p.training_days:>7.1f} {p.paper_days:>7.1f}"
    if p.compression is not None:
        row += f" {p.compression.saved_s:>7.3f} {_compressed_summary(p.compression):<10}"
    if args.schedule == "any":
        row += f" {lay.schedule:<16}"
    return row


def print_without_context(best, without, args, experts: bool = False) -> None:
    """The fastest plan without context parallelism (c = 1), or that none fits, against the
    fastest plan."""
    if without is None:
        print(
            f"\nwithout context parallelism (--context 1): no layout of {args.gpus} GPUs with "
            f"batch {args.batch} fits with these pins"
        )
        return
    print(
        f"\nwithout context parallelism (--context 1), the fastest: step "
        f"{without.step_time_s:.3f} s, {without.step_time_s / best.step_time_s:.2f}x the fastest "
        f"plan's {best.step_time_s:.3f} s"
    )
    print(_header(args, True, experts))
    print(_row(without, args, True, experts))


TECHNIQUE_CODES = {"pipe_grad": "P", "embedding_sync": "E", "data_grad": "D"}
"""Table codes: P compressed backpropagation, E fused embedding sync, D data-parallel PowerSGD
(with its stage count when not every stage)."""


def _compressed_summary(cost) -> str:
    """e.g. `P E D<3`: the techniques on; D<k when only stages < k compress."""
    codes = []
    for technique in cost.techniques:
        if technique.on:
            code = TECHNIQUE_CODES[technique.name]
            stages = cost.config.data_grad_stages
            if technique.name == "data_grad" and stages != -1:
                code += f"<{stages}"
            codes.append(code)
    return " ".join(codes) or "-"


def print_compression(cost) -> None:
    """The fastest plan's techniques: bytes per GPU and in all, compute, seconds saved."""
    comp = cost.config
    print(
        f"\ncompression of the fastest plan: step {cost.base_step_s:.3f} s -> {cost.step_s:.3f} s "
        f"(saves {cost.saved_s:.3f} s, {100 * cost.saved_s / cost.base_step_s:.1f}%)"
    )
    settings = {
        "pipe_grad": f"rank {comp.pipe_grad_rank}, {comp.pipe_grad_phase}, "
        f"{comp.pipe_error_feedback.replace('none', 'no')} error feedback",
        "embedding_sync": "fused: {first, last stage} x data",
        "data_grad": f"rank {comp.data_grad_rank}, stages "
        + ("all" if comp.data_grad_stages == -1 else f"< {comp.data_grad_stages}"),
    }
    print(
        f"{'technique':<15} {'':<3} {'GB/GPU before':>13} {'after':>8} {'GB all before':>13} "
        f"{'after':>9} {'compute s':>9} {'saved s':>8}  setting"
    )
    for t in cost.techniques:
        print(
            f"{t.name:<15} {'on' if t.on else 'off':<3} {t.per_gpu_bytes[0] / 1e9:>13.3f} "
            f"{t.per_gpu_bytes[1] / 1e9:>8.3f} {t.total_bytes[0] / 1e9:>13.1f} "
            f"{t.total_bytes[1] / 1e9:>9.1f} {t.compute_s:>9.4f} {t.saved_s:>8.4f}  "
            + (settings[t.name] if t.on else "-")
        )


if __name__ == "__main__":
    sys.exit(main())
