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
                     per tensor group)
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

from typing import Any

import jax
import numpy as np

from jaxmeg.parallel.hlo_cost import StepCost
from jaxmeg.perf.collectives import WIRE_BYTES
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import bytes_per_step, flops_per_iteration, shape_of
from jaxmeg.training.compilation import memory_report
from jaxmeg.training.flops import model_flops_per_step
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import Trainable, abstract_state
from jaxmeg.training.step import make_train_step

AXES = ("pipe", "data", "tensor")


def _collective_bytes(cost) -> dict[str, float]:
    """`pipe`: sends between stages (collective-permutes over `pipe`); `data` and `tensor`:
    every collective within a data or a tensor group; anything else (the shared gradients'
    reduction over stages, groups over several axes) under `kind@axis+axis`."""
    out = dict.fromkeys(AXES, 0.0)
    for (kind, axes), nbytes in cost.collective_bytes.items():
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


def planner_layout(cfg) -> Layout:
    par = cfg.parallel
    return Layout(
        tensor=par.tensor, pipe=par.pipe, data=par.data, context=par.context,
        chunks=par.chunks,
        microbatch=cfg.train.microbatch_size, microbatches=cfg.train.microbatches,
        recompute=cfg.model.remat, pipe_scatter_gather=par.uses_scatter_gather,
        sequence_parallel=par.sequence_parallel,
        schedule=par.schedule if par.pipe > 1 else "1f1b", warmup=par.pipeline_warmup,
        stage_layers=tuple(par.stage_layers or ()), zero_stage=par.zero_stage,
    )  # fmt: skip


def cost_report(trainable: Trainable) -> dict[str, Any]:
    """Compiles the step of `trainable` and counts what it executes (see the module docstring)."""
    cfg = trainable.cfg
    par, model = cfg.parallel, cfg.model
    loss_and_grads = make_loss_and_grads(trainable)
    step = make_train_step(trainable, loss_and_grads)
    batch = jax.ShapeDtypeStruct(
        (cfg.train.global_batch, model.seq_len), np.int32, sharding=trainable.batch_sharding()
    )
    with jax.set_mesh(trainable.mesh):
        compiled = step.lower(abstract_state(trainable), batch, batch).compile()
    counter = StepCost(compiled.as_text(), trainable.mesh, loss_and_grads.branch_columns)
    total, stages = counter.total(), counter.per_stage()
    mesh = trainable.mesh

    table = loss_and_grads.table
    forwards = int((table.f_mb >= 0).sum())
    slot_bytes = loss_and_grads.trace_info["slot_bytes"]
    stored = forwards * slot_bytes * par.data

    act_bytes = np.dtype(model.compute_dtype).itemsize
    b, s, h = cfg.train.microbatch_size, model.seq_len, model.hidden
    m, p, v, t, d = cfg.train.microbatches, par.pipe, par.chunks, par.tensor, par.data
    megatron_whole = 2 * m * (p * v - 1) * b * s * h * act_bytes * d * t
    megatron = megatron_whole / t
    model_flops = model_flops_per_step(model, cfg.train.global_batch)
    collective = _collective_bytes(total)

    busiest = max(range(len(stages)), key=lambda i: stages[i].matmul_flops)
    device = stages[busiest]
    shape = shape_of(model)
    layout = planner_layout(cfg)
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
            "collective_bytes": _collective_bytes(device),
        },
        "planner": {
            "flops": planned_flops,
            "collective_bytes_per_device": {
                "pipe": predicted["pipe"],
                "tensor": predicted["tensor"],
                "data": predicted["data"] * grad_bytes / WIRE_BYTES,
            },
        },
        "per_stage_collective_bytes": [_collective_bytes(c) for c in stages],
        "unweighted_conditionals": sorted(total.unweighted),
        "devices": mesh.size,
        **memory_report(compiled),
    }
    return report


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
    for axis in AXES:
        ours = dev["collective_bytes"].get(axis, 0.0)
        lines.append(
            f"  {axis:6} bytes {gb(ours)} | {gb(plan['collective_bytes_per_device'][axis])}"
        )
    if r["unweighted_conditionals"]:
        lines.append(
            f"conditionals counted by their costliest branch: {r['unweighted_conditionals']}"
        )
    return "\n".join(lines)
