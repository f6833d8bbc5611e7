"""The F&B slot (DualPipeV): where the tick table pairs a stage's F and B in one tick, one
microbatch's forward and another's whole backward in one loop. B's operands are read before F
writes the rings, so nothing orders B after F, and a GPU's scheduler can run each one's
collectives under the other's GEMMs. The forward and backward bodies are `bodies`'."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxmeg import ordering
from jaxmeg.pipeline import gradients
from jaxmeg.pipeline.executor import slots
from jaxmeg.pipeline.executor.bodies import (
    B_STATE,
    F_STATE,
    At,
    f_first,
    f_last,
    f_middle,
    present,
    whole_backwards,
)
from jaxmeg.pipeline.executor.carry import Carry, Stage
from jaxmeg.pipeline.executor.columns import F_FIRST, F_LAST, F_MIDDLE, FB_KINDS
from jaxmeg.pipeline.executor.plan import Plan

B_READS = ("inputs", "cots", "stored", "matmul_inputs")
"""The rings a backward reads and the F slot writes."""


def _after(done: Carry, read: dict) -> dict:
    """`read` plus integer zeros read from what the forward wrote (its output or loss), so
    that what reads it runs after the forward's collectives (XLA:CPU drops an optimization
    barrier: `jaxmeg.ordering`). One element of each: nothing is split over an automatic axis
    in a map manual over `expert`."""
    token = sum(
        ordering.zeros_from(a.reshape(-1)[0]) for a in jax.tree.leaves(done.only(("y", "loss")))
    )
    return jax.tree.map(lambda x: x + token.astype(x.dtype), read)


def paired_slot(plan: Plan, st: Stage, c: Carry, row: dict) -> Carry:
    """The F&B slot (DualPipeV): where the table pairs a stage's F and B in one tick, the
    forward of its kind and the whole backward of its kind in one loop. The backward's operands
    (its stage input, residuals and output cotangent) are taken from the rings first, and pass
    an optimization barrier with the rings before the forward writes into them: the forward's
    in-place writes wait only for those reads, and the backward's compute for nothing of the
    forward, so the two are independent in the program. On CPU devices (`Plan.ordered`) with
    the map manual over `expert` the backward reads them after the forward (`_after`): both
    run their exchange's collectives in the one loop, and a device could enter B's while
    another of its expert group waits in F's."""
    f_chunk, b_chunk = row["f_chunk"], row["b_chunk"]
    f_at = At(st.slot_params(c, "f", f_chunk), st.real_layers(f_chunk),
              jnp.maximum(row["f_slot"], 0), None, row)  # fmt: skip
    b_slot, cot_slot = jnp.maximum(row["b_slot"], 0), jnp.maximum(row["b_cot_slot"], 0)
    x_slot = jnp.maximum(row["b_x_slot"], 0)
    b_row = {**row, **{k: jnp.zeros_like(row[k]) for k in ("b_cot_slot", "b_x_slot")}}
    b_at = At(st.slot_params(c, "b", b_chunk), st.real_layers(b_chunk), 0,
              st.chunk_at(b_chunk), b_row)  # fmt: skip
    forwards = {F_FIRST: f_first, F_MIDDLE: f_middle, F_LAST: f_last}
    backwards = whole_backwards(plan)
    batches = (*st.batch(jnp.maximum(row["f_mb"], 0)), *st.batch(jnp.maximum(row["b_mb"], 0)))

    def one_slot(a):
        taken = {k: getattr(a, k) for k in B_READS if getattr(a, k) is not None}
        slot_of = {"cots": cot_slot, "matmul_inputs": x_slot}
        return {
            k: jax.tree.map(
                lambda buf, k=k: jax.lax.dynamic_slice_in_dim(buf, slot_of.get(k, b_slot), 1),
                ring,
            )
            for k, ring in taken.items()
        }

    def pair(f_fn, b_fn, a, f_tokens, f_targets, b_tokens, b_targets):
        a, read = jax.lax.optimization_barrier((a, one_slot(a)))
        after_f = f_fn(plan, st, f_at, a, f_tokens, f_targets)
        if plan.ordered and gradients.EXPERT in plan.manual:
            read = _after(after_f, read)
        after_b = b_fn(plan, st, b_at, after_f.replace(**read), b_tokens, b_targets)
        return after_b.replace(**{k: getattr(after_f, k) for k in read})

    state = c.only((*F_STATE, *B_STATE))
    pairs = present(plan, {kind: kinds for kinds, kind in FB_KINDS.items()})
    for kind, (f_kind, b_kind) in pairs.items():
        body = partial(pair, forwards[f_kind], backwards[b_kind])
        active = row[kind.column] == kind.code
        state = slots.run_if(active, body, state, kind.scope, batches)
    return c.merge(state)
