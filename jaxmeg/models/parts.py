"""The pieces the dense and the mixture-of-experts layers share: parameters with logical axes,
the activation hook (`Constrain`), and the weight matmul that the split backward taps
(`jaxmeg.models.split_backward`), with the dense MLP built from them."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmeg import ordering
from jaxmeg.config import ModelConfig
from jaxmeg.models import fp8

Array = jax.Array
Constrain = Callable[[Array, tuple], Array]


def no_constraint(x: Array, logical_axes: tuple) -> Array:
    del logical_axes
    return x


RESIDUAL_AXES = ("act_rows", "act_seq", "act_embed")
"""Between the layer's parts: with sequence parallelism split over `tensor` on its rows
(`act_rows`, the batch dim) where t divides them, else on `act_seq` (`rules.activation_rules`);
over `context` on `act_seq` with context parallelism. Inside attention and the MLP the batch
dim is `act_batch` and the sequence dim `act_tokens`, whole but for context parallelism."""


def dtype_of(name: str) -> Any:
    return jnp.dtype(name)


def param(module: nn.Module, name: str, shape: tuple, axes: tuple, init: Callable) -> Array:
    dtype = dtype_of(module.cfg.param_dtype)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def normal(std: float) -> Callable:
    return nn.initializers.normal(stddev=std)


MATMUL_INPUTS = "matmul_inputs"
TAPS = "perturbations"
"""Collections of the split backward (`jaxmeg.models.split_backward`): every weight matmul adds
a zero tap to its output (`nn.Module.perturb`, named like its weight), whose cotangent is the
output's, and sows its input; both are no-ops unless a caller asks for them."""


def weight_matmul(
    module: nn.Module, name: str, spec: str, x: Array, w: Array, residual: str = ""
) -> Array:
    """einsum(spec, x, w) for the weight `name` of `module`, tapped and its input sown. What is
    kept for W is split like the residual stream (over `tensor` on the sequence with sequence
    parallelism): the input where `residual` is "input" (a column-parallel matmul's, gathered
    for the matmul), the output's cotangent where it is "output" (a row-parallel matmul's,
    reduce-scattered right after it, and only when tapped)."""
    scales = counts = None
    if module.cfg.fp8 == "delayed":
        scales, counts = delayed_scaling(module, name)
    sow_input(module, name, x, residual, scales)
    if scales is not None:
        y = fp8.delayed_einsum(spec, x, w, scales, counts, _fp8_layouts(module, residual))
    elif module.cfg.fp8 == "current":
        y = fp8.einsum(spec, x, w, _fp8_layouts(module, residual))
    else:
        y = jnp.einsum(spec, x, w)
    if residual == "output" and module.has_variable(TAPS, name):
        y = module.constrain(y, RESIDUAL_AXES)
    return module.perturb(name, y, collection=TAPS)


def sow_input(
    module: nn.Module, name: str, x: Array, residual: str, scales: Array | None = None
) -> None:
    """Sows the input x of the weight `name`'s matmul for W (`MATMUL_INPUTS`; `weight_matmul`
    says how it is split), with the delayed FP8 `scales` the forward rounded it at."""
    kept = module.constrain(x, RESIDUAL_AXES) if residual == "input" else x
    if scales is not None:
        kept = {fp8.SOWN_INPUT: kept, fp8.SOWN_SCALES: scales}  # W rounds as the forward did
    module.sow(MATMUL_INPUTS, name, kept, init_fn=lambda: None, reduce_fn=lambda _, new: new)


STACKED_PARTS = "stacked_matmul_parts"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of `stacked_matmul`'s outputs, which the
checkpoint policies that keep matmul outputs keep after the bias, not the GEMM's own output."""


def keeping_stacked_parts(policy: Callable) -> Callable:
    """Checkpoint `policy`, and q, k, v kept after their biases (`STACKED_PARTS`): their GEMMs'
    outputs are then read by nothing in the backward."""
    names = jax.checkpoint_policies.save_only_these_names(STACKED_PARTS)
    return jax.checkpoint_policies.save_from_both_policies(policy, names)


def splits_backward(module: nn.Module, name: str) -> bool:
    """Whether the weight `name`'s matmul runs for a split backward (its tap asked for or being
    made, `jaxmeg.models.split_backward`)."""
    return module.is_mutable_collection(TAPS) or module.has_variable(TAPS, name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(x: Array, n: int) -> tuple[Array, ...]:
    """n uses of x, whose cotangents the backward sums as ct_0 + (ct_1 + (... + ct_n-1)): where
    each use is a GEMM, every add's first operand is a GEMM's own output, the form in which XLA's
    GPU GEMM rewriter folds the add into that GEMM (cuBLAS beta 1). jax sums a value's
    cotangents as (ct_0 + ct_1) + ct_2: the first add folds, and the second's first operand is
    then a GEMM that already adds, which the rewriter does not fold again, so it ran as an
    elementwise kernel (q, k and v's input gradients: one read of two and a write of x's size
    per layer and microbatch)."""
    return (x,) * n


def _fan_out_fwd(x: Array, n: int):
    return (x,) * n, None


def _fan_out_bwd(n: int, _, cotangents):
    total = cotangents[-1]
    for ct in cotangents[-2::-1]:
        total = ct + total
    return (total,)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def stacked_matmul(
    module: nn.Module,
    name: str,
    x_BxSxD: Array,
    w: Array,
    bias: Array | None = None,
    residual: str = "",
    per_part: bool = True,
    axes: tuple = ("act_batch", "act_tokens", "act_heads", None),
) -> list[Array]:
    """x [B, S, D] times each part of `w` [D, T, *out] (the fused q/k/v of `w_qkv`, or k/v of
    `w_kv`), plus its part of `bias` [T, *out]: T arrays [B, S, *out], each its own GEMM with
    its bias in the GEMM's epilogue (cuBLASLt adds a vector bias to a 2-D output), so each comes
    out contiguous and its cotangent goes straight into its own GEMM. One GEMM whose output is
    sliced copies every part out of it and its backward copies the parts' cotangents back into
    one (on an H100, 1.5% of a gpt_1.3b step). For a split backward the parts' outputs share
    one tap (a tuple of T, `split_backward.weight_gradients` stacks their X^T dY) and x is sown
    once. FP8 keeps the one GEMM (`weight_matmul`), and so does `per_part` False: XLA:CPU
    reduces each part's input gradient over `tensor` by itself (three all-reduces where one
    did), and its attention einsums read the slices in place. `axes`: each part's logical axes
    (the joined output's has the stacked axis, unsplit, after its first two)."""
    out = "nhijk"[: w.ndim - 2]
    if not per_part or module.cfg.fp8 != "none":
        y = weight_matmul(module, name, f"bsd,dt{out}->bst{out}", x_BxSxD, w, residual)
        if bias is not None:
            y = y + bias
        y = module.constrain(y, (*axes[:2], None, *axes[2:]))
        return [jax.lax.index_in_dim(y, i, 2, keepdims=False) for i in range(w.shape[1])]
    ys = []
    # split, not sliced: its transpose joins the parts' dW by a concatenate, whose slices XLA
    # sees through (a slice's transpose pads and adds), so that a per-part gradient
    # accumulator (`jaxmeg.pipeline.accumulator.Parts`) adds each GEMM's own output
    uses = fan_out(x_BxSxD, w.shape[1])  # their input gradients summed in the GEMMs
    for x_i, w_i in zip(uses, jax.lax.split(w, [1] * w.shape[1], axis=1), strict=True):
        ys.append(jnp.einsum("bsd,df->bsf", x_i, w_i.reshape(w.shape[0], -1)))
    if splits_backward(module, name):
        sow_input(module, name, x_BxSxD, residual)
        shaped = tuple(y.reshape(*y.shape[:2], *w.shape[2:]) for y in ys)  # as W's parts
        ys = [y.reshape(*y.shape[:2], -1) for y in module.perturb(name, shaped, collection=TAPS)]
    parts = []
    for i, y in enumerate(ys):
        if bias is not None:
            y = y + bias[i].reshape(-1)
        # kept for the backward after its bias (the GEMM's only reader is then its epilogue)
        y = checkpoint_name(y.reshape(*y.shape[:2], *w.shape[2:]), STACKED_PARTS)
        parts.append(module.constrain(y, axes))
    return parts


GATHERED_AXES = ("act_batch", "act_tokens", "act_embed")
"""The residual stream as a column-parallel linear reads it and a row-parallel one writes it
(whole on the sequence but for context parallelism)."""


def _fp8_layouts(module: nn.Module, residual: str) -> fp8.Layouts:
    """A linear's FP8 operand layouts (`fp8.Layouts`): with sequence parallelism the input of a
    column-parallel linear (`residual` "input") and the output cotangent of a row-parallel one
    ("output") are put into FP8 split over `tensor` (`RESIDUAL_AXES`) and gathered as FP8."""
    split = lambda t: module.constrain(t, RESIDUAL_AXES)  # noqa: E731
    whole = lambda t: module.constrain(t, GATHERED_AXES)  # noqa: E731
    if residual == "input":
        return fp8.Layouts(x_split=split, x_whole=whole)
    if residual == "output":
        return fp8.Layouts(dy_split=split, dy_whole=whole)
    return fp8.SAME


def delayed_scaling(module: nn.Module, name: str) -> tuple[Array, Array]:
    """(the scales [3] from the linear's amax history, its seen-amax leaf): `model.fp8:
    delayed`'s two leaves beside the weight `name` (`jaxmeg.models.fp8`)."""
    cfg = module.cfg
    state = nn.with_logical_partitioning(nn.initializers.zeros, (None, None))
    operands = len(fp8.FORMATS)
    history = module.param(name + fp8.HISTORY, state, (operands, cfg.fp8_history), jnp.float32)
    counts = module.param(name + fp8.SEEN, state, (operands, fp8.BINS), jnp.float32)
    return fp8.delayed_scales(history, cfg.fp8_margin), counts


class Mlp(nn.Module):
    """GeLU MLP (gpt) or SwiGLU (llama): fc1 column-parallel over `mlp`, fc2 row-parallel.
    `width` 0 is the model's MLP width; a mixture-of-experts layer's shared experts give theirs."""

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    width: int = 0

    @nn.compact
    def __call__(self, x_BxSxD: Array) -> Array:
        cfg = self.cfg
        d, f = cfg.hidden, self.width or cfg.mlp_hidden
        compute = dtype_of(cfg.compute_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        w_in = param(self, "w_in", (d, f), ("embed", "mlp"), normal(cfg.init_std))
        w_out = param(self, "w_out", (f, d), ("mlp", "embed"), normal(out_std))
        u_BxSxF = weight_matmul(self, "w_in", "bsd,df->bsf", x_BxSxD, w_in.astype(compute), "input")
        if cfg.block == "gpt":
            b_in = param(self, "b_in", (f,), ("mlp",), nn.initializers.zeros)
            u_BxSxF = jax.nn.gelu(u_BxSxF + b_in.astype(compute), approximate=True)
        else:
            w_gate = param(self, "w_gate", (d, f), ("embed", "mlp"), normal(cfg.init_std))
            gate_BxSxF = weight_matmul(
                self, "w_gate", "bsd,df->bsf", x_BxSxD, w_gate.astype(compute), "input"
            )
            u_BxSxF = jax.nn.silu(gate_BxSxF) * u_BxSxF
        u_BxSxF = self.constrain(u_BxSxF, ("act_batch", "act_tokens", "act_mlp"))
        y_BxSxD = weight_matmul(
            self, "w_out", "bsf,fd->bsd", u_BxSxF, w_out.astype(compute), "output"
        )
        if cfg.block == "gpt":
            b_out = param(self, "b_out", (d,), ("embed",), nn.initializers.zeros)
            y_BxSxD = y_BxSxD + b_out.astype(compute)
        return y_BxSxD


@jax.custom_vjp
def lookup(table_VxD: Array, ids: Array) -> Array:
    """Rows `ids` of the table (`jnp.take`), whose backward moves the ids only once their
    cotangent exists: a split table's gradient gathers the ids from the devices that share it,
    and that collective, free to run at any time of a backward, could meet another device's
    in another order (a stage slot's expert exchange)."""
    return jnp.take(table_VxD, ids, axis=0)


def _lookup_fwd(table_VxD, ids):
    return jnp.take(table_VxD, ids, axis=0), (table_VxD, ids)


def _lookup_bwd(residuals, g):
    table_VxD, ids = residuals
    # the ids read after their cotangent: one word of each row's cotangent [b, s] (split as
    # the ids are), so whatever collective moves them runs after the backward that made g
    ids = ids + ordering.zeros_from(g[..., 0]).astype(ids.dtype)
    return jnp.zeros_like(table_VxD).at[ids].add(g.astype(table_VxD.dtype)), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)
