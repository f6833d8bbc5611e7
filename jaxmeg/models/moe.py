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
all-to-all (`jaxmeg.models.experts_ffn.experts_ffn_exchanged`, run under a map by
`jaxmeg.parallel.experts`, which the step hands the layer as its `dispatch`). Which layers
are MoE layers (`moe.first_dense`, `moe.every`) is the model's (`jaxmeg.models.gpt.GPT`,
`LayerGroup`).

Capacity limits (`moe.capacity_factor` cf > 0, Switch Transformer's): each expert takes at most
C = ceil(cf s k / E) of each sequence's s k choices, first come in token order; the rest are
dropped (they add nothing to the token's output; the residual carries it). Decided per sequence,
so the same choices drop however the batch is split. The experts then run on fixed buffers of
[E, sequences x C] rows as one batched GEMM (`experts_ffn.experts_ffn_capacity`), and with
expert parallelism the all-to-all moves exactly those buffers: cf times the routed tokens' bytes,
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

from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.config_moe import BOUND_SLOTS
from jaxmeg.models import fp8 as fp8_scaling
from jaxmeg.models import parts
from jaxmeg.models.experts_ffn import (
    capacity,
    capacity_slots,
    experts_ffn,
    experts_ffn_capacity,
    experts_ffn_capacity_exchanged,
    experts_ffn_exchanged,
)
from jaxmeg.models.grouped_gemm import (
    GroupedMatmul,
    differentiable_matmul,
    grouped_gemm,
    ragged_matmul,
)
from jaxmeg.models.moe_exchange import settled as settled_exchange
from jaxmeg.models.parts import Array, Constrain, Mlp, dtype_of, no_constraint, normal, param
from jaxmeg.models.router import expert_load, route_by, router_logits, sequence_balance_loss, z_loss

MOE_STATS = "moe_stats"
"""The collection a MoE layer sows its `aux` (the weighted auxiliary losses, scalar) and `share`
(each expert's share of the k T routing choices [E], summing to 1; with a capacity factor
[2, E], and each expert's share of the choices it kept) in, when the caller makes it mutable."""


def moe_ffn(
    moe: MoeConfig, sequences: int, x: Array, logits: Array, bias: Array, w_in: Array,
    w_out: Array, *w_gate: Array, axis: str | None = None, tensor_axis: str | None = None,
    gmm: GroupedMatmul = ragged_matmul, taps: dict | None = None, fp8: str = "none",
    scaling: dict | None = None, average: bool = True,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """The routed experts of `sequences` sequences' rows x [T, h] (sequence-major), given the
    router's `logits` [T, E]: (y [T, h], the weighted auxiliary losses (scalar), each expert's
    share of the k T choices [E]; with a capacity factor [2, E]: that and its share of the
    choices it kept; dropless with `axis` [E + BOUND_SLOTS]: that and the
    bound its exchange took, one-hot). w_gate: () or (the SwiGLU gate,). With `axis` (inside a map
    manual over it, each device holding its own rows and E_l experts) the choices travel by
    all-to-all (`experts_ffn_exchanged`), and the losses and shares are averaged over `axis`:
    every device holds as many sequences, so that is the mean over all of them (not with
    `average` False: where whoever called the layer averages them with its gradients). `gmm`: the
    experts' grouped GEMM on one device. `taps` (dropless, with `axis`): as
    `experts_ffn_exchanged`'s, and the tapped GEMMs' rows and group sizes are returned fourth.
    `fp8` (`model.fp8`; with `axis`: on one device `gmm` says): the experts' grouped GEMMs on
    FP8 operands, at current scales whose amaxes are reduced over the map's axes
    (`grouped_gemm.fp8_grouped`), or at delayed ones, `scaling`: name -> (scales [3], the seen
    leaf), whose cotangent reports the amaxes reduced alike (`grouped_gemm.delayed_grouped`,
    `moe_exchange.through_experts`)."""
    routing = route_by(moe, logits, bias)
    gate = w_gate[0] if w_gate else None
    recorded, taken = {}, None
    axes = (axis,) if tensor_axis is None else (axis, tensor_axis)
    if moe.capacity_factor:
        cap = capacity(moe, x.shape[0] // sequences)
        if axis is None:
            y = experts_ffn_capacity(x, routing, w_in, w_out, gate, sequences, cap, gmm)
        else:
            batched = differentiable_matmul(moe, fp8, scaling, axes)
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
            scaling,
            settled_exchange(moe.exchange, jax.default_backend()),
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
    if axis is not None and average:
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
        # the experts whose weights this layer is given (a dispatch may hand it a rank's own)
        held = getattr(self.dispatch, "experts_here", lambda n: n)(e)
        w_in = param(self, "w_in", (held, d, f), expert_in, normal(cfg.init_std))
        w_out = param(self, "w_out", (held, f, d), expert_out, normal(out_std))
        w_gate = None
        if cfg.block == "llama":
            w_gate = param(self, "w_gate", (held, d, f), expert_in, normal(cfg.init_std))
        x_TxD = x_BxSxD.reshape(b * s, d)
        experts = (w_in, w_out) if w_gate is None else (w_in, w_out, w_gate)
        scaling = {}  # delayed FP8 scaling: name -> (scales, the seen leaf)
        if cfg.fp8 == "delayed":
            names = ("w_in", "w_out", "w_gate")[: len(experts)]
            scaling = {name: parts.delayed_scaling(self, name) for name in names}
        local = self.dispatch is None or self.is_initializing()
        run = self.dispatch
        if local:
            run = partial(moe_ffn, gmm=partial(self._tapped_matmul, scaling))
        elif self._tapped_exchange():
            run = self._exchanged_tapped
        logits = router_logits(x_TxD, w_router)
        experts = tuple(w.astype(compute) for w in experts)
        y_TxD, aux, share = run(moe, b, x_TxD, logits, bias, *experts, scaling=scaling)
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
        split = parts.splits_backward(self, "w_in")
        return split and not self.moe.capacity_factor and hasattr(self.dispatch, "tapped")

    def _exchanged_tapped(self, moe, sequences, x, logits, bias, *experts, scaling=None):
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
            moe, sequences, x, logits, bias, taps, *experts, scaling=scaling
        )
        keep = {"init_fn": lambda: None, "reduce_fn": lambda _, new: new}
        for name, rows in recorded.items():
            if scaling:  # W rounds as the forward did
                rows = {**rows, fp8_scaling.SOWN_SCALES: scaling[name][0]}
            self.sow(parts.MATMUL_INPUTS, name, rows, **keep)
        return y, aux, share

    def _tapped_matmul(
        self, scaling: dict, name: str, rows: Array, w: Array, sizes: Array | None
    ) -> Array:
        """The experts' grouped GEMM on one device, as `parts.weight_matmul` is for a dense
        one: its input sown (the rows, and the group sizes of a ragged one, `MATMUL_INPUTS`)
        and its output tapped (`TAPS`), so a split backward computes the expert weights'
        gradients in W (`jaxmeg.models.split_backward.weight_gradients`), with delayed
        FP8 scaling at the scales kept beside them. With the experts split over devices the
        exchange's taps do the same (`_exchanged_tapped`)."""
        grouped = {"rows": rows} if sizes is None else {"rows": rows, "sizes": sizes}
        if scaling:
            grouped[fp8_scaling.SOWN_SCALES] = scaling[name][0]
        keep = {"init_fn": lambda: None, "reduce_fn": lambda _, new: new}
        self.sow(parts.MATMUL_INPUTS, name, grouped, **keep)
        matmul = differentiable_matmul(self.moe, self.cfg.fp8, scaling)
        return self.perturb(name, matmul(name, rows, w, sizes), collection=parts.TAPS)
