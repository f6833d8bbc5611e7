"""A mixture-of-experts feed-forward block, as pure functions of its weights: a router picks
`top_k` of `E` experts per token, the token's rows are sorted by expert, and each expert's FFN
runs as one grouped GEMM over its rows (`jaxmeg.models.grouped_gemm`: `jax.lax.ragged_dot`, which
XLA's GPU compiler makes a dense GEMM over every expert, or a loop of dense GEMMs over blocks of
each expert's rows). Dropless: every choice is computed, however uneven the load; an expert that
receives no token is a group of size 0.

The router (which experts, with what weights, and the auxiliary losses: Switch Transformer's
load-balancing loss per sequence and ST-MoE's z-loss) is `jaxmeg.models.router`'s.

The layer (`MoeMlp`, the `moe` config section) replaces a block's dense MLP. Its auxiliary
losses are per sequence (the balance loss's f and P over one sequence's tokens, averaged over the
sequences): a sum over sequences is the same however the batch is cut into microbatches,
replicas and stages, so the step's gradient equals one device's. They reach the gradient
without a second output of the model: `into_backward` is the identity on the layer's output,
and its backward hands the losses the cotangent `grad_scale` (the step's weight of one
microbatch, 1/m), as if they had been added to the loss (Megatron-Core's
MoEAuxLossAutoScaler). The same backward gives the routing bias the cotangent grad_scale x the
microbatch's expert load (each expert's share of the microbatch's k T routing choices), so the
bias's "gradient" after the step is each expert's share of the step's choices, averaged over
microbatches and replicas like a gradient, the same however the batch is split: what the bias
update and the load metrics read
(`jaxmeg.training.expert_balance`). The true gradient of the bias is 0 (it only moves top-k).
With `grad_scale` 0 (evaluation, generation, the single-device reference) nothing is injected;
the losses and loads are sown in the `moe_stats` collection for a caller that asks for them.

Expert parallelism (`parallel.expert` > 1): the experts are split over the mesh's `expert`
axis, a microbatch's rows too, and each choice travels to its expert's device and back by
all-to-all (`experts_ffn_exchanged`, run under a map by `jaxmeg.parallel.experts`, which the
step hands the layer as its `dispatch`). Which layers are MoE layers (`moe.first_dense`,
`moe.every`) is the model's (`jaxmeg.models.gpt.GPT`, `LayerGroup`).

Capacity limits (`moe.capacity_factor` cf > 0, Switch Transformer's): each expert takes at most
C = ceil(cf s k / E) of each sequence's s k choices, first come in token order; the rest are
dropped (they add nothing to the token's output; the residual carries it). Decided per sequence,
so the same choices drop however the batch is split. The experts then run on fixed buffers of
[E, sequences x C] rows as one batched GEMM (`experts_ffn_capacity`), and with expert
parallelism the all-to-all moves exactly those buffers: cf times the routed tokens' bytes,
where the dropless exchange moves its bound's, max/mean block load rounded up to one of
`config_moe.EXCHANGE_BOUNDS` (`experts_ffn_capacity_exchanged`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmeg import ordering
from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.config_moe import (
    BOUND_SLOTS,
    EXCHANGE_BOUNDS,
    EXCHANGE_KEPT_BOUND,
    bound_slots,
    exchange_bounds,
    kept_bound,
)
from jaxmeg.models import parts, residual_switch
from jaxmeg.models.grouped_gemm import (
    RAGGED,
    ExpertGemms,
    GroupedMatmul,
    cotangent_like,
    fp8_grouped,
    grouped_gemm,
    ragged_matmul,
)
from jaxmeg.models.moe_exchange import (
    EXCHANGE_KEPT,
    bound_index,
    exchange,
    sorted_by,
    through_experts,
)
from jaxmeg.models.parts import Array, Constrain, Mlp, dtype_of, no_constraint, normal, param
from jaxmeg.models.router import (
    Routing,
    expert_load,
    route_by,
    router_logits,
    sequence_balance_loss,
    z_loss,
)

MOE_STATS = "moe_stats"
"""The collection a MoE layer sows its `aux` (the weighted auxiliary losses, scalar) and `share`
(each expert's share of the k T routing choices [E], summing to 1; with a capacity factor
[2, E], and each expert's share of the choices it kept) in, when the caller makes it mutable."""


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
) -> tuple[jax.Array, dict, jax.Array]:  # fmt: skip
    """`experts_ffn` with the experts split over the devices of mesh `axis` (expert parallelism),
    inside a map manual over it: this device holds rows x [T, h] and experts
    [e * E_l, (e + 1) * E_l) (w_* [E_l, ...], e its index on `axis`). Each choice goes to its
    expert's device and its output comes back by two `all_to_all`s (dispatch, combine); the
    experts run as grouped GEMMs on the rows they receive (`gemm`: the GEMM and its weight
    gradient, `grouped_gemm.grouped_gemm`).

    Dropless at a bound chosen per step: each (sender, receiver) block holds B rows, the first
    `count` real. B is the smallest of `exchange_bounds` (multiples of the even load T k /
    E_ranks, up to T k) that the step's busiest block fits, the same on every device of the
    exchange and its tensor group (`bound_index`, one all-reduce of a scalar); each bound is a
    branch of a switch compiled at its shapes (`moe_exchange.through_experts`), and the taken
    one runs. So the wire and the experts' GEMMs carry about max/mean load times the routed
    tokens, not E_ranks times, and a router that sends everything to one device still runs
    (B = T k). Every bound keeps the same residual buffers, the largest bound's
    (`residual_switch`). With `tensor_axis`, w_* hold a 1/t slice of the experts' width and
    the outputs are summed over it.

    `taps`: name -> zeros [E_ranks T k, out] added to that grouped GEMM's output (a split
    backward's, their cotangents are its dY). Returns (y [T, h], name -> the tapped GEMM's
    rows and group sizes, padded to E_ranks T k rows, the bound taken as a one-hot over its
    slots [BOUND_SLOTS] (`config_moe.bound_slots`), the same on every device of the exchange)."""
    tokens, k = routing.experts.shape
    ranks, local = jax.lax.axis_size(axis), w_in.shape[0]
    choices = tokens * k
    expert = routing.experts.reshape(-1)  # [T k], token-major
    order, counts, slot = sorted_by(expert // local, ranks)
    bounds = exchange_bounds(choices, ranks, factors)
    const = ((expert // local)[order], slot, expert[order] % local)
    diff = (x[order // k], w_in, w_out, w_gate, taps or {})
    keep = ranks * kept_bound(bounds, choices, ranks, kept_factor)
    branches = [partial(through_experts, b, ranks * choices, keep, axis, gemm) for b in bounds]
    index = bound_index(counts, bounds, (axis,) if tensor_axis is None else (axis, tensor_axis))
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


def moe_ffn(
    moe: MoeConfig, sequences: int, x: Array, logits: Array, bias: Array, w_in: Array,
    w_out: Array, *w_gate: Array, axis: str | None = None, tensor_axis: str | None = None,
    gmm: GroupedMatmul = ragged_matmul, taps: dict | None = None, fp8: bool = False,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """The routed experts of `sequences` sequences' rows x [T, h] (sequence-major), given the
    router's `logits` [T, E]: (y [T, h], the weighted auxiliary losses (scalar), each expert's
    share of the k T choices [E]; with a capacity factor [2, E]: that and its share of the
    choices it kept; dropless with `axis` [E + BOUND_SLOTS]: that and the
    bound its exchange took, one-hot). w_gate: () or (the SwiGLU gate,). With `axis` (inside a map
    manual over it, each device holding its own rows and E_l experts) the choices travel by
    all-to-all (`experts_ffn_exchanged`), and the losses and shares are averaged over `axis`:
    every device holds as many sequences, so that is the mean over all of them. `gmm`: the
    experts' grouped GEMM on one device. `taps` (dropless, with `axis`): as
    `experts_ffn_exchanged`'s, and the tapped GEMMs' rows and group sizes are returned fourth.
    `fp8` (`model.fp8`; with `axis`: on one device `gmm` says): the experts' grouped GEMMs on
    FP8 operands (`grouped_gemm.fp8_grouped`), their amaxes reduced over the map's axes."""
    routing = route_by(moe, logits, bias)
    gate = w_gate[0] if w_gate else None
    recorded, taken = {}, None
    axes = (axis,) if tensor_axis is None else (axis, tensor_axis)
    if moe.capacity_factor:
        cap = capacity(moe, x.shape[0] // sequences)
        if axis is None:
            y = experts_ffn_capacity(x, routing, w_in, w_out, gate, sequences, cap, gmm)
        else:
            batched = fp8_grouped(axes) if fp8 else ragged_matmul
            y = experts_ffn_capacity_exchanged(
                x, routing, w_in, w_out, gate, sequences, cap, axis, tensor_axis, batched
            )
    elif axis is None:
        y = experts_ffn(x, routing, w_in, w_out, gate, gmm)
    else:
        y, recorded, taken = experts_ffn_exchanged(
            x,
            routing,
            w_in,
            w_out,
            gate,
            axis,
            tensor_axis,
            taps,
            grouped_gemm(moe, fp8, axes),
            moe.exchange_bounds,
            moe.exchange_kept_bound,
        )
    aux = jnp.zeros((), jnp.float32)
    if moe.aux_loss:
        aux = aux + moe.aux_loss * sequence_balance_loss(routing, sequences, moe.router)
    if moe.z_loss:
        aux = aux + moe.z_loss * z_loss(routing)
    share = expert_load(routing, logits.shape[-1]) / routing.experts.size
    if moe.capacity_factor:  # and each expert's share of the choices it kept
        _, kept = capacity_slots(routing, sequences, logits.shape[-1], cap)
        expert = routing.experts.reshape(-1)
        kept_share = jnp.zeros_like(share).at[expert].add(kept.astype(share.dtype))
        share = jnp.stack([share, kept_share / routing.experts.size])
    if axis is not None:
        aux, share = jax.lax.pmean((aux, share), axis)
    if taken is not None:  # the same on every device of the exchange
        share = jnp.concatenate([share, taken])
    if taps is not None:
        return y, aux, share, recorded
    return y, aux, share


Dispatch = Callable[..., tuple[Array, Array, Array]]
"""`moe_ffn`'s signature without `axis`: how a layer runs its experts when they are split over
devices (`jaxmeg.parallel.experts.exchanged`); the model is handed one and never sees a mesh."""


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def into_backward(y: Array, aux: Array, bias: Array, load: Array, grad_scale: float) -> Array:
    """y itself; in the backward, `aux` (a scalar loss) gets the cotangent `grad_scale` and
    `bias` gets grad_scale x `load` (float, [E]; see the module docstring)."""
    del aux, bias, load
    return y


def _into_backward_fwd(y, aux, bias, load, grad_scale):
    del grad_scale
    return y, (aux, bias, load)


def _into_backward_bwd(grad_scale, residuals, g_y):
    aux, bias, load = residuals
    g_aux = jax.lax.full_like(aux, grad_scale)  # varying over the manual axes as aux is
    g_bias = (grad_scale * load).astype(bias.dtype)
    return g_y, g_aux, g_bias, jnp.zeros_like(load)


into_backward.defvjp(_into_backward_fwd, _into_backward_bwd)


TAKEN = "exchange_taken"
"""Dropless with `moe.record_exchange_bounds`: a never-trained [BOUND_SLOTS] whose "gradient"
counts the exchange bounds the layer took (`jaxmeg.training.expert_balance`)."""


class MoeMlp(nn.Module):
    """The mixture-of-experts block in place of `Mlp`: router (`w_router` [D, E], float32),
    routing bias (`router_bias` [E]; with a capacity factor also `router_kept` [E], never
    trained, whose "gradient" is each expert's share of the kept choices), routed experts
    (`w_in` [E, D, F], `w_out` [E, F, D], and for SwiGLU, the llama block's, `w_gate`
    [E, D, F]), and optional shared experts (`shared`,
    a dense MLP, with `w_shared_gate` [D, 1]). The experts' width is split over `tensor`
    (`expert_mlp`); the expert dim (`experts`) is whole on every device."""

    cfg: ModelConfig
    moe: MoeConfig
    constrain: Constrain = no_constraint
    grad_scale: float = 0.0
    dispatch: Dispatch | None = None

    @nn.compact
    def __call__(self, x_BxSxD: Array) -> Array:
        cfg, moe = self.cfg, self.moe
        b, s, d = x_BxSxD.shape
        e, f = moe.experts, moe.expert_width(cfg.mlp_hidden)
        compute = dtype_of(cfg.compute_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        w_router = param(self, "w_router", (d, e), ("embed", None), normal(cfg.init_std))
        bias = param(self, "router_bias", (e,), (None,), nn.initializers.zeros)
        kept = taken = None
        if moe.capacity_factor:  # its "gradient": each expert's share of the kept choices
            kept = param(self, "router_kept", (e,), (None,), nn.initializers.zeros)
        elif moe.record_exchange_bounds:  # its "gradient": the exchange bounds taken
            taken = param(self, TAKEN, (BOUND_SLOTS,), (None,), nn.initializers.zeros)
        expert_in = ("experts", "embed", "expert_mlp")
        expert_out = ("experts", "expert_mlp", "embed")
        w_in = param(self, "w_in", (e, d, f), expert_in, normal(cfg.init_std))
        w_out = param(self, "w_out", (e, f, d), expert_out, normal(out_std))
        w_gate = None
        if cfg.block == "llama":
            w_gate = param(self, "w_gate", (e, d, f), expert_in, normal(cfg.init_std))
        x_TxD = x_BxSxD.reshape(b * s, d)
        experts = (w_in, w_out) if w_gate is None else (w_in, w_out, w_gate)
        local = self.dispatch is None or self.is_initializing()
        run = partial(moe_ffn, gmm=self._tapped_matmul) if local else self.dispatch
        logits = router_logits(x_TxD, w_router)
        experts = tuple(w.astype(compute) for w in experts)
        if not local and self._tapped_exchange():
            run = self._exchanged_tapped
        y_TxD, aux, share = run(moe, b, x_TxD, logits, bias, *experts)
        share, bounds = share[..., :e], share[..., e:]  # bounds: [] but over an exchange
        y_BxSxD = y_TxD.reshape(b, s, d)
        if moe.shared_experts:
            shared = Mlp(cfg, self.constrain, moe.shared_width(cfg.mlp_hidden), name="shared")
            y_shared = shared(x_BxSxD)
            if moe.shared_gate:
                w_shared_gate = param(self, "w_shared_gate", (d, 1), ("embed", None),
                                      normal(cfg.init_std))  # fmt: skip
                gate = jnp.einsum("bsd,do->bso", x_BxSxD, w_shared_gate.astype(compute))
                gate = jax.nn.sigmoid(gate)
                y_shared = y_shared * gate
            y_BxSxD = y_BxSxD + y_shared
        self.sow(MOE_STATS, "aux", aux, init_fn=lambda: None, reduce_fn=lambda _, new: new)
        self.sow(MOE_STATS, "share", share, init_fn=lambda: None, reduce_fn=lambda _, new: new)
        if self.grad_scale:
            load = share if kept is None else share[0]
            y_BxSxD = into_backward(y_BxSxD, aux, bias, load, self.grad_scale)
            none = jnp.zeros((), jnp.float32)  # no second aux: its cotangent goes to a constant
            if kept is not None:
                y_BxSxD = into_backward(y_BxSxD, none, kept, share[1], self.grad_scale)
            if taken is not None and bounds.size:  # with one expert rank nothing is exchanged
                y_BxSxD = into_backward(y_BxSxD, none, taken, bounds, self.grad_scale)
        return y_BxSxD

    def _tapped_exchange(self) -> bool:
        """Whether the experts split over devices run tapped: in a split backward's layer (its
        taps collection given or being made), dropless, with a dispatch that can."""
        split = self.is_mutable_collection(parts.TAPS) or self.has_variable(parts.TAPS, "w_in")
        return split and not self.moe.capacity_factor and hasattr(self.dispatch, "tapped")

    def _exchanged_tapped(self, moe, sequences, x, logits, bias, *experts):
        """The dispatch's tapped exchange (`jaxmeg.parallel.experts.exchanged_tapped`): zero
        taps on the experts' grouped GEMMs (`TAPS`, each device's block stacked), their rows
        and group sizes sown (`MATMUL_INPUTS`), so a split backward computes the expert
        weights' gradients in W, as on one device."""
        shapes = self.dispatch.tap_shapes(moe, sequences, x, logits, bias, *experts)
        taps = {
            name: self.variable(parts.TAPS, name, jnp.zeros, a.shape, a.dtype).value
            for name, a in shapes.items()
        }
        y, aux, share, recorded = self.dispatch.tapped(
            moe, sequences, x, logits, bias, taps, *experts
        )
        keep = {"init_fn": lambda: None, "reduce_fn": lambda _, new: new}
        for name, rows in recorded.items():
            self.sow(parts.MATMUL_INPUTS, name, rows, **keep)
        return y, aux, share

    def _tapped_matmul(self, name: str, rows: Array, w: Array, sizes: Array | None) -> Array:
        """The experts' grouped GEMM on one device, as `parts.weight_matmul` is for a dense
        one: its input sown (the rows, and the group sizes of a ragged one, `MATMUL_INPUTS`)
        and its output tapped (`TAPS`), so a split backward computes the expert weights'
        gradients in W (`jaxmeg.models.split_backward.weight_gradients`). With the experts
        split over devices the exchange's taps do the same (`_exchanged_tapped`)."""
        grouped = {"rows": rows} if sizes is None else {"rows": rows, "sizes": sizes}
        keep = {"init_fn": lambda: None, "reduce_fn": lambda _, new: new}
        self.sow(parts.MATMUL_INPUTS, name, grouped, **keep)
        matmul = grouped_gemm(self.moe, self.cfg.fp8 != "none").matmul
        return self.perturb(name, matmul(name, rows, w, sizes), collection=parts.TAPS)
