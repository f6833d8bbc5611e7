"""Per device, inside the map: the stage's context (`Stage`: its params, the shared params,
its microbatches, its index, and how to take a chunk's weights) and the loop's carry (`Carry`:
the rings and accumulators every tick reads and writes), built once before the tick loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmeg.pipeline import accumulator, gradients
from jaxmeg.pipeline.executor import casts, pool, residuals, slots
from jaxmeg.pipeline.executor.columns import LATE_COLUMNS
from jaxmeg.pipeline.executor.plan import Plan
from jaxmeg.pipeline.executor.reduction import SCATTER


def _varying(tree, axes):
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)


def _split(shape: tuple, dim: int, parts: int) -> tuple:
    """`shape` with dim `dim` divided by `parts`."""
    return (*shape[:dim], shape[dim] // parts, *shape[dim + 1 :])


def _whole(shape: tuple, dim: int, parts: int) -> tuple:
    """`shape` with dim `dim` multiplied by `parts` (the inverse of `_split`)."""
    return (*shape[:dim], shape[dim] * parts, *shape[dim + 1 :])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    """The tick loop's state on one device, all varying over the map's manual axes (so the
    slots' loops keep one type). A field the build does not use is None (no buffer). Per device:
    x = one microbatch's activation [b, s, h] (split over tensor with sequence parallelism),
    K, J, W, N the tick table's `num_input_slots`, `num_cot_slots`, `num_w_slots`,
    `num_x_slots`, v chunks of Lc layers, a chunk's leaves [Lc, ...]. A slot's loop passes the
    fields it declares (`only`), and its result goes back in by name (`merge`): a misspelt
    field is an error, not dropped state.

    The fields are in name order: that of the dict the carry was, whose flatten order the
    compiled loop's tuple follows.
    """

    b_next: Any = None
    """ZeRO-3, the B slot: the pieces [d, ...] of its next chunk (see `f_next`)."""
    b_params: Any = None
    """ZeRO-3, the B slot: its gathered chunk (see `f_params`)."""
    cots: Any = None
    """Output cotangents [J, *x], received or (last virtual stage) made by the F slot."""
    d_x: Any = None
    """x: the input cotangent the B slot sends this tick."""
    f_next: Any = None
    """ZeRO-3, the F slot: every replica's piece [d, ...] of the chunk it takes next, gathered
    ahead while the slot runs the one before (`beside.take_prefetched`)."""
    f_params: Any = None
    """ZeRO-3, the F slot: its chunk's weights whole [Lc, ...], assembled from `f_next`."""
    g_reduced: Any = None
    """A sharded optimizer's split accumulator: the stage gradients [v, Lc, ...] fp32, split
    over `data` on each leaf's ZeRO dim (`reduction.SCATTER`)."""
    g_shared: Any = None
    """The embedding's and head's gradients, fp32."""
    g_embed: Any = None
    """The whole model's slot (`Plan.whole_model`) over several microbatches: the embedding
    lookup's gradients, fp32, apart from `g_shared` until the loop ends: the head's
    weight-gradient GEMM then adds into `g_shared` itself, which XLA does not fuse where a
    scatter into the same accumulator follows it. (With one microbatch there is nothing to
    accumulate, and a second [V, D] accumulator would only cost its fill and sum.)"""
    g_stage: Any = None
    """The stage gradients [v, Lc, ...] fp32 (whole under ZeRO-3)."""
    head_w: Any = None
    """`Plan.head_in_w`: what the last stage's W_HEAD reads for the output projection's weight
    gradient, [1, ...]: {"inputs": the final norm's output [b, s, h], "dys": the logits'
    cotangent [b, s, V]}, from an F_LAST_HEAD_IN_W to the stage's next W (one at a time,
    `last_stage.head_in_w_columns`)."""
    inputs: Any = None
    """Stage inputs [K, *x], written on arrival (or by the first virtual stage's F)."""
    last_kept: Any = None
    """`Plan.last_kept`: what the last virtual stage's F keeps for its I, [1, ...] each, from
    each F there to its I, one at a time (`last_stage.kept_one_at_a_time`): {"stored": the
    residuals (as `stored`)}, and with `Plan.x_after_i` {"inputs": per layer, the matmul
    inputs X, which the I writes into `matmul_inputs` for W}. The F's kernels write them and
    the I's read them as they are, where a ring slot costs a copy each way. X in a buffer per
    layer: stacked, XLA would first concatenate the layers'."""
    links: Any = None
    """The compression state of this device (`Program.run`'s `links`, without [p, d])."""
    loss: Any = None
    """The loss over the microbatches so far, fp32 []."""
    matmul_inputs: Any = None
    """Split backwards with stored residuals: each weight matmul's input X per slot [N, ...],
    from the forward until its W (or whole B) reads it."""
    pending: Any = None
    """A chunk's gradients until its mean is written back [Lc or 1, ...] fp32
    (`reduction.AFTER`, `BESIDE_B`)."""
    pool: Any = None
    """Zero-bubble tables with stored residuals (`Plan.pooled`): per slot [N, ...] a
    microbatch's stored residuals from its F to its I, then its dY until its W
    (`executor.pool`), in place of `stored` and `wstore`."""
    stored: Any = None
    """The residuals the F slot keeps for the backward: a list of rings [K, ...]."""
    wstore: Any = None
    """Split backwards: what I keeps for W per slot [W, ...], {"dys": dY} (the output
    cotangents of the weight matmuls), with {"inputs": X} beside it when the backward
    recomputes the chunk (`model.remat` full: no forward kept X)."""
    y: Any = None
    """x: the activation the F slot sends this tick."""

    def replace(self, **fields) -> Carry:
        return dataclasses.replace(self, **fields)

    def only(self, names: Iterable[str]) -> Carry:
        """The named fields (those in use), the others None: what a slot's loop passes."""
        return Carry(**{name: getattr(self, name) for name in names})

    def merge(self, part: Carry) -> Carry:
        """This carry with `part`'s fields that are in use."""
        return self.replace(**{k: v for k, v in vars(part).items() if v is not None})

    def params(self, slot: str):
        """ZeRO-3: the gathered chunk of the F ("f") or B ("b") slot."""
        return getattr(self, f"{slot}_params")

    def next(self, slot: str):
        """ZeRO-3: the pieces of the chunk the F ("f") or B ("b") slot takes next."""
        return getattr(self, f"{slot}_next")


class Stage:
    """One device's stage: what every slot body reads besides the carry and the row."""

    def __init__(self, plan: Plan, stage_params, shared, tokens, targets):
        self.plan = plan
        params = jax.tree.map(lambda a: a[:, 0], stage_params)  # [v, Lc, ...]
        # varying over the replica axes, so that each device's gradients stay its own until
        # the step reduces them (a rank's own experts already vary over `expert`)
        self.params = slots.varying_everywhere(params, plan.replica_axes)
        zero = plan.zero
        if plan.gathering:

            def gather(a, dim, spec):
                if dim < 0:
                    return a
                gather = functools.partial(
                    jax.lax.all_gather, axis_name=zero.shared_axes, axis=dim, tiled=True
                )
                return gradients.on_blocks(gather, a, spec)

            shared = jax.tree.map(gather, shared, zero.shared_dims, zero.shared_specs)
        self.shared = slots.varying_everywhere(shared, plan.manual)
        # [b, m, s]: microbatch mb is every m-th row from mb on, so with rows split over an
        # automatic axis (expert) each device holds its share of every microbatch and taking
        # one moves nothing. Split [m, b] instead, a microbatch's rows sit on some of those
        # devices, and GSPMD moves them by a collective inside the slot that runs on one stage
        # only: with expert 4 a collective-permute over every device, which hangs the step.
        self.tokens = tokens.reshape(-1, plan.m, tokens.shape[-1])
        self.targets = targets.reshape(-1, plan.m, targets.shape[-1])
        self.index = jax.lax.axis_index("pipe")
        self.x_abstract = jax.eval_shape(plan.fns.embed, self.shared, self.tokens[:, 0])
        # the shared leaves the head only reads in a narrower dtype (a tied embedding's table
        # as the logits GEMM's bf16 operand), cast once per step instead of per microbatch
        self.head_shared = casts.cast(self.shared, self._head_read_as())
        self.layers = self.split_layers = None
        if not plan.gathering:  # the weights the chunk reads in its compute dtype, cast once
            self.params = casts.cast(self.params, self._read_as())
            if plan.v == 1 and plan.fns.per_layer:  # and sliced per layer once
                chunk = self.chunk_shard(0)
                self.layers = plan.taken(chunk)
                if plan.table.split:  # a split backward's matmul weights likewise
                    taps = self.zero_taps(chunk, self.zeros_x())
                    self.split_layers = plan.taken(plan.split.split_weights(chunk, taps)[0])
        self._trace_residuals()

    def _head_read_as(self):
        """Per leaf of the shared params, the dtype the head and loss only read it in, if
        narrower (`casts.read_as`)."""
        x = _varying(self.zeros_x(), self.plan.manual)
        return casts.read_as(self.plan.fns.head_loss, self.shared, x, self.targets[:, 0])

    def head_avals(self) -> dict:
        """What the last stage's F keeps for its W's output projection (`Carry.head_w`)."""
        head, x = self.plan.split.head, _varying(self.zeros_x(), self.plan.manual)
        z = jax.eval_shape(head.inputs, self.head_shared, x)
        w = head.weight(self.head_shared)
        return {"inputs": z, "dys": jax.eval_shape(head.logits, self.head_shared, z, w)}

    def _read_as(self):
        """Per leaf of the stage's params, the dtype the chunk only reads it in, if narrower
        (`casts.read_as`; ZeRO-3 gathers its chunks inside the loop, where they stay fp32)."""
        plan, x = self.plan, _varying(self.zeros_x(), self.plan.manual)
        chunk = jax.tree.map(lambda a: a[0], self.params)
        real = self.real_layers(0)
        return casts.read_as(lambda cp, x_: plan.fns.chunk(plan.taken(cp), x_, real), chunk, x)

    # -- reading the tables -------------------------------------------------------------------

    def row(self, t) -> dict[str, Any]:
        """This stage's columns at tick t."""
        return {name: col[t, self.index] for name, col in self.plan.tick_columns.items()}

    def late_row(self, t) -> dict[str, Any]:
        """The columns a late cotangent reads (`columns.LATE_COLUMNS`) at tick t - 1; at tick 0
        nothing is sent and nothing arrives."""
        row = self.row(jnp.maximum(t - 1, 0))
        idle = lambda k: -1 if k.endswith("_slot") else 0  # noqa: E731
        return {k: jnp.where(t > 0, row[k], idle(k)) for k in LATE_COLUMNS if k in row}

    def batch(self, mb):
        """Microbatch mb's (tokens, targets) [b, s]."""
        return self.tokens[:, mb], self.targets[:, mb]

    def real_layers(self, chunk):
        return self.plan.chunk_layers[jnp.maximum(chunk, 0), self.index]

    def chunk_at(self, chunk):
        """Where chunk `chunk` sits in the stage's [v, ...] leaves (static with one chunk)."""
        return 0 if self.plan.v == 1 else jnp.maximum(chunk, 0)

    # -- a chunk's weights ---------------------------------------------------------------------

    def chunk_shard(self, chunk):
        """The stage's own (ZeRO-3: split) leaves of `chunk` [Lc, ...]."""
        if self.plan.v == 1:  # a static index: no dynamic-slice copy of the weights per slot
            return jax.tree.map(lambda a: a[0], self.params)
        return jax.tree.map(lambda a: a[jnp.maximum(chunk, 0)], self.params)

    def taken(self, cp):
        """`Plan.taken` of a slot's chunk `cp`: with one chunk of the stage's own weights, the
        per-layer slices made once per step, before the tick loop (in the slot, XLA sliced the
        stacked weights again in every microbatch's forward and backward)."""
        return self.plan.taken(cp) if self.layers is None else self.layers

    def slot_params(self, c, slot: str, chunk):
        """The weights the F ("f") or B ("b") slot runs `chunk` with: gathered ahead under
        ZeRO-3, else the stage's own."""
        return c.params(slot) if self.plan.gathering else self.chunk_shard(chunk)

    def gather_pieces(self, chunk_shard):
        """ZeRO-3: every replica's piece of a chunk's split leaves, stacked [d, ...] (the
        layout the all-gather writes, so the buffer it fills needs no transposing copy)."""
        zero = self.plan.zero
        gather = functools.partial(jax.lax.all_gather, axis_name="data", axis=0)
        return jax.tree.map(
            lambda a, dim, spec: (
                a if dim < 0 else gradients.on_blocks(gather, a, spec, P(None, *spec))
            ),
            chunk_shard,
            zero.chunk_dims,
            zero.chunk_specs,
        )

    def assemble(self, pieces):
        """The chunk's weights [Lc, ...] whole from `gather_pieces`."""
        d = self.plan.d
        return jax.tree.map(
            lambda a, dim: (
                a if dim < 0 else jnp.moveaxis(a, 0, dim).reshape(_whole(a.shape[1:], dim, d))
            ),
            pieces,
            self.plan.zero.chunk_dims,
        )

    # -- the chunk as the slots run it ---------------------------------------------------------

    def zeros_x(self, *lead):
        return jnp.zeros((*lead, *self.x_abstract.shape), self.x_abstract.dtype)

    def zero_taps(self, cp, x):
        """The chunk's zero taps, varying like everything else in the slot: an invariant tap's
        pullback would sum its cotangent over `pipe` (a collective in a branch)."""
        return slots.varying_everywhere(self.plan.split.taps(cp, x), self.plan.manual)

    def tapped(self, real, recompute=False):
        """fn(weights, rest, x, taps) -> (y, matmul inputs): the split chunk; `weights` stacked
        or, as `split_weights` gives them with one chunk, a list of per-layer trees."""
        sf = self.plan.split
        chunk = sf.chunk_recompute if recompute else sf.chunk

        def merged(w, r):
            if not isinstance(w, list):
                return sf.merge_weights(w, r)
            return [sf.merge_weights(w_i, jax.tree.map(lambda a, i=i: a[i], r))
                    for i, w_i in enumerate(w)]  # fmt: skip

        return lambda w, r, x, t: chunk(merged(w, r), x, real, t)

    def split_weights(self, cp, taps):
        """(the chunk's matmul weights, the rest) for the split chunk (`tapped`): with one
        chunk of the stage's own weights, the weights as per-layer slices made once per step,
        before the tick loop (as `taken`)."""
        weights, rest = self.plan.split.split_weights(cp, taps)
        return (weights if self.split_layers is None else self.split_layers), rest

    def _trace_residuals(self):
        """Sets `whole_chunk` (a slot's chunk weights, whole) and `g_like` (the gradient
        accumulator's shapes); `kept`: what a forward keeps (a `residuals.ResidualSplit`, read
        from a trace of chunk 0 whose result is dropped; None when the B slot recomputes); and
        with a split backward `w_avals`, what I keeps for W."""
        plan, sf = self.plan, self.plan.split
        if plan.gathering:  # the slots' gathered chunks, filled by their first gather
            whole = jax.tree.map(
                lambda a, dim: jnp.zeros(
                    a.shape if dim < 0 else _whole(a.shape, dim, plan.d), a.dtype
                ),
                self.chunk_shard(0),
                plan.zero.chunk_dims,
            )
            self.whole_chunk = slots.varying_everywhere(whole, plan.manual)
            self.g_like = jax.tree.map(
                lambda a: jnp.zeros((plan.v, *a.shape), a.dtype), self.whole_chunk
            )
        else:
            self.whole_chunk, self.g_like = self.chunk_shard(0), self.params
        self.kept = self.w_avals = self.pool_layout = None
        x = _varying(self.zeros_x(), plan.manual)
        real = self.real_layers(0)
        if plan.store and plan.table.split:
            taps = self.zero_taps(self.whole_chunk, x)
            self.kept = residuals.forward_split(
                self.tapped(real), *self.split_weights(self.whole_chunk, taps), x, taps
            )[1]
        elif plan.store:
            self.kept = residuals.trace_split(
                lambda cp, x_: plan.fns.chunk(cp, x_, real), self.taken(self.whole_chunk), x
            )
        if plan.table.split:  # what W reads: the matmul inputs and their output cotangents
            taps = self.zero_taps(self.whole_chunk, x)
            inputs = jax.eval_shape(
                lambda cp, x_, t: sf.chunk(cp, x_, real, t)[1], self.whole_chunk, x, taps
            )
            self.w_avals = {"inputs": inputs, "dys": taps}
        if plan.pooled:
            self.pool_layout = pool.layout(stored=list(self.kept.stored), dys=taps)

    @property
    def stored_avals(self) -> list:
        """What one forward keeps per microbatch: the stage input and the stored residuals."""
        return [self.x_abstract, *(self.kept.stored if self.plan.store else ())]


RING_FILL = jnp.zeros
"""What a ring holds before its slots are written, which no slot reads: zeros. The tests fill
NaN (tests/conftest.py), so every equivalence test also shows that no slot is read before it is
written. Uninitialised rings (`lax.empty`, an allocation without a fill on a GPU) were measured
in the H100 program: no change in kernel bytes on (1,4,1) gpt_1.3b, and 116 GB more per step
(roofline 162 -> 167 ms) on (2,2,2), so the rings stay zero-filled."""


def _ring(n: int, tree):
    return jax.tree.map(lambda a: RING_FILL((n, *a.shape), a.dtype), tree)


def initial(plan: Plan, st: Stage, links) -> Carry:
    """The loop's carry before the first tick (`Carry`)."""
    table, zero = plan.table, plan.zero
    unpooled = plan.store and not plan.pooled  # the residuals in rings of their own
    carry = {
        "inputs": _ring(table.num_input_slots, st.x_abstract),
        "cots": _ring(table.num_cot_slots, st.x_abstract),
        "stored": [_ring(table.num_input_slots, a) for a in (st.kept.stored if unpooled else ())],
        "loss": jnp.zeros((), jnp.float32),
        "y": st.zeros_x(),  # the activation the F slot sends
        "d_x": st.zeros_x(),  # the input cotangent the B slot sends
    }
    if plan.pooled:  # X from the forward to W; residuals to I, then dY to W, in one slot
        carry["matmul_inputs"] = _ring(table.num_x_slots, st.w_avals["inputs"])
        carry["pool"] = st.pool_layout.ring(table.num_x_slots, RING_FILL)
    elif table.split and plan.store:  # X from the forward to W, dY from I to W
        carry["matmul_inputs"] = _ring(table.num_x_slots, st.w_avals["inputs"])
        carry["wstore"] = _ring(table.num_w_slots, {"dys": st.w_avals["dys"]})
    elif table.split:  # I reruns the chunk, and keeps X with dY
        carry["wstore"] = _ring(table.num_w_slots, st.w_avals)
    if plan.last_kept:  # from the last virtual stage's F to its I: one at a time
        kept = {"stored": list(st.kept.stored)}
        if plan.x_after_i:  # X too, one buffer per layer
            one = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), st.w_avals["inputs"]
            )  # fmt: skip
            kept["inputs"] = [one] * jax.tree.leaves(st.w_avals["inputs"])[0].shape[0]
        carry["last_kept"] = _ring(1, kept)
    if plan.head_in_w:  # from the last stage's F to its next W: one at a time
        carry["head_w"] = _ring(1, st.head_avals())
    for slot in plan.gathering_slots:  # each slot's chunk, and the one gathered for its next
        carry[f"{slot}_params"] = st.whole_chunk
        carry[f"{slot}_next"] = jax.tree.map(
            lambda a, dim: jnp.zeros(a.shape if dim < 0 else (plan.d, *a.shape), a.dtype),
            st.chunk_shard(0),
            zero.chunk_dims,
        )
    carry["g_stage"] = accumulator.zeros(st.g_like, plan.layer_accumulators, plan.fns.weight_gemms)
    if plan.reduction.where == SCATTER:  # the split accumulator the reductions write into
        carry["g_reduced"] = gradients.zeros_f32(
            jax.tree.map(
                lambda a, dim: a if dim < 0 else jnp.zeros(_split(a.shape, dim, plan.d)),
                st.g_like,
                zero.local_stage_dims,
            )
        )
    if plan.reduction.mean:  # a chunk's gradients until reduced
        first = plan.reduction.pending_layers
        carry["pending"] = accumulator.layers_at(carry["g_stage"], 0, slice(None, first))
    carry["g_shared"] = gradients.zeros_f32(st.shared)
    if plan.whole_model and plan.m > 1:
        carry["g_embed"] = gradients.zeros_f32(st.shared)
    if plan.stateful:
        carry["links"] = jax.tree.map(lambda a: a[0, 0], links)  # [v, ...] per device
    return slots.varying_everywhere(Carry(**carry), plan.manual)
