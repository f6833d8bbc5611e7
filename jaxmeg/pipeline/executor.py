"""The pipeline executor: one `jax.shard_map`, manual over `pipe` and `data` (and `context`
when the sequence is split over it: each rank then holds its part of every sequence, and the
gradients are averaged over data x context), that runs a schedule's tick table for a generic
model given as `StageFunctions`. Every layout takes this path; pipe = 1 is the degenerate
pipeline of one stage.

Per tick, every stage looks up its actions in static tables at (tick, axis_index('pipe'))
(`tick_columns.slot_columns`):
  F slot  the forward of the stage's kind in that tick (first virtual stage: embed + chunk;
          middle: chunk; last: chunk + head + loss and the head's backward, whose output
          cotangent goes to the `cots` ring), each a loop of 0 or 1 trips (`slots.run_if`) that
          writes only the ring slots it fills; then the activation goes to stage s+1 on the
          pairs that send in that tick (`slots.send`; the wrap p-1 -> 0 only when v > 1).
  B slot  likewise the backward of its kind (chunk; first virtual stage: chunk and embedding),
          accumulating its gradients in place; then the input cotangent goes to stage s-1.
With p v = 1 the F slot only embeds and the B slot runs chunk + head + loss under one
`jax.vjp`, then the embedding's backward: plain training, nothing recomputed.
A table of split backwards (zero-bubble schedules, `table.unit`) runs one action per stage and
tick: the B slot runs I (`StageFunctions.split`: the input cotangent, the norm and bias
gradients, and what W needs, kept in the `wstore` ring) and a W slot after it the weight
gradients, sending nothing; a V placement (zbv) sends both ways (`send_x_back`,
`send_cot_back`) and hands the V's turn to itself.

What a stage keeps for its backward (`StageFunctions.chunk_recompute`):
  None   the F slot runs `jax.vjp(chunk)` and keeps the pullback's residuals (less the params and
         the stage input, see `residuals`) in rings indexed like the stage inputs; the B slot
         rebuilds the pullback: no forward runs twice (`model.remat` none / selective).
  a fn   the F slot runs the chunk forward only and keeps just the stage input; the B slot runs
         `jax.vjp(chunk_recompute)` from it: one recompute (`model.remat` full).
The B slot reads its inputs before the F slot's receive is written, so the activation send
overlaps the backward. The sends' index depends on the tick only, so every stage runs the same
ppermute: a pipe collective that only some stages reach deadlocks. Collectives over `tensor`
inside the stage-dependent slot loops are fine (a tensor group shares a stage).

Accumulation and the reductions over `data` and `pipe` live in `gradients`; with `data` > 1 a
chunk's layer gradients are reduced inside the loop (the `reduce_chunk` column): the reduction
starts from the gradients as the tick after the chunk's last backward begins, runs beside that
tick's slots (nothing in them waits for it) and is written back at its end. With ZeRO-3 a slot
takes a chunk's weights gathered in the tick before (a second buffer per slot), so no slot
waits for its gather either. The loop runs the table's ticks plus an idle one before them
(ZeRO-3: the first gather) and one after (the last reduction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmeg.pipeline import compression, gradients, powersgd, residuals, slots
from jaxmeg.pipeline.layout import StageLayout
from jaxmeg.pipeline.tick_columns import (
    B_CHUNK,
    B_FIRST,
    B_WHOLE,
    COMPRESS_LINK,
    F_EMBED,
    F_FIRST,
    F_LAST,
    F_MIDDLE,
    FETCH,
    GATHER,
    I_CHUNK,
    I_FIRST,
    RECEIVE,
    REDUCE_CHUNK,
    REDUCE_POWERSGD,
    REDUCE_TAKE,
    REDUCE_WRITE,
    SEND_COT,
    SEND_COT_BACK,
    SEND_FACTORS,
    SEND_WHOLE,
    SEND_X,
    SEND_X_BACK,
    W_CHUNK,
    SlotKind,
    slot_columns,
)
from jaxmeg.pipeline.tick_table import TickTable


@dataclasses.dataclass(frozen=True)
class SplitFunctions:
    """A chunk whose backward splits into I and W (zero-bubble schedules;
    `jaxmeg.models.split_backward`).

    chunk(chunk_params, x, real_layers, taps) -> (x, matmul inputs [Lc, ...]): the chunk with
        zero taps on its weight matmuls' outputs; chunk_recompute likewise for `model.remat`
        full (the I slot reruns it), or None
    taps(chunk_params, x) -> zero taps [Lc, ...]
    split_weights(tree, taps) -> (matmul weights, rest); merge_weights(weights, rest) -> tree
    weight_grads(matmul inputs, tap cotangents) -> the weights' gradients (W)
    """

    chunk: Callable
    chunk_recompute: Callable | None
    taps: Callable
    split_weights: Callable
    merge_weights: Callable
    weight_grads: Callable


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model as the executor sees it; it knows nothing else about the model.

    embed(shared, tokens_BxS) -> x_BxSxD                  first virtual stage
    chunk(chunk_params, x_BxSxD, real_layers) -> x_BxSxD  every virtual stage; `real_layers`
        (int32 scalar) of the chunk's layer slots are real, the rest are padding (identity)
    head_loss(shared, x_BxSxD, targets_BxS) -> scalar     last virtual stage (microbatch mean)
    chunk_recompute: same signature as `chunk`, or None (see the module docstring)
    split: how to split the chunk's backward into I and W, for tables that do (else None)
    """

    embed: Callable
    chunk: Callable
    head_loss: Callable
    chunk_recompute: Callable | None = None
    split: SplitFunctions | None = None


@dataclasses.dataclass(frozen=True)
class ZeroSharding:
    """How a data group splits the params (a sharded optimizer; `jaxmeg.parallel.zero`).

    stage: 0 none; 1 gradients reduce-scattered, params arrive whole; 3 params also arrive
        split, and each slot all-gathers a chunk when its order moves to it and keeps it until
        the next (`tick_columns.gather_columns`).
    stage_dims: tree like stage_params, the global dim split over `data` (-1 none).
    shared_dims: tree like shared, the dim split over `shared_axes` (-1 none).
    """

    stage: int = 0
    stage_dims: Any = None
    shared_dims: Any = None
    shared_axes: tuple[str, ...] = ("pipe", "data")


def _varying(tree, axes):
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)


def _split(shape: tuple, dim: int, parts: int) -> tuple:
    """`shape` with dim `dim` divided by `parts`."""
    return (*shape[:dim], shape[dim] // parts, *shape[dim + 1 :])


def _whole(shape: tuple, dim: int, parts: int) -> tuple:
    """`shape` with dim `dim` multiplied by `parts` (the inverse of `_split`)."""
    return (*shape[:dim], shape[dim] * parts, *shape[dim + 1 :])


def _spec_with(lead: tuple, dim: int, axes) -> P:
    """PartitionSpec with `lead` entries, then `axes` on `dim` (if >= 0)."""
    entries = list(lead)
    if dim >= 0:
        entries += [None] * (dim + 1 - len(entries))
        entries[dim] = axes
    return P(*entries)


def make_pipeline_loss_and_grads(
    fns: StageFunctions,
    table: TickTable,
    layout: StageLayout,
    mesh: Mesh,
    *,
    microbatches: int,
    zero: ZeroSharding = ZeroSharding(),
    pipe_compression: compression.PipeCompression | None = None,
    data_compression: powersgd.DataCompression | None = None,
    fused_embedding_sync: bool = False,
    scatter_gather: bool = False,
) -> Callable:
    """Returns `f(stage_params, shared, tokens, targets) -> (loss, (stage_grads, shared_grads))`,
    or with `pipe_compression` or `data_compression`, `f(..., targets, links, step) -> (loss,
    grads, links)`: `links` is the compression state, fp32 on (pipe, data), kept across steps
    (`jaxmeg.training.links`): the backward links' {"q": [p, d, v, h, r], "error": [p, d, v, n,
    h] (lazy only)} and PowerSGD's {"data": {"q": {key: [p, d, v, Lc, m, r]}, "error": {key:
    [p, d, v, Lc, ...]}}}; `step` (int32 scalar) is the optimizer step, for the warm-up.
    `fused_embedding_sync`: the shared gradients are reduced by `gradients.fused_sync`.
    `scatter_gather` (with an automatic `tensor` axis > 1): Megatron-LM's scatter/gather; each
    tensor rank sends 1/t of an activation or cotangent [b, s, h] (its slice of the sequence)
    and the receiver all-gathers it over `tensor`, so the link between stages carries t times
    fewer bytes.

    stage_params: leaves [v, p, Lc, ...] (`layout.shape`), `p` on `pipe`.
    shared: embedding and head params, replicated over `pipe`.
    tokens, targets: [global_batch, seq] on `data`; each replica's rows are m microbatches.
    Gradients come back in fp32, in the same layouts, equal on every replica (split over the
    data group with a sharded optimizer, as `zero` says; with ZeRO-3 the params arrive split
    the same way).
    """
    p, v, m = layout.num_stages, layout.num_chunks, microbatches
    if zero.stage and gradients.trivial(mesh.shape):
        raise ValueError(f"zero stage {zero.stage} needs a data axis > 1, the mesh is {mesh.shape}")
    if (zero.stage and (data_compression or fused_embedding_sync)) or (
        data_compression and mesh.shape["data"] == 1
    ):
        raise ValueError(
            f"PowerSGD and the fused embedding sync need a data axis > 1 (PowerSGD) and no "
            f"sharded optimizer (zero stage {zero.stage}); the mesh is {mesh.shape}"
        )
    if mesh.shape["pipe"] != p or table.num_stages != p:
        raise ValueError(
            f"layout has {p} stages, the mesh's pipe axis {mesh.shape['pipe']}, the tick table "
            f"{table.num_stages}"
        )
    whole_model = p * v == 1
    sf = fns.split
    if table.unit and (
        sf is None or whole_model or ((table.b_mb >= 0) & (table.b_split == 0)).any()
    ):
        raise ValueError(
            f"the tick table splits backwards into I and W: the stage functions need `split`, "
            f"the pipeline more than one virtual stage (p v = {p * v}) and every backward "
            f"split (no B among I and W)"
        )
    # Reducing each chunk inside the loop leaves the stage gradients typed as varying over
    # `data` though their values agree, which shard_map's type check cannot know: it is off then
    # (the equivalence tests check the values).
    context = mesh.shape.get("context", 1)
    reduce_in_loop = mesh.shape["data"] * context > 1
    stage_dims = shared_dims = local_stage_dims = chunk_dims = None
    d = mesh.shape["data"]
    if zero.stage:
        # stage leaves are [v, p, Lc, ...]; per device [v, Lc, ...]; one chunk [Lc, ...]
        local_stage_dims = gradients.drop_leading_dims(zero.stage_dims, 1)
        chunk_dims = gradients.drop_leading_dims(zero.stage_dims, 2)
        stage_dims = zero.stage_dims
        shared_dims = zero.shared_dims
        grad_specs = (
            jax.tree.map(lambda dim: _spec_with((None, "pipe"), dim, "data"), stage_dims),
            jax.tree.map(lambda dim: _spec_with((), dim, zero.shared_axes), shared_dims),
        )
    else:
        grad_specs = (P(None, "pipe"), P())
    param_specs = grad_specs if zero.stage == 3 else (P(None, "pipe"), P())
    gathering = zero.stage == 3
    # with p v = 1 the F slot only embeds: only the B slot gathers
    gathering_slots = (("b",) if whole_model else ("b", "f")) if gathering else ()
    pc = pipe_compression
    table_columns = slot_columns(
        table, v, gathering=gathering, reduce_in_loop=reduce_in_loop,
        sharded_reduction=bool(zero.stage),
        compress=None if pc is None else pc.compress,
        powersgd_stages=None if data_compression is None else data_compression.stages,
    )  # fmt: skip
    patterns, branch_columns = table_columns.patterns, table_columns.branch_columns
    columns = {name: jnp.asarray(col, jnp.int32) for name, col in table_columns.columns.items()}
    chunk_layers = jnp.asarray(layout.chunk_layers, jnp.int32)  # [v, p]
    store = fns.chunk_recompute is None and not whole_model
    manual = gradients.manual_axes(mesh.shape)
    replica_axes = gradients.replica_axes(manual)

    def gather_pieces(chunk_shard):
        """ZeRO-3: every replica's piece of a chunk's split leaves, stacked [d, ...] (the
        layout the all-gather writes, so the buffer it fills needs no transposing copy)."""
        return jax.tree.map(
            lambda a, dim: a if dim < 0 else jax.lax.all_gather(a, "data", axis=0),
            chunk_shard,
            chunk_dims,
        )

    def assemble(pieces):
        """The chunk's weights [Lc, ...] whole from `gather_pieces`."""
        return jax.tree.map(
            lambda a, dim: (
                a if dim < 0 else jnp.moveaxis(a, 0, dim).reshape(_whole(a.shape[1:], dim, d))
            ),
            pieces,
            chunk_dims,
        )

    dc, fused = data_compression, fused_embedding_sync and p > 1
    v_shape = table.placement == "v"
    if v_shape and layout.placement != "v":
        raise ValueError("the tick table runs a V placement (zbv); the stage layout is not one")
    split_sends = scatter_gather and mesh.shape.get("tensor", 1) > 1

    stateful = pc is not None or dc is not None

    trace_info: dict[str, Any] = {}  # filled when traced: what one forward stores

    def per_device(stage_params, shared, tokens, targets, links=None, step=None):
        params = jax.tree.map(lambda a: a[:, 0], stage_params)  # [v, Lc, ...]
        params = _varying(params, replica_axes)
        if gathering:
            shared = jax.tree.map(
                lambda a, dim: (
                    a if dim < 0 else jax.lax.all_gather(a, zero.shared_axes, axis=dim, tiled=True)
                ),
                shared,
                shared_dims,
            )
        shared = slots.varying_everywhere(shared, manual)
        tokens_MxBxS = tokens.reshape(m, -1, tokens.shape[-1])
        targets_MxBxS = targets.reshape(m, -1, targets.shape[-1])
        stage = jax.lax.axis_index("pipe")
        x_abstract = jax.eval_shape(fns.embed, shared, tokens_MxBxS[0])

        def chunk_shard(chunk):
            if v == 1:  # a static index: no dynamic-slice copy of the stage's weights per slot
                return jax.tree.map(lambda a: a[0], params)
            return jax.tree.map(lambda a: a[jnp.maximum(chunk, 0)], params)

        def chunk_params(chunk):  # without ZeRO-3
            return chunk_shard(chunk)

        def real_layers(chunk):
            return chunk_layers[jnp.maximum(chunk, 0), stage]

        def zeros_x(*lead):
            return jnp.zeros((*lead, *x_abstract.shape), x_abstract.dtype)

        def zero_taps(cp, x):
            """The chunk's zero taps, varying like everything else in the slot: an invariant
            tap's pullback would sum its cotangent over `pipe` (a collective in a branch)."""
            return slots.varying_everywhere(sf.taps(cp, x), manual)

        def tapped(real, recompute=False):
            """fn(weights, rest, x, taps) -> (y, matmul inputs): the split chunk."""
            chunk = sf.chunk_recompute if recompute else sf.chunk
            return lambda w, r, x, t: chunk(sf.merge_weights(w, r), x, real, t)

        if gathering:  # the slots' gathered chunks, filled by their first gather
            whole_chunk = slots.varying_everywhere(
                jax.tree.map(
                    lambda a, dim: jnp.zeros(
                        a.shape if dim < 0 else _whole(a.shape, dim, d), a.dtype
                    ),
                    chunk_shard(0),
                    chunk_dims,
                ),
                manual,
            )
            g_like = jax.tree.map(lambda a: jnp.zeros((v, *a.shape), a.dtype), whole_chunk)
        else:
            whole_chunk, g_like = chunk_params(0), params

        split = None
        x_probe = _varying(zeros_x(), manual)
        if store and table.unit:
            taps = zero_taps(whole_chunk, x_probe)
            split = residuals.forward_split(
                tapped(real_layers(0)), *sf.split_weights(whole_chunk, taps), x_probe, taps
            )[1]
        elif store:
            split = residuals.trace_split(
                lambda cp, x: fns.chunk(cp, x, real_layers(0)), whole_chunk, x_probe
            )
        if table.unit:  # what I keeps for W: the matmul inputs and their output cotangents
            taps = zero_taps(whole_chunk, x_probe)
            inputs_aval = jax.eval_shape(
                lambda cp, x, t: sf.chunk(cp, x, real_layers(0), t)[1], whole_chunk, x_probe, taps
            )
            w_avals = {"inputs": inputs_aval, "dys": taps}

        stored_avals = [x_abstract, *(split.stored if store else ())]
        trace_info["slot_bytes"] = sum(a.size * a.dtype.itemsize for a in stored_avals)
        carry = {
            "inputs": zeros_x(table.num_input_slots),
            "cots": zeros_x(table.num_cot_slots),
            "stored": [
                jnp.zeros((table.num_input_slots, *a.shape), a.dtype)
                for a in (split.stored if store else ())
            ],
            "loss": jnp.zeros((), jnp.float32),
            "y": zeros_x(),  # the activation the F slot sends
            "d_x": zeros_x(),  # the input cotangent the B slot sends
        }
        if table.unit:
            ring = lambda n, tree: jax.tree.map(  # noqa: E731
                lambda a: jnp.zeros((n, *a.shape), a.dtype), tree
            )
            carry["wstore"] = ring(table.num_w_slots, w_avals)
            if store:  # the matmul inputs from the forward until I moves them to `wstore`
                carry["matmul_inputs"] = ring(table.num_input_slots, w_avals["inputs"])
        if gathering:  # each slot's chunk, and the one gathered for its next
            for slot in gathering_slots:
                carry[f"{slot}_params"] = whole_chunk
                carry[f"{slot}_next"] = jax.tree.map(
                    lambda a, dim: jnp.zeros(a.shape if dim < 0 else (d, *a.shape), a.dtype),
                    chunk_shard(0),
                    chunk_dims,
                )
        carry["g_stage"] = gradients.zeros_f32(g_like)
        if zero.stage and reduce_in_loop:  # the split accumulator the reductions write into
            carry["g_reduced"] = gradients.zeros_f32(
                jax.tree.map(
                    lambda a, dim: a if dim < 0 else jnp.zeros(_split(a.shape, dim, d)),
                    carry["g_stage"],
                    local_stage_dims,
                )
            )
        if reduce_in_loop and not zero.stage:  # a chunk's gradients until reduced
            carry["pending"] = jax.tree.map(lambda a: a[0], carry["g_stage"])
        carry["g_shared"] = gradients.zeros_f32(shared)
        if stateful:
            carry["links"] = jax.tree.map(lambda a: a[0, 0], links)  # [v, ...] per device
        carry = slots.varying_everywhere(carry, manual)

        def forward_slot(c, row):
            """The F slot: the forward of its kind (first, middle or last virtual stage; with
            p v = 1 the embedding only) reads its stage input and writes the ring slots it fills
            (the embedded input, the chunk's residuals, the head's cotangent), the activation
            to send (`y`), the shared gradients and the loss."""
            chunk, mb = row["f_chunk"], jnp.maximum(row["f_mb"], 0)
            if whole_model:
                cp = None  # the F slot only embeds
            else:
                cp = c["f_params"] if gathering else chunk_params(chunk)
            real = real_layers(chunk)
            slot = jnp.maximum(row["f_slot"], 0)
            tokens_BxS, targets_BxS = tokens_MxBxS[mb], targets_MxBxS[mb]
            dtype = c["y"].dtype

            def run_chunk(x):
                if not store:
                    return fns.chunk(cp, x, real), []
                if table.unit:
                    taps = zero_taps(cp, x)
                    y, traced, stored, inputs = residuals.forward_split(
                        tapped(real), *sf.split_weights(cp, taps), x, taps
                    )
                    split.check(traced)
                    return y, (stored, inputs)
                y, traced, stored = residuals.forward(lambda p_, x_: fns.chunk(p_, x_, real), cp, x)
                split.check(traced)
                return y, stored

            def keep(r, stored):
                """The ring writes of what the forward keeps (the stored residuals, and for a
                split backward the matmul inputs)."""

                def write(bufs, leaves):
                    return jax.tree.map(
                        lambda buf, leaf: buf.at[slot].set(leaf.astype(buf.dtype)), bufs, leaves
                    )

                if table.unit and store:
                    stored, inputs = stored
                    return {"stored": write(r["stored"], stored),
                            "matmul_inputs": write(r["matmul_inputs"], inputs)}  # fmt: skip
                return {"stored": write(r["stored"], stored)}

            def embed_only(r, tokens_BxS, targets_BxS):
                x = fns.embed(shared, tokens_BxS).astype(dtype)
                return {**r, "inputs": r["inputs"].at[slot].set(x)}

            def first(r, tokens_BxS, targets_BxS):
                x = fns.embed(shared, tokens_BxS).astype(dtype)
                y, stored = run_chunk(x)
                inputs = r["inputs"].at[slot].set(x)
                return {**r, "inputs": inputs, **keep(r, stored), "y": y.astype(dtype)}

            def middle(r, tokens_BxS, targets_BxS):
                y, stored = run_chunk(r["inputs"][slot])
                return {**r, **keep(r, stored), "y": y.astype(dtype)}

            def last(r, tokens_BxS, targets_BxS):
                y, stored = run_chunk(r["inputs"][slot])
                loss, (d_shared, d_y) = jax.value_and_grad(fns.head_loss, argnums=(0, 1))(
                    shared, y, targets_BxS
                )
                scale = 1.0 / m
                d_shared = jax.tree.map(lambda g: g * scale, d_shared)
                cot_slot = jnp.maximum(row["f_cot_slot"], 0)
                return {
                    **r,
                    **keep(r, stored),
                    "cots": r["cots"].at[cot_slot].set((d_y * scale).astype(dtype)),
                    "g_shared": gradients.accumulate(r["g_shared"], d_shared),
                    "loss": r["loss"] + (loss * scale).astype(jnp.float32),
                }

            if whole_model:
                kinds = {F_EMBED: embed_only}
            else:
                kinds = {F_FIRST: first, F_MIDDLE: middle, F_LAST: last}
            ring = {k: c[k] for k in ("inputs", "stored", "matmul_inputs", "cots", "y",
                                      "g_shared", "loss") if k in c}  # fmt: skip
            for kind, fn in kinds.items():
                ring = slots.run_if(
                    row[kind.column] == kind.code, fn, ring, kind.scope, (tokens_BxS, targets_BxS)
                )
            return {**c, **ring}

        def backward_slot(c, row):
            """The B slot: the backward of its kind reads its stage input, residuals and
            output cotangent, accumulates the gradients it produces and writes the input
            cotangent to send (`d_x`)."""
            chunk, mb = row["b_chunk"], jnp.maximum(row["b_mb"], 0)
            cp = c["b_params"] if gathering else chunk_params(chunk)
            real = real_layers(chunk)
            slot = jnp.maximum(row["b_slot"], 0)
            tokens_BxS, targets_BxS = tokens_MxBxS[mb], targets_MxBxS[mb]
            at = 0 if v == 1 else jnp.maximum(chunk, 0)  # static with one chunk

            def chunk_backward(a):
                inputs, cots, rings = a["inputs"], a["cots"], a["stored"]
                x = inputs[slot]
                cot = cots[jnp.maximum(row["b_cot_slot"], 0)]
                if store:
                    return residuals.backward(split, cp, x, [buf[slot] for buf in rings], cot)
                _, pullback = jax.vjp(lambda p_, x_: fns.chunk_recompute(p_, x_, real), cp, x)
                return pullback(cot)

            def embed_backward(d_x, tokens_BxS):
                _, pullback = jax.vjp(lambda sh: fns.embed(sh, tokens_BxS), shared)
                return pullback(d_x.astype(x_abstract.dtype))[0]

            def middle(a, tokens_BxS, targets_BxS):
                d_params, d_x = chunk_backward(a)
                g_stage = gradients.accumulate_at(a["g_stage"], at, d_params)
                return {**a, "g_stage": g_stage, "d_x": d_x.astype(a["d_x"].dtype)}

            def first(a, tokens_BxS, targets_BxS):
                d_params, d_x = chunk_backward(a)
                d_shared = embed_backward(d_x, tokens_BxS)
                return {
                    **a,
                    "g_stage": gradients.accumulate_at(a["g_stage"], at, d_params),
                    "g_shared": gradients.accumulate(a["g_shared"], d_shared),
                }

            def whole(a, tokens_BxS, targets_BxS):
                def chunk_head_loss(p_, sh, x_):
                    return fns.head_loss(sh, fns.chunk(p_, x_, real), targets_BxS)

                loss, pullback = jax.vjp(chunk_head_loss, cp, shared, a["inputs"][slot])
                d_params, d_shared, d_x = pullback(jnp.ones_like(loss) / m)
                d_shared = gradients.accumulate(d_shared, embed_backward(d_x, tokens_BxS))
                return {
                    **a,
                    "g_stage": gradients.accumulate_at(a["g_stage"], at, d_params),
                    "g_shared": gradients.accumulate(a["g_shared"], d_shared),
                    "loss": a["loss"] + (loss / m).astype(jnp.float32),
                }

            def input_backward(a):
                """I: (d_x, the gradients of the chunk's other params, what W needs) from the
                stored residuals, or by rerunning the chunk (`model.remat` full)."""
                x = a["inputs"][slot]
                cot = a["cots"][jnp.maximum(row["b_cot_slot"], 0)]
                taps = zero_taps(cp, x)
                weights, rest = sf.split_weights(cp, taps)
                if store:
                    kept = [buf[slot] for buf in a["stored"]]
                    d_rest, d_x, d_taps = residuals.backward_split(
                        split, weights, rest, x, kept, cot
                    )
                    inputs = jax.tree.map(lambda buf: buf[slot], a["matmul_inputs"])
                else:
                    _, pullback, inputs = jax.vjp(
                        lambda r_, x_, t_: tapped(real, recompute=True)(weights, r_, x_, t_),
                        rest, x, taps, has_aux=True,
                    )  # fmt: skip
                    d_rest, d_x, d_taps = pullback(cot)
                w_slot = jnp.maximum(row["b_w_slot"], 0)
                wstore = jax.tree.map(
                    lambda buf, leaf: buf.at[w_slot].set(leaf.astype(buf.dtype)),
                    a["wstore"], {"inputs": inputs, "dys": d_taps},
                )  # fmt: skip
                g_weights, g_rest = sf.split_weights(a["g_stage"], taps)
                g_rest = gradients.accumulate_at(g_rest, at, d_rest)
                return d_x, {"g_stage": sf.merge_weights(g_weights, g_rest), "wstore": wstore}

            def i_middle(a, tokens_BxS, targets_BxS):
                d_x, written = input_backward(a)
                return {**a, **written, "d_x": d_x.astype(a["d_x"].dtype)}

            def i_first(a, tokens_BxS, targets_BxS):
                d_x, written = input_backward(a)
                d_shared = embed_backward(d_x, tokens_BxS)
                return {**a, **written, "g_shared": gradients.accumulate(a["g_shared"], d_shared)}

            if whole_model:
                kinds = {B_WHOLE: whole}
            elif table.unit:
                kinds = {I_CHUNK: i_middle, I_FIRST: i_first}
            else:
                kinds = {B_CHUNK: middle, B_FIRST: first}
            # the rings it reads go through the loop too: read-only operands would be copied
            acc = {
                k: c[k]
                for k in ("g_stage", "g_shared", "loss", "d_x", "inputs", "cots", "stored",
                          "matmul_inputs", "wstore")
                if k in c
            }  # fmt: skip
            for kind, fn in kinds.items():
                acc = slots.run_if(
                    row[kind.column] == kind.code, fn, acc, kind.scope, (tokens_BxS, targets_BxS)
                )
            return {**c, **acc}

        def weight_slot(c, row):
            """The W slot: the weight gradients of a split backward, dW = X^T dY from what its
            I kept in `wstore`; it sends nothing."""

            def weights(a):
                w_slot = jnp.maximum(row["w_slot"], 0)
                kept = jax.tree.map(lambda buf: buf[w_slot], a["wstore"])
                d_weights = sf.weight_grads(kept["inputs"], kept["dys"])
                g_weights, g_rest = sf.split_weights(a["g_stage"], kept["dys"])
                at = 0 if v == 1 else jnp.maximum(row["w_chunk"], 0)
                g_weights = gradients.accumulate_at(g_weights, at, d_weights)
                return {**a, "g_stage": sf.merge_weights(g_weights, g_rest)}

            acc = {k: c[k] for k in ("g_stage", "wstore")}
            return {**c, **slots.run_if(row["w_mb"] >= 0, weights, acc, W_CHUNK.scope)}

        def send(x, row, kind: SlotKind, split=True):
            index, scope = row[kind.scope], kind.scope
            return slots.send(x, index, patterns[scope], scope, split=split and split_sends)

        def arrive(buffer, row, what, scope, arrived):
            """What arrived in this tick ({"": usual, "_back": from the other side, "_local":
            this stage's own}) written into `buffer` at the slots the table names."""
            for way, value in arrived.items():
                slot = row[f"recv_{what}{way}_slot" if way else f"recv_{what}_slot"]
                kind = RECEIVE[scope, way]
                buffer = slots.receive(buffer, slot, value, kind.scope, gather=split_sends)
            return buffer

        def send_cotangent(c, row, d_x):
            """The B slot's send, where `pipe_compression` says compressed: the link's error is
            added (lazy), then either the factors or the whole gradient go, and the receiver
            adds what arrived of both (the other is zero)."""
            if pc is None:
                return c, send(d_x, row, SEND_COT)
            chunk = jnp.maximum(row["b_chunk"], 0)
            here = row["pipe_compress"] > 0
            sending = (row["b_kind"] == B_CHUNK.code) | (row["b_kind"] == I_CHUNK.code)
            g = d_x.reshape(-1, d_x.shape[-1]).astype(jnp.float32)
            with jax.named_scope(COMPRESS_LINK.scope):
                factors, x, new = compression.encode_link(pc, c["links"], chunk, g, here, sending)
            whole = x.astype(d_x.dtype).reshape(d_x.shape)
            # compressed links send whole: the two parts are added before they are kept
            got_whole = send(whole, row, SEND_WHOLE, split=False)
            # the rank-r factors are small: they go whole from every tensor rank
            got_p, got_q = send(factors, row, SEND_FACTORS, split=False)
            rebuilt = compression.rebuild(got_p, got_q).astype(d_x.dtype).reshape(d_x.shape)
            return {**c, "links": new}, got_whole + rebuilt

        def take_prefetched(c, row):
            """ZeRO-3: a slot whose chunk changes takes the weights gathered ahead into its
            second buffer, which then all-gathers the chunk the slot takes next: a loop of its
            own, so that no slot waits for it before a later tick (the idle tick before the
            table gathers the first)."""
            c = dict(c)
            for slot in gathering_slots:
                # both buffers go through the loop: one only read by it would be copied
                gather = GATHER[slot].scope
                c[f"{slot}_params"], c[f"{slot}_next"] = slots.run_if(
                    row[gather] > 0, lambda st: (assemble(st[1]), st[1]),
                    (c[f"{slot}_params"], c[f"{slot}_next"]), gather,
                )  # fmt: skip
                chunk = row[f"{slot}_fetch_chunk"]
                c[f"{slot}_next"] = slots.run_if(
                    chunk >= 0, lambda _, ch: gather_pieces(chunk_shard(ch)), c[f"{slot}_next"],
                    FETCH[slot].scope, (chunk,),
                )  # fmt: skip
            return c

        def take_final(c, row):
            """After the B slot: the gradients of the chunk whose last backward ran now move to
            `pending`, where the next tick reduces them while its slots run."""
            chunk = row["final_chunk"]

            def take(st):
                return jax.tree.map(lambda a: a[jnp.maximum(chunk, 0)], st[1]), st[1]

            pending, g_stage = slots.run_if(
                chunk >= 0, take, (c["pending"], c["g_stage"]), REDUCE_TAKE.scope
            )
            return {**c, "pending": pending, "g_stage": g_stage}

        def scatter_final(c, row):
            """A sharded optimizer: after the B slot, the chunk whose last backward ran is
            reduce-scattered into the split accumulator, which only the optimizer reads."""
            chunk = row[REDUCE_CHUNK.scope]
            at = jnp.maximum(chunk, 0)

            def scatter(st):
                part = jax.tree.map(lambda a: a[at], st[1])
                part = gradients.reduce_scatter(part, chunk_dims, ("data",))
                return jax.tree.map(lambda a, r: a.at[at].set(r), st[0], part), st[1]

            g_reduced, g_stage = slots.run_if(
                chunk >= 0, scatter, (c["g_reduced"], c["g_stage"]), REDUCE_CHUNK.scope
            )
            return {**c, "g_reduced": g_reduced, "g_stage": g_stage}

        def start_reduction(c, row):
            """Reduce `pending` over `data` (the chunk `reduce_chunk` whose last backward ran in
            the tick before; PowerSGD's on its stages after the warm-up): nothing in this
            tick's slots waits for it, and `finish_reduction` writes it back."""
            reduce = REDUCE_CHUNK.scope
            chunk = row[reduce]
            due, at = chunk >= 0, jnp.maximum(chunk, 0)
            mean = gradients.reduce_over_data
            if dc is None:
                return {**c, "pending": slots.run_if(due, mean, c["pending"], reduce)}
            on = (stage < dc.stages) & (step >= dc.warmup_steps)
            reduced = slots.run_if(due & ~on, mean, c["pending"], reduce)

            def compressed(st):
                return gradients.reduce_chunk_compressed(st[0], at, st[1], dc)

            reduced, data_state = slots.run_if(
                due & on, compressed, (reduced, c["links"]["data"]), REDUCE_POWERSGD.scope
            )
            return {**c, "pending": reduced, "links": {**c["links"], "data": data_state}}

        def finish_reduction(c, row):
            """The mean written back into the stage gradients, after this tick's B slot."""
            chunk = row[REDUCE_CHUNK.scope]

            def write(st):
                at = jnp.maximum(chunk, 0)
                return jax.tree.map(lambda a, r: a.at[at].set(r), st[0], st[1]), st[1]

            g_stage, pending = slots.run_if(
                chunk >= 0, write, (c["g_stage"], c["pending"]), REDUCE_WRITE.scope
            )
            return {**c, "g_stage": g_stage, "pending": pending}

        def tick(t, c):
            row = {name: col[t, stage] for name, col in columns.items()}
            if gathering:
                c = take_prefetched(c, row)
            if reduce_in_loop and not zero.stage:
                c = start_reduction(c, row)
            c = forward_slot(c, row)
            y = c["y"]
            arrived_x = {"": send(y, row, SEND_X)}
            if v_shape:  # a V's chunk 1 sends the other way; its turn stays on the stage
                arrived_x["_back"] = send(y, row, SEND_X_BACK)
                arrived_x["_local"] = y
            c = backward_slot(c, row)
            if table.unit:
                c = weight_slot(c, row)
            d_x = c["d_x"]
            c = {**c, "inputs": arrive(c["inputs"], row, "act", "x", arrived_x)}
            c, received_cot = send_cotangent(c, row, d_x)
            arrived_cot = {"": received_cot}
            if v_shape:
                arrived_cot["_back"] = send(d_x, row, SEND_COT_BACK)
                arrived_cot["_local"] = d_x
            c = {**c, "cots": arrive(c["cots"], row, "cot", "cot", arrived_cot)}
            if reduce_in_loop and zero.stage:
                c = scatter_final(c, row)
            elif reduce_in_loop:
                c = take_final(finish_reduction(c, row), row)
            return c

        out = jax.lax.fori_loop(0, table_columns.num_ticks, tick, carry)
        scatter = {}
        if zero.stage:
            scatter = {
                "stage_dims": None if reduce_in_loop else local_stage_dims,
                "shared_dims": shared_dims,
                "shared_axes": zero.shared_axes,
            }
        loss, g_stage, g_shared = gradients.reduce_step(
            out["g_reduced"] if zero.stage and reduce_in_loop else out["g_stage"],
            out["g_shared"],
            out["loss"],
            stage_grads_reduced=reduce_in_loop,
            fused=fused,
            **scatter,
        )
        g_stage = jax.tree.map(lambda a: a[:, None], g_stage)  # back to [v, 1, Lc, ...]
        if not stateful:
            return loss, (g_stage, g_shared)
        return loss, (g_stage, g_shared), jax.tree.map(lambda a: a[None, None], out["links"])

    link_specs = (P("pipe", "data"), P()) if stateful else ()
    # with context parallelism each context rank holds its part of every sequence (tokens and
    # targets already in the load-balanced order: `jaxmeg.parallel.context`)
    rows = P("data", "context") if context > 1 else P("data")
    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(*param_specs, rows, rows, *link_specs),
        out_specs=(P(), grad_specs, *link_specs[:1]),
        axis_names=frozenset(manual),
        check_vma=not (
            gradients.trivial(mesh.shape) or reduce_in_loop or zero.stage or stateful or fused
        ),
    )
    # for `jaxmeg.training.cost_report`: how to weight the compiled slots, and what a forward
    # stores (filled when `run` is traced)
    run.branch_columns = branch_columns
    run.trace_info = trace_info
    return run
