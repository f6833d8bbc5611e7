"""The slot bodies: what the F, B (or I) and W slots of a tick compute, one top-level function
per slot kind (`columns.F_KINDS`, `columns.B_KINDS`, `columns.W_CHUNK`), each a function of the
plan, the stage, where the slot is (`At`), the ring state it passes through and the
microbatch's tokens and targets. A slot runs the body of its kind as a loop of 0 or 1 trips
(`slots.run_if`) that writes only what it fills.

  F  first virtual stage: embed + chunk; middle: chunk; last: chunk + head + loss and the head's
     backward, whose output cotangent goes to the `cots` ring; with p v = 1 only the embedding.
  B  the chunk's backward from the kept residuals (`residuals`) or by rerunning it (`model.remat`
     full), accumulating its gradients in place; the first virtual stage also the embedding's;
     with p v = 1 chunk + head + loss under one `jax.vjp`, then the embedding: plain training;
     where a tick's F and B are one microbatch's on the last virtual stage (1F1B's last stage),
     the B slot runs both at once the same way (`B_LAST`), the F slot nothing.
  I  a split backward's input half: the input cotangent, the norm and bias gradients and what W
     needs (the matmuls' output cotangents dY), kept in the `wstore` ring (on GPUs in the
     `pool` slot its residuals were read from, `Plan.pooled`).  W  the weight gradients
     dW = X^T dY, X from the ring slot its F wrote (`matmul_inputs`), dY from `wstore` (or
     that `pool` slot).
     In a table that also splits backwards (DualPipeV), a whole B is I with its W at once.
  F&B  one microbatch's F and another's whole B in one loop: `jaxmeg.pipeline.executor.paired`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import accumulator, gradients, rings
from jaxmeg.pipeline.executor import head_split, residuals, slots, weight_grads
from jaxmeg.pipeline.executor.carry import Carry, Stage
from jaxmeg.pipeline.executor.columns import (
    B_CHUNK,
    B_FIRST,
    B_LAST,
    B_WHOLE,
    F_EMBED,
    F_FIRST,
    F_LAST,
    F_LAST_HEAD_IN_W,
    F_MIDDLE,
    I_CHUNK,
    I_FIRST,
    I_LAST,
    REDUCING_OF,
    W_CHUNK,
    W_CHUNK_REDUCING,
    W_HEAD,
)
from jaxmeg.pipeline.executor.plan import Plan

F_STATE = ("inputs", "stored", "pool", "matmul_inputs", "cots", "y", "g_shared", "loss",
           "head_w", "last_kept")  # fmt: skip
"""What the F slot's loops pass through (what its bodies write, or read)."""
B_STATE = ("g_stage", "g_shared", "g_embed", "loss", "d_x", "inputs", "cots", "stored",
           "matmul_inputs", "wstore", "pool", "last_kept")  # fmt: skip
"""What the B slot's loops pass through: the rings it reads go through the loop too (a
read-only operand of a loop would be copied)."""


KEEPS_LAST = (F_LAST, F_LAST_HEAD_IN_W, I_LAST)
"""The slot kinds that write or read `Carry.last_kept`."""


def _scattering(plan: Plan) -> tuple[str, ...]:
    """The split accumulator, where a chunk's last B or W reduce-scatters into it."""
    return ("g_reduced",) if plan.reduction.layers and plan.sharded else ()


@dataclasses.dataclass(frozen=True)
class At:
    """Where a slot runs: the chunk's weights (None when the F slot only embeds), how many of
    its layers are real, its ring slot, the chunk's index in the gradient accumulator (B and I
    only), and the row."""

    cp: Any
    real: Any
    slot: Any
    index: Any
    row: dict


def _padding(plan: Plan, real) -> weight_grads.Padding | None:
    """What a weight-gradient body skips of the chunk's layer slots (None if even)."""
    return weight_grads.Padding(plan.padding_slots, real) if plan.padding_slots else None


def present(plan: Plan, kinds: dict) -> dict:
    """The kinds that run somewhere in the step (a loop that never runs is not built)."""
    columns = plan.columns.columns
    return {k: fn for k, fn in kinds.items() if (columns[k.column] == k.code).any()}


def _run_slot(kinds: dict, plan: Plan, st: Stage, at: At, state: Carry, batch) -> Carry:
    """Each kind's body as a loop of 0 or 1 trips, run where the row holds its code. Only the
    last virtual stage's F and I loops carry its one buffer (`Carry.last_kept`): passed
    through the others' loops, XLA copies each of its leaves once per step."""
    for kind, fn in kinds.items():
        active = at.row[kind.column] == kind.code
        part = state if kind in KEEPS_LAST else state.replace(last_kept=None)
        part = slots.run_if(active, partial(fn, plan, st, at), part, kind.scope, batch)
        state = state.merge(part)
    return state


# -- F ------------------------------------------------------------------------------------------


def _run_chunk(plan: Plan, st: Stage, at: At, x):
    """The chunk's forward, and what it keeps for the backward (nothing when it recomputes)."""
    if not plan.store:
        return plan.fns.chunk(st.taken(at.cp), x, at.real), []
    if plan.table.split:
        taps = st.zero_taps(at.cp, x)
        y, traced, stored, inputs = residuals.forward_split(
            st.tapped(at.real), *st.split_weights(at.cp, taps), x, taps
        )
        st.kept.check(traced)
        return y, (stored, inputs)
    y, traced, stored = residuals.forward(
        lambda p_, x_: plan.fns.chunk(p_, x_, at.real), st.taken(at.cp), x
    )
    st.kept.check(traced)
    return y, stored


def _keep(plan: Plan, st: Stage, at: At, r: Carry, stored, last: bool = False) -> dict:
    """The ring writes of what the forward keeps (the stored residuals, and for a split
    backward the matmul inputs); `last`: the last virtual stage's F, whose residuals go to
    its one buffer where `Plan.last_kept`."""

    def write(bufs, leaves, slot=at.slot):
        return jax.tree.map(lambda buf, leaf: rings.write(buf, slot, leaf), bufs, leaves)

    if plan.table.split and plan.store:
        stored, inputs = stored
        if last and plan.x_after_i:  # X too, a buffer per layer: its I writes them to the ring
            count = len(r.last_kept["inputs"])
            layers = [jax.tree.map(lambda a, i=i: a[i], inputs) for i in range(count)]
            kept = {"stored": list(stored), "inputs": layers}
            return {"last_kept": write(r.last_kept, kept, 0)}
        x_slot = jnp.maximum(at.row["f_x_slot"], 0)
        written = {"matmul_inputs": write(r.matmul_inputs, inputs, x_slot)}
        if last and plan.last_kept:
            written["last_kept"] = {"stored": write(r.last_kept["stored"], list(stored), 0)}
        elif plan.pooled:
            written["pool"] = st.pool_layout.write(r.pool, "stored", x_slot, list(stored))
        else:
            written["stored"] = write(r.stored, stored)
        return written
    return {"stored": write(r.stored, stored)}


def f_embed(plan, st, at, r, tokens, targets):
    x = plan.fns.embed(st.shared, tokens).astype(st.x_abstract.dtype)
    return r.replace(inputs=rings.write(r.inputs, at.slot, x))


def f_first(plan, st, at, r, tokens, targets):
    dtype = st.x_abstract.dtype
    x = plan.fns.embed(st.shared, tokens).astype(dtype)
    y, stored = _run_chunk(plan, st, at, x)
    inputs = rings.write(r.inputs, at.slot, x)
    return r.replace(inputs=inputs, **_keep(plan, st, at, r, stored), y=y.astype(dtype))


def f_middle(plan, st, at, r, tokens, targets):
    y, stored = _run_chunk(plan, st, at, r.inputs[at.slot])
    return r.replace(**_keep(plan, st, at, r, stored), y=y.astype(st.x_abstract.dtype))


def f_last(plan, st, at, r, tokens, targets, head_in_w=False):
    dtype = st.x_abstract.dtype
    y, stored = _run_chunk(plan, st, at, r.inputs[at.slot])
    scale = gradients.loss_scale(plan.m)
    written = _keep(plan, st, at, r, stored, last=True)
    if head_in_w:  # F_LAST_HEAD_IN_W: what the stage's next W needs, in its one buffer
        loss, d_shared, d_y, kept = head_split.backward_but_weight(plan, st, y, targets, scale)
        written["head_w"] = jax.tree.map(
            lambda buf, leaf: rings.write(buf, 0, leaf), r.head_w, kept
        )
    else:
        loss, pullback = jax.vjp(
            lambda sh, y_: plan.fns.head_loss(sh, y_, targets), st.head_shared, y
        )
        # the scale seeds the pullback (as in `b_whole`): it lands on the logits' cotangent, and
        # the head's weight-gradient GEMM adds into `g_shared` itself (a scale after it would
        # not fuse)
        d_shared, d_y = pullback(jnp.ones_like(loss) * scale)
    cot_slot = jnp.maximum(at.row["f_cot_slot"], 0)
    return r.replace(
        **written,
        cots=rings.write(r.cots, cot_slot, d_y.astype(dtype)),
        g_shared=gradients.accumulate(r.g_shared, d_shared),
        loss=r.loss + (loss * scale).astype(jnp.float32),
    )


def forward_slot(plan: Plan, st: Stage, c: Carry, row: dict) -> Carry:
    """The F slot: the forward of its kind reads its stage input and writes the ring slots it
    fills (the embedded input, the chunk's residuals, the head's cotangent), the activation to
    send (`y`), the shared gradients and the loss."""
    chunk, mb = row["f_chunk"], jnp.maximum(row["f_mb"], 0)
    cp = None if plan.whole_model else st.slot_params(c, "f", chunk)  # p v = 1: only embeds
    at = At(cp, st.real_layers(chunk), jnp.maximum(row["f_slot"], 0), None, row)
    batch = st.batch(mb)
    if plan.whole_model:
        kinds = {F_EMBED: f_embed}
    else:
        kinds = {F_FIRST: f_first, F_MIDDLE: f_middle, F_LAST: f_last}
        if plan.head_in_w:
            kinds[F_LAST_HEAD_IN_W] = partial(f_last, head_in_w=True)
    # kinds the table never runs in this slot (the F&B slot's, B_LAST's) are left out
    return c.merge(_run_slot(present(plan, kinds), plan, st, at, c.only(F_STATE), batch))


# -- B and I ------------------------------------------------------------------------------------


def _chunk_backward(plan: Plan, st: Stage, at: At, a: Carry):
    """(d_params, d_x) of the chunk, from the kept residuals or by rerunning it."""
    x = a.inputs[at.slot]
    cot = a.cots[jnp.maximum(at.row["b_cot_slot"], 0)]
    cp = st.taken(at.cp)
    if plan.store:
        return residuals.backward(st.kept, cp, x, [buf[at.slot] for buf in a.stored], cot)
    _, pullback = jax.vjp(lambda p_, x_: plan.fns.chunk_recompute(p_, x_, at.real), cp, x)
    return pullback(cot)


def _embed_backward(plan: Plan, st: Stage, d_x, tokens):
    _, pullback = jax.vjp(lambda sh: plan.fns.embed(sh, tokens), st.shared)
    return pullback(d_x.astype(st.x_abstract.dtype))[0]


def _accumulate(plan: Plan, a: Carry, index, d_params, last: bool = False) -> dict:
    """The fields it writes: the chunk's gradients added in (`g_stage`); in its last B or W
    (`Reduction.layers`) each layer's but the first also reduced over `data` once final: the
    mean (or sum, `Plan.sums_in_loop`) written back, or the sharded optimizer's reduce-scatter
    into `g_reduced`, but for leaves split along the layers (`beside.scatter_final`'s)."""
    if not last:
        return {"g_stage": accumulator.add_at(a.g_stage, index, d_params)}
    if not plan.sharded:
        sums, reduced = accumulator.add_reducing_layers(
            a.g_stage, index, d_params, plan.reduce_in_loop
        )
        return {"g_stage": accumulator.write_layers(a.g_stage, index, [sums[0], *reduced])}
    dims = plan.zero.chunk_dims  # of [Lc, ...]: one layer's is one less; 0 splits the layers

    experts = jax.tree.map(lambda _: False, dims) if plan.experts is None else plan.experts
    specs = gradients.drop_leading_specs(plan.zero.chunk_specs, 1)  # one layer's

    def scatter(layer):
        def one(x, dim, expert, spec):
            if dim == 0:
                return x
            return gradients.reduce_scatter(x, dim - 1, ("data",), expert, spec)

        return jax.tree.map(one, layer, dims, experts, specs)

    sums, reduced = accumulator.add_reducing_layers(a.g_stage, index, d_params, scatter)
    g_stage = accumulator.write_layers(a.g_stage, index, sums)
    g_reduced = jax.tree.map(
        lambda g, dim, *layers: g if dim == 0 else rings.write_layers(g, index, list(layers), 1),
        a.g_reduced, dims, *reduced,
    )  # fmt: skip
    return {"g_stage": g_stage, "g_reduced": g_reduced}


def b_middle(plan, st, at, a, tokens, targets, last=False):
    d_params, d_x = _chunk_backward(plan, st, at, a)
    d_x = d_x.astype(a.d_x.dtype)
    return a.replace(**_accumulate(plan, a, at.index, d_params, last), d_x=d_x)


def b_first(plan, st, at, a, tokens, targets, last=False):
    d_params, d_x = _chunk_backward(plan, st, at, a)
    d_shared = _embed_backward(plan, st, d_x, tokens)
    return a.replace(
        **_accumulate(plan, a, at.index, d_params, last),
        g_shared=gradients.accumulate(a.g_shared, d_shared),
    )


def _chunk_head_loss_backward(plan: Plan, st: Stage, at: At, a: Carry, targets):
    """(scaled loss, d_params, d_shared, d_x) of the chunk, head and loss under one `jax.vjp`
    from the stage input: nothing the backward reads goes through a ring. The scale seeds the
    pullback (as in `f_last`)."""
    fns = plan.fns

    def chunk_head_loss(p_, sh, x_):
        return fns.head_loss(sh, fns.chunk(p_, x_, at.real), targets)

    loss, pullback = jax.vjp(chunk_head_loss, st.taken(at.cp), st.head_shared, a.inputs[at.slot])
    scale = gradients.loss_scale(plan.m)
    d_params, d_shared, d_x = pullback(jnp.ones_like(loss) * scale)
    return (loss * scale).astype(jnp.float32), d_params, d_shared, d_x


def b_last(plan, st, at, a, tokens, targets, last=False):
    """B_LAST: the last virtual stage's F and B of one microbatch at once."""
    loss, d_params, d_shared, d_x = _chunk_head_loss_backward(plan, st, at, a, targets)
    return a.replace(
        **_accumulate(plan, a, at.index, d_params, last),
        g_shared=gradients.accumulate(a.g_shared, d_shared),
        loss=a.loss + loss,
        d_x=d_x.astype(a.d_x.dtype),
    )


def b_whole(plan, st, at, a, tokens, targets, last=False):
    loss, d_params, d_shared, d_x = _chunk_head_loss_backward(plan, st, at, a, targets)
    g_shared = gradients.accumulate(a.g_shared, d_shared)
    d_embed = _embed_backward(plan, st, d_x, tokens)
    if a.g_embed is None:  # one microbatch: nothing to keep apart (`Carry.g_embed`)
        shared = {"g_shared": gradients.accumulate(g_shared, d_embed)}
    else:
        shared = {"g_shared": g_shared, "g_embed": gradients.accumulate(a.g_embed, d_embed)}
    return a.replace(
        **_accumulate(plan, a, at.index, d_params, last),
        **shared,
        loss=a.loss + loss,
    )


def _kept_for_i(plan: Plan, st: Stage, at: At, a: Carry, x_slot, last: bool):
    """(the stored residuals an I reads, the rings it writes besides): from the pool slot or
    the residual rings, or for I_LAST from the last virtual stage's buffer, with X from there
    into the ring slot W reads it from where `Plan.x_after_i`."""
    if not last:
        if plan.pooled:
            return st.pool_layout.read(a.pool, "stored", x_slot), {}
        return [buf[at.slot] for buf in a.stored], {}
    kept = [buf[0] for buf in a.last_kept["stored"]]
    if not plan.x_after_i:
        return kept, {}
    inputs = jax.tree.map(
        lambda ring, *layers: rings.write_layers(ring, x_slot, [b[0] for b in layers]),
        a.matmul_inputs, *a.last_kept["inputs"],
    )  # fmt: skip
    return kept, {"matmul_inputs": inputs}


def _input_backward(plan: Plan, st: Stage, at: At, a: Carry, whole=False, last=False):
    """I: (d_x, the gradients of the chunk's other params, what W needs) from the stored
    residuals, or by rerunning the chunk (`model.remat` full). `whole` (a B in a table of split
    backwards): the weight gradients are added at once instead of kept for W. `last` (I_LAST):
    the residuals from the last virtual stage's one buffer (`Carry.last_kept`)."""
    sf = plan.split
    x = a.inputs[at.slot]
    cot = a.cots[jnp.maximum(at.row["b_cot_slot"], 0)]
    taps = st.zero_taps(at.cp, x)
    weights, rest = st.split_weights(at.cp, taps)
    if plan.store:
        x_slot = jnp.maximum(at.row["b_x_slot"], 0)
        kept, written = _kept_for_i(plan, st, at, a, x_slot, last)
        d_rest, d_x, d_taps = residuals.backward_split(st.kept, weights, rest, x, kept, cot, taps)
        inputs = jax.tree.map(lambda buf: buf[x_slot], a.matmul_inputs) if whole else None
    else:
        _, pullback, inputs = jax.vjp(
            lambda r_, x_, t_: st.tapped(at.real, recompute=True)(weights, r_, x_, t_),
            rest, x, taps, has_aux=True,
        )  # fmt: skip
        d_rest, d_x, d_taps = pullback(cot)
        written = {}
    if plan.pooled and not whole:  # dY over the residuals it was made of, all of them read
        written["pool"] = st.pool_layout.write(a.pool, "dys", x_slot, d_taps)
    elif not whole:  # what W reads besides the matmul inputs its F kept (`Carry.wstore`)
        w_slot = jnp.maximum(at.row["b_w_slot"], 0)
        kept_for_w = {"dys": d_taps} if plan.store else {"inputs": inputs, "dys": d_taps}
        written["wstore"] = jax.tree.map(
            lambda buf, leaf: rings.write(buf, w_slot, leaf), a.wstore, kept_for_w
        )
    g_weights, g_rest = accumulator.split(a.g_stage, partial(sf.split_weights, taps=taps))
    g_rest = accumulator.add_at(g_rest, at.index, d_rest)
    if whole:
        kept = {"inputs": inputs, "dys": d_taps}
        padding = _padding(plan, at.real)
        g_weights = weight_grads.add_weights(sf, g_weights, at.index, kept, padding)
    return d_x, {**written, "g_stage": accumulator.merge(g_weights, g_rest, sf.merge_weights)}


def i_middle(plan, st, at, a, tokens, targets, whole=False, last=False):
    d_x, written = _input_backward(plan, st, at, a, whole, last)
    return a.replace(**written, d_x=d_x.astype(a.d_x.dtype))


def i_first(plan, st, at, a, tokens, targets, whole=False):
    d_x, written = _input_backward(plan, st, at, a, whole)
    d_shared = _embed_backward(plan, st, d_x, tokens)
    return a.replace(**written, g_shared=gradients.accumulate(a.g_shared, d_shared))


def backward_slot(plan: Plan, st: Stage, c: Carry, row: dict, cells=None) -> Carry:
    """The B slot: the backward of its kind reads its stage input, residuals and output
    cotangent, accumulates the gradients it produces and writes the input cotangent to send
    (`d_x`). `cells` (bool [ticks, p], static): where this copy of the slot runs; kinds that
    run in none of them are left out of it (as everywhere, kinds the table never runs)."""
    chunk, mb = row["b_chunk"], jnp.maximum(row["b_mb"], 0)
    cp, real = st.slot_params(c, "b", chunk), st.real_layers(chunk)
    slot = jnp.maximum(row["b_slot"], 0)
    batch = st.batch(mb)
    at = At(cp, real, slot, st.chunk_at(chunk), row)
    kinds = _backward_kinds(plan)
    if plan.reduction.layers and not plan.table.split:  # with a split backward W reduces
        kinds.update({REDUCING_OF[k]: partial(fn, last=True) for k, fn in kinds.items()})
    runs = plan.columns.columns["b_kind"]
    if cells is not None:
        runs = runs[cells]
    kinds = {kind: fn for kind, fn in kinds.items() if (runs == kind.code).any()}
    state = c.only((*B_STATE, *_scattering(plan)))
    return c.merge(_run_slot(kinds, plan, st, at, state, batch))


def _backward_kinds(plan: Plan) -> dict:
    """The B slot's kinds and their bodies: in a table that splits backwards, I, and B (where
    some stay whole) as I with its W at once."""
    if plan.whole_model:
        return {B_WHOLE: b_whole}
    if not plan.table.split:
        return {B_CHUNK: b_middle, B_FIRST: b_first, B_LAST: b_last}
    split = {I_CHUNK: i_middle, I_FIRST: i_first, I_LAST: partial(i_middle, last=True)}
    return {**split, **present(plan, whole_backwards(plan))}


def whole_backwards(plan: Plan) -> dict:
    """The bodies of a whole B of a chunk and of the first virtual stage."""
    if not plan.table.split:
        return {B_CHUNK: b_middle, B_FIRST: b_first}
    return {B_CHUNK: partial(i_middle, whole=True), B_FIRST: partial(i_first, whole=True)}


# -- W ------------------------------------------------------------------------------------------


def weight_slot(plan: Plan, st: Stage, c: Carry, row: dict) -> Carry:
    """The W slot: the weight gradients of a split backward, dW = X^T dY, dY from what its I
    kept in `wstore` and X from the `matmul_inputs` slot its F wrote (`w_x_slot`; with `full`
    recompute from `wstore` too); it sends nothing. A chunk's last W (`Reduction.layers`)
    computes them layer by layer, last first, and starts each layer's mean but the first's
    beside the next one's dW (the norms' and biases' gradients are final since the chunk's
    last I)."""
    sf = plan.split
    at = st.chunk_at(row["w_chunk"])
    padding = _padding(plan, st.real_layers(row["w_chunk"]))

    def weights(a, reducing=False):
        w_slot, x_slot = jnp.maximum(row["w_slot"], 0), jnp.maximum(row["w_x_slot"], 0)
        if plan.pooled:
            kept = {"dys": st.pool_layout.read(a.pool, "dys", x_slot)}
        else:
            kept = jax.tree.map(lambda buf: buf[w_slot], a.wstore)
        if plan.store:  # X from the slot its forward wrote
            kept["inputs"] = jax.tree.map(lambda buf: buf[x_slot], a.matmul_inputs)
        if reducing:
            layers = weight_grads.layers(sf, a.g_stage, at, kept, padding)
            return a.replace(**_accumulate(plan, a, at, layers, last=True))
        return a.replace(g_stage=weight_grads.add(sf, a.g_stage, at, kept, padding))

    state = c.only(("g_stage", "wstore", "pool", "matmul_inputs", *_scattering(plan)))
    if not plan.reduction.layers:
        state = slots.run_if(row["w_mb"] >= 0, weights, state, W_CHUNK.scope)
    else:
        last = row[W_CHUNK_REDUCING.scope] > 0
        state = slots.run_if((row["w_mb"] >= 0) & ~last, weights, state, W_CHUNK.scope)
        reducing = partial(weights, reducing=True)
        state = slots.run_if(last, reducing, state, W_CHUNK_REDUCING.scope)
    c = c.merge(state)
    if not plan.head_in_w:
        return c
    head = partial(head_split.weight_gradient, plan, st)
    state = c.only(("g_shared", "head_w"))
    return c.merge(slots.run_if(row[W_HEAD.scope] > 0, head, state, W_HEAD.scope))
