"""The router of a mixture-of-experts layer: which `top_k` of `E` experts each token goes to and
with what weights, and the auxiliary losses that keep the load even (the router's logits in
fp32 whatever the compute dtype).

  softmax   Mixtral and Qwen-MoE: probabilities over all experts, the top k chosen, their
            weights renormalised to sum to 1 (`normalize`, Mixtral's) or kept as they are
            (Qwen1.5-MoE's default)
  sigmoid   DeepSeek-V3: independent scores, the top k chosen, weights normalised

A per-expert `bias` (DeepSeek-V3's loss-free balancing) shifts which experts are chosen, never
the weights they are combined with.

Group-limited routing (DeepSeek-V3's node-limited routing, `moe.router_groups` G and
`moe.router_group_topk` M): the experts come in G groups of E / G consecutive ones; a group
scores the sum of its two highest (biased) scores (its highest with one expert per group),
each token keeps its M best groups, and its top k are chosen among their experts only. With
the groups laid over the expert ranks (E / G experts per group, a multiple of the experts a
rank holds) a token's choices reach at most M groups of ranks. The combine weights are then
scaled by `moe.routed_scaling` (DeepSeek-V3: 2.5), after any normalisation.

Auxiliary losses: Switch Transformer's load-balancing loss E sum_e f_e P_e (f_e the share of the
k T choices that went to e, P_e the mean router probability of e), taken per sequence and
averaged (`sequence_balance_loss`: DeepSeek-V3's sequence-wise balance loss, whose f_e is
E / (k T) times e's count and whose P_e averages the scores normalised per token), and ST-MoE's
router z-loss, the mean squared log-sum-exp of the logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmeg.config_moe import MOE_ROUTERS

ROUTERS = MOE_ROUTERS


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes: `experts` [T, k] int32 and their combine `weights` [T, k] fp32,
    with the router's `probs` [T, E] (softmax or sigmoid scores) and `logits` [T, E], fp32."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


def limit_to_groups(scores: jax.Array, groups: int, group_topk: int) -> jax.Array:
    """`scores` [T, E] with every expert outside each token's `group_topk` best of `groups`
    groups (E / groups consecutive experts each) set to -inf; a group scores the sum of its
    two highest scores (its highest if it holds one expert)."""
    tokens, experts = scores.shape
    grouped = scores.reshape(tokens, groups, experts // groups)
    best = jax.lax.top_k(grouped, min(2, experts // groups))[0]
    _, kept = jax.lax.top_k(jnp.sum(best, axis=-1), group_topk)  # [T, M]
    keep = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], kept].set(True)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


def route(
    logits: jax.Array, top_k: int, router: str = "softmax", normalize: bool = True,
    bias: jax.Array | None = None, groups: int = 1, group_topk: int = 1, scaling: float = 1.0,
) -> Routing:  # fmt: skip
    """The top `top_k` experts of each row of `logits` [T, E] (see the module docstring)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {list(ROUTERS)}, got {router!r}")
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the {num_experts} experts, got {top_k}")
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits)
    choose = probs if bias is None else probs + bias.astype(jnp.float32)
    if groups > 1:
        choose = limit_to_groups(choose, groups, group_topk)
    _, experts = jax.lax.top_k(choose, top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if router == "sigmoid" or normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scaling != 1.0:
        weights = weights * scaling
    return Routing(experts.astype(jnp.int32), weights, probs, logits)


def route_by(moe, logits: jax.Array, bias: jax.Array | None) -> Routing:
    """`route` as the `moe` config section says."""
    return route(
        logits, moe.top_k, moe.router, moe.normalize, bias, moe.router_groups,
        moe.router_group_topk, moe.routed_scaling,
    )  # fmt: skip


def expert_load(routing: Routing, num_experts: int) -> jax.Array:
    """Tokens routed to each expert [E] (int32): the group sizes of the grouped GEMMs."""
    return jnp.bincount(routing.experts.reshape(-1), length=num_experts).astype(jnp.int32)


def load_balancing_loss(routing: Routing, num_experts: int) -> jax.Array:
    """Switch Transformer's E sum_e f_e P_e: 1 when the load and the probabilities are uniform."""
    share = expert_load(routing, num_experts) / routing.experts.size
    mean_prob = jnp.mean(routing.probs, axis=0)
    return num_experts * jnp.sum(jax.lax.stop_gradient(share) * mean_prob)


def z_loss(routing: Routing) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(jax.nn.logsumexp(routing.logits, axis=-1) ** 2)


def sequence_balance_loss(routing: Routing, sequences: int, router: str = "softmax") -> jax.Array:
    """`load_balancing_loss` of each sequence's tokens (rows in sequence-major order), averaged
    over the `sequences`. A sigmoid router's scores are normalised per token first (DeepSeek-V3's
    sequence-wise loss), so the loss is 1 at an even load with either router."""
    num_experts = routing.probs.shape[-1]
    probs = routing.probs
    if router == "sigmoid":
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    split = lambda a: a.reshape(sequences, -1, *a.shape[1:])  # noqa: E731

    def one(experts, probs_):
        return load_balancing_loss(Routing(experts, experts, probs_, probs_), num_experts)

    return jnp.mean(jax.vmap(one)(split(routing.experts), split(probs)))


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
    """The router's logits [T, E] in float32, whatever the compute dtype."""
    return jnp.einsum("td,de->te", x.astype(jnp.float32), w_router.astype(jnp.float32))
