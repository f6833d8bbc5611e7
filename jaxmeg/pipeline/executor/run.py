"""The executor's program: one `jax.shard_map` that, per device, enters the stage, builds the
carry, runs the tick loop and reduces the step's gradients (`build`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmeg.pipeline import accumulator, gradients
from jaxmeg.pipeline.executor import beside, bodies, carry, paired, slots
from jaxmeg.pipeline.executor.columns import (
    B_ALONE,
    REDUCE_BESIDE_B,
    SEND_COT,
    SEND_COT_BACK,
    SEND_X,
    SEND_X_BACK,
)
from jaxmeg.pipeline.executor.contract import ExecutorOptions, StageFunctions
from jaxmeg.pipeline.executor.plan import Plan, build_plan
from jaxmeg.pipeline.executor.reduction import BESIDE_B, SCATTER
from jaxmeg.pipeline.layout import StageLayout
from jaxmeg.pipeline.tick_table import TickTable


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A built executor.

    run(stage_params, shared, tokens, targets, links=None, step=None) -> (loss, (stage_grads,
        shared_grads), links): `links` is the compression state (None without compression),
        fp32 on (pipe, data), kept across steps (`jaxmeg.training.links`): the backward links'
        {"q": [p, d, v, h, r], "error": [p, d, v, n, h] (lazy only)} and PowerSGD's {"data":
        {"q": {key: [p, d, v, Lc, m, r]}, "error": {key: [p, d, v, Lc, ...]}}}; `step` (int32
        scalar) is the optimizer step, for PowerSGD's warm-up.
        stage_params: leaves [v, p, Lc, ...] (`layout.shape`), `p` on `pipe`; shared: the
        embedding and head, replicated over `pipe`; tokens, targets: [global_batch, seq] on
        `data`, each replica's rows m microbatches. Gradients come back in fp32 in the same
        layouts, equal on every replica (split over the data group with a sharded optimizer;
        with ZeRO-3 the params arrive split the same way).
    table: the tick table it runs.
    branch_columns: name scope -> [ticks, p], how the cost report weights the compiled slots.
    trace_info: what one forward stores ("slot_bytes"; of it its stage input, "input_bytes"),
        filled when `run` is traced.
    reduces_in_slots: a chunk's last B slot reduces its layers over `data` (`Reduction.layers`):
        the slots hold collectives of their own.
    """

    run: Callable
    table: TickTable
    branch_columns: dict[str, Any]
    trace_info: dict[str, Any]
    reduces_in_slots: bool = False


def tick(plan: Plan, st: carry.Stage, t, c: carry.Carry, step=None) -> carry.Carry:
    """One tick of every stage, in schedule order: ZeRO-3 takes its gathered chunks, the
    in-loop reduction starts, F runs (where a table pairs F and B: F alone, then the F&B slot)
    and sends, B (or I, then W) runs, what F sent arrives, B's cotangent is sent and arrives,
    the reduction is written back. With late cotangents the previous tick's B cotangent leaves
    first and arrives after F (before the F&B slot, which reads it), so that each send has a
    slot to overlap: B's with F, F's with B. On CPU devices each runs after the one before on every
    device (`Plan.ordered`, `slots.ordered_tick`)."""
    with slots.ordered_tick(plan.ordered):
        return _tick(plan, st, t, c, step)


def _tick(plan: Plan, st: carry.Stage, t, c: carry.Carry, step=None) -> carry.Carry:
    row = st.row(t)
    if plan.gathering:
        c = beside.take_prefetched(plan, st, c, row)
    if plan.reduction.mean:
        c = beside.start_reduction(plan, st, c, row, step)
    if plan.late_cotangents:
        late = st.late_row(t)
        arrived_cot = _sent(plan, c.d_x, late, SEND_COT, SEND_COT_BACK)
    c = bodies.forward_slot(plan, st, c, row)
    if plan.paired:
        if plan.late_cotangents:
            c = c.replace(cots=beside.arrive(plan, c.cots, late, "cot", "cot", arrived_cot))
        c = paired.paired_slot(plan, st, c, row)
    arrived_x = _sent(plan, c.y, row, SEND_X, SEND_X_BACK)
    if plan.late_cotangents and not plan.paired:
        c = c.replace(cots=beside.arrive(plan, c.cots, late, "cot", "cot", arrived_cot))
    c = _backward(plan, st, c, row)
    if plan.table.split:
        c = bodies.weight_slot(plan, st, c, row)
    c = c.replace(inputs=beside.arrive(plan, c.inputs, row, "act", "x", arrived_x))
    if not plan.late_cotangents:
        c, received = beside.send_cotangent(plan, c, row, c.d_x)
        arrived_cot = {"": received, **_sent(plan, c.d_x, row, None, SEND_COT_BACK)}
        c = c.replace(cots=beside.arrive(plan, c.cots, row, "cot", "cot", arrived_cot))
    if plan.reduction.where == SCATTER:
        return beside.scatter_final(plan, c, row)
    if plan.reduction.mean:
        return beside.take_final(plan, beside.finish_reduction(plan, c, row), row)
    return c


def _sent(plan: Plan, value, row, usual, back) -> dict:
    """What arrives of `value` by way ("" the usual link when `usual` is given; a V's chunk 1
    sends the other way ("_back") and keeps its turn on the stage ("_local"))."""
    arrived = {} if usual is None else {"": beside.send(plan, value, row, usual)}
    if plan.v_shape:
        arrived["_back"] = beside.send(plan, value, row, back)
        arrived["_local"] = value
    return arrived


def _backward(plan: Plan, st: carry.Stage, c: carry.Carry, row: dict) -> carry.Carry:
    """The B slot; with BESIDE_B a mean due in this tick runs in one loop with it
    (nothing in the slot reads `pending`), so that a GPU overlaps the two. Each of the two
    copies of the slot holds only the kinds that run where it does."""
    if plan.reduction.where != BESIDE_B:
        return bodies.backward_slot(plan, st, c, row)
    cells = plan.columns.columns[REDUCE_BESIDE_B.scope] > 0  # where a mean runs beside B
    if not cells.any():
        return bodies.backward_slot(plan, st, c, row)
    state = c.only((*bodies.B_STATE, "pending"))
    due = row[REDUCE_BESIDE_B.scope] > 0

    def both(s):
        s = bodies.backward_slot(plan, st, s, row, cells)
        return s.replace(pending=plan.reduce_in_loop(s.pending))

    state = slots.run_if(due, both, state, REDUCE_BESIDE_B.scope)
    alone = lambda s: bodies.backward_slot(plan, st, s, row, ~cells)  # noqa: E731
    return c.merge(slots.run_if(~due, alone, state, B_ALONE.scope))


def _final_reduction(plan: Plan, out: carry.Carry):
    """The step's one reduction of what the loop left unreduced (`gradients.reduce_step`)."""
    zero, sharded, in_loop = plan.zero, plan.sharded, plan.reduction.in_loop
    scatter = {}
    if sharded:
        scatter = {
            "stage_dims": None if in_loop else zero.local_stage_dims,
            "shared_dims": zero.shared_dims,
            "shared_axes": zero.shared_axes,
            "specs": (None if in_loop else zero.local_stage_specs, zero.shared_specs),
        }
    g_shared = out.g_shared
    if out.g_embed is not None:
        g_shared = jax.tree.map(lambda a, b: a + b, g_shared, out.g_embed)
    loss, g_stage, g_shared = gradients.reduce_step(
        out.g_reduced if sharded and in_loop else accumulator.stacked(out.g_stage),
        g_shared,
        out.loss,
        stage_grads_reduced=in_loop,
        fused=plan.fused,
        experts=plan.experts,
        **scatter,
    )
    if plan.sums_in_loop:
        g_stage = gradients.mean_of_sum(g_stage)
    g_stage = jax.tree.map(lambda a: a[:, None], g_stage)  # back to [v, 1, Lc, ...]
    return loss, (g_stage, g_shared)


def build(fns: StageFunctions, table: TickTable, layout: StageLayout, mesh: Mesh,
          options: ExecutorOptions) -> Program:  # fmt: skip
    """The executor for `table` on `mesh` (see the package docstring)."""
    plan = build_plan(fns, table, layout, mesh, options)
    trace_info: dict[str, Any] = {}

    def per_device(stage_params, shared, tokens, targets, links=None, step=None):
        st = carry.Stage(plan, stage_params, shared, tokens, targets)
        trace_info["slot_bytes"] = sum(a.size * a.dtype.itemsize for a in st.stored_avals)
        trace_info["input_bytes"] = st.x_abstract.size * st.x_abstract.dtype.itemsize
        c = carry.initial(plan, st, links)
        out = jax.lax.fori_loop(
            0, plan.columns.num_ticks, lambda t, c_: tick(plan, st, t, c_, step), c
        )
        loss, grads = _final_reduction(plan, out)
        if not plan.stateful:
            return loss, grads
        return loss, grads, jax.tree.map(lambda a: a[None, None], out.links)

    link_specs = (P("pipe", "data"), P()) if plan.stateful else ()
    # with context parallelism each context rank holds its part of every sequence (tokens and
    # targets already in the load-balanced order: `jaxmeg.parallel.context`); with expert
    # parallelism each expert rank its share of the replica's rows
    batch = ("data", gradients.EXPERT) if gradients.EXPERT in plan.manual else "data"
    rows = P(batch, "context") if plan.context > 1 else P(batch)
    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(*plan.param_specs, rows, rows, *link_specs),
        out_specs=(P(), plan.grad_specs, *link_specs[:1]),
        axis_names=frozenset(gradients.map_axes(mesh.shape, options.splits_experts)),
        check_vma=plan.check_vma,
    )

    def run(stage_params, shared, tokens, targets, links=None, step=None):
        if not plan.stateful:
            return (*mapped(stage_params, shared, tokens, targets), None)
        return mapped(stage_params, shared, tokens, targets, links, step)

    return Program(run, table, plan.columns.branch_columns, trace_info, plan.reduction.layers)
