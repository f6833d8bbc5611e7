"""Expert parallelism: a MoE layer's experts split over the mesh's `expert` axis
(`parallel.expert`), run under a map manual over the axes the executor leaves automatic
(context, expert, tensor), as `jaxmeg.parallel.attention` runs cuDNN. Each device routes its
own rows, sends every choice to its expert's device and gets the output back by all-to-all
(`jaxmeg.models.moe.experts_ffn_exchanged`); the experts' width is split over `tensor`.

`exchanged` is the layer's `dispatch` (`jaxmeg.models.moe.MoeMlp`), given the router's logits
(computed outside the map). Its backward is a map of its own that reruns the device's forward
under `jax.vjp` (a custom VJP): jax 0.10 cannot keep a nested map's residuals across the
pipeline's checkpointed layers (it stacks them over the whole mesh, pipe included, and the
step fails to lower: "manual axis expert after free axis pipe"), so the forward keeps none.
For the same reason the map holds no `dot_general`, which a layer's checkpoint policy would
keep as such a residual: the router's matmul stays outside. The cost: the backward repeats the
forward's dispatch (two more all-to-alls and the experts' forward GEMMs per layer and
microbatch).

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


def _nested_map(fn: Callable, in_specs: tuple, out_specs) -> Callable:
    axes = automatic_axes_here(("context", EXPERT, TENSOR))
    if not axes:  # inside a map over every axis (`gradients.map_axes`): already per device
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=axes)


def _in_specs(gated: int) -> tuple:
    """x, logits, bias, w_in, w_out(, w_gate)."""
    return (ROWS, ROWS, P(), EXPERT_IN, EXPERT_OUT, *([EXPERT_IN] * gated))


def _on_device(moe, sequences: int) -> Callable:
    ranks = jax.sharding.get_abstract_mesh().shape[EXPERT]

    def local(x, logits, bias, *experts):
        return moe_ffn(moe, sequences // ranks, x, logits, bias, *experts, axis=EXPERT,
                       tensor_axis=TENSOR)  # fmt: skip

    return local


def _forward(moe, sequences, x, logits, bias, *experts):
    gated = len(experts) - 2
    local = _on_device(moe, sequences)
    return _nested_map(local, _in_specs(gated), (ROWS, P(), P()))(x, logits, bias, *experts)


exchanged = jax.custom_vjp(_forward, nondiff_argnums=(0, 1))
"""`jaxmeg.models.moe.moe_ffn` with the experts split over `expert` (a `moe.Dispatch`)."""


def _exchanged_fwd(moe, sequences, x, logits, bias, *experts):
    return _forward(moe, sequences, x, logits, bias, *experts), (x, logits, bias, *experts)


def _exchanged_bwd(moe, sequences, args, cotangents):
    g_y, g_aux, _ = cotangents  # the shares count choices: no gradient
    x, logits, bias, *experts = args
    local = _on_device(moe, sequences)

    def local_vjp(x_, logits_, bias_, *more):
        *experts_, g_y_, g_aux_ = more

        def differentiable(a, scores, *weights):
            y, aux, _ = local(a, scores, bias_, *weights)
            return y, aux

        pullback = jax.vjp(differentiable, x_, logits_, *experts_)[1]
        return pullback((g_y_, g_aux_))

    specs = _in_specs(len(experts) - 2)
    grads = _nested_map(local_vjp, (*specs, ROWS, P()), (specs[0], specs[1], *specs[3:]))(
        x, logits, bias, *experts, g_y, g_aux
    )
    d_x, d_logits, *d_experts = grads
    # the bias only moves the top-k choice: its gradient is 0 (`moe.into_backward` gives it
    # the loads, outside this function)
    return (d_x, d_logits, jax.lax.full_like(bias, 0), *d_experts)


exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)


def dispatch_for(mesh_shape) -> Callable | None:
    """The MoE layers' dispatch on a mesh of `mesh_shape`: `exchanged` with an expert axis > 1,
    else None (the layer's own, every expert on every device)."""
    return exchanged if mesh_shape.get(EXPERT, 1) > 1 else None
