"""The pipeline executor: one `jax.shard_map`, manual over `pipe` and `data`, that runs a
schedule's tick table for a generic model given as `StageFunctions`. Every layout takes this
path; pipe = 1 is the degenerate pipeline of one stage.

Per tick, every stage looks up its actions in static tables at (tick, axis_index('pipe')):
  F slot  `lax.switch` over {idle, first virtual stage: embed + chunk, middle: chunk, last:
          chunk + head + loss and the head's backward (its output cotangent goes to the `cots`
          ring)}, then ALL stages `ppermute` the activation to stage s+1 (the ring wrap from
          stage p-1 to stage 0 only when v > 1).
  B slot  `lax.switch` over {idle, chunk backward, first virtual stage: chunk and embedding
          backward}, then ALL stages `ppermute` the input cotangent to stage s-1.
With p v = 1 the F slot only embeds and the B slot runs chunk + head + loss under one
`jax.vjp`, then the embedding's backward: plain training, nothing recomputed.

What a stage keeps for its backward (`StageFunctions.chunk_recompute`):
  None   the F slot runs `jax.vjp(chunk)` and keeps the pullback's residuals (less the params and
         the stage input, see `residuals`) in rings indexed like the stage inputs; the B slot
         rebuilds the pullback: no forward runs twice (`model.remat` none / selective).
  a fn   the F slot runs the chunk forward only and keeps just the stage input; the B slot runs
         `jax.vjp(chunk_recompute)` from it: one recompute (`model.remat` full).
The branches return only what they produce; ring writes and gradient accumulation happen once,
outside `lax.switch`, so the loop carries no copies. The B slot reads its inputs before the F
slot's receive is written, so the activation send overlaps the backward. The ppermutes sit
outside the branches: a pipe collective inside a stage-dependent branch deadlocks; collectives
over `tensor` inside the branches are fine (a tensor group shares a stage).

Accumulation and the reductions over `data` and `pipe` live in `gradients`; with `data` > 1 a
chunk's layer gradients are reduced in the tick of its last backward on its stage, inside the
loop (the `reduce_chunk` column), overlapping the backward of the chunks still running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmeg.pipeline import compression, gradients, powersgd, residuals
from jaxmeg.pipeline.layout import StageLayout
from jaxmeg.pipeline.tick_columns import (
    B_CHUNK,
    F_EMBED,
    F_FIRST,
    IDLE,
    final_backward_chunks,
    gather_columns,
    kind_columns,
)
from jaxmeg.pipeline.tick_table import FIELDS, TickTable


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model as the executor sees it; it knows nothing else about the model.

    embed(shared, tokens_BxS) -> x_BxSxD                  first virtual stage
    chunk(chunk_params, x_BxSxD, real_layers) -> x_BxSxD  every virtual stage; `real_layers`
        (int32 scalar) of the chunk's layer slots are real, the rest are padding (identity)
    head_loss(shared, x_BxSxD, targets_BxS) -> scalar     last virtual stage (microbatch mean)
    chunk_recompute: same signature as `chunk`, or None (see the module docstring)
    """

    embed: Callable
    chunk: Callable
    head_loss: Callable
    chunk_recompute: Callable | None = None


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


def _varying_everywhere(tree, axes):
    """pcast each leaf to varying over the `axes` it does not vary over yet, so that all
    `lax.switch` branches return the same types."""

    def cast(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _write(buffer, slot, value):
    """buffer[slot] = value where slot >= 0; unchanged where slot == -1."""
    safe = jnp.maximum(slot, 0)
    return buffer.at[safe].set(jnp.where(slot >= 0, value.astype(buffer.dtype), buffer[safe]))


def _ring_pairs(p: int, step: int, wrap: bool) -> list[tuple[int, int]]:
    """ppermute pairs s -> s + step, with the wrap-around pair only if `wrap`."""
    return [(s, (s + step) % p) for s in range(p) if wrap or 0 <= s + step < p]


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
) -> Callable:
    """Returns `f(stage_params, shared, tokens, targets) -> (loss, (stage_grads, shared_grads))`,
    or with `pipe_compression` or `data_compression`, `f(..., targets, links, step) -> (loss,
    grads, links)`: `links` is the compression state, fp32 on (pipe, data), kept across steps
    (`jaxmeg.training.links`): the backward links' {"q": [p, d, v, h, r], "error": [p, d, v, n,
    h] (lazy only)} and PowerSGD's {"data": {"q": {key: [p, d, v, Lc, m, r]}, "error": {key:
    [p, d, v, Lc, ...]}}}; `step` (int32 scalar) is the optimizer step, for the warm-up.
    `fused_embedding_sync`: the shared gradients are reduced by `gradients.fused_sync`.

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
    columns = {name: getattr(table, name) for name in FIELDS}
    columns["f_kind"], columns["b_kind"] = kind_columns(table, v)
    columns["reduce_chunk"] = final_backward_chunks(table)
    # Reducing each chunk inside the loop leaves the stage gradients typed as varying over
    # `data` though their values agree, which shard_map's type check cannot know: it is off then
    # (the equivalence tests check the values).
    reduce_in_loop = mesh.shape["data"] > 1
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
    if gathering:
        columns["f_gather"], columns["b_gather"] = gather_columns(table)
    pc = pipe_compression
    if pc is not None:
        sends = columns["b_kind"] == B_CHUNK
        compress = np.asarray(pc.compress, bool) & sends
        factor_ticks, whole_ticks = compress.any(1), (sends & ~compress).any(1)
        columns["pipe_compress"] = compress
        columns["factor_tick"] = np.repeat(factor_ticks[:, None], p, 1)
        columns["whole_tick"] = np.repeat(whole_ticks[:, None], p, 1)
        sends_factors, sends_whole = bool(factor_ticks.any()), bool(whole_ticks.any())
    columns = {name: jnp.asarray(col, jnp.int32) for name, col in columns.items()}
    chunk_layers = jnp.asarray(layout.chunk_layers, jnp.int32)  # [v, p]
    forward_pairs = _ring_pairs(p, 1, wrap=v > 1)
    backward_pairs = _ring_pairs(p, -1, wrap=v > 1)
    store = fns.chunk_recompute is None and not whole_model
    manual = gradients.MANUAL_AXES

    def gather_chunk(chunk_shard):
        """A chunk's weights [Lc, ...] whole from their split over `data` (ZeRO-3)."""
        return jax.tree.map(
            lambda a, dim: a if dim < 0 else jax.lax.all_gather(a, "data", axis=dim, tiled=True),
            chunk_shard,
            chunk_dims,
        )

    dc, fused = data_compression, fused_embedding_sync and p > 1
    stateful = pc is not None or dc is not None

    def per_device(stage_params, shared, tokens, targets, links=None, step=None):
        params = _varying(jax.tree.map(lambda a: a[:, 0], stage_params), "data")  # [v, Lc, ...]
        if gathering:
            shared = jax.tree.map(
                lambda a, dim: (
                    a if dim < 0 else jax.lax.all_gather(a, zero.shared_axes, axis=dim, tiled=True)
                ),
                shared,
                shared_dims,
            )
        shared = _varying_everywhere(shared, manual)
        tokens_MxBxS = tokens.reshape(m, -1, tokens.shape[-1])
        targets_MxBxS = targets.reshape(m, -1, targets.shape[-1])
        stage = jax.lax.axis_index("pipe")
        x_abstract = jax.eval_shape(fns.embed, shared, tokens_MxBxS[0])

        def chunk_shard(chunk):
            if v == 1:  # a static index: no dynamic-slice copy of the stage's weights per slot
                return jax.tree.map(lambda a: a[0], params)
            return jax.tree.map(lambda a: a[jnp.maximum(chunk, 0)], params)

        def chunk_params(chunk):
            shard = chunk_shard(chunk)
            return _varying_everywhere(gather_chunk(shard), manual) if gathering else shard

        def real_layers(chunk):
            return chunk_layers[jnp.maximum(chunk, 0), stage]

        def zeros_x(*lead):
            return jnp.zeros((*lead, *x_abstract.shape), x_abstract.dtype)

        if gathering:  # the slots' gathered chunks, filled by their first gather
            whole_chunk = _varying_everywhere(
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
        if store:
            x_probe = _varying(zeros_x(), manual)
            split = residuals.trace_split(
                lambda cp, x: fns.chunk(cp, x, real_layers(0)), whole_chunk, x_probe
            )

        carry = {
            "inputs": zeros_x(table.num_input_slots),
            "cots": zeros_x(table.num_cot_slots),
            "stored": [
                jnp.zeros((table.num_input_slots, *a.shape), a.dtype)
                for a in (split.stored if store else ())
            ],
            "loss": jnp.zeros((), jnp.float32),
        }
        if gathering:
            carry["b_params"] = whole_chunk
            if not whole_model:  # with p v = 1 the F slot only embeds
                carry["f_params"] = whole_chunk
        carry["g_stage"] = gradients.zeros_f32(g_like)
        if zero.stage and reduce_in_loop:  # the split accumulator the reductions write into
            carry["g_reduced"] = gradients.zeros_f32(
                jax.tree.map(
                    lambda a, dim: a if dim < 0 else jnp.zeros(_split(a.shape, dim, d)),
                    carry["g_stage"],
                    local_stage_dims,
                )
            )
        carry["g_shared"] = gradients.zeros_f32(shared)
        if stateful:
            carry["links"] = jax.tree.map(lambda a: a[0, 0], links)  # [v, ...] per device
        carry = _varying_everywhere(carry, manual)

        def _switch(index, branches):
            typed = [lambda b=b: _varying_everywhere(b(), manual) for b in branches]
            return jax.lax.switch(index, typed)

        def forward_slot(c, row):
            chunk, mb = row["f_chunk"], jnp.maximum(row["f_mb"], 0)
            if whole_model:
                cp = None  # the F slot only embeds
            else:
                cp = c["f_params"] if gathering else chunk_params(chunk)
            real = real_layers(chunk)
            x_in = c["inputs"][jnp.maximum(row["f_slot"], 0)]
            tokens_BxS, targets_BxS = tokens_MxBxS[mb], targets_MxBxS[mb]
            no_stored = [jnp.zeros(a.shape, a.dtype) for a in (split.stored if store else ())]

            def run_chunk(x):
                if not store:
                    return fns.chunk(cp, x, real), no_stored
                y, traced, stored = residuals.forward(lambda p_, x_: fns.chunk(p_, x_, real), cp, x)
                split.check(traced)
                return y, stored

            def out(x_embedded=None, y=None, stored=None, head_cot=None, d_shared=None, loss=None):
                zero_x = jnp.zeros_like(x_in)
                return (
                    zero_x if x_embedded is None else x_embedded.astype(x_in.dtype),
                    zero_x if y is None else y.astype(x_in.dtype),
                    no_stored if stored is None else stored,
                    zero_x if head_cot is None else head_cot.astype(x_in.dtype),
                    _zeros_like(shared) if d_shared is None else d_shared,
                    jnp.zeros((), jnp.float32) if loss is None else loss.astype(jnp.float32),
                )

            def idle():
                return out()

            def embed_only():
                return out(x_embedded=fns.embed(shared, tokens_BxS))

            def first():
                x = fns.embed(shared, tokens_BxS).astype(x_in.dtype)
                y, stored = run_chunk(x)
                return out(x_embedded=x, y=y, stored=stored)

            def middle():
                y, stored = run_chunk(x_in)
                return out(y=y, stored=stored)

            def last():
                y, stored = run_chunk(x_in)
                loss, (d_shared, d_y) = jax.value_and_grad(fns.head_loss, argnums=(0, 1))(
                    shared, y, targets_BxS
                )
                scale = 1.0 / m
                d_shared = jax.tree.map(lambda g: g * scale, d_shared)
                return out(
                    stored=stored, head_cot=d_y * scale, d_shared=d_shared, loss=loss * scale
                )

            if whole_model:
                branches, index = (idle, embed_only), jnp.minimum(row["f_kind"], 1)
            else:
                branches, index = (idle, first, middle, last), row["f_kind"]
            x_embedded, y, stored, head_cot, d_shared, loss = _switch(index, branches)
            embeds = (row["f_kind"] == F_FIRST) | (row["f_kind"] == F_EMBED)
            c = {
                **c,
                "inputs": _write(c["inputs"], jnp.where(embeds, row["f_slot"], -1), x_embedded),
                "stored": [
                    _write(ring, jnp.where(row["f_kind"] == IDLE, -1, row["f_slot"]), leaf)
                    for ring, leaf in zip(c["stored"], stored, strict=True)
                ],
                "cots": _write(c["cots"], row["f_cot_slot"], head_cot),
                "g_shared": gradients.accumulate(c["g_shared"], d_shared),
                "loss": c["loss"] + loss,
            }
            return c, y

        def backward_slot(c, row):
            chunk, mb = row["b_chunk"], jnp.maximum(row["b_mb"], 0)
            cp = c["b_params"] if gathering else chunk_params(chunk)
            real = real_layers(chunk)
            slot = jnp.maximum(row["b_slot"], 0)
            x = c["inputs"][slot]
            cot = c["cots"][jnp.maximum(row["b_cot_slot"], 0)]
            stored = [ring[slot] for ring in c["stored"]]
            tokens_BxS, targets_BxS = tokens_MxBxS[mb], targets_MxBxS[mb]

            def chunk_backward():
                if store:
                    return residuals.backward(split, cp, x, stored, cot)
                _, pullback = jax.vjp(lambda p_, x_: fns.chunk_recompute(p_, x_, real), cp, x)
                return pullback(cot)

            def embed_backward(d_x):
                _, pullback = jax.vjp(lambda sh: fns.embed(sh, tokens_BxS), shared)
                return pullback(d_x.astype(x_abstract.dtype))[0]

            def idle():
                return _zeros_like(cp), _zeros_like(shared), jnp.zeros_like(x), jnp.float32(0)

            def middle():
                d_params, d_x = chunk_backward()
                return d_params, _zeros_like(shared), d_x.astype(x.dtype), jnp.float32(0)

            def first():
                d_params, d_x = chunk_backward()
                return d_params, embed_backward(d_x), jnp.zeros_like(x), jnp.float32(0)

            def whole():
                def chunk_head_loss(p_, sh, x_):
                    return fns.head_loss(sh, fns.chunk(p_, x_, real), targets_BxS)

                loss, pullback = jax.vjp(chunk_head_loss, cp, shared, x)
                d_params, d_shared, d_x = pullback(jnp.ones_like(loss) / m)
                d_shared = gradients.accumulate(d_shared, embed_backward(d_x))
                return d_params, d_shared, jnp.zeros_like(x), (loss / m).astype(jnp.float32)

            if whole_model:
                branches, index = (idle, whole), jnp.minimum(row["b_kind"], 1)
            else:
                branches, index = (idle, middle, first), row["b_kind"]
            d_params, d_shared, d_x, loss = _switch(index, branches)
            if v == 1:
                g_stage = gradients.accumulate_at(c["g_stage"], 0, d_params)
            else:
                g_stage = gradients.accumulate_at(c["g_stage"], jnp.maximum(chunk, 0), d_params)
            c = {
                **c,
                "g_stage": g_stage,
                "g_shared": gradients.accumulate(c["g_shared"], d_shared),
                "loss": c["loss"] + loss,
            }
            return c, d_x

        def send(x, pairs):
            return jax.lax.ppermute(x, "pipe", pairs) if pairs else jax.tree.map(jnp.zeros_like, x)

        def send_when(flag, static_any, x, pairs):
            """ppermute `x` in the ticks where `flag` (the same on every stage) is set."""
            zeros = lambda: jax.tree.map(jnp.zeros_like, x)  # noqa: E731
            if not static_any or not pairs:
                return zeros()
            return jax.lax.cond(flag > 0, lambda: send(x, pairs), zeros)

        def send_cotangent(c, row, d_x):
            """The B slot's send, where `pipe_compression` says compressed: the link's error is
            added (lazy), then either the factors or the whole gradient go, and the receiver
            adds what arrived of both (the other is zero)."""
            if pc is None:
                return c, send(d_x, backward_pairs)
            chunk = jnp.maximum(row["b_chunk"], 0)
            here, sending = row["pipe_compress"] > 0, row["b_kind"] == B_CHUNK
            g = d_x.reshape(-1, d_x.shape[-1]).astype(jnp.float32)
            factors, x, new = compression.encode_link(pc, c["links"], chunk, g, here, sending)
            whole = x.astype(d_x.dtype).reshape(d_x.shape)
            got_whole = send_when(row["whole_tick"], sends_whole, whole, backward_pairs)
            got_p, got_q = send_when(row["factor_tick"], sends_factors, factors, backward_pairs)
            rebuilt = compression.rebuild(got_p, got_q).astype(d_x.dtype).reshape(d_x.shape)
            return {**c, "links": new}, got_whole + rebuilt

        def gather_if(flag, chunk, buffer):
            return jax.lax.cond(flag > 0, lambda: chunk_params(chunk), lambda: buffer)

        def tick(t, c):
            row = {name: col[t, stage] for name, col in columns.items()}
            if gathering:
                c = {**c, "b_params": gather_if(row["b_gather"], row["b_chunk"], c["b_params"])}
                if not whole_model:
                    c["f_params"] = gather_if(row["f_gather"], row["f_chunk"], c["f_params"])
            c, y = forward_slot(c, row)
            received_x = send(y, forward_pairs)
            c, d_x = backward_slot(c, row)
            c = {**c, "inputs": _write(c["inputs"], row["recv_act_slot"], received_x)}
            c, received_cot = send_cotangent(c, row, d_x)
            c = {**c, "cots": _write(c["cots"], row["recv_cot_slot"], received_cot)}
            if reduce_in_loop and dc is not None:
                on = (stage < dc.stages) & (step >= dc.warmup_steps)
                c["g_stage"], data_state = gradients.reduce_final_chunk(
                    c["g_stage"], c["g_stage"], row["reduce_chunk"],
                    compressed=(dc, c["links"]["data"], on),
                )  # fmt: skip
                c["links"] = {**c["links"], "data": data_state}
            elif reduce_in_loop:
                key = "g_reduced" if zero.stage else "g_stage"
                c[key] = gradients.reduce_final_chunk(
                    c["g_stage"], c[key], row["reduce_chunk"], chunk_dims
                )
            return c

        out = jax.lax.fori_loop(0, table.num_ticks, tick, carry)
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
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(*param_specs, P("data"), P("data"), *link_specs),
        out_specs=(P(), grad_specs, *link_specs[:1]),
        axis_names=frozenset(manual),
        check_vma=not (
            gradients.trivial(mesh.shape) or reduce_in_loop or zero.stage or stateful or fused
        ),
    )
