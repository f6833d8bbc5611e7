"""The pipeline executor: one `jax.shard_map`, manual over `pipe` and `data`, that runs a
schedule's tick table for a generic model given as three functions.

Per tick, every stage looks up its actions in the static table at (axis_index('pipe'), tick):
  F slot: `lax.switch` over {idle, first virtual stage (embed + chunk), middle chunk, last
          virtual stage (nothing: its forward is recomputed by its backward)}, then ALL stages
          `ppermute` the activation to stage s+1 (ring: stage p-1 feeds chunk c+1 on stage 0).
  B slot: `lax.switch` over {idle, middle (vjp of the chunk), first (vjp of the chunk, then of
          the embedding), last (vjp of chunk + head + loss)}, then ALL stages `ppermute` the input
          cotangent to stage s-1.
The ppermutes sit outside the branches: a pipe collective inside a stage-dependent branch
deadlocks. Collectives over `tensor` inside the branches are fine (a tensor group shares a stage).

Backward = the chunk's forward recomputed with `jax.vjp` from the saved stage input (Megatron's
full recompute), so a stage stores only its inputs, in a ring of `num_input_slots` that the
schedule sizes; cotangents wait in a ring of `num_cot_slots`. Weight gradients accumulate in
fp32 in the loop carry; one `pmean` over `data` after the loop is the step's only data-parallel
gradient reduction, and one `psum` over `pipe` adds the embedding gradients of the first stage
and the head gradients of the last (with tied embeddings, the two copies' sum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

TABLE_FIELDS = (
    "f_mb", "f_chunk", "f_slot",
    "b_mb", "b_chunk", "b_slot", "b_cot_slot",
    "recv_act_slot", "recv_cot_slot",
)  # fmt: skip
IDLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model as the executor sees it; it knows nothing else about the model.

    embed(shared, tokens_BxS) -> x_BxSxD          first virtual stage
    chunk(chunk_params, x_BxSxD) -> x_BxSxD       every virtual stage (layers_per_chunk layers)
    loss(shared, x_BxSxD, targets_BxS) -> scalar  last virtual stage (mean over the microbatch)
    """

    embed: Callable
    chunk: Callable
    loss: Callable


def _varying(tree, axes):
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)


def _take(tree, index):
    return jax.tree.map(lambda a: a[index], tree)


def _add_at(tree, index, delta):
    return jax.tree.map(lambda a, d: a.at[index].add(d.astype(a.dtype)), tree, delta)


def _add(tree, delta):
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), tree, delta)


def _write_slot(buffer, slot, value):
    """buffer[slot] = value where slot >= 0; unchanged where slot == -1."""
    safe = jnp.maximum(slot, 0)
    return buffer.at[safe].set(jnp.where(slot >= 0, value, buffer[safe]))


def make_pipeline_loss_and_grads(
    fns: StageFunctions, table, mesh: Mesh, *, num_chunks: int, microbatches: int
) -> Callable:
    """Returns `f(stage_params, shared, tokens, targets) -> (loss, (stage_grads, shared_grads))`.

    stage_params: leaves [v, p, layers_per_chunk, ...], `p` on `pipe` (virtual stage c*p+s
    holds layer block c*p+s: a reshape of the canonical [layers, ...] order).
    shared: embedding and head params, replicated over `pipe`.
    tokens, targets: [global_batch, seq] on `data`; each replica's rows are m microbatches.
    """
    p, v, m = mesh.shape["pipe"], num_chunks, microbatches
    if p < 2:
        raise ValueError(f"the pipeline executor needs parallel.pipe >= 2, got {p}")
    columns = {name: jnp.asarray(getattr(table, name), jnp.int32) for name in TABLE_FIELDS}
    num_ticks = int(table.num_ticks)
    forward_ring = [(i, (i + 1) % p) for i in range(p)]
    backward_ring = [(i, (i - 1) % p) for i in range(p)]
    manual = ("pipe", "data")

    def per_device(stage_params, shared, tokens, targets):
        stage_params = _varying(_take(stage_params, (slice(None), 0)), "data")  # [v, Lc, ...]
        shared = _varying(shared, manual)
        tokens_MxBxS = tokens.reshape(m, -1, tokens.shape[-1])
        targets_MxBxS = targets.reshape(m, -1, targets.shape[-1])
        x_abstract = jax.eval_shape(fns.embed, shared, tokens_MxBxS[0])
        stage = jax.lax.axis_index("pipe")
        is_first_stage, is_last_stage = stage == 0, stage == p - 1

        def zeros_x(*lead):
            return jnp.zeros((*lead, *x_abstract.shape), x_abstract.dtype)

        carry = {
            "inputs": zeros_x(table.num_input_slots),
            "cots": zeros_x(table.num_cot_slots),
            "g_stage": jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), stage_params),
            "g_shared": jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), shared),
            "loss": jnp.zeros((), jnp.float32),
        }
        carry = {
            k: (val if k in ("g_stage", "g_shared") else _varying(val, manual))
            for k, val in carry.items()
        }

        def kind(mb, chunk, first_chunk_stage, last_chunk_stage):
            first = first_chunk_stage & (chunk == 0)
            last = last_chunk_stage & (chunk == v - 1)
            return jnp.where(mb < 0, IDLE, jnp.where(first, FIRST, jnp.where(last, LAST, MIDDLE)))

        def forward_slot(c, row):
            mb, chunk, slot = row["f_mb"], row["f_chunk"], row["f_slot"]
            params = _take(stage_params, jnp.maximum(chunk, 0))
            tokens_BxS = tokens_MxBxS[jnp.maximum(mb, 0)]

            def idle(inputs):
                return inputs, jnp.zeros_like(inputs[0])

            def first(inputs):
                x = fns.embed(shared, tokens_BxS).astype(inputs.dtype)
                return inputs.at[slot].set(x), fns.chunk(params, x).astype(inputs.dtype)

            def middle(inputs):
                return inputs, fns.chunk(params, inputs[slot]).astype(inputs.dtype)

            branch = kind(mb, chunk, is_first_stage, is_last_stage)
            inputs, y = jax.lax.switch(branch, (idle, first, middle, idle), c["inputs"])
            received = jax.lax.ppermute(y, "pipe", forward_ring)
            return {**c, "inputs": _write_slot(inputs, row["recv_act_slot"], received)}

        def backward_slot(c, row):
            mb, chunk = row["b_mb"], row["b_chunk"]
            safe_chunk = jnp.maximum(chunk, 0)
            params = _take(stage_params, safe_chunk)
            x = c["inputs"][jnp.maximum(row["b_slot"], 0)]
            cot = c["cots"][jnp.maximum(row["b_cot_slot"], 0)]
            tokens_BxS = tokens_MxBxS[jnp.maximum(mb, 0)]
            targets_BxS = targets_MxBxS[jnp.maximum(mb, 0)]

            def idle(g_stage, g_shared, loss):
                return g_stage, g_shared, loss, jnp.zeros_like(x)

            def middle(g_stage, g_shared, loss):
                _, pullback = jax.vjp(fns.chunk, params, x)
                d_params, d_x = pullback(cot)
                return _add_at(g_stage, safe_chunk, d_params), g_shared, loss, d_x.astype(x.dtype)

            def first(g_stage, g_shared, loss):
                g_stage, g_shared, loss, d_x = middle(g_stage, g_shared, loss)
                _, pullback = jax.vjp(lambda sh: fns.embed(sh, tokens_BxS), shared)
                (d_shared,) = pullback(d_x.astype(x_abstract.dtype))
                return g_stage, _add(g_shared, d_shared), loss, jnp.zeros_like(x)

            def last(g_stage, g_shared, loss):
                def head(cp, sh, x_in):
                    return fns.loss(sh, fns.chunk(cp, x_in), targets_BxS)

                mb_loss, pullback = jax.vjp(head, params, shared, x)
                d_params, d_shared, d_x = pullback(jnp.ones_like(mb_loss) / m)
                g_stage = _add_at(g_stage, safe_chunk, d_params)
                loss = loss + mb_loss.astype(jnp.float32) / m
                return g_stage, _add(g_shared, d_shared), loss, d_x.astype(x.dtype)

            branch = kind(mb, chunk, is_first_stage, is_last_stage)
            g_stage, g_shared, loss, d_x = jax.lax.switch(
                branch, (idle, first, middle, last), c["g_stage"], c["g_shared"], c["loss"]
            )
            received = jax.lax.ppermute(d_x, "pipe", backward_ring)
            cots = _write_slot(c["cots"], row["recv_cot_slot"], received)
            return {**c, "cots": cots, "g_stage": g_stage, "g_shared": g_shared, "loss": loss}

        def tick(t, c):
            row = {name: col[t, stage] for name, col in columns.items()}
            return backward_slot(forward_slot(c, row), row)

        out = jax.lax.fori_loop(0, num_ticks, tick, carry)
        g_stage = jax.lax.pmean(out["g_stage"], "data")
        g_shared = jax.lax.pmean(jax.lax.psum(out["g_shared"], "pipe"), "data")
        loss = jax.lax.pmean(jax.lax.psum(out["loss"], "pipe"), "data")
        g_stage = jax.tree.map(lambda a: a[:, None], g_stage)  # back to [v, 1, Lc, ...]
        return loss, (g_stage, g_shared)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(None, "pipe"), P(), P("data"), P("data")),
        out_specs=(P(), (P(None, "pipe"), P())),
        axis_names=frozenset(manual),
    )
