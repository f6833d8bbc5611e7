"""Expert parallelism: a MoE layer's experts split over the mesh's `expert` axis
(`parallel.expert`), run under a map manual over the axes the executor leaves automatic
(context, expert, tensor), as `jaxmeg.parallel.attention` runs cuDNN. Each device routes its
own rows, sends every choice to its expert's device and gets the output back by all-to-all
(`jaxmeg.models.moe.experts_ffn_exchanged`); the experts' width is split over `tensor`.

`exchanged` is the layer's `dispatch` (`jaxmeg.models.moe.MoeMlp`), given the router's logits
(computed outside the map), with a custom VJP. Dropless, its forward keeps each device's
pullback: `jax.vjp` inside the map, its residuals returned stacked over the map's axes that
each varies over (their types unchanged, so the backward's map takes them apart and runs the
pullback as is). Left to jax, a nested map's residuals inside the pipeline's checkpointed layers
are stacked over the whole mesh, pipe included, and the step fails to lower ("manual axis
expert after free axis pipe"). With the whole model in one computation (p v = 1) the backward
then runs only the transposed exchange. In a pipeline's slots the layer's checkpoint policy
(matmul outputs) does not keep these residuals, so the B slot reruns the forward: keeping them
by name as well hung (expert 4, pipe 2) on CPU in 2 of 3 runs (XLA:CPU ran F's send and B's
all-to-all in different orders on different devices). With a capacity factor the lowering
failure comes back on some meshes (data 1 x pipe 2), so there the forward keeps nothing and the
backward always reruns it: two more all-to-alls and the experts' forward GEMMs per layer and
microbatch. The map holds no `dot_general` that a layer's checkpoint policy would keep: the
router's matmul stays outside.

Dropless at fixed shapes: each (sender, receiver) block of the all-to-all holds all T k of the
sender's choices, of which the first `count` are real, so the bytes on the wire are E_ranks
times those of the routed tokens (`experts_ffn_exchanged`). XLA's CPU backend has no ragged
all-to-all, which would send only the real rows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxmeg.models.moe import moe_ffn
from jaxmeg.parallel.mesh import automatic_axes_here

EXPERT, TENSOR = "expert", "tensor"
ROWS = P(EXPERT)
EXPERT_IN, EXPERT_OUT = P(EXPERT, None, TENSOR), P(EXPERT, TENSOR, None)
"""w_in / w_gate [E, h, f] and w_out [E, f, h]: experts over `expert`, width over `tensor`."""


def _nested_axes() -> tuple[str, ...]:
    """The axes the layer's map is manual over: what the executor's map left automatic."""
    return tuple(sorted(automatic_axes_here(("context", EXPERT, TENSOR))))


def _nested_map(fn: Callable, in_specs: tuple, out_specs) -> Callable:
    axes = _nested_axes()
    if not axes:  # inside a map over every axis (`gradients.map_axes`): already per device
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes))


def _in_specs(gated: int) -> tuple:
    """x, logits, bias, w_in, w_out(, w_gate)."""
    return (ROWS, ROWS, P(), EXPERT_IN, EXPERT_OUT, *([EXPERT_IN] * gated))


def _on_device(moe, sequences: int) -> Callable:
    ranks = jax.sharding.get_abstract_mesh().shape[EXPERT]

    def local(x, logits, bias, *experts):
        return moe_ffn(moe, sequences // ranks, x, logits, bias, *experts, axis=EXPERT,
                       tensor_axis=TENSOR)  # fmt: skip

    return local


def _differentiable(moe, sequences, bias):
    """The device's layer as a function of what has a gradient: ((y, aux), shares)."""
    local = _on_device(moe, sequences)

    def fn(x, logits, *experts):
        y, aux, shares = local(x, logits, bias, *experts)
        return (y, aux), shares

    return fn


def _forward(moe, sequences, x, logits, bias, *experts):
    gated = len(experts) - 2
    local = _on_device(moe, sequences)
    return _nested_map(local, _in_specs(gated), (ROWS, P(), P()))(x, logits, bias, *experts)


exchanged = jax.custom_vjp(_forward, nondiff_argnums=(0, 1))
"""`jaxmeg.models.moe.moe_ffn` with the experts split over `expert` (a `moe.Dispatch`)."""


def _varies(x, axes) -> tuple[str, ...]:
    return tuple(a for a in axes if a in jax.typeof(x).manual_axis_type.varying)


def _forward_keeping(moe, sequences) -> Callable:
    """The device's forward and its pullback: ((y, aux, shares), pullback)."""

    def local(x, logits, bias, *experts):
        fn = _differentiable(moe, sequences, bias)
        (y, aux), pullback, shares = jax.vjp(fn, x, logits, *experts, has_aux=True)
        return (y, aux, shares), pullback

    return local


def _residual_axes(local, specs, args, axes) -> list[tuple[str, ...]]:
    """The axes each residual of the device's pullback varies over (flattened order), read
    from a trace of the map."""
    seen = []

    def probe(*a):
        out, pullback = local(*a)
        seen.extend(_varies(r, axes) for r in jax.tree.leaves(pullback))
        return out

    mapped = jax.shard_map(probe, in_specs=specs, out_specs=(ROWS, P(), P()), axis_names=set(axes))
    jax.eval_shape(mapped, *args)
    return seen


def _encode(kinds, axes) -> tuple:
    """Each residual's axes as an empty tree a custom VJP can keep: a tuple of Nones whose
    length is the bit mask of `axes` it varies over."""
    return tuple((None,) * sum(1 << axes.index(a) for a in kind) for kind in kinds)


def _decode(code, axes) -> list[tuple[str, ...]]:
    return [tuple(a for i, a in enumerate(axes) if len(c) >> i & 1) for c in code]


def _keeping_fwd(moe, sequences, x, logits, bias, *experts):
    """The forward, keeping each device's pullback: its residuals leave the map stacked over
    the axes each varies over, their types unchanged (the backward's map takes them apart
    again); the backward reruns no forward where they are kept (the module docstring)."""
    axes = _nested_axes()
    gates = len(experts) - 2
    local = _forward_keeping(moe, sequences)
    args = (x, logits, bias, *experts)
    d_bias = jax.lax.full_like(bias, 0)  # the bias only moves the top-k choice (see bwd)
    if not axes:
        out, pullback = local(*args)
        return out, (d_bias, pullback, (), (None,) * gates)
    specs = _in_specs(gates)
    kinds = _residual_axes(local, specs, args, axes)
    tree = []

    def stacked(*a):
        out, pullback = local(*a)
        leaves, treedef = jax.tree.flatten(pullback)
        tree.append(treedef)
        return out, [r[None] if k else r for r, k in zip(leaves, kinds, strict=True)]

    mapped = jax.shard_map(
        stacked, in_specs=specs, out_specs=((ROWS, P(), P()), [P(k) if k else P() for k in kinds]),
        axis_names=set(axes),
    )  # fmt: skip
    out, leaves = mapped(*args)
    pullback = jax.tree.unflatten(tree[0], leaves)
    # the gates' count too as an empty tree, for the backward's specs
    return out, (d_bias, pullback, _encode(kinds, axes), (None,) * gates)


def _keeping_bwd(saved, g_y, g_aux):
    d_bias, pullback, code, gates = saved
    axes = _nested_axes()
    if not axes:
        d_x, d_logits, *d_experts = pullback((g_y, g_aux))
        return (d_x, d_logits, d_bias, *d_experts)
    kinds = _decode(code, axes)
    leaves, treedef = jax.tree.flatten(pullback)

    def local(leaves_, g_y_, g_aux_):
        leaves_ = [r[0] if k else r for r, k in zip(leaves_, kinds, strict=True)]
        return jax.tree.unflatten(treedef, leaves_)((g_y_, g_aux_))

    specs = _in_specs(len(gates))
    mapped = jax.shard_map(
        local, in_specs=([P(k) if k else P() for k in kinds], ROWS, P()),
        out_specs=(specs[0], specs[1], *specs[3:]), axis_names=set(axes),
    )  # fmt: skip
    d_x, d_logits, *d_experts = mapped(leaves, g_y, g_aux)
    return (d_x, d_logits, d_bias, *d_experts)


def _rerunning_fwd(moe, sequences, x, logits, bias, *experts):
    return _forward(moe, sequences, x, logits, bias, *experts), (x, logits, bias, *experts)


def _rerunning_bwd(moe, sequences, args, g_y, g_aux):
    """The backward as a map of its own that reruns the device's forward under `jax.vjp`."""
    x, logits, bias, *experts = args
    forward = _forward_keeping(moe, sequences)

    def local_vjp(x_, logits_, bias_, *more):
        *experts_, g_y_, g_aux_ = more
        return forward(x_, logits_, bias_, *experts_)[1]((g_y_, g_aux_))

    specs = _in_specs(len(experts) - 2)
    grads = _nested_map(local_vjp, (*specs, ROWS, P()), (specs[0], specs[1], *specs[3:]))(
        x, logits, bias, *experts, g_y, g_aux
    )
    d_x, d_logits, *d_experts = grads
    return (d_x, d_logits, jax.lax.full_like(bias, 0), *d_experts)


def _exchanged_fwd(moe, sequences, *args):
    """Dropless (the default) keeps the pullback; with a capacity factor the backward reruns
    the forward (see the module docstring)."""
    if moe.capacity_factor:
        return _rerunning_fwd(moe, sequences, *args)
    return _keeping_fwd(moe, sequences, *args)


def _exchanged_bwd(moe, sequences, saved, cotangents):
    g_y, g_aux, _ = cotangents  # the shares count choices: no gradient
    # the bias only moves the top-k choice: its gradient is 0 (`moe.into_backward` gives it
    # the loads, outside this function)
    if moe.capacity_factor:
        return _rerunning_bwd(moe, sequences, saved, g_y, g_aux)
    return _keeping_bwd(saved, g_y, g_aux)


exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)


def dispatch_for(mesh_shape) -> Callable | None:
    """The MoE layers' dispatch on a mesh of `mesh_shape`: `exchanged` with an expert axis > 1,
    else None (the layer's own, every expert on every device)."""
    return exchanged if mesh_shape.get(EXPERT, 1) > 1 else None
