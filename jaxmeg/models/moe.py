"""A mixture-of-experts feed-forward block, as pure functions of its weights: a router picks
`top_k` of `E` experts per token, the token's rows are sorted by expert, and each expert's FFN
runs as one grouped GEMM over its rows (`jax.lax.ragged_dot`: a grouped GEMM on a GPU, no loop
and no dense einsum over all experts). Dropless: every choice is computed, however uneven the
load; an expert that receives no token is a group of size 0.

Routers (the router's logits in fp32 whatever the compute dtype):
  softmax   Mixtral and Qwen-MoE: probabilities over all experts, the top k chosen, their
            weights renormalised to sum to 1 (`normalize`, Mixtral's) or kept as they are
            (Qwen1.5-MoE's default)
  sigmoid   DeepSeek-V3: independent scores, the top k chosen, weights normalised
A per-expert `bias` (DeepSeek-V3's loss-free balancing) shifts which experts are chosen, never
the weights they are combined with.

Auxiliary losses, per layer and batch: Switch Transformer's load-balancing loss E sum_e f_e P_e
(f_e the share of the k T choices that went to e, P_e the mean router probability of e) and
ST-MoE's router z-loss, the mean squared log-sum-exp of the logits.

Not here yet: the `moe` config section, the block inside the model and the pipeline, and
expert parallelism (issue 33).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

ROUTERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes: `experts` [T, k] int32 and their combine `weights` [T, k] fp32,
    with the router's `probs` [T, E] (softmax or sigmoid scores) and `logits` [T, E], fp32."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(
    logits: jax.Array, top_k: int, router: str = "softmax", normalize: bool = True,
    bias: jax.Array | None = None,
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
    _, experts = jax.lax.top_k(choose, top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if router == "sigmoid" or normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights, probs, logits)


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


def experts_ffn(
    x: jax.Array, routing: Routing, w_in: jax.Array, w_out: jax.Array, gated: bool = True,
) -> jax.Array:  # fmt: skip
    """sum over a token's k choices of weight x FFN_e(x): x [T, h]; w_in [E, h, f] (gated:
    [E, h, 2 f], gate then up, SwiGLU as Mixtral and Qwen-MoE) and w_out [E, f, h]. Rows are
    sorted by expert (a stable sort: a token's choices keep their order), each expert's rows go
    through two grouped GEMMs, and the results are put back in token order and combined."""
    tokens, k = routing.experts.shape
    choice_expert = routing.experts.reshape(-1)  # [T k], token-major
    order = jnp.argsort(choice_expert, stable=True)
    sizes = expert_load(routing, w_in.shape[0])
    rows = x[order // k]  # [T k, h], grouped by expert
    hidden = jax.lax.ragged_dot(rows, w_in.astype(x.dtype), sizes)
    if gated:
        gate, up = jnp.split(hidden, 2, axis=-1)
        hidden = jax.nn.silu(gate) * up
    else:
        hidden = jax.nn.gelu(hidden)
    out = jax.lax.ragged_dot(hidden, w_out.astype(x.dtype), sizes)  # [T k, h]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, -1)
    weights = routing.weights.astype(jnp.float32)[..., None]
    return jnp.sum(unsorted.astype(jnp.float32) * weights, axis=1).astype(x.dtype)
