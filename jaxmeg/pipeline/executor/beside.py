"""What runs beside the slots in a tick, each a small unit of the plan, the stage, the carry and
the row, switched on by the plan: the sends and receives of the pipe links (compressed where
`pipe_compression` says), ZeRO-3's gather ahead, and the in-loop reduction of a chunk's
gradients over `data` (a mean, PowerSGD's, or a reduce-scatter with a sharded optimizer).

With `data` > 1 a chunk's layer gradients are reduced inside the loop (the `reduce_chunk`
column): the reduction starts from the gradients as the tick after the chunk's last backward
begins, runs beside that tick's slots (nothing in them waits for it) and is written back at its
end. With ZeRO-3 a slot takes a chunk's weights gathered in the tick before (a second buffer
per slot), so no slot waits for its gather either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import accumulator, compression, gradients, rings
from jaxmeg.pipeline.executor import slots
from jaxmeg.pipeline.executor.carry import Carry, Stage
from jaxmeg.pipeline.executor.columns import (
    COMPRESS_LINK,
    COTANGENT_SENDERS,
    FETCH,
    GATHER,
    RECEIVE,
    REDUCE_BESIDE_B,
    REDUCE_CHUNK,
    REDUCE_POWERSGD,
    REDUCE_TAKE,
    REDUCE_WRITE,
    SEND_COT,
    SEND_FACTORS,
    SEND_WHOLE,
    SlotKind,
)
from jaxmeg.pipeline.executor.plan import Plan
from jaxmeg.pipeline.executor.reduction import BESIDE_B

# -- the pipe links -----------------------------------------------------------------------------


def send(plan: Plan, x, row: dict, kind: SlotKind, split: bool = True, zero_idle: bool = False):
    """`x` over the pairs that send it in this tick (`slots.send`); what arrives here (where
    nothing is sent, zeros only with `zero_idle`: `receive` reads only what the table says
    arrives)."""
    index, scope = row[kind.scope], kind.scope
    patterns = plan.columns.patterns[scope]
    split = split and plan.split_sends
    every_tick = plan.options.overlap_sends
    return slots.send(x, index, patterns, scope, split, every_tick, zero_idle)


def arrive(plan: Plan, buffer, row: dict, what: str, scope: str, arrived: dict):
    """What arrived in this tick ({"": usual, "_back": from the other side, "_local": this
    stage's own}) written into `buffer` at the slots the table names."""
    for way, value in arrived.items():
        slot = row[f"recv_{what}{way}_slot" if way else f"recv_{what}_slot"]
        kind = RECEIVE[scope, way]
        buffer = slots.receive(buffer, slot, value, kind.scope, gather=plan.split_sends)
    return buffer


def send_cotangent(plan: Plan, c: Carry, row: dict, d_x):
    """The B slot's send, where `pipe_compression` says compressed: the link's error is added
    (lazy), then either the factors or the whole gradient go, and the receiver adds what
    arrived of both (the other is zero)."""
    pc = plan.options.pipe_compression
    if pc is None:
        return c, send(plan, d_x, row, SEND_COT)
    chunk = jnp.maximum(row["b_chunk"], 0)
    here = row["pipe_compress"] > 0
    sending = functools.reduce(
        jnp.logical_or, [row["b_kind"] == kind.code for kind in COTANGENT_SENDERS]
    )
    g = d_x.reshape(-1, d_x.shape[-1]).astype(jnp.float32)
    with jax.named_scope(COMPRESS_LINK.scope):
        factors, x, new = compression.encode_link(pc, c.links, chunk, g, here, sending)
    whole = x.astype(d_x.dtype).reshape(d_x.shape)
    # compressed links send whole: the two parts are added before they are kept
    got_whole = send(plan, whole, row, SEND_WHOLE, split=False, zero_idle=True)
    # the rank-r factors are small: they go whole from every tensor rank
    got_p, got_q = send(plan, factors, row, SEND_FACTORS, split=False, zero_idle=True)
    rebuilt = compression.rebuild(got_p, got_q).astype(d_x.dtype).reshape(d_x.shape)
    return c.replace(links=new), got_whole + rebuilt


# -- ZeRO-3 -------------------------------------------------------------------------------------


def take_prefetched(plan: Plan, st: Stage, c: Carry, row: dict) -> Carry:
    """ZeRO-3: a slot whose chunk changes takes the weights gathered ahead into its second
    buffer, which then all-gathers the chunk the slot takes next: a loop of its own, so that no
    slot waits for it before a later tick (the idle tick before the table gathers the first)."""
    for slot in plan.gathering_slots:
        # both buffers go through the loop: one only read by it would be copied
        gather = GATHER[slot].scope
        params, pieces = slots.run_if(
            row[gather] > 0, lambda s: (st.assemble(s[1]), s[1]),
            (c.params(slot), c.next(slot)), gather,
        )  # fmt: skip
        chunk = row[f"{slot}_fetch_chunk"]
        pieces = slots.run_if(
            chunk >= 0, lambda _, ch: st.gather_pieces(st.chunk_shard(ch)), pieces,
            FETCH[slot].scope, (chunk,),
        )  # fmt: skip
        c = c.replace(**{f"{slot}_params": params, f"{slot}_next": pieces})
    return c


# -- the in-loop reduction over data ------------------------------------------------------------


def take_final(plan: Plan, c: Carry, row: dict) -> Carry:
    """After the B slot: the gradients of the chunk whose last backward ran now move to
    `pending` (its first layer's only, where the B slot reduced the others:
    `Reduction.layers`), where the next tick reduces them while its slots run."""
    chunk = row["final_chunk"]

    def take(s):
        first = plan.reduction.pending_layers
        return accumulator.layers_at(s[1], jnp.maximum(chunk, 0), slice(None, first)), s[1]

    pending, g_stage = slots.run_if(chunk >= 0, take, (c.pending, c.g_stage), REDUCE_TAKE.scope)
    return c.replace(pending=pending, g_stage=g_stage)


def scatter_final(plan: Plan, c: Carry, row: dict) -> Carry:
    """A sharded optimizer: after the B slot, the chunk whose last backward ran is
    reduce-scattered into the split accumulator, which only the optimizer reads (its first
    layer only, where the slot scattered the others: `Reduction.layers`)."""
    chunk = row[REDUCE_CHUNK.scope]
    at = jnp.maximum(chunk, 0)

    def scatter(s):
        # with `Reduction.layers` the first layer, and whole the leaves split along the layers
        dims, first = plan.zero.chunk_dims, plan.reduction.pending_layers
        layers = jax.tree.map(lambda dim: slice(None if dim == 0 else first), dims)
        part = accumulator.layers_at(s[1], at, layers)
        part = gradients.reduce_scatter(part, dims, ("data",), plan.experts, plan.zero.chunk_specs)
        return jax.tree.map(lambda a, r: rings.write(a, at, r), s[0], part), s[1]

    g_reduced, g_stage = slots.run_if(
        chunk >= 0, scatter, (c.g_reduced, c.g_stage), REDUCE_CHUNK.scope
    )
    return c.replace(g_reduced=g_reduced, g_stage=g_stage)


def start_reduction(plan: Plan, st: Stage, c: Carry, row: dict, step) -> Carry:
    """Reduce `pending` over `data` (the chunk `reduce_chunk` whose last backward ran in the
    tick before; PowerSGD's on its stages after the warm-up): nothing in this tick's slots
    waits for it, and `finish_reduction` writes it back."""
    dc = plan.options.data_compression
    reduce = REDUCE_CHUNK.scope
    chunk = row[reduce]
    due, at = chunk >= 0, jnp.maximum(chunk, 0)
    mean = plan.reduce_in_loop
    if plan.reduction.where == BESIDE_B:  # where a B slot runs, the mean runs in its loop
        due = due & (row[REDUCE_BESIDE_B.scope] == 0)
    if dc is None:
        return c.replace(pending=slots.run_if(due, mean, c.pending, reduce))
    on = (st.index < dc.stages) & (step >= dc.warmup_steps)
    reduced = slots.run_if(due & ~on, mean, c.pending, reduce)

    def compressed(s):
        return gradients.reduce_chunk_compressed(s[0], at, s[1], dc)

    reduced, data_state = slots.run_if(
        due & on, compressed, (reduced, c.links["data"]), REDUCE_POWERSGD.scope
    )
    return c.replace(pending=reduced, links={**c.links, "data": data_state})


def finish_reduction(plan: Plan, c: Carry, row: dict) -> Carry:
    """The mean written back into the stage gradients, after this tick's B slot."""
    chunk = row[REDUCE_CHUNK.scope]

    def write(s):
        at = jnp.maximum(chunk, 0)
        return accumulator.write_leading(s[0], at, s[1]), s[1]

    g_stage, pending = slots.run_if(chunk >= 0, write, (c.g_stage, c.pending), REDUCE_WRITE.scope)
    return c.replace(g_stage=g_stage, pending=pending)
