"""The cost report of a compiled train step (`scripts/bench.py --cost-report`): what the step
executes, counted from its HLO by `jaxmeg.parallel.hlo_cost` (loops by their trip counts, the
executor's branches by the tick table), against what the model needs, and the planner's
prediction for the same config beside it. Compile only: nothing runs.

Per step, summed over all devices:
  model_flops        Megatron-LM eq. 3 without recompute (the model's FLOPs)
  matmul_flops       dots executed; `elementwise_flops` one per element of the other arithmetic
  written_bytes      bytes written by dynamic-update-slice and copy (`transpose_bytes`: the
                     copies that change layout, transposes the backend placed around matmuls)
  stored_bytes       what the forwards keep for their backwards: each forward's stage input and
                     the residuals its chunk stores, at their logical size (with tensor > 1, once
                     per tensor group); a forward its backward runs with (`B_LAST`) only its input
  collective_bytes   bytes sent on links: `pipe` the sends between stages, `data` and `tensor`
                     every collective within one data or tensor group; the rest (the shared
                     gradients' reduction over stages, groups over several axes) by kind and axes;
                     every one by kind and axes in `collective_bytes_by_kind` (ZeRO-3's gathers
                     are `all-gather@data`)
  megatron_pipe_bytes  Megatron-LM's pipe traffic for the layout: b s h per microbatch per
                     stage boundary each way, 2 m (p v - 1) messages per replica, split over the
                     tensor group (scatter/gather, its default) when t > 1; without it in
                     `megatron_pipe_bytes_without_scatter_gather`
`per_device` holds the busiest device's figures (the most matmul FLOPs) beside the planner's
per-GPU prediction (`jaxmeg.perf.model`), `per_stage_collective_bytes` one device's of each stage
(the planner's per-GPU links are a stage with neighbours on both sides and no embedding or head).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from jaxmeg.config_moe import exchange_bounds
from jaxmeg.models.moe_exchange import EXCHANGE_KEPT
from jaxmeg.parallel import hlo_gpu
from jaxmeg.parallel.hlo_cost import StepCost
from jaxmeg.perf.collectives import WIRE_BYTES
from jaxmeg.perf.experts import exchange_block, exchange_branch, kept_block, tokens
from jaxmeg.perf.layout import config_layout
from jaxmeg.perf.model import flops_per_iteration, shape_of, step_time
from jaxmeg.perf.traffic import bytes_per_step
from jaxmeg.pipeline.executor.columns import B_LAST, B_LAST_REDUCING
from jaxmeg.training.compilation import compile_step, hlo_text, memory_report
from jaxmeg.training.flops import model_flops_per_step
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import Trainable

AXES = ("pipe", "data", "tensor")
EXPERT_KEY = "all-to-all@expert"
"""How `_collective_bytes` names the experts' exchange (an MoE layer's tokens over `expert`)."""


def _collective_bytes(by_kind) -> dict[str, float]:
    """`pipe`: sends between stages (collective-permutes over `pipe`); `data` and `tensor`:
    every collective within a data or a tensor group; anything else (the shared gradients'
    reduction over stages, groups over several axes) under `kind@axis+axis`, a ragged
    all-to-all with the all-to-alls (`EXPERT_KEY`)."""
    out = dict.fromkeys(AXES, 0.0)
    for (kind, axes), nbytes in by_kind.items():
        kind = kind.removeprefix("ragged-")
        if not axes:
            continue
        if axes == ("pipe",) and kind == "collective-permute":
            key = "pipe"
        elif axes in (("data",), ("tensor",)):
            key = axes[0]
        else:
            key = f"{kind}@{'+'.join(axes)}"
        out[key] = out.get(key, 0.0) + nbytes
    return out


def cost_report(trainable: Trainable, target=None) -> dict[str, Any]:
    """Compiles the step of `trainable` and counts what it executes (see the module docstring);
    with `target` (a `jaxmeg.parallel.gpu_target.GpuTarget` whose devices the mesh is built
    on), also what the GPU program shows (`gpu_figures`)."""
    cfg = trainable.cfg
    par, model = cfg.parallel, cfg.model
    loss_and_grads = make_loss_and_grads(trainable)
    compiled, seconds = compile_step(trainable, loss_and_grads)
    hw = target.hardware if target is not None else None
    roofline = None
    if hw:
        fp8_peak = hw.fp8_peak_tflops or hw.peak_tflops
        roofline = (hw.peak_tflops * 1e12, hw.hbm_tb_per_s * 1e12, fp8_peak * 1e12)
    # the exchange as it runs here (`moe.exchange: auto` settled): its wire bytes as priced
    shape = shape_of(model, cfg.moe)
    layout = config_layout(dataclasses.replace(cfg, moe=trainable.moe_cfg))
    # the dropless exchange's bound is the data's: counted at a balanced load's
    branch = exchange_branch(shape, layout)
    bounded = dataclasses.replace(layout, expert_exchange="bounded")
    padding = trainable.layout.padding_branches()  # what each stage runs of its layer slots
    counter = StepCost(
        hlo_text(compiled), trainable.mesh, loss_and_grads.program.branch_columns,
        roofline=roofline,
        chosen_branches=padding if branch is None else {**padding, EXCHANGE_KEPT: branch},
    )  # fmt: skip
    total, stages = counter.total(), counter.per_stage()
    mesh = trainable.mesh

    table = loss_and_grads.program.table
    forwards = int((table.f_mb >= 0).sum())
    columns, info = loss_and_grads.program.branch_columns, loss_and_grads.program.trace_info
    # a forward whose backward runs with it (B_LAST) keeps only its stage input, as it arrived
    at_once = int(sum(np.sum(columns.get(k.scope, 0)) for k in (B_LAST, B_LAST_REDUCING)))
    kept = forwards * info["slot_bytes"] - at_once * (info["slot_bytes"] - info["input_bytes"])
    stored = kept * par.data

    act_bytes = np.dtype(model.compute_dtype).itemsize
    b, s, h = cfg.train.microbatch_size, model.seq_len, model.hidden
    m, p, v, t, d = cfg.train.microbatches, par.pipe, par.chunks, par.tensor, par.data
    megatron_whole = 2 * m * (p * v - 1) * b * s * h * act_bytes * d * t
    megatron = megatron_whole / t
    model_flops = model_flops_per_step(model, cfg.train.global_batch, moe=cfg.moe)
    collective = _collective_bytes(total.collective_bytes)

    busiest = max(range(len(stages)), key=lambda i: stages[i].matmul_flops)
    device = stages[busiest]
    predicted = bytes_per_step(shape, layout, compute_bytes=act_bytes)
    grad_bytes = 4  # gradients are reduced in fp32
    planned_flops = flops_per_iteration(
        shape, cfg.train.global_batch, recompute=model.remat == "full"
    )
    report = {
        "mesh": {"data": d, "pipe": p, "tensor": t},
        "schedule": par.schedule if p > 1 else None,
        "chunks": v,
        "microbatches": m,
        "remat": model.remat,
        "scatter_gather": par.uses_scatter_gather,
        "model_flops": model_flops,
        "matmul_flops": total.matmul_flops,
        "elementwise_flops": total.elementwise_flops,
        "written_bytes": total.written_bytes,
        "dynamic_update_slice_bytes": total.dus_bytes,
        "copy_bytes": total.copy_bytes,
        "transpose_bytes": total.transpose_bytes,
        "stored_bytes": float(stored),
        "collective_bytes": collective,
        "collective_bytes_by_kind": {
            f"{kind}@{'+'.join(axes)}": nbytes
            for (kind, axes), nbytes in sorted(total.collective_bytes.items())
            if axes
        },
        "megatron_pipe_bytes": float(megatron),
        "megatron_pipe_bytes_without_scatter_gather": float(megatron_whole),
        "ratios": {
            "matmul_over_model_flops": total.matmul_flops / model_flops,
            "written_over_stored": total.written_bytes / stored if stored else None,
            "pipe_over_megatron": collective["pipe"] / megatron if megatron else None,
            "pipe_over_megatron_without_scatter_gather": (
                collective["pipe"] / megatron_whole if megatron_whole else None
            ),
        },
        "per_device": {
            "stage": busiest,
            "matmul_flops": device.matmul_flops,
            "written_bytes": device.written_bytes,
            "collective_bytes": _collective_bytes(device.collective_bytes),
        },
        "planner": {
            "flops": planned_flops,
            "collective_bytes_per_device": {
                "pipe": predicted["pipe"],
                "tensor": predicted["tensor"],
                "data": predicted["data"] * grad_bytes / WIRE_BYTES,
                EXPERT_KEY: predicted["expert"],
            },
        },
        "per_stage_collective_bytes": [_collective_bytes(c.collective_bytes) for c in stages],
        "unweighted_conditionals": sorted(total.unweighted),
        "expert_exchange_block": None if branch is None else exchange_block(shape, bounded),
        "devices": mesh.size,
        **memory_report(compiled),
    }
    if target is not None:
        report.update(gpu_figures(trainable, compiled, target, counter, model_flops))
        # the performance model's step time for this layout (`plan.py`'s), beside the bounds
        report["planner_step_seconds"] = step_time(shape, layout, hw).total
        report["compile_seconds"] = round(seconds, 3)
        if branch is not None:
            text, columns = hlo_text(compiled), loss_and_grads.program.branch_columns

            def at_bound(j):
                return StepCost(text, mesh, columns, roofline=roofline,
                                chosen_branches={**padding, EXCHANGE_KEPT: j})  # fmt: skip

            report["exchange_bounds"] = exchange_bound_figures(
                trainable, shape, layout, at_bound, hw, model_flops
            )
    return report


def exchange_bound_figures(trainable, shape, layout, at_bound, hw, model_flops) -> list[dict]:
    """The dropless exchange's step at each of its bounds (`config_moe.exchange_bounds`): a
    skewed router's step takes a larger one than the balanced step the report counts. Per bound:
    its block rows, that as a multiple of the even load, whether its residuals are kept
    (`moe.exchange_kept_bound`; else its backward reruns the forward), and the roofline and
    schedule bound with the MFU each allows, the step counted with that branch (`at_bound(j)`,
    a `StepCost`)."""
    x, e = shape.experts, layout.expert
    choices = max(1, round(tokens(shape, layout) * x.top_k))
    kept = kept_block(shape, layout)
    peak, devices = hw.peak_tflops * 1e12, trainable.mesh.size
    seconds = partial(_step_seconds, trainable=trainable, hw=hw)
    figures = []
    for j, rows in enumerate(exchange_bounds(choices, e, x.exchange_bounds)):
        counter = at_bound(j)
        stages = counter.per_stage()
        roof = max(seconds(c) for c in stages)
        bound = schedule_bound(counter, stages, seconds)
        figures.append({
            "rows": rows, "load": rows * e / choices, "kept": rows <= kept,
            "roofline_seconds": roof, "roofline_mfu": model_flops / devices / roof / peak,
            "schedule_bound_seconds": bound,
            "schedule_bound_mfu": model_flops / devices / bound / peak,
        })  # fmt: skip
    return figures


def link_overlap(cost) -> dict[str, float | None]:
    """Per link (as `_collective_bytes` names them) the share of bytes whose collective has a
    GEMM scheduled between its start and done."""
    sent = _collective_bytes(cost.collective_bytes)
    overlapped = _collective_bytes(cost.overlapped_bytes)
    return {k: (overlapped.get(k, 0.0) / v if v else None) for k, v in sent.items()}


def _step_seconds(cost, trainable: Trainable, hw) -> float:
    """A device's cost at the roofline, plus its collectives not overlapped (`_exposed_seconds`)."""
    return cost.roofline_seconds + _exposed_seconds(cost, trainable, hw)


def _exposed_seconds(cost, trainable: Trainable, hw) -> float:
    """Collective bytes of one device not overlapped by a GEMM, at its links' bandwidth
    (`jaxmeg.perf.links`: NVLink inside a node, the network across)."""
    from jaxmeg.perf import links

    layout = config_layout(trainable.cfg)
    link_of = {"pipe": links.pipe_link, "data": links.data_link, "tensor": links.tensor_link,
               "context": links.context_link, "expert": links.expert_link}  # fmt: skip
    seconds = 0.0
    for (kind, axes), nbytes in cost.collective_bytes.items():
        exposed = nbytes - cost.overlapped_bytes.get((kind, axes), 0.0)
        if not axes or exposed <= 0:
            continue
        gb_per_s = min(link_of.get(a, links.data_link)(layout, hw)[0] for a in axes)
        seconds += exposed / (gb_per_s * 1e9)
    return seconds


def gpu_figures(trainable, compiled, target, counter: StepCost, model_flops) -> dict[str, Any]:
    """What the GPU program shows: per-device memory and whether it fits (`fit`), GEMM and
    cuDNN attention FLOPs and calls, kernel and copy bytes, how much of each link's bytes
    overlaps a GEMM, and two bounds on the step time, with the MFU each allows:
      roofline        per device the sum over its kernels of the larger of FLOPs at peak and
                      bytes at memory bandwidth, plus the collectives not overlapped at their
                      links' bandwidth, for the busiest device (`kernel_classes` splits it)
      schedule bound  the stages move in lockstep: per tick the slowest stage's slots at that
                      roofline, summed over the tick table, plus the slowest stage's work
                      outside the tick loop: the roofline with the schedule's bubble."""
    from jaxmeg.training.fit import fit_report

    hw = target.hardware
    memory = memory_report(compiled)
    fit = fit_report(trainable, compiled, target)
    total, stages = counter.total(), counter.per_stage()

    seconds = partial(_step_seconds, trainable=trainable, hw=hw)
    per_stage = [seconds(c) for c in stages]
    busiest = int(np.argmax(per_stage))
    devices = trainable.mesh.size
    per_replica = devices // len(stages)
    peak = hw.peak_tflops * 1e12
    bound = schedule_bound(counter, stages, seconds)
    classes = {k: stages[busiest].roofline_by_class.get(k, 0.0) for k in hlo_gpu.KERNEL_CLASSES}
    classes["collectives_exposed"] = _exposed_seconds(stages[busiest], trainable, hw)
    return {
        "target": fit["target"],
        "memory": {
            **{k.removesuffix("_bytes"): v for k, v in memory.items()},
            "device": fit["device_bytes"],
            "usable": fit["usable_device_bytes"],
            "fits": fit["fits"],
            "planner": fit["planner_device_bytes"],
        },  # fmt: skip
        "gemm_flops": total.matmul_flops,
        "fp8_gemms": {"flops": total.fp8_gemm_flops, "calls": total.fp8_gemm_calls},
        "fp32_accumulating_gemm_calls": total.adding_gemm_calls["f32"],
        "adding_gemm_calls": dict(total.adding_gemm_calls),
        "attention_kernels": {
            "forward_per_replica": total.attention_forward_calls / per_replica,
            "backward_per_replica": total.attention_backward_calls / per_replica,
            "flops": total.attention_flops,
        },
        "kernel_bytes": total.kernel_bytes,
        "copy_kernel_bytes": total.copy_kernel_bytes,
        "copy_share": total.copy_kernel_bytes / total.kernel_bytes if total.kernel_bytes else 0,
        "kernel_bytes_by_class": dict(total.kernel_bytes_by_class),
        "collective_overlap": link_overlap(total),
        "roofline_seconds": per_stage[busiest],
        "roofline_mfu": model_flops / devices / per_stage[busiest] / peak,
        "roofline_stage": busiest,
        "kernel_classes": classes,
        "model_flops_at_peak_seconds": model_flops / devices / peak,
        "schedule_bound_seconds": bound,
        "schedule_bound_mfu": model_flops / devices / bound / peak,
    }


def schedule_bound(counter: StepCost, stages, seconds) -> float:
    """The step's bound with the schedule's bubble (`gpu_figures`): `stages` the cost of one
    device of each stage, `seconds` a cost's time at the roofline."""
    ticks = [counter.tick_costs(s) for s in range(len(stages))]
    if not ticks[0]:
        return max(seconds(c) for c in stages)
    per_tick = np.array([[seconds(c) for c in stage] for stage in ticks])  # [p, ticks]
    outside = max(seconds(c) - row.sum() for c, row in zip(stages, per_tick, strict=True))
    return float(outside + per_tick.max(axis=0).sum())


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned text lines (bench.py --cost-report without --json)."""
    r, ratios = report, report["ratios"]
    gb = lambda x: f"{x / 1e9:10.4f} GB"  # noqa: E731
    gf = lambda x: f"{x / 1e9:10.3f} GFLOP"  # noqa: E731
    lines = [
        f"mesh {r['mesh']}  schedule {r['schedule']}  chunks {r['chunks']}  "
        f"microbatches {r['microbatches']}  remat {r['remat']}  "
        f"scatter_gather {r['scatter_gather']}",
        "per step, all devices:",
        f"  model FLOPs         {gf(r['model_flops'])}",
        f"  matmul FLOPs        {gf(r['matmul_flops'])}   x{ratios['matmul_over_model_flops']:.3f}",
        f"  elementwise FLOPs   {gf(r['elementwise_flops'])}",
        f"  written (DUS+copy)  {gb(r['written_bytes'])}   "
        f"(DUS {r['dynamic_update_slice_bytes'] / 1e9:.4f}, copy {r['copy_bytes'] / 1e9:.4f}, "
        f"of which transposes {r['transpose_bytes'] / 1e9:.4f})",
        f"  stored for backward {gb(r['stored_bytes'])}   written/stored "
        + (f"x{ratios['written_over_stored']:.2f}" if ratios["written_over_stored"] else "-"),
    ]
    for axis, nbytes in r["collective_bytes"].items():
        lines.append(f"  {axis + ' bytes':19} {gb(nbytes)}")
    if ratios["pipe_over_megatron"] is not None:
        lines.append(
            f"  Megatron-LM pipe    {gb(r['megatron_pipe_bytes'])}   ours x"
            f"{ratios['pipe_over_megatron']:.2f} (x"
            f"{ratios['pipe_over_megatron_without_scatter_gather']:.2f} of its bytes without "
            "scatter/gather)"
        )
    dev, plan = r["per_device"], r["planner"]
    lines.append(f"busiest device (stage {dev['stage']}) | planner per GPU:")
    lines.append(f"  matmul FLOPs {gf(dev['matmul_flops'])} | {gf(plan['flops'] / r['devices'])}")
    planned = plan["collective_bytes_per_device"]
    experts = (EXPERT_KEY,) if planned[EXPERT_KEY] or EXPERT_KEY in dev["collective_bytes"] else ()
    for axis in (*AXES, *experts):
        ours = dev["collective_bytes"].get(axis, 0.0)
        name = "expert" if axis == EXPERT_KEY else axis
        lines.append(f"  {name:6} bytes {gb(ours)} | {gb(planned[axis])}")
    if "target" in r:
        lines += _format_gpu(r, gb, gf)
    if r.get("expert_exchange_block"):
        lines.append(
            f"the dropless exchange counted at {r['expert_exchange_block']:.0f} rows per block "
            "(a balanced load's bound; a step runs the bound its busiest block fits)"
        )
    for bound in r.get("exchange_bounds", []):
        lines.append(
            f"  at {bound['rows']:.0f} rows ({bound['load']:.2f}x the even load"
            f"{', kept' if bound['kept'] else ', rerun in the backward'}): roofline "
            f"{bound['roofline_seconds'] * 1e3:.2f} ms (MFU at most {bound['roofline_mfu']:.1%}), "
            f"with the schedule's bubble {bound['schedule_bound_seconds'] * 1e3:.2f} ms "
            f"({bound['schedule_bound_mfu']:.1%})"
        )
    if r["unweighted_conditionals"]:
        lines.append(
            f"conditionals counted by their costliest branch: {r['unweighted_conditionals']}"
        )
    return "\n".join(lines)


def _format_gpu(r: dict[str, Any], gb, gf) -> list[str]:
    mem, att = r["memory"], r["attention_kernels"]
    overlap = ", ".join(
        f"{axis} {share:.0%}"
        for axis, share in r["collective_overlap"].items()
        if share is not None
    )
    planner = f", planner {mem['planner'] / 1e9:.2f} GB" if mem["planner"] else ""
    return [
        f"{r['target']}: compiled in {r['compile_seconds']:.1f} s",
        f"  memory per device {mem['device'] / 1e9:.2f} GB of {mem['usable'] / 1e9:.2f} GB "
        f"usable: {'fits' if mem['fits'] else 'does not fit'} (arguments "
        f"{mem['argument'] / 1e9:.2f}, temp {mem['temp'] / 1e9:.2f}{planner})",
        f"  GEMM FLOPs          {gf(r['gemm_flops'])}   attention {gf(att['flops'])} in "
        f"{att['forward_per_replica']:.0f} forward + {att['backward_per_replica']:.0f} backward "
        "cuDNN calls per replica"
        + (
            f"; FP8 GEMMs {gf(r['fp8_gemms']['flops'])} in {r['fp8_gemms']['calls']:.0f} calls"
            if r["fp8_gemms"]["calls"]
            else ""
        )
        + (
            f"; {r['fp32_accumulating_gemm_calls']:.0f} add into an fp32 accumulator"
            if r["fp32_accumulating_gemm_calls"]
            else ""
        ),
        f"  kernel bytes        {gb(r['kernel_bytes'])}   copies {gb(r['copy_kernel_bytes'])} "
        f"({r['copy_share']:.1%})",
        f"  overlapped with GEMMs: {overlap or 'no collectives'}",
        f"  roofline {r['roofline_seconds'] * 1e3:.2f} ms per step: MFU at most "
        f"{r['roofline_mfu']:.1%}; with the schedule's bubble "
        f"{r['schedule_bound_seconds'] * 1e3:.2f} ms, MFU at most {r['schedule_bound_mfu']:.1%} "
        f"(the planner's step: {r['planner_step_seconds'] * 1e3:.2f} ms)",
        f"  the roofline by kernel class (stage {r['roofline_stage']}; the model's FLOPs at peak "
        f"take {r['model_flops_at_peak_seconds'] * 1e3:.2f} ms):",
        *(
            f"    {name.replace('_', ' '):20} {seconds * 1e3:10.2f} ms"
            for name, seconds in r["kernel_classes"].items()
        ),
    ]
