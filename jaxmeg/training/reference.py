"""The unpipelined step by plain autodiff, on one device: `jax.value_and_grad` of the whole model
per microbatch, accumulated by `lax.scan`. MoE layers' auxiliary losses are added to the loss it
differentiates (the step itself injects their gradient, `jaxmeg.models.moe.into_backward`), and
their experts' load shares, averaged like gradients, fill the routing bias's slot as in the
step. It shares no code with the executor, so the tests compare the executor with it, and
`scripts/bench.py --compare-plain` times the one step path against it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmeg.models import cross_entropy
from jaxmeg.models.moe import MOE_STATS
from jaxmeg.training.state import Trainable, to_canonical_layout, to_stage_layout


def make_plain_loss_and_grads(trainable: Trainable) -> Callable:
    """(params, tokens [G, S], targets [G, S]) -> (mean loss, fp32 grads), params and grads in
    the run's layout (a reshape of the canonical one on a one-stage mesh). One device only."""
    if trainable.mesh.size != 1:
        raise ValueError(f"the plain step runs on one device, the mesh has {trainable.mesh.size}")
    cfg, layout = trainable.cfg, trainable.layout
    model = trainable.model()
    microbatches = cfg.train.microbatches

    def loss_fn(params, tokens_BxS, targets_BxS):
        """(cross-entropy + the MoE layers' auxiliary losses, (cross-entropy, the experts'
        shares of the routing choices [L, E] of each MoE block of a stack entry, or None))."""
        logits, stats = model.apply({"params": params}, tokens_BxS, mutable=[MOE_STATS])
        loss = cross_entropy(logits, targets_BxS, cfg.model.vocab_size)
        if not stats:
            return loss, (loss, None)
        layers = stats[MOE_STATS]["blocks"]["layers"]
        moe_stats = [_at(layers, path) for path in moe_paths(cfg.moe)]
        aux = sum(jnp.sum(one["aux"]) for one in moe_stats)
        return loss + aux, (loss, [one["share"] for one in moe_stats])

    def loss_and_grads(params, tokens, targets):
        params = to_canonical_layout(params, layout)
        # microbatch i is every m-th row from i on, as the executor cuts them
        tokens_MxBxS = tokens.reshape(-1, microbatches, tokens.shape[-1]).swapaxes(0, 1)
        targets_MxBxS = targets.reshape(-1, microbatches, targets.shape[-1]).swapaxes(0, 1)

        def accumulate(carry, microbatch):
            loss_sum, grad_sum = carry
            (_, (loss, load)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, *microbatch
            )
            for path, share in zip(moe_paths(cfg.moe), load or [], strict=False):
                # the routing bias's slot holds the load shares (`models.moe`)
                moe = _at(grads["blocks"]["layers"], path)
                if "router_kept" in moe:  # [layers, 2, E]: routed and kept shares
                    share, kept = share[:, 0], share[:, 1]
                    moe["router_kept"] = kept.astype(jnp.float32)
                moe["router_bias"] = share.astype(jnp.float32)
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, grad_sum), None

        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        init = (jnp.zeros((), jnp.float32), zeros)
        (loss, grads), _ = jax.lax.scan(accumulate, init, (tokens_MxBxS, targets_MxBxS))
        grads = jax.tree.map(lambda g: g / microbatches, grads)
        return loss / microbatches, to_stage_layout(grads, layout)

    return loss_and_grads


def moe_paths(moe) -> list[tuple[str, ...]]:
    """Where a stack entry's MoE blocks sit in its params (and sows), in model order (a
    `LayerGroup`'s `layer_k`)."""
    group = moe.layers_per_unit > 1
    return [(f"layer_{k}", "moe") if group else ("moe",) for k, m in enumerate(moe.unit) if m]


def _at(tree: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        tree = tree[key]
    return tree
