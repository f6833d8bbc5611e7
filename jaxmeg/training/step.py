"""The jitted train step: loss and gradients from the pipeline executor (every layout, pipe = 1
included: see `pipeline_step`), then the optimizer update on the sharded arrays.

Inside the executor's `shard_map` (manual over `data` and `pipe`, and over `expert` where
`pipeline_step.splits_experts` says; automatic over `tensor`) each replica accumulates its m
microbatches' gradients in fp32 and reduces them once per step (`jaxmeg.pipeline.gradients`);
the sharding rules let XLA insert Megatron's tensor-parallel collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmeg.parallel.gpu_target import compiler_options
from jaxmeg.training import amax_history, expert_balance
from jaxmeg.training.optimizer import learning_rate_schedule
from jaxmeg.training.pipeline_step import make_loss_and_grads, sends_point_to_point
from jaxmeg.training.state import Trainable, state_shardings


def make_train_step(trainable: Trainable, loss_and_grads: Callable | None = None) -> Callable:
    """Returns jitted `step(state, tokens, targets) -> (state, metrics)`; the state is donated.
    `loss_and_grads` defaults to the executor's (`pipeline_step.make_loss_and_grads`)."""
    loss_and_grads = loss_and_grads or make_loss_and_grads(trainable)
    program = getattr(loss_and_grads, "program", None)
    point_to_point = sends_point_to_point(trainable, program)
    schedule = learning_rate_schedule(trainable.cfg.optimizer)
    shardings = state_shardings(trainable)
    moe = trainable.cfg.moe
    replicated = NamedSharding(trainable.mesh, P())

    def step(state, tokens, targets):
        links = (state["links"],) if "links" in state else ()
        # the optimizer step (PowerSGD's warm-up) goes with the compression state
        step_arg = {"step": state["step"]} if links else {}
        loss, grads, *links = loss_and_grads(state["params"], tokens, targets, *links, **step_arg)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        grads, loads, kept, bounds = expert_balance.take_loads(grads)  # [] without MoE layers
        grads, amaxes = amax_history.take_seen(grads)  # {} without delayed FP8 scaling
        with jax.named_scope("optimizer"):  # the cost report's kernel class
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = trainable.tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        if moe.bias_update_rate:
            params = expert_balance.move_biases(params, loads, moe.bias_update_rate)
        params = amax_history.advance_histories(params, state["params"], amaxes)
        # A non-finite loss or gradient leaves params and optimizer state as they were.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def keep(new, old):
            with jax.named_scope("optimizer"):
                return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "skipped": jnp.logical_not(finite).astype(jnp.int32),
        }
        if loads:  # max / mean tokens per expert, each MoE layer, whole on every device
            spread = expert_balance.load_spread(loads, trainable.layout)
            metrics["moe_load_spread"] = jax.lax.with_sharding_constraint(spread, replicated)
        if bounds:  # dropless: the largest exchange bound taken, each MoE layer
            largest = expert_balance.largest_bound(
                bounds, trainable.layout, moe.exchange_bounds, trainable.mesh.shape["expert"]
            )
            metrics["moe_exchange_bound"] = jax.lax.with_sharding_constraint(largest, replicated)
        if kept:  # with a capacity factor: the share of choices dropped, each MoE layer
            dropped = expert_balance.dropped_share(kept, trainable.layout)
            metrics["moe_dropped"] = jax.lax.with_sharding_constraint(dropped, replicated)
        new_state = {
            "step": state["step"] + 1,
            "params": keep(params, state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
        }
        if links:  # compression state: errors and warm starts
            new_state["links"] = keep(links[0], state["links"])
        return new_state, metrics

    batch = trainable.batch_sharding()
    return jax.jit(
        step,
        in_shardings=(shardings, batch, batch),
        out_shardings=(shardings, None),
        donate_argnums=(0,),
        compiler_options=compiler_options(trainable.platform, point_to_point) or None,
    )
