"""The routed experts' feed-forward as functions of rows and weights (`jaxmeg.models.moe`'s
layer runs them): dropless on one device (`experts_ffn`: rows sorted by expert through grouped
GEMMs), dropless with the experts split over an expert axis (`experts_ffn_exchanged`: the
choices travel by all-to-all at a bound chosen per step, `jaxmeg.models.moe_exchange`), and
with a capacity factor (`experts_ffn_capacity`, `experts_ffn_capacity_exchanged`: fixed
[E, sequences x C] buffers, batched GEMMs). See `jaxmeg.models.moe` for what each mode costs.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxmeg import ordering
from jaxmeg.config import MoeConfig
from jaxmeg.config_moe import (
    BOUND_SLOTS,
    EXCHANGE_BOUNDS,
    EXCHANGE_KEPT_BOUND,
    bound_slots,
    exchange_bounds,
    kept_bound,
)
from jaxmeg.models import residual_switch
from jaxmeg.models.grouped_gemm import (
    RAGGED,
    ExpertGemms,
    GroupedMatmul,
    cotangent_like,
    ragged_matmul,
)
from jaxmeg.models.moe_exchange import (
    EXCHANGE_KEPT,
    bound_index,
    exchange,
    sorted_by,
    through_experts,
)
from jaxmeg.models.router import Routing, expert_load


def experts_ffn(
    x: jax.Array, routing: Routing, w_in: jax.Array, w_out: jax.Array,
    w_gate: jax.Array | None = None, gmm: GroupedMatmul = ragged_matmul,
) -> jax.Array:  # fmt: skip
    """sum over a token's k choices of weight x FFN_e(x): x [T, h]; w_in [E, h, f] and w_out
    [E, f, h]; with `w_gate` [E, h, f], SwiGLU (silu(x w_gate) * x w_in, Mixtral's and
    Qwen-MoE's experts), else GeLU. Rows are sorted by expert (a stable sort: a token's choices
    keep their order), each expert's rows go through the grouped GEMMs (`gmm`), and the
    results are put back in token order and combined."""
    k = routing.experts.shape[1]
    order = jnp.argsort(routing.experts.reshape(-1), stable=True)  # [T k], token-major
    sizes = expert_load(routing, w_in.shape[0])
    out = _grouped_ffn(x[order // k], sizes, w_in, w_out, w_gate, gmm)  # grouped by expert
    return _combine(jnp.zeros_like(out).at[order].set(out), routing.weights).astype(x.dtype)


def _grouped_ffn(rows, sizes, w_in, w_out, w_gate, gmm: GroupedMatmul = ragged_matmul):
    """Each expert's FFN on its group of `rows` (sorted by expert, `sizes` [E] rows each; rows
    past the groups give zeros) as grouped GEMMs."""
    hidden = gmm("w_in", rows, w_in, sizes)
    if w_gate is not None:
        gate = gmm("w_gate", rows, w_gate, sizes)
        hidden = jax.nn.silu(gate) * hidden
    else:
        hidden = jax.nn.gelu(hidden)
    return gmm("w_out", hidden, w_out, sizes)


def _combine(per_choice: jax.Array, weights: jax.Array) -> jax.Array:
    """The sum over each token's k choices [T k, h] (token-major) weighted by `weights` [T, k]:
    [T, h] in float32."""
    tokens, k = weights.shape
    per_choice = per_choice.reshape(tokens, k, -1).astype(jnp.float32)
    return jnp.sum(per_choice * weights.astype(jnp.float32)[..., None], axis=1)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def combined_over(per_choice: jax.Array, weights: jax.Array, axis: str) -> jax.Array:
    """`_combine` summed over mesh `axis` (inside a map manual over it: each rank's experts ran
    a slice of their width). Its backward sums the weights' cotangent over `axis` before it
    hands on the choices' cotangent, which carries zeros read from that sum (`ordering`): so the
    exchange's transpose that follows (a conditional that holds the expert axis's all-to-alls)
    starts after the sum on every device. Left to jax, no data ordered the two, and on CPU one
    device could enter the sum while another of its group waited in the exchange."""
    return jax.lax.psum(_combine(per_choice, weights), axis)


def _combined_over_fwd(per_choice, weights, axis):
    return combined_over(per_choice, weights, axis), (per_choice, weights)


def _combined_over_bwd(axis, residuals, g):
    per_choice, weights = residuals
    tokens, k = weights.shape
    g = g.astype(jnp.float32)
    rows = per_choice.reshape(tokens, k, -1).astype(jnp.float32)
    d_weights = cotangent_like(jnp.sum(g[:, None, :] * rows, axis=-1), weights)
    after = ordering.zeros_from(d_weights).astype(jnp.float32)[..., None]
    d_rows = g[:, None, :] * weights.astype(jnp.float32)[..., None] + after
    return cotangent_like(d_rows.reshape(tokens * k, -1), per_choice), d_weights


combined_over.defvjp(_combined_over_fwd, _combined_over_bwd)


def experts_ffn_exchanged(
    x: jax.Array, routing: Routing, w_in: jax.Array, w_out: jax.Array,
    w_gate: jax.Array | None, axis: str, tensor_axis: str | None = None,
    taps: dict | None = None, gemm: ExpertGemms = RAGGED,
    factors: tuple[float, ...] = EXCHANGE_BOUNDS, kept_factor: float = EXCHANGE_KEPT_BOUND,
    scaling: dict | None = None, form: str = "blocks",
) -> tuple[jax.Array, dict, jax.Array]:  # fmt: skip
    """`experts_ffn` with the experts split over the devices of mesh `axis` (expert parallelism),
    inside a map manual over it: this device holds rows x [T, h] and experts
    [e * E_l, (e + 1) * E_l) (w_* [E_l, ...], e its index on `axis`). Each choice goes to its
    expert's device and its output comes back by two `all_to_all`s (dispatch, combine); the
    experts run as grouped GEMMs on the rows they receive (`gemm`: the GEMM and its weight
    gradient, `grouped_gemm.grouped_gemm`; with delayed FP8 scaling at `scaling`, name ->
    (scales, the seen leaf), `moe_exchange.through_experts`).

    Dropless at a bound chosen per step: each (sender, receiver) block holds B rows, the first
    `count` real. B is the smallest of `exchange_bounds` (multiples of the even load T k /
    E_ranks, up to T k) that the step's busiest block fits, the same on every device of the
    exchange and its tensor group (`bound_index`, one all-reduce of a scalar); each bound is a
    branch of a switch compiled at its shapes (`moe_exchange.through_experts`), and the taken
    one runs. So the wire and the experts' GEMMs carry about max/mean load times the routed
    tokens, not E_ranks times, and a router that sends everything to one device still runs
    (B = T k). Every bound keeps the same residual buffers, the largest bound's
    (`residual_switch`). `form` (`moe.exchange`): `blocks` as above, or `ragged`: each device
    sends only its routed rows (`moe_exchange.ragged_all_to_all`) and the bound is on the rows a
    device receives in all, E_ranks B (every device's choices per expert gathered first, one
    all-gather of E integers). With `tensor_axis`, w_* hold a 1/t slice of the experts' width and
    the outputs are summed over it.

    `taps`: name -> zeros [E_ranks T k, out] added to that grouped GEMM's output (a split
    backward's, their cotangents are its dY). Returns (y [T, h], name -> the tapped GEMM's
    rows and group sizes, padded to E_ranks T k rows, the bound taken as a one-hot over its
    slots [BOUND_SLOTS] (`config_moe.bound_slots`), the same on every device of the exchange)."""
    tokens, k = routing.experts.shape
    ranks, local = jax.lax.axis_size(axis), w_in.shape[0]
    choices = tokens * k
    expert = routing.experts.reshape(-1)  # [T k], token-major
    order, per_expert, _ = sorted_by(expert, ranks * local)  # so by device, then local expert
    counts = per_expert.reshape(ranks, local).sum(1)
    device = (expert // local)[order]
    slot = jnp.arange(choices) - (jnp.cumsum(counts) - counts)[device]
    bounds = exchange_bounds(choices, ranks, factors)
    const = (device, slot, expert[order] % local)
    busiest = counts
    if form == "ragged":  # every device's choices per expert; a bound holds a device's rows
        gathered = jax.lax.all_gather(per_expert, axis)
        const = (*const, gathered)
        received = gathered.reshape(ranks, ranks, local).sum((0, 2))
        busiest = -(-received // ranks)
    diff = (x[order // k], w_in, w_out, w_gate, taps or {}, scaling or {})
    keep = ranks * kept_bound(bounds, choices, ranks, kept_factor)
    branches = [
        partial(through_experts, b, ranks * choices, keep, axis, form, gemm) for b in bounds
    ]
    index = bound_index(busiest, bounds, (axis,) if tensor_axis is None else (axis, tensor_axis))
    sent, recorded = residual_switch.switch(index, branches, const, diff, EXCHANGE_KEPT)
    per_choice = jnp.zeros((choices, x.shape[-1]), x.dtype).at[order].set(sent)
    if tensor_axis is None:
        combined = _combine(per_choice, routing.weights)
    else:  # each tensor rank's experts ran a slice of their width
        combined = combined_over(per_choice, routing.weights, tensor_axis)
    slot = jnp.asarray(bound_slots(choices, ranks, factors))[index]
    taken = jax.nn.one_hot(slot, BOUND_SLOTS, dtype=jnp.float32)
    return combined.astype(x.dtype), recorded, taken


def capacity(moe: MoeConfig, tokens_per_sequence: int) -> int:
    """C, the slots each expert has for one sequence's choices: ceil(cf s k / E)."""
    return math.ceil(moe.capacity_factor * tokens_per_sequence * moe.top_k / moe.experts)


def capacity_slots(
    routing: Routing, sequences: int, num_experts: int, cap: int
) -> tuple[jax.Array, jax.Array]:
    """(each choice's row in its expert's buffer [T k], whether it keeps it [T k]): sequence n's
    choices of expert e take rows n C .. n C + C - 1 in token order; those past C are dropped
    (their row is the buffer's end, which a scatter with mode='drop' ignores)."""
    expert = routing.experts.reshape(-1)  # [T k], token-major
    per_sequence = expert.shape[0] // sequences
    sequence = jnp.arange(expert.shape[0]) // per_sequence
    order, _, position = sorted_by(sequence * num_experts + expert, sequences * num_experts)
    position = jnp.zeros_like(position).at[order].set(position)
    kept = position < cap
    return jnp.where(kept, sequence * cap + position, sequences * cap), kept


def _batched_ffn(rows, w_in, w_out, w_gate, gmm: GroupedMatmul = ragged_matmul) -> jax.Array:
    """Each expert's FFN on its own rows [E, N, h] as batched GEMMs (zero rows give zeros)."""
    return _grouped_ffn(rows, None, w_in, w_out, w_gate, gmm)


def _capacity_buffers(x, routing, sequences, num_experts, cap):
    """(the [E, sequences C, h] buffers of the kept choices' rows, each choice's expert, row and
    whether it is kept)."""
    k = routing.experts.shape[1]
    expert = routing.experts.reshape(-1)
    row, kept = capacity_slots(routing, sequences, num_experts, cap)
    buffers = jnp.zeros((num_experts, sequences * cap, x.shape[-1]), x.dtype)
    token = jnp.arange(expert.shape[0]) // k
    return buffers.at[expert, row].set(x[token], mode="drop"), expert, row, kept


def _capacity_combine(out, expert, row, kept, weights, dtype) -> jax.Array:
    per_choice = out.at[expert, row].get(mode="fill", fill_value=0)
    return _combine(per_choice, weights * kept.reshape(weights.shape)).astype(dtype)


def experts_ffn_capacity(
    x: jax.Array, routing: Routing, w_in: jax.Array, w_out: jax.Array,
    w_gate: jax.Array | None, sequences: int, cap: int, gmm: GroupedMatmul = ragged_matmul,
) -> jax.Array:  # fmt: skip
    """`experts_ffn` with at most `cap` of each sequence's choices per expert (see the module
    docstring): the kept choices' rows in [E, sequences x cap] buffers, one batched GEMM per
    matrix, the dropped choices adding nothing."""
    buffers, expert, row, kept = _capacity_buffers(x, routing, sequences, w_in.shape[0], cap)
    out = _batched_ffn(buffers, w_in, w_out, w_gate, gmm)
    return _capacity_combine(out, expert, row, kept, routing.weights, x.dtype)


def experts_ffn_capacity_exchanged(
    x: jax.Array, routing: Routing, w_in: jax.Array, w_out: jax.Array,
    w_gate: jax.Array | None, sequences: int, cap: int, axis: str,
    tensor_axis: str | None = None, gmm: GroupedMatmul = ragged_matmul,
) -> jax.Array:  # fmt: skip
    """`experts_ffn_capacity` with the experts split over mesh `axis` (as
    `experts_ffn_exchanged`): this device's [E, sequences x cap] buffers go to the experts'
    devices by one all-to-all (E_l experts' buffers to each) and come back by another; each
    device runs its E_l experts on the e x sequences x cap rows it received."""
    ranks, local = jax.lax.axis_size(axis), w_in.shape[0]
    buffers, expert, row, kept = _capacity_buffers(x, routing, sequences, ranks * local, cap)
    h = x.shape[-1]
    send = buffers.reshape(ranks, local, sequences * cap, h)
    received = exchange(send, axis)  # [sender, E_l, n C, h]
    rows = received.transpose(1, 0, 2, 3).reshape(local, ranks * sequences * cap, h)
    out = _batched_ffn(rows, w_in, w_out, w_gate, gmm).reshape(local, ranks, sequences * cap, h)
    back = exchange(out.transpose(1, 0, 2, 3), axis)
    combined = _capacity_combine(
        back.reshape(ranks * local, sequences * cap, h), expert, row, kept, routing.weights,
        jnp.float32,
    )  # fmt: skip
    if tensor_axis is not None:  # each tensor rank's experts ran a slice of their width
        combined = jax.lax.psum(combined, tensor_axis)
    return combined.astype(x.dtype)
