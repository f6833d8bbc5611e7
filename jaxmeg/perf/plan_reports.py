"""The tables `scripts/plan.py` prints for a cluster file (`--cluster`: layouts, NIC-aware
placement and partition against Megatron's) and for the shortest training time (`--objective
shortest_time`: per pipeline method, the fastest layout to the target), from the parsed
arguments; each returns the script's exit code."""

from __future__ import annotations

import json
import sys

from jaxmeg.perf.planner import METHODS, Method, shortest_time


def cluster_report(args, shape, pins) -> int:
    """Layouts of a cluster file, NIC-aware placement and partition against Megatron's
    (`jaxmeg.perf.cluster_planner.plan_cluster`)."""
    from jaxmeg import config
    from jaxmeg.parallel.cluster import load_cluster
    from jaxmeg.perf.cluster_planner import plan_cluster

    if pins.pop("chunks", None) not in (None, 1):
        print("error: --cluster plans one chunk per stage (uneven stages)", file=sys.stderr)
        return 2
    try:
        cluster = load_cluster(args.cluster)
        batch = args.batch or config.load(args.config).train.global_batch
        if args.gpus not in (None, cluster.gpus):
            raise ValueError(f"--gpus {args.gpus}, but cluster {cluster.name!r} has {cluster.gpus}")
        plans = plan_cluster(
            shape,
            cluster,
            batch,
            sequence_parallel=args.sequence_parallel,
            outer_axis=args.outer_axis,
            **pins,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not plans:
        print(
            f"error: no layout of cluster {cluster.name!r} with batch {batch} fits with these pins",
            file=sys.stderr,
        )
        return 1
    rows = [p.as_dict() for p in plans[: args.top]]
    if args.json:
        print(json.dumps({**rows[0], "cluster": cluster.name, "ranked": rows}))
        return 0
    groups = ", ".join(
        f"{g.name}: {g.nodes} x {g.gpus_per_node} {g.gpu} {g.nic} "
        f"{g.nic_gbps:g} Gb/s x {g.nics_per_node}"
        for g in cluster.groups
    )
    print(
        f"cluster {cluster.name} ({groups}); batch {batch} x {shape.seq_len}; "
        f"{len(plans)} layouts fit, fastest (auto) first"
    )
    print(f"megatron: its rank order and even split; transport: {rows[0]['megatron_transport']}")
    print(
        f"{'t':>2} {'p':>3} {'d':>3} {'b':>2} {'recomp':>9} {'mem GB':>6} | {'auto layers':<28} "
        f"{'TFLOP/s':>7} {'step s':>7} | {'megatron layers':<28} {'TFLOP/s':>7} {'step s':>7} | "
        f"{'per-group TFLOP/s':>17}"
    )
    for row in rows:
        meg = row["megatron"]
        print(
            f"{row['tensor']:>2} {row['pipe']:>3} {row['data']:>3} {row['microbatch']:>2} "
            f"{row['recompute']:>9} {row['memory_per_gpu_gb']:>6.1f} | "
            f"{_stage_summary(row):<28} {row['tflops_per_gpu']:>7.1f} {row['step_time_s']:>7.3f} | "
            f"{_stage_summary(meg):<28} {meg['tflops_per_gpu']:>7.1f} {meg['step_time_s']:>7.3f} | "
            f"{row['megatron_per_group']['tflops_per_gpu']:>17.1f}"
        )
    return 0


def _stage_summary(row) -> str:
    """Layers per stage by group, e.g. `ib 19 | roce 17`."""
    parts, groups, layers = [], row["stage_groups"], row["stage_layers"]
    for s, (group, n) in enumerate(zip(groups, layers, strict=True)):
        if s and group == groups[s - 1]:
            parts[-1] += f",{n}"
        else:
            parts.append(f"{group} {n}")
    return " | ".join(parts)


def shortest_time_report(args, shape, hw, pins) -> int:
    """Per method, the fastest layout to the target (`jaxmeg.perf.planner.shortest_time`)."""
    from jaxmeg.perf import scaling

    params = scaling.non_embedding_parameters(shape.hidden, shape.layers, shape.mlp_ratio)
    try:
        if args.target_loss is not None:
            target = scaling.target_from_loss(args.target_loss, params)
        else:
            target = scaling.target_from_tokens(args.tokens, params)
    except ValueError as err:
        flag = "--target-loss" if args.target_loss is not None else "--tokens"
        print(f"error: {flag}: {err}", file=sys.stderr)
        return 2
    methods = METHODS
    if args.zero_stage is not None:
        methods = tuple(dict.fromkeys(
            Method(f"{m.schedule}+zero{args.zero_stage}", m.schedule, args.zero_stage)
            for m in METHODS
        ))  # fmt: skip
    options = {"sequence_parallel": args.sequence_parallel, "outer_axis": args.outer_axis}
    if "recompute" in pins:
        options["recompute"] = pins["recompute"]
    try:
        runs = shortest_time(shape, args.gpus, target, hw, methods, **options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {
        "target_loss": round(target.loss, 4),
        "critical_batch_tokens": float(f"{target.critical_batch_tokens:.4g}"),
        "min_steps": round(target.min_steps),
        "min_tokens": float(f"{target.min_tokens:.4g}"),
    }
    if args.json:
        print(json.dumps({**summary, "methods": {r.method.name: r.as_dict() for r in runs}}))
        return 0 if runs else 1
    print(
        f"target loss {target.loss:.3f}: critical batch {target.critical_batch_tokens:.3g} "
        f"tokens ({target.critical_batch_tokens / shape.seq_len:.0f} x {shape.seq_len}), "
        f"S_min {target.min_steps:.0f} steps, E_min {target.min_tokens:.3g} tokens; up to "
        f"{args.gpus} x {hw.name}"
    )
    print(
        f"{'method':<24} {'days':>6} {'GPUs':>6} {'t':>2} {'p':>3} {'d':>5} {'v':>3} {'b':>2} "
        f"{'m':>4} {'recomp':>9} {'step s':>7} {'mem GB':>6} {'TP GB':>7} {'PP GB':>6} "
        f"{'DP GB':>6}"
    )
    for run in runs:
        lay, traffic = run.plan.layout, run.plan.bytes_per_step
        print(
            f"{run.method.name:<24} {run.days:>6.2f} {lay.gpus:>6} {lay.tensor:>2} "
            f"{lay.pipe:>3} {lay.data:>5} {lay.chunks:>3} {lay.microbatch:>2} "
            f"{lay.microbatches:>4} {lay.recompute:>9} {run.plan.step_time_s:>7.2f} "
            f"{run.plan.memory_per_gpu_gb:>6.1f} {traffic['tensor'] / 1e9:>7.1f} "
            f"{traffic['pipe'] / 1e9:>6.2f} {traffic['data'] / 1e9:>6.1f}"
        )
    missing = [m.name for m in methods if m not in {r.method for r in runs}]
    if missing:
        print(f"no layout fits for: {', '.join(missing)}")
    return 0 if runs else 1
