"""The plan: everything static about one build, decided once from the stage functions, the
tick table, the layout, the mesh and the options, and read by the carry, the slot bodies, the
units beside the slots and the tick. No mode flag is worked out anywhere else."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmeg.pipeline import gradients
from jaxmeg.pipeline.executor.columns import I_LAST, LATE_COLUMNS, SlotColumns, slot_columns
from jaxmeg.pipeline.executor.contract import ExecutorOptions, StageFunctions
from jaxmeg.pipeline.executor.reduction import Reduction, choose
from jaxmeg.pipeline.layout import StageLayout
from jaxmeg.pipeline.tick_table import ONE_ACTION, PAIRS, TickTable


@dataclasses.dataclass(frozen=True)
class Zero:
    """The sharded optimizer as the executor reads it (all None / () without one).

    chunk_dims: one chunk's leaves [Lc, ...], the dim split over `data` (-1 none)
    local_stage_dims: one device's stage leaves [v, Lc, ...]
    stage_dims / shared_dims / shared_axes: as `ZeroSharding`
    chunk_specs / local_stage_specs / shared_specs: the leaves' own specs, as the dims (P()
        for each leaf where the caller gave none)
    """

    stage: int
    chunk_dims: Any
    local_stage_dims: Any
    stage_dims: Any
    shared_dims: Any
    shared_axes: tuple[str, ...]
    chunk_specs: Any = None
    local_stage_specs: Any = None
    shared_specs: Any = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """p stages of v chunks, m microbatches, d data replicas.

    whole_model: p v = 1 (the F slot only embeds; the B slot runs the model under one vjp)
    store: the F slot keeps the chunk's residuals (no recompute); else only the stage input
    pooled: `ExecutorOptions.pooled_slots`, a zero-bubble table (not DualPipeV's F&B pairs)
        with stored residuals, and no automatic axis splits what is kept: a microbatch's
        residuals and then its dY share the slot it holds from F to W as flat runs
        (`Carry.pool`, `executor.pool`; a flat run of a leaf split over an automatic axis
        would be gathered)
    head_in_w: each F of the last stage leaves the output projection's weight gradient to
        the W slot of a later tick before its next F: its first W if one comes, else its I's
        tick (`last_stage.head_in_w_columns`: F_LAST_HEAD_IN_W, W_HEAD): in a zero-bubble
        table of one chunk per stage and one action per tick (zb_h1) with stored residuals,
        the stage functions' `HeadSplit` given, and no automatic axis > 1 (W_HEAD runs on one
        stage only: nothing GSPMD could add to it may be a collective). The last stage's F
        (chunk, head and loss) is the slowest slot of its ticks; its W, beside the other
        stages' I, of the lightest.
    gathering / gathering_slots: ZeRO-3, and the slots ("f", "b") that gather their chunk
    reduction: where a chunk's gradients are reduced over data x context inside the loop
        (`reduction.Reduction`: none, after its last backward, beside a B slot, or scattered
        for a sharded optimizer; and whether its last backward reduces it layer by layer)
    split_sends: scatter/gather over `tensor` on the pipe links
    v_shape: a V placement (zbv, dualpipev), sending both ways
    paired: the table runs F&B pairs (`TickTable.paired`) in one slot (`paired.paired_slot`)
    late_cotangents: a B slot's cotangent leaves at the start of the next tick and arrives
        before that tick's B slot (`overlap_sends` without pipe compression)
    fused: the shared gradients reduced by `gradients.fused_sync`
    ordered: each loop and send of a tick runs after the one before (`slots.ordered_tick`):
        on CPU devices, whose runtime may start two collectives that no
        data orders in another order on another device (a send on one, a slot's exchange on
        another: the step hangs). A GPU runs the one order its scheduler chose on every
        device, and overlaps them
    manual / replica_axes: the map's manual axes, and those the dense gradients are averaged
        over (`gradients.replica_axes`)
    experts: with a manual `expert` axis, a tree like the stage params of bools: the leaves
        split over it (a rank's own experts), which `gradients.reduce_over_data` reduces over
        the replicas only, not summed over `expert`; None without
    """

    fns: StageFunctions
    table: TickTable
    options: ExecutorOptions
    p: int
    v: int
    m: int
    d: int
    context: int
    whole_model: bool
    store: bool
    gathering: bool
    gathering_slots: tuple[str, ...]
    reduction: Reduction
    split_sends: bool
    v_shape: bool
    paired: bool
    late_cotangents: bool
    fused: bool
    ordered: bool
    manual: tuple[str, ...]
    replica_axes: tuple[str, ...]
    experts: Any
    zero: Zero
    columns: SlotColumns
    tick_columns: dict[str, jax.Array]  # columns.columns as arrays, read per tick
    chunk_layers: jax.Array  # int32 [v, p]
    param_specs: tuple
    grad_specs: tuple
    check_vma: bool
    pooled: bool = False
    head_in_w: bool = False
    padding_slots: tuple[int, ...] = ()  # the layer slots some stage pads (`StageLayout`)

    @property
    def last_kept(self) -> bool:
        """The last virtual stage's F keeps its residuals in one buffer for its I (`I_LAST`,
        `last_stage.kept_one_at_a_time`; `Carry.last_kept`)."""
        return bool((self.columns.columns["b_kind"] == I_LAST.code).any())

    @property
    def x_after_i(self) -> bool:
        """With `last_kept` and the head split (`head_in_w`), the last stage's F keeps the matmul
        inputs X in that buffer too (one per layer) and its I writes them into their ring, not
        its F: there the F (chunk, head and loss) outlasts every other stage's slot and its I
        is the lightest I (gpt_1.3b zb_h1 on 4 H100s: F 11.9 -> 11.2 ms, I 9.7 -> 10.6 against
        the other stages' 10.4; the schedule bound 299.1 -> 297.3 ms). With an automatic axis
        (tensor) > 1, I's collectives have no weight-gradient GEMM to hide under and its tick no
        room (gpt_1.3b (2,2,2): 166.6 -> 169.1 ms), so F writes X there."""
        return self.last_kept and self.head_in_w

    @property
    def sharded(self) -> bool:
        """A sharded optimizer (ZeRO-1 or 3): chunks reduce-scatter instead of averaging."""
        return bool(self.zero.stage)

    @property
    def sums_in_loop(self) -> bool:
        """The loop's reductions of the stage gradients sum over the replicas, and the step
        divides by their count once after the loop, where the update reads the gradients (in
        the loop the divide would be a pass of its own over them): an in-loop mean, without a
        sharded optimizer or PowerSGD (whose stages return the mean itself)."""
        uncompressed = self.options.data_compression is None
        return self.reduction.in_loop and not self.sharded and uncompressed

    def reduce_in_loop(self, tree):
        """A chunk's (or layer's) stage gradients reduced over the replicas in the loop: the
        mean, or the sum where `sums_in_loop`."""
        return gradients.reduce_over_data(tree, self.experts, mean=not self.sums_in_loop)

    def taken(self, cp):
        """A chunk's params [Lc, ...] as its functions take them: a list of per-layer slices
        where `StageFunctions.per_layer` says, else as they are."""
        if not self.fns.per_layer:
            return cp
        count = jax.tree.leaves(cp)[0].shape[0]
        return [jax.tree.map(lambda a, i=i: a[i], cp) for i in range(count)]

    @property
    def layer_accumulators(self) -> bool:
        """The stage's gradients accumulate per layer (`accumulator`): one chunk per stage
        whose functions take its layers one by one."""
        return self.v == 1 and self.fns.per_layer

    @property
    def stateful(self) -> bool:
        return self.options.stateful

    @property
    def split(self):
        return self.fns.split


def _check(fns: StageFunctions, table: TickTable, layout: StageLayout, mesh: Mesh,
           options: ExecutorOptions) -> None:  # fmt: skip
    """What the build refuses: combinations config validation keeps from users, checked again
    here for callers of the library."""
    p, v, zero = layout.num_stages, layout.num_chunks, options.zero
    dc = options.data_compression
    if zero.stage and gradients.trivial(mesh.shape, options.splits_experts):
        raise ValueError(f"zero stage {zero.stage} needs a data axis > 1, the mesh is {mesh.shape}")
    if (zero.stage and (dc or options.fused_embedding_sync)) or (dc and mesh.shape["data"] == 1):
        raise ValueError(
            f"PowerSGD and the fused embedding sync need a data axis > 1 (PowerSGD) and no "
            f"sharded optimizer (zero stage {zero.stage}); the mesh is {mesh.shape}"
        )
    if mesh.shape["pipe"] != p or table.num_stages != p:
        raise ValueError(
            f"layout has {p} stages, the mesh's pipe axis {mesh.shape['pipe']}, the tick table "
            f"{table.num_stages}"
        )
    if table.split and (fns.split is None or p * v == 1):
        raise ValueError(
            f"the tick table splits backwards into I and W: the stage functions need `split`, "
            f"and the pipeline more than one virtual stage (p v = {p * v})"
        )
    if table.placement == "v" and layout.placement != "v":
        raise ValueError("the tick table runs a V placement (zbv); the stage layout is not one")


def _check_last_tick_sends_no_cotangent(columns: SlotColumns) -> None:
    """A cotangent sent late leaves in the tick after its B slot: there is none after the last
    (nothing a last tick sends could be read by a later one)."""
    last = {k: c[-1] for k, c in columns.columns.items() if k in LATE_COLUMNS}
    assert all((c == (-1 if k.endswith("_slot") else 0)).all() for k, c in last.items()), last


def _spec_with(lead: tuple, dim: int, axes, expert_dim: int = -1) -> P:
    """PartitionSpec with `lead` entries, then `axes` on `dim` (if >= 0), and `expert` on
    `expert_dim` (if >= 0)."""
    entries = list(lead)
    for d, a in ((dim, axes), (expert_dim, gradients.EXPERT)):
        if d >= 0:
            entries += [None] * (d + 1 - len(entries))
            entries[d] = a
    return P(*entries)


def _expert_dims(options: ExecutorOptions, mesh: Mesh):
    """Per stage leaf the dim split over a manual `expert` axis (-1 none), or None where the
    map is not manual over `expert`."""
    if gradients.EXPERT not in gradients.manual_axes(mesh.shape, options.splits_experts):
        return None
    return options.expert_dims


def _whole_specs(expert_dims):
    """The stage leaves' specs [v, p, Lc, ...] where no data group splits them: over `pipe`,
    and over a manual `expert` axis where `expert_dims` says."""
    if expert_dims is None:
        return P(None, "pipe")
    return jax.tree.map(lambda e: _spec_with((None, "pipe"), -1, None, e), expert_dims)


def _specs_or_none(specs, dims):
    """The leaves' own specs, or P() for each (no automatic axis splits them)."""
    return jax.tree.map(lambda _: P(), dims) if specs is None else specs


def _zero(options: ExecutorOptions, expert_dims) -> tuple[Zero, tuple]:
    """The sharded optimizer's dims, and the gradients' specs (stage, shared)."""
    z = options.zero
    if not z.stage:
        return Zero(0, None, None, None, None, z.shared_axes), (_whole_specs(expert_dims), P())
    # stage leaves are [v, p, Lc, ...]; per device [v, Lc, ...]; one chunk [Lc, ...]
    stage_specs = _specs_or_none(z.stage_specs, z.stage_dims)
    zero = Zero(
        stage=z.stage,
        chunk_dims=gradients.drop_leading_dims(z.stage_dims, 2),
        local_stage_dims=gradients.drop_leading_dims(z.stage_dims, 1),
        stage_dims=z.stage_dims,
        shared_dims=z.shared_dims,
        shared_axes=z.shared_axes,
        chunk_specs=gradients.drop_leading_specs(stage_specs, 2),
        local_stage_specs=gradients.drop_leading_specs(stage_specs, 1),
        shared_specs=_specs_or_none(z.shared_specs, z.shared_dims),
    )
    experts = jax.tree.map(lambda _: -1, z.stage_dims) if expert_dims is None else expert_dims
    grad_specs = (
        jax.tree.map(
            lambda dim, e: _spec_with((None, "pipe"), dim, "data", e), z.stage_dims, experts
        ),  # fmt: skip
        jax.tree.map(lambda dim: _spec_with((), dim, z.shared_axes), z.shared_dims),
    )
    return zero, grad_specs


def build_plan(fns: StageFunctions, table: TickTable, layout: StageLayout, mesh: Mesh,
               options: ExecutorOptions) -> Plan:  # fmt: skip
    _check(fns, table, layout, mesh, options)
    p, v = layout.num_stages, layout.num_chunks
    whole_model = p * v == 1
    expert_dims = _expert_dims(options, mesh)
    zero, grad_specs = _zero(options, expert_dims)
    gathering = zero.stage == 3
    pc, dc = options.pipe_compression, options.data_compression
    manual = gradients.manual_axes(mesh.shape, options.splits_experts)
    fused = options.fused_embedding_sync and p > 1
    # a chunk's last B reduces its layers (whole backwards, per-layer chunks), or its last W
    # (split backwards); not where a chunk's last action may be either (DualPipeV)
    last_reduces = not table.whole_backwards if table.split else fns.per_layer
    replica_axes = gradients.replica_axes(manual)
    # with `expert` manual its ranks' sum goes with the replicas' mean
    reduced = (*replica_axes, *gradients.summed_axes(manual))
    reduction = choose(
        data_replicas=math.prod(mesh.shape[a] for a in reduced), sharded=bool(zero.stage),
        overlap_sends=options.overlap_sends, powersgd=dc is not None,
        paired=table.ticks == PAIRS, last_reduces=bool(last_reduces),
        layers_per_chunk=layout.layers_per_chunk,
    )  # fmt: skip
    store = fns.chunk_recompute is None and not whole_model
    unsplit = all(n == 1 for axis, n in mesh.shape.items() if axis not in manual)
    zero_bubble = table.split and table.ticks == ONE_ACTION and store
    head_in_w = zero_bubble and unsplit and v == 1 and fns.split.head is not None
    columns = slot_columns(
        table, v, reduction, gathering=gathering, compress=None if pc is None else pc.compress,
        powersgd_stages=None if dc is None else dc.stages, head_in_w=head_in_w,
        at_once=store and options.overlap_sends, last_kept=zero_bubble,
    )  # fmt: skip
    late_cotangents = options.overlap_sends and pc is None
    if late_cotangents:
        _check_last_tick_sends_no_cotangent(columns)
    # Reducing each chunk inside the loop leaves the stage gradients typed as varying over
    # `data` though their values agree, which shard_map's type check cannot know: it is off
    # then (the equivalence tests check the values).
    check_vma = not (
        gradients.trivial(mesh.shape, options.splits_experts)
        or reduction.in_loop
        or zero.stage
        or options.stateful
        or fused
    )
    return Plan(
        fns=fns,
        table=table,
        options=options,
        p=p,
        v=v,
        m=options.microbatches,
        d=mesh.shape["data"],
        context=mesh.shape.get("context", 1),
        whole_model=whole_model,
        store=store,
        gathering=gathering,
        # with p v = 1 the F slot only embeds: only the B slot gathers
        gathering_slots=(("b",) if whole_model else ("b", "f")) if gathering else (),
        reduction=reduction,
        split_sends=options.scatter_gather and mesh.shape.get("tensor", 1) > 1,
        v_shape=table.placement == "v",
        paired=table.ticks == PAIRS,
        late_cotangents=late_cotangents,
        fused=fused,
        ordered=mesh.devices.flat[0].platform == "cpu",
        manual=manual,
        replica_axes=replica_axes,
        experts=None if expert_dims is None else jax.tree.map(lambda e: e >= 0, expert_dims),
        zero=zero,
        columns=columns,
        tick_columns={k: jnp.asarray(c, jnp.int32) for k, c in columns.columns.items()},
        chunk_layers=jnp.asarray(layout.chunk_layers, jnp.int32),
        param_specs=grad_specs if zero.stage == 3 else (_whole_specs(expert_dims), P()),
        grad_specs=grad_specs,
        check_vma=check_vma,
        pooled=options.pooled_slots and zero_bubble and unsplit,
        head_in_w=head_in_w,
        padding_slots=layout.padding_slots,
    )
