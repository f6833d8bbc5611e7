"""The jitted train step.

Without a pipeline, gradients come from one `jax.shard_map` that is manual over `data` and
automatic over `tensor`: each data-parallel replica accumulates its m microbatches' gradients in
fp32 (params are cast to data-varying once, so autodiff inserts no per-microbatch reduction) and
one `pmean` over `data` per step reduces them. With a pipeline, the executor in
`jaxmeg.pipeline` does the same over `pipe` and `data` (see `pipeline_step`). Inside either, the
sharding rules let XLA insert Megatron's tensor-parallel collectives. The optimizer update runs
outside, on the sharded arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxmeg.models import cross_entropy
from jaxmeg.parallel import activation_rules, make_constrain
from jaxmeg.training.optimizer import learning_rate_schedule
from jaxmeg.training.state import BATCH_SPEC, Trainable, state_shardings


def _identity(x):
    return x


def make_loss_and_grads(trainable: Trainable) -> Callable:
    """(params, tokens [G,S], targets [G,S]) -> (mean loss, fp32 grads), data-parallel."""
    cfg = trainable.cfg
    microbatches = cfg.train.microbatches
    constrain = make_constrain(activation_rules(cfg.parallel), manual_axes=frozenset({"data"}))
    model = trainable.model(constrain)
    vocab_size = cfg.model.vocab_size

    def loss_fn(params, tokens_BxS, targets_BxS):
        logits = model.apply({"params": params}, tokens_BxS)
        return cross_entropy(logits, targets_BxS, vocab_size)

    # XLA rejects a manual partition whose manual axes all have size 1, so with d == 1 the
    # same body runs without shard_map and without the data-axis casts and reduction.
    data_parallel = trainable.mesh.shape["data"] > 1
    to_varying = partial(jax.lax.pcast, axis_name="data", to="varying")
    if not data_parallel:
        to_varying = _identity

    def replica_loss_and_grads(params, tokens, targets):
        params = to_varying(params)
        tokens_MxBxS = tokens.reshape(microbatches, -1, tokens.shape[-1])
        targets_MxBxS = targets.reshape(microbatches, -1, targets.shape[-1])
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)

        def accumulate(carry, microbatch):
            loss_sum, grad_sum = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, *microbatch)
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, grad_sum), None

        init = (to_varying(jnp.zeros((), jnp.float32)), zeros)
        (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, init, (tokens_MxBxS, targets_MxBxS))
        scale = 1.0 / microbatches
        loss_and_grads = (loss_sum * scale, jax.tree.map(lambda g: g * scale, grad_sum))
        return jax.lax.pmean(loss_and_grads, "data") if data_parallel else loss_and_grads

    if not data_parallel:
        return replica_loss_and_grads
    return jax.shard_map(
        replica_loss_and_grads,
        mesh=trainable.mesh,
        in_specs=(P(), BATCH_SPEC, BATCH_SPEC),
        out_specs=(P(), P()),
        axis_names=frozenset({"data"}),
    )


def make_train_step(trainable: Trainable) -> Callable:
    """Returns jitted `step(state, tokens, targets) -> (state, metrics)`; the state is donated."""
    if trainable.pipe > 1:
        from jaxmeg.training.pipeline_step import make_pipeline_loss_and_grads

        loss_and_grads = make_pipeline_loss_and_grads(trainable)
    else:
        loss_and_grads = make_loss_and_grads(trainable)
    schedule = learning_rate_schedule(trainable.cfg.optimizer)
    shardings = state_shardings(trainable)

    def step(state, tokens, targets):
        loss, grads = loss_and_grads(state["params"], tokens, targets)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = trainable.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # A non-finite loss or gradient leaves params and optimizer state as they were.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "skipped": jnp.logical_not(finite).astype(jnp.int32),
        }
        new_state = {
            "step": state["step"] + 1,
            "params": keep(params, state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
        }
        return new_state, metrics

    batch = trainable.batch_sharding()
    return jax.jit(
        step,
        in_shardings=(shardings, batch, batch),
        out_shardings=(shardings, None),
        donate_argnums=(0,),
    )
