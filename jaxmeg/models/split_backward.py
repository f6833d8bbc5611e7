"""A layer's backward split in two (zero-bubble pipelines, Qi et al. 2024): I, the cotangent of
the layer's input, and W, its weight gradients, which nothing downstream waits for.

Every weight matmul of the model adds a zero tap to its output and sows its input
(`gpt._weight_matmul`). One `jax.vjp` of the layer with respect to (the other parameters, the
input, the taps), the matmul weights held constant, gives I: the input cotangent, the gradients
of the norms and biases, and every matmul's output cotangent dY (the tap's), without one
weight-gradient matmul. W is then dW = X^T dY per weight from the sown inputs X. I + W run the
same matmuls as the whole backward (FLOPs 0.994x on gpt_tiny's layer: W's dW in place of the
transpose inside the backward), and the gradients are equal (tests/test_zero_bubble.py). A
split that differentiates twice (for the input, then for the parameters) would run the
backward's input chain twice: about 1.5x.

Between I and W a stage keeps X and dY of every weight matmul: 16 s b h elements per GPT layer
(QKV 1 + 3, attention out 1 + 1, fc1 1 + 4, fc2 4 + 1), h the hidden size.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import flax.traverse_util as traverse
import jax
import jax.numpy as jnp

from jaxmeg.models import fp8
from jaxmeg.models.gpt import MATMUL_INPUTS, TAPS
from jaxmeg.models.grouped_gemm import grouped_weight_gradient


def tapped(block: nn.Module) -> Callable:
    """layer(params, x, taps) -> (y, matmul inputs): the block with zero taps on its matmul
    outputs; `taps` and the inputs are nested like the params of the weights they belong to."""

    def layer(params, x, taps):
        (y, _), state = block.apply({"params": params, TAPS: taps}, x, mutable=[MATMUL_INPUTS])
        return y, state[MATMUL_INPUTS]

    return layer


def tap_shapes(block: nn.Module, params, x) -> dict:
    """The shapes of one layer's taps (a matmul output's each), for params and input x: a
    trace of the layer."""

    def created(p, x_):
        return block.apply({"params": p}, x_, mutable=[TAPS])[1][TAPS]

    return jax.eval_shape(created, params, x)


def zero_taps(block: nn.Module, params, x) -> dict:
    """Zero taps of one layer, for params and input x."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tap_shapes(block, params, x))


def split_weights(params, taps) -> tuple[dict, dict]:
    """(the matmul weights, the rest) of a params tree: a leaf is a weight when a tap sits at
    its path (leading stacking dims of either do not matter)."""
    tapped_paths = set(traverse.flatten_dict(taps))
    flat = traverse.flatten_dict(params)
    weights = {k: v for k, v in flat.items() if k in tapped_paths}
    rest = {k: v for k, v in flat.items() if k not in tapped_paths}
    return traverse.unflatten_dict(weights), traverse.unflatten_dict(rest)


def merge_weights(weights, rest) -> dict:
    """The params tree again from `split_weights`' two halves."""
    return traverse.unflatten_dict(
        {**traverse.flatten_dict(weights), **traverse.flatten_dict(rest)}
    )


def weight_gradients(
    inputs, cotangents, batch_dims: int = 2, lead: int = 0, exchanged: Callable | None = None,
    grouped_gradient: Callable | None = None, fp8_gemms: bool = False,
):  # fmt: skip
    """dW = X^T dY for every weight: the sown input X [*lead, b, s, ...in] and the tap's
    cotangent dY [*lead, b, s, ...out] contracted over their `batch_dims` leading dims after the
    `lead` stacking dims (a chunk's layers) -> [*lead, ...in, ...out], the weight's shape; a
    tuple of T cotangents (`parts.stacked_matmul`'s parts) gives T GEMMs stacked [..in, T, ..out]. A
    grouped GEMM's input (`moe.MoeMlp`: {"rows" [N, in], "sizes" [E]} sorted by expert, or
    {"rows" [E, N, in]} each expert's own) gives each expert's X_e^T dY_e, [E, in, out]; one
    of experts split over devices ({"device_rows", "device_sizes"}) is `exchanged(dy, input,
    name, grouped_gradient, fp8_gemms)`'s (`jaxmeg.parallel.experts.weight_gradient`).
    `grouped_gradient`: the ragged GEMM's weight gradient, as the forward ran it
    (`grouped_gemm.grouped_gemm(...).weight_gradient`, FP8 ones with `model.fp8`); None:
    `jax.lax.ragged_dot`'s transpose. `fp8_gemms`
    (`model.fp8`): a weight's dW reads X in E4M3 and dY in E5M2, as the whole backward's
    (`jaxmeg.models.fp8.einsum`); with delayed scaling X comes with the forward's scales
    ({"fp8_input", "fp8_scales"}, `jaxmeg.models.fp8.delayed_einsum`; a grouped GEMM's rows
    with "fp8_scales" beside them)."""

    def dense(dy, x):
        if isinstance(dy, tuple):  # `parts.stacked_matmul`'s parts: [..in, T, ..out]
            return jnp.stack([one_gemm(part, x) for part in dy], axis=x.ndim - batch_dims)
        return one_gemm(dy, x)

    def one_gemm(dy, x):
        if isinstance(x, dict):  # delayed FP8 scaling: at the scales the forward used
            x, dy = fp8.weight_gradient_operands(x[fp8.SOWN_INPUT], dy, x[fp8.SOWN_SCALES])
        elif fp8_gemms:
            x, dy = fp8.weight_gradient_operands(x, dy)
        contract = list(range(batch_dims))
        return jnp.tensordot(x, dy, axes=(contract, contract))

    def grouped(dy, x, name):
        if "device_rows" in x:
            return exchanged(dy, x, name, grouped_gradient, fp8_gemms)
        rows, dy, gradient = x["rows"], dy.astype(x["rows"].dtype), grouped_gradient
        if fp8.SOWN_SCALES in x:  # delayed FP8 scaling: at the scales the forward used
            rows, dy = fp8.weight_gradient_operands(rows, dy, x[fp8.SOWN_SCALES])
            gradient = None
        elif fp8_gemms and "sizes" not in x:
            rows, dy = fp8.weight_gradient_operands(rows, dy)
        if "sizes" not in x:  # a capacity factor's batched GEMM, in FP8 as its forward's
            return jnp.einsum("eni,eno->eio", rows, dy)
        return grouped_weight_gradient(rows, x["sizes"], dy, gradient, name)

    for _ in range(lead):
        dense, grouped = jax.vmap(dense), _one_by_one(grouped)

    def one(path, dy, x):
        if isinstance(x, dict) and fp8.SOWN_INPUT not in x:
            return grouped(dy, x, path[-1].key)
        return dense(dy, x)

    parted = lambda t: isinstance(t, tuple)  # noqa: E731
    return jax.tree_util.tree_map_with_path(one, cotangents, inputs, is_leaf=parted)


def _one_by_one(fn: Callable) -> Callable:
    """fn(*arrays, name) over the arrays' leading dim by `lax.map`: jax batches no transposed
    `ragged_dot`."""
    return lambda dy, x, name: jax.lax.map(lambda a: fn(*a, name), (dy, x))
