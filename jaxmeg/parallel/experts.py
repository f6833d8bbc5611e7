"""Expert parallelism: a MoE layer's experts split over the mesh's `expert` axis
(`parallel.expert`), run under a map manual over the axes the executor leaves automatic
(context, expert, tensor), as `jaxmeg.parallel.attention` runs cuDNN; where the executor's map
is manual over `expert` itself (tensor 1: `jaxmeg.training.pipeline_step.splits_experts`) the
layer runs in it as it is, on the rank's rows and its own experts
(`ExpertDispatch.experts_here`). Each device routes its own rows, sends every choice to its
expert's device and gets the output back by all-to-all
(`jaxmeg.models.experts_ffn.experts_ffn_exchanged`); the experts' width is split over `tensor`.

`exchanged` is the layer's `dispatch` (`jaxmeg.models.moe.MoeMlp`), given the router's logits
(computed outside the map), with a custom VJP. Dropless, its forward keeps each device's
pullback: `jax.vjp` inside the map, its residuals returned stacked over the map's axes that
each varies over (their types unchanged, so the backward's map takes them apart and runs the
pullback as is), and named (`moe_exchange.EXCHANGE_KEPT`) there, outside the map: the layer's
checkpoint policy keeps them by that name (`jaxmeg.training.pipeline_step` adds it to every
policy but full recompute), so the backward runs only the transposed exchange, in a pipeline's
B (or I) slot as with the whole model in one computation: 4 all-to-alls of rows per layer and
microbatch. Named inside the map instead, the checkpoint stacked them over the whole mesh,
pipe included, and the step failed to lower ("manual axis expert after free axis pipe"). A CPU
tick orders its slots' loops and sends (`jaxmeg.pipeline.executor.slots.ordered_tick`), so the
F slot's send and the B slot's exchange meet in one order on every device. With a capacity
factor in a pipeline the forward keeps nothing and the backward reruns it (`_reruns`): two more
all-to-alls and the experts' forward GEMMs per layer and microbatch. Kept, its pullback (every
intermediate of the experts' FFN, left to jax) doubled a Mixtral-shaped pipeline's temp memory
on the H100 target for the same roofline (docs/benchmarks.md); with p v = 1 it keeps the
pullback. The map holds no `dot_general` that a layer's checkpoint policy would keep: the
router's matmul stays outside.

For a split backward (zero-bubble schedules) `exchanged_tapped` adds zero taps to the experts'
grouped GEMMs inside the map and returns the rows they ran on, so W computes the expert
weights' gradients (`weight_gradient`), not I.

Dropless at a bound chosen per step (`experts_ffn_exchanged`): each (sender, receiver) block
holds B rows, the smallest of `config_moe.exchange_bounds` the step's busiest block fits, so
a balanced step sends about 1.25 times the routed tokens, and a router that sends every choice
to one device E_ranks times (B = T k). On a GPU (`moe.exchange: auto`) the rows go by ragged
all-to-all instead: only the routed rows travel, and the bound is on the rows a device receives
in all (`moe_exchange._Ragged`); XLA's CPU backend has none (there `ragged` runs a reference of
it, for tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxmeg.models import fp8 as fp8_scaling
from jaxmeg.models.grouped_gemm import fp8_weight_gradient, grouped_weight_gradient
from jaxmeg.models.moe import moe_ffn
from jaxmeg.models.moe_exchange import EXCHANGE_KEPT
from jaxmeg.parallel.mesh import automatic_axes_here

EXPERT, TENSOR = "expert", "tensor"
ROWS = P(EXPERT)
EXPERT_IN, EXPERT_OUT = P(EXPERT, None, TENSOR), P(EXPERT, TENSOR, None)
"""w_in / w_gate [E, h, f] and w_out [E, f, h]: experts over `expert`, width over `tensor`."""


def _nested_axes() -> tuple[str, ...]:
    """The axes the layer's map is manual over: what the executor's map left automatic (the
    executor's map is manual over `expert` itself: `jaxmeg.pipeline.gradients.manual_axes`)."""
    return tuple(sorted(automatic_axes_here(("context", EXPERT, TENSOR))))


def _nested_map(fn: Callable, in_specs: tuple, out_specs) -> Callable:
    axes = _nested_axes()
    if not axes:  # inside a map over every axis (`gradients.map_axes`): already per device
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes))


def _in_specs(gated: int) -> tuple:
    """x, logits, bias, scaling, w_in, w_out(, w_gate). `scaling`: with delayed FP8 scaling,
    name -> (scales, the seen leaf), whole on every device (`moe.moe_ffn`); else {}."""
    return (ROWS, ROWS, P(), P(), EXPERT_IN, EXPERT_OUT, *([EXPERT_IN] * gated))


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """What a device's share of the layer runs with (a static of `exchanged`): the sequences
    of the rows the layer is given, the FP8 recipe of the experts' grouped GEMMs
    (`model.fp8`), and whether the layer's map splits those rows over `expert` (`spans`).
    Where the executor's map is manual over `expert` it does not: the rows are already the
    rank's, and its losses and shares stay the rank's, for the step to sum with the gradients
    (`jaxmeg.pipeline.gradients.summed_axes`)."""

    sequences: int
    fp8: str = "none"
    spans: bool = True

    @classmethod
    def here(cls, sequences: int, fp8: str) -> OnDevice:
        """Outside the layer's map: whether it will span `expert`."""
        return cls(sequences, fp8, EXPERT in _nested_axes())


def _on_device(moe, device: OnDevice) -> Callable:
    ranks = jax.sharding.get_abstract_mesh().shape[EXPERT] if device.spans else 1

    def local(x, logits, bias, scaling, *experts, taps=None):
        return moe_ffn(moe, device.sequences // ranks, x, logits, bias, *experts, axis=EXPERT,
                       tensor_axis=TENSOR, taps=taps, fp8=device.fp8, scaling=scaling,
                       average=device.spans)  # fmt: skip

    return local


def _stack(v, axes):
    """A device's value as its block of a global stacked over `axes` (leading dims of 1)."""
    missing = tuple(a for a in axes if a not in jax.typeof(v).manual_axis_type.varying)
    if missing:
        v = jax.lax.pcast(v, missing, to="varying")
    return v.reshape((1,) * len(axes) + v.shape)


def _unstack(v, axes):
    return v.reshape(v.shape[len(axes) :])


def _tap_axes(axes) -> tuple[str, ...]:
    """The axes the experts' grouped GEMMs' values vary over, of the map's: their taps and
    recorded rows are stacked over these."""
    return tuple(a for a in axes if a in (EXPERT, TENSOR))


def _differentiable(moe, device, bias, axes):
    """The device's layer as a function of what has a gradient: ((y, aux), (shares, the
    tapped GEMMs' rows and group sizes, stacked over `axes`))."""
    local = _on_device(moe, device)
    stacked = _tap_axes(axes)

    def fn(x, logits, taps, scaling, *experts):
        device_taps = {name: _unstack(t, stacked) for name, t in taps.items()}
        y, aux, shares, recorded = local(x, logits, bias, scaling, *experts, taps=device_taps)
        kept = jax.tree.map(lambda v: _stack(v, stacked), recorded)
        return (y, aux), (shares, kept)

    return fn


def _forward(moe, device, x, logits, bias, scaling, *experts):
    gated = len(experts) - 2
    local = _on_device(moe, device)
    mapped = _nested_map(local, _in_specs(gated), (ROWS, P(), P()))
    return mapped(x, logits, bias, scaling, *experts)


exchanged = jax.custom_vjp(_forward, nondiff_argnums=(0, 1))
"""`jaxmeg.models.moe.moe_ffn` with the experts split over `expert` (a `moe.Dispatch`)."""


def _varies(x, axes) -> tuple[str, ...]:
    return tuple(a for a in axes if a in jax.typeof(x).manual_axis_type.varying)


def _forward_keeping(moe, device, axes) -> Callable:
    """The device's forward and its pullback: ((y, aux, shares, recorded), pullback)."""

    def local(x, logits, bias, taps, scaling, *experts):
        fn = _differentiable(moe, device, bias, axes)
        (y, aux), pullback, (shares, kept) = jax.vjp(
            fn, x, logits, taps, scaling, *experts, has_aux=True
        )
        return (y, aux, shares, kept), pullback

    return local


def _tapped_specs(taps: dict, axes) -> tuple[dict, dict]:
    """(the taps' in_specs, the recorded rows' and sizes' out_specs): stacked over `axes`."""
    stacked = P(*_tap_axes(axes))
    return (
        {name: stacked for name in taps},
        {name: {"device_rows": stacked, "device_sizes": stacked} for name in taps},
    )


def _residual_axes(local, specs, out_specs, args, axes) -> list[tuple[str, ...]]:
    """The axes each residual of the device's pullback varies over (flattened order), read
    from a trace of the map."""
    seen = []

    def probe(*a):
        out, pullback = local(*a)
        seen.extend(_varies(r, axes) for r in jax.tree.leaves(pullback))
        return out

    mapped = jax.shard_map(probe, in_specs=specs, out_specs=out_specs, axis_names=set(axes))
    jax.eval_shape(mapped, *args)
    return seen


def _encode(kinds, axes) -> tuple:
    """Each residual's axes as an empty tree a custom VJP can keep: a tuple of Nones whose
    length is the bit mask of `axes` it varies over."""
    return tuple((None,) * sum(1 << axes.index(a) for a in kind) for kind in kinds)


def _decode(code, axes) -> list[tuple[str, ...]]:
    return [tuple(a for i, a in enumerate(axes) if len(c) >> i & 1) for c in code]


def kept_statistics(aux, shares):
    """The routing's statistics, named to be kept with the pullback: a layer's backward that
    recomputed them would run the bound's all-reduce (over expert x tensor) again, beside the
    transposed exchange and in no order that data fixes, so on CPU one device could enter the
    all-reduce while another of its group waits in the exchange."""
    return checkpoint_name((aux, shares), EXCHANGE_KEPT)


def _keeping_fwd(moe, device, x, logits, bias, taps, scaling, *experts):
    """The forward, keeping each device's pullback: its residuals leave the map stacked over
    the axes each varies over, their types unchanged (the backward's map takes them apart
    again); the backward reruns no forward where they are kept (the module docstring).
    ((y, aux, shares, recorded), residuals); `taps` and `recorded` as `exchanged_tapped`'s."""
    axes = _nested_axes()
    gates = len(experts) - 2
    local = _forward_keeping(moe, device, axes)
    args = (x, logits, bias, taps, scaling, *experts)
    d_bias = jax.lax.full_like(bias, 0)  # the bias only moves the top-k choice (see bwd)
    names = {name: None for name in taps}  # an empty tree: which taps, for the backward
    if not axes:  # the executor's map is manual over every axis the layer splits over
        (y, aux, shares, kept), pullback = local(*args)
        out = (y, *kept_statistics(aux, shares), kept)
        pullback = checkpoint_name(pullback, EXCHANGE_KEPT)
        return out, (d_bias, pullback, (), (None,) * gates, names)
    tap_specs, kept_specs = _tapped_specs(taps, axes)
    specs = (*_in_specs(gates)[:3], tap_specs, *_in_specs(gates)[3:])
    out_specs = (ROWS, P(), P(), kept_specs)
    kinds = _residual_axes(local, specs, out_specs, args, axes)
    tree = []

    def stacked(*a):
        out, pullback = local(*a)
        leaves, treedef = jax.tree.flatten(pullback)
        tree.append(treedef)
        return out, [r[None] if k else r for r, k in zip(leaves, kinds, strict=True)]

    mapped = jax.shard_map(
        stacked, in_specs=specs, out_specs=(out_specs, [P(k) if k else P() for k in kinds]),
        axis_names=set(axes),
    )  # fmt: skip
    (y, aux, shares, kept), leaves = mapped(*args)
    out = (y, *kept_statistics(aux, shares), kept)
    # named out here, where they are one device's blocks of the map's axes: a name inside the
    # map would make the layer's checkpoint stack them over the whole mesh (pipe included)
    pullback = jax.tree.unflatten(tree[0], checkpoint_name(leaves, EXCHANGE_KEPT))
    # the gates' count and the taps' names too as empty trees, for the backward's specs
    return out, (d_bias, pullback, _encode(kinds, axes), (None,) * gates, names)


def _keeping_bwd(saved, g_y, g_aux):
    """(d_x, d_logits, d_bias, d_taps, d_scaling, *d_experts) from `_keeping_fwd`'s
    residuals."""
    d_bias, pullback, code, gates, names = saved
    axes = _nested_axes()
    if not axes:
        d_x, d_logits, d_taps, *d_experts = pullback((g_y, g_aux))
        return (d_x, d_logits, d_bias, d_taps, *d_experts)
    kinds = _decode(code, axes)
    leaves, treedef = jax.tree.flatten(pullback)

    def local(leaves_, g_y_, g_aux_):
        leaves_ = [r[0] if k else r for r, k in zip(leaves_, kinds, strict=True)]
        return jax.tree.unflatten(treedef, leaves_)((g_y_, g_aux_))

    specs = _in_specs(len(gates))
    tap_specs, _ = _tapped_specs(names, axes)
    mapped = jax.shard_map(
        local, in_specs=([P(k) if k else P() for k in kinds], ROWS, P()),
        out_specs=(specs[0], specs[1], tap_specs, *specs[3:]), axis_names=set(axes),
    )  # fmt: skip
    d_x, d_logits, d_taps, *d_experts = mapped(leaves, g_y, g_aux)
    return (d_x, d_logits, d_bias, d_taps, *d_experts)


def _rerunning_fwd(moe, device, x, logits, bias, scaling, *experts):
    saved = (x, logits, bias, scaling, *experts)
    return _forward(moe, device, *saved), saved


def _rerunning_bwd(moe, device, args, g_y, g_aux):
    """The backward as a map of its own that reruns the device's forward under `jax.vjp`."""
    x, logits, bias, scaling, *experts = args
    forward = _forward_keeping(moe, device, _nested_axes())

    def local_vjp(x_, logits_, bias_, scaling_, *more):
        *experts_, g_y_, g_aux_ = more
        pullback = forward(x_, logits_, bias_, {}, scaling_, *experts_)[1]
        d_x, d_logits, _, *d_rest = pullback((g_y_, g_aux_))
        return (d_x, d_logits, *d_rest)

    specs = _in_specs(len(experts) - 2)
    grads = _nested_map(local_vjp, (*specs, ROWS, P()), (specs[0], specs[1], *specs[3:]))(
        x, logits, bias, scaling, *experts, g_y, g_aux
    )
    d_x, d_logits, *d_rest = grads  # d_rest: the scaling's, the experts'
    return (d_x, d_logits, jax.lax.full_like(bias, 0), *d_rest)


def _reruns(moe) -> bool:
    """Whether the backward reruns the forward: with a capacity factor in a pipeline (see the
    module docstring)."""
    return bool(moe.capacity_factor) and jax.sharding.get_abstract_mesh().shape.get("pipe", 1) > 1


def _exchanged_fwd(moe, device, x, logits, bias, scaling, *experts):
    """Keeps the pullback, but with a capacity factor in a pipeline, whose backward reruns the
    forward (see the module docstring)."""
    if _reruns(moe):
        return _rerunning_fwd(moe, device, x, logits, bias, scaling, *experts)
    (y, aux, shares, _), saved = _keeping_fwd(moe, device, x, logits, bias, {}, scaling,
                                              *experts)  # fmt: skip
    return (y, aux, shares), saved


def _exchanged_bwd(moe, device, saved, cotangents):
    g_y, g_aux, _ = cotangents  # the shares count choices: no gradient
    # the bias only moves the top-k choice: its gradient is 0 (`moe.into_backward` gives it
    # the loads, outside this function)
    if _reruns(moe):
        return _rerunning_bwd(moe, device, saved, g_y, g_aux)
    d_x, d_logits, d_bias, _, *d_rest = _keeping_bwd(saved, g_y, g_aux)
    return (d_x, d_logits, d_bias, *d_rest)  # d_rest: the scaling's, the experts'


exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)


def _tapped_forward(moe, device, x, logits, bias, taps, scaling, *experts):
    return _keeping_fwd(moe, device, x, logits, bias, taps, scaling, *experts)[0]


exchanged_tapped = jax.custom_vjp(_tapped_forward, nondiff_argnums=(0, 1))
"""`exchanged` (dropless) with zero taps added to the experts' grouped GEMMs' outputs (`taps`:
name -> [*axes, N, out], each device's block stacked over the map's axes): (y, aux, shares,
recorded), recorded: name -> {"device_rows", "device_sizes"} stacked alike, what W needs. Its
backward gives the taps' cotangents (the GEMMs' dY); a split backward holds the expert weights
and computes their gradients in W (`weight_gradient`)."""


def _tapped_fwd(moe, device, *args):
    return _keeping_fwd(moe, device, *args)


def _tapped_bwd(moe, device, saved, cotangents):
    g_y, g_aux, _, _ = cotangents
    return _keeping_bwd(saved, g_y, g_aux)


exchanged_tapped.defvjp(_tapped_fwd, _tapped_bwd)


def tap_shapes(moe, sequences, x, logits, bias, *experts) -> dict:
    """name -> the stacked shape of each grouped GEMM's output, for `exchanged_tapped`'s taps:
    [*axes, E_ranks T k, out] (the exchange's largest bound, `experts_ffn_exchanged`)."""
    del sequences, logits, bias
    axes = _nested_axes()
    ranks = jax.sharding.get_abstract_mesh().shape[EXPERT]

    def outputs(x_, *experts_):
        rows = ranks * x_.shape[0] * moe.top_k
        return {
            name: _stack(jnp.zeros((rows, w.shape[-1]), x_.dtype), _tap_axes(axes))
            for name, w in zip(("w_in", "w_out", "w_gate"), experts_, strict=False)
        }

    names = ("w_in", "w_out", "w_gate")[: len(experts)]
    stacked = P(*_tap_axes(axes))
    specs = (ROWS, *_in_specs(len(experts) - 2)[4:])
    mapped = _nested_map(outputs, specs, dict.fromkeys(names, stacked))
    return jax.eval_shape(mapped, x, *experts)


def weight_gradient(
    dy, recorded: dict, name: str, grouped_gradient: Callable | None = None, fp8: bool = False
):
    """The gradient of the expert weight `name` from `exchanged_tapped`'s recorded rows and
    group sizes and its tap's cotangent dy: each device's grouped X_e^T dY_e for its experts,
    in a map over the layer's axes ([E, h, f] or [E, f, h], split as the weight is), by
    `grouped_gradient` as the forward's grouped GEMM ran (`grouped_gemm.grouped_gemm`; None:
    `jax.lax.ragged_dot`'s transpose); with `fp8` (`model.fp8`) on FP8 operands scaled over
    the expert group and its tensor ranks, as the forward's (`grouped_gemm.fp8_grouped`), or
    with delayed scaling at the forward's scales, kept beside the rows ("fp8_scales")."""
    axes = _tap_axes(_nested_axes())
    scales = recorded.get(fp8_scaling.SOWN_SCALES)
    if fp8 and scales is None:
        grouped_gradient = fp8_weight_gradient((EXPERT, TENSOR))

    def local(rows, sizes, dy_, scales_):
        rows, sizes, dy_ = (_unstack(a, axes) for a in (rows, sizes, dy_))
        gradient = grouped_gradient
        if scales_ is not None:
            rows, dy_ = fp8_scaling.weight_gradient_operands(rows, dy_.astype(rows.dtype), scales_)
            gradient = None
        return grouped_weight_gradient(rows, sizes, dy_, gradient, name)

    stacked = P(*axes)
    spec = EXPERT_OUT if name == "w_out" else EXPERT_IN
    return _nested_map(local, (stacked, stacked, stacked, P()), spec)(
        recorded["device_rows"], recorded["device_sizes"], dy, scales
    )


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """The MoE layers' `dispatch` with an expert axis: `exchanged`, and for a split backward
    `exchanged_tapped` and `tap_shapes` (`jaxmeg.models.moe.MoeMlp`). `fp8` (`model.fp8`):
    the experts' grouped GEMMs run on FP8 operands (`moe.moe_ffn`)."""

    fp8: str = "none"

    def __call__(self, moe, sequences, x, logits, bias, *experts, scaling=None):
        device = OnDevice.here(sequences, self.fp8)
        return exchanged(moe, device, x, logits, bias, scaling or {}, *experts)

    def tapped(self, moe, sequences, x, logits, bias, taps, *experts, scaling=None):
        """Dropless only."""
        device = OnDevice.here(sequences, self.fp8)
        return exchanged_tapped(moe, device, x, logits, bias, taps, scaling or {}, *experts)

    tap_shapes = staticmethod(tap_shapes)

    @staticmethod
    def experts_here(experts: int) -> int:
        """How many of a layer's `experts` the weights it is given hold: a rank's own inside
        a map manual over `expert` (the executor's), else all of them."""
        mesh = jax.sharding.get_abstract_mesh()
        return experts // mesh.shape[EXPERT] if EXPERT in mesh.manual_axes else experts


def dispatch_for(mesh_shape, fp8: str = "none") -> Callable | None:
    """The MoE layers' dispatch on a mesh of `mesh_shape`: `exchanged` with an expert axis > 1,
    else None (the layer's own, every expert on every device)."""
    return ExpertDispatch(fp8) if mesh_shape.get(EXPERT, 1) > 1 else None
