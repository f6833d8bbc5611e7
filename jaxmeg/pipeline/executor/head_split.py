"""The last stage's head in two (`Plan.head_in_w`): its F runs the head's forward and backward
but for the output projection's weight gradient, and keeps what that gradient needs, the
projection's input and the logits' cotangent, for the stage's next W, which runs it
(`last_stage.head_in_w_columns`). The pieces come from the stage functions (`HeadSplit`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import gradients
from jaxmeg.pipeline.executor.carry import Carry, Stage
from jaxmeg.pipeline.executor.plan import Plan


def backward_but_weight(plan: Plan, st: Stage, y, targets, scale):
    """The head's forward and backward without the output projection's weight gradient
    (`Plan.head_in_w`): (loss, the other shared gradients, y's cotangent, what W reads: the
    projection's input and the logits' cotangent, seeded with the loss scale)."""
    head, shared = plan.split.head, st.head_shared
    w = head.weight(shared)
    z, z_pullback = jax.vjp(head.inputs, shared, y)
    logits, logits_pullback = jax.vjp(lambda z_: head.logits(shared, z_, w), z)
    loss, loss_pullback = jax.vjp(lambda l_: head.loss(l_, targets), logits)
    (d_logits,) = loss_pullback(jnp.ones_like(loss) * scale)
    (d_z,) = logits_pullback(d_logits)
    d_shared, d_y = z_pullback(d_z)
    return loss, d_shared, d_y, {"inputs": z, "dys": d_logits}


def weight_gradient(plan: Plan, st: Stage, a: Carry) -> Carry:
    """W_HEAD: the output projection's weight gradient from what the last F kept
    (`backward_but_weight`), added into `g_shared`."""
    head, shared = plan.split.head, st.head_shared
    kept = jax.tree.map(lambda buf: buf[0], a.head_w)
    w = head.weight(shared)
    _, projection_pullback = jax.vjp(lambda w_: head.logits(shared, kept["inputs"], w_), w)
    (d_w,) = projection_pullback(kept["dys"])
    _, weight_pullback = jax.vjp(head.weight, shared)
    (d_shared,) = weight_pullback(d_w)
    return a.replace(g_shared=gradients.accumulate(a.g_shared, d_shared))
