"""The experts' grouped GEMMs: each group of rows (sorted by expert) times its expert's weight,
and the weights' gradients from the rows and the output cotangents (`moe.grouped_gemm`).

  ragged   `jax.lax.ragged_dot`, which XLA's GPU compiler makes one dense GEMM over every expert
           (docs/benchmarks.md)
  blocked  `blocked_ragged_dot`: a loop of dense GEMMs over blocks of each expert's rows
  pallas   `kernel_ragged_dot`: kernels of our own that run only each group's rows
           (`jaxmeg.models.grouped_kernels`)

With no group sizes, a batched GEMM of each expert's own rows (a capacity factor's buffers).
With `model.fp8` the ragged (and batched) GEMMs run on FP8 operands, one scale per operand over
all experts: at current scales (`fp8_grouped`) or at the expert weight's delayed ones
(`delayed_grouped` where jax differentiates the GEMM, `DelayedGemms` in a backward written out).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmeg.config import MoeConfig
from jaxmeg.models import fp8, grouped_kernels

GroupedMatmul = Callable[[str, jax.Array, jax.Array, "jax.Array | None"], jax.Array]
"""gmm(name, rows, w [E, in, out], sizes) -> the grouped GEMM of the expert weight `name`:
rows [N, in] sorted by expert with `sizes` [E] rows each -> [N, out], or with sizes None each
expert's own rows [E, N, in] -> [E, N, out] (`ragged_matmul`, or the layer's tapped one for a
split backward)."""


def ragged_matmul(name: str, rows: jax.Array, w: jax.Array, sizes: jax.Array | None) -> jax.Array:
    """Each group of `rows` (sorted by group, `sizes` [E] rows each; rows past the groups give
    zeros) times its expert's weight: `jax.lax.ragged_dot`; with sizes None, a batched GEMM
    of each expert's [N, in] rows."""
    del name
    if sizes is None:
        return jnp.einsum("eni,eio->eno", rows, w.astype(rows.dtype))
    return jax.lax.ragged_dot(rows, w.astype(rows.dtype), sizes)


def fp8_grouped(axes: tuple[str, ...] = ()) -> GroupedMatmul:
    """`ragged_matmul` on FP8 operands with current scales (`model.fp8`): one scale per operand
    over all experts (`fp8.ragged_dot`, and `fp8.einsum` for a capacity factor's batched
    GEMMs), so each of the three GEMMs is one cuBLASLt FP8 GEMM on the H100 target (a dropless
    layer's the dense GEMM over every expert a `ragged_dot` becomes there). Inside a map over
    `axes` (the experts split over `expert`, their width over `tensor`) each amax is reduced
    over them, so every device scales by the whole tensor's, as one device would."""
    layouts = fp8.SAME if not axes else fp8.Layouts(amax=_amax_over(axes))

    def gmm(name: str, rows: jax.Array, w: jax.Array, sizes: jax.Array | None) -> jax.Array:
        del name
        if sizes is None:
            return fp8.einsum("eni,eio->eno", rows, w.astype(rows.dtype), layouts)
        # its output a kernel's own: XLA would fuse a GELU that follows into the cuBLASLt
        # GEMM, and where the pre-activation is kept too (the exchange's backward keeps it)
        # with an aux output, which XLA 0.10.2's FP8 GEMM thunk refuses (a RET_CHECK)
        return jax.lax.optimization_barrier(
            fp8.ragged_dot(rows, w.astype(rows.dtype), sizes, layouts)
        )

    return gmm


def _amax_over(axes: tuple[str, ...]) -> Callable:
    return (lambda a: jax.lax.pmax(a, axes)) if axes else fp8.SAME.amax


def fp8_weight_gradient(axes: tuple[str, ...] = ()) -> Callable:
    """`grouped_weight_gradient` of `fp8_grouped`'s GEMMs, for a backward written out (the
    exchange's, a split backward's W): the rows in E4M3, dY in E5M2, at current scales taken
    over `axes` as the forward's."""
    amax = _amax_over(axes)

    def gradient(name, rows, sizes, dy):
        rows, dy = fp8.weight_gradient_operands(rows, dy.astype(rows.dtype), None, amax)
        return grouped_weight_gradient(rows, sizes, dy, name=name)

    return gradient


def fp8_input_gradient(axes: tuple[str, ...] = ()) -> Callable:
    """dX = dY W^T of `fp8_grouped`'s ragged GEMM, for a backward written out: dY in E5M2,
    W in E4M3, at current scales taken over `axes` as the forward's."""
    amax = _amax_over(axes)

    def gradient(name, dy, w, sizes):
        del name
        w = jnp.swapaxes(fp8.round_trip(w.astype(dy.dtype), fp8.E4M3, amax), 1, 2)
        return jax.lax.ragged_dot(fp8.round_trip(dy, fp8.E5M2, amax), w, sizes)

    return gradient


BLOCK_ROWS = 256
"""Rows per GEMM of `blocked_ragged_dot`."""


def _block_table(sizes: jax.Array, n: int, block: int):
    """(each block's expert, first row, end of its group) for `blocked_ragged_dot`'s loop:
    ceil(n_e / B) blocks for expert e, ceil(N / B) + E entries in all (the ones past the real
    blocks end at row 0: they keep nothing)."""
    e = sizes.shape[0]
    count = -(-n // block) + e
    per = (sizes + block - 1) // block
    ends = jnp.cumsum(per)
    group_starts = jnp.cumsum(sizes) - sizes
    i = jnp.arange(count)
    expert = jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1), e - 1)
    start = jnp.minimum(group_starts[expert] + (i - (ends - per)[expert]) * block, n)
    stop = jnp.where(i < ends[-1], group_starts[expert] + sizes[expert], 0)
    return expert, start, stop


def varying_like(zeros: jax.Array, *arrays) -> jax.Array:
    """`zeros` varying over the manual axes `arrays` vary over as well (a loop carry inside a
    map)."""
    varying = set()
    for a in arrays:
        varying |= set(jax.typeof(a).manual_axis_type.varying)
    missing = tuple(sorted(varying - set(jax.typeof(zeros).manual_axis_type.varying)))
    return jax.lax.pcast(zeros, missing, to="varying") if missing else zeros


def _block_rows(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    n = rows.shape[0]
    block = max(1, min(BLOCK_ROWS, n))
    padded = jnp.pad(rows, ((0, block), (0, 0)))
    w = w.astype(rows.dtype)

    def one_block(y, blk):
        ex, first, end = blk
        x = jax.lax.dynamic_slice_in_dim(padded, first, block)
        keep = (first + jnp.arange(block)) < end
        out = jnp.where(keep[:, None], x @ w[ex], 0).astype(y.dtype)
        now = jax.lax.dynamic_slice_in_dim(y, first, block)
        return jax.lax.dynamic_update_slice_in_dim(y, now + out, first, 0), None

    y = varying_like(jnp.zeros((n + block, w.shape[-1]), rows.dtype), rows, w, sizes)
    y, _ = jax.lax.scan(one_block, y, _block_table(sizes, n, block))
    return y[:n]


def blocked_weight_gradient(rows: jax.Array, sizes: jax.Array, dy: jax.Array) -> jax.Array:
    """Each expert's X_e^T dY_e [E, in, out] over its group of `rows`, block by block as
    `blocked_ragged_dot` runs (its weights' cotangent)."""
    n, e = rows.shape[0], sizes.shape[0]
    block = max(1, min(BLOCK_ROWS, n))
    padded_x = jnp.pad(rows, ((0, block), (0, 0)))
    padded_dy = jnp.pad(dy.astype(rows.dtype), ((0, block), (0, 0)))

    def one_block(g, blk):
        ex, first, end = blk
        keep = (first + jnp.arange(block)) < end
        x = jnp.where(keep[:, None], jax.lax.dynamic_slice_in_dim(padded_x, first, block), 0)
        d = jax.lax.dynamic_slice_in_dim(padded_dy, first, block)
        now = jax.lax.dynamic_index_in_dim(g, ex, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(g, now + (x.T @ d).astype(g.dtype), ex, 0), None

    g = jnp.zeros((e, rows.shape[-1], dy.shape[-1]), rows.dtype)
    g = varying_like(g, rows, sizes, dy)
    g, _ = jax.lax.scan(one_block, g, _block_table(sizes, n, block))
    return g


@jax.custom_vjp
def blocked_ragged_dot(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(rows [N, in], w [E, in, out], sizes [E])` as a loop over blocks of
    B = min(BLOCK_ROWS, N) sorted rows, each block within one expert's group: ceil(n_e / B)
    blocks for expert e, at most ceil(N / B) + E in all, one dense [B, in] x [in, out] GEMM
    each, the rows of a block past its group's end masked. Its FLOPs are at most
    (N + E B) in out, against the E N in out of the dense GEMM over every expert that XLA's
    GPU compiler makes of a `ragged_dot` (docs/benchmarks.md). Its backward runs the same
    loop for the rows' cotangent (dY against each expert's transposed weight) and
    `blocked_weight_gradient` for the weights', and keeps only its inputs."""
    return _block_rows(rows, w, sizes)


def _blocked_fwd(rows, w, sizes):
    return _block_rows(rows, w, sizes), (rows, w, sizes)


def _blocked_bwd(saved, dy):
    rows, w, sizes = saved
    d_rows = _block_rows(dy.astype(rows.dtype), jnp.swapaxes(w, 1, 2), sizes)
    d_w = blocked_weight_gradient(rows, sizes, dy)
    return cotangent_like(d_rows, rows), cotangent_like(d_w, w), None


def cotangent_like(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """A custom VJP's cotangent typed as its primal: summed over the manual axes it varies over
    and the primal does not (the transpose of the primal's implicit broadcast, as jax's own
    rules give), cast to varying over those the primal varies over and it does not, in the
    primal's dtype."""
    varying = lambda a: set(jax.typeof(a).manual_axis_type.varying)  # noqa: E731
    extra = tuple(sorted(varying(cotangent) - varying(primal)))
    if extra:
        cotangent = jax.lax.psum(cotangent, extra)
    missing = tuple(sorted(varying(primal) - varying(cotangent)))
    if missing:
        cotangent = jax.lax.pcast(cotangent, missing, to="varying")
    return cotangent.astype(primal.dtype)


blocked_ragged_dot.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_matmul(name: str, rows: jax.Array, w: jax.Array, sizes: jax.Array | None) -> jax.Array:
    """`ragged_matmul` with the ragged GEMM as `blocked_ragged_dot`."""
    if sizes is None:
        return ragged_matmul(name, rows, w, sizes)
    return blocked_ragged_dot(rows, w, sizes)


def _blocked_weights(name: str, rows, sizes, dy) -> jax.Array:
    del name
    return blocked_weight_gradient(rows, sizes, dy)


@jax.custom_vjp
def kernel_ragged_dot(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(rows, w, sizes)` by `grouped_kernels.grouped_matmul`, whose FLOPs are
    the groups' rows' (XLA's GPU compiler makes a `ragged_dot` a dense GEMM over every expert);
    its backward the same kernel against the transposed weights for the rows' cotangent and
    `grouped_kernels.grouped_weight_gradient` for the weights'. A shape the kernels do not take
    (`grouped_kernels.runs`) runs `ragged_dot`."""
    return _kernel_rows(rows, w, sizes)


def _kernel_rows(rows, w, sizes, transpose_w=False):
    inner, out = (w.shape[2], w.shape[1]) if transpose_w else w.shape[1:]

    def ragged():
        w_ = jnp.swapaxes(w, 1, 2) if transpose_w else w
        return jax.lax.ragged_dot(rows, w_.astype(rows.dtype), sizes)

    if not grouped_kernels.runs(rows.shape[0], inner, out):
        return ragged()
    return grouped_kernels.grouped_matmul(rows, w, sizes, transpose_w, ragged)


def kernel_weight_gradient(name: str, rows, sizes, dy) -> jax.Array:
    """Each expert's rows_e^T dY_e [E, in, out] by `grouped_kernels.grouped_weight_gradient`
    (`ragged_dot`'s transpose for a shape the kernels do not take)."""
    ragged = functools.partial(grouped_weight_gradient, rows, sizes, dy, name=name)
    if not grouped_kernels.runs(rows.shape[0], rows.shape[1], dy.shape[1]):
        return ragged()
    return grouped_kernels.grouped_weight_gradient(rows, sizes, dy, ragged)


def kernel_input_gradient(name: str, dy, w, sizes) -> jax.Array:
    """dX = dY w[e]^T of `kernel_ragged_dot`, for a backward written out."""
    del name
    return _kernel_rows(dy, w.astype(dy.dtype), sizes, transpose_w=True)


def _kernel_fwd(rows, w, sizes):
    return _kernel_rows(rows, w, sizes), (rows, w, sizes)


def _kernel_bwd(saved, dy):
    rows, w, sizes = saved
    d_rows = _kernel_rows(dy.astype(rows.dtype), w.astype(rows.dtype), sizes, transpose_w=True)
    d_w = kernel_weight_gradient("", rows, sizes, dy)
    return cotangent_like(d_rows, rows), cotangent_like(d_w, w), None


kernel_ragged_dot.defvjp(_kernel_fwd, _kernel_bwd)


def kernel_matmul(name: str, rows: jax.Array, w: jax.Array, sizes: jax.Array | None) -> jax.Array:
    """`ragged_matmul` with the ragged GEMM as `kernel_ragged_dot`."""
    if sizes is None:
        return ragged_matmul(name, rows, w, sizes)
    return kernel_ragged_dot(rows, w.astype(rows.dtype), sizes)


class ExpertGemms(NamedTuple):
    """How a layer runs its experts' grouped GEMMs: `matmul` (its backward jax's, or its own
    custom VJP's), and for a backward written out (the exchange's, a split backward's W)
    `weight_gradient` (name, rows, sizes, dY) -> [E, in, out] (None: `jax.lax.ragged_dot`'s
    transpose) and `input_gradient` (name, dY, w, sizes) -> dX (None: `matmul` of dY and the
    transposed w)."""

    matmul: GroupedMatmul
    weight_gradient: Callable | None = None
    input_gradient: Callable | None = None

    def at(self, scaling: dict) -> ExpertGemms:
        """Itself: its scales are its own (`DelayedGemms.at` takes them from the step)."""
        del scaling
        return self


RAGGED = ExpertGemms(ragged_matmul)
"""`moe.grouped_gemm: ragged` in 16 bits: `jax.lax.ragged_dot` and its transposes."""


@dataclasses.dataclass(frozen=True)
class DelayedGemms:
    """The exchange's grouped GEMMs with delayed FP8 scaling (`model.fp8: delayed`): `at` the
    layer's scaling (name -> (scales [3], the seen leaf)) they are `delayed_gemms`; the
    exchange's backward reports the operands' amaxes reduced over `axes` (the map's expert and
    tensor axes). A split backward's W reads the scales kept with the rows, so no
    `weight_gradient` of its own."""

    axes: tuple[str, ...] = ()
    weight_gradient = None

    def at(self, scaling: dict) -> ExpertGemms:
        return delayed_gemms({name: scales for name, (scales, _) in scaling.items()})


def delayed_gemms(scales: dict) -> ExpertGemms:
    """The experts' GEMMs at delayed scales (name -> [3]: x, w, dy), for a backward written
    out: each operand round-tripped through its format at its scale (`fp8.round_trip_scaled`)
    right before the GEMM, the pattern XLA's GPU compiler makes a cuBLASLt FP8 GEMM of."""

    def scaled(name, operand, a):
        return fp8.round_trip_scaled(a, scales[name][operand], fp8.FORMATS[operand])

    def matmul(name, rows, w, sizes):
        rows, w = scaled(name, 0, rows), scaled(name, 1, w.astype(rows.dtype))
        if sizes is None:
            return jnp.einsum("eni,eio->eno", rows, w)
        return jax.lax.optimization_barrier(jax.lax.ragged_dot(rows, w, sizes))  # `fp8_grouped`

    def weight_gradient(name, rows, sizes, dy):
        rows, dy = fp8.weight_gradient_operands(rows, dy.astype(rows.dtype), scales[name])
        return grouped_weight_gradient(rows, sizes, dy, name=name)

    def input_gradient(name, dy, w, sizes):
        w = jnp.swapaxes(scaled(name, 1, w.astype(dy.dtype)), 1, 2)
        return jax.lax.ragged_dot(scaled(name, 2, dy), w, sizes)

    return ExpertGemms(matmul, weight_gradient, input_gradient)


def delayed_grouped(scaling: dict, axes: tuple[str, ...] = ()) -> GroupedMatmul:
    """The experts' grouped GEMM at delayed scales where jax differentiates it (one device, a
    capacity factor's exchange): `fp8.delayed_ragged_dot` (`fp8.delayed_einsum` for batched
    GEMMs) at scaling[name] = (scales, the seen leaf), whose cotangent reports the operands'
    amaxes, reduced over `axes` inside a map over them."""
    layouts = fp8.SAME if not axes else fp8.Layouts(amax=_amax_over(axes))

    def gmm(name: str, rows: jax.Array, w: jax.Array, sizes: jax.Array | None) -> jax.Array:
        scales, counts = scaling[name]
        w = w.astype(rows.dtype)
        if sizes is None:
            return fp8.delayed_einsum("eni,eio->eno", rows, w, scales, counts, layouts)
        y = fp8.delayed_ragged_dot(rows, w, sizes, scales, counts, layouts)
        return jax.lax.optimization_barrier(y)  # as `fp8_grouped`'s

    return gmm


def grouped_gemm(moe: MoeConfig, fp8_recipe: str = "none", axes: tuple[str, ...] = ()):
    """The `ExpertGemms` of `moe.grouped_gemm` for `model.fp8` = `fp8_recipe`: `blocked_matmul`
    for `blocked`, `kernel_matmul` for `pallas`, else `ragged_matmul`; with current scaling
    (`ragged` only) `fp8_grouped` and its written-out gradients, their amaxes reduced over
    `axes` (inside a map over them); with delayed scaling `DelayedGemms`, which the exchange
    puts at the layer's scales."""
    if fp8_recipe == "delayed":
        return DelayedGemms(axes)
    if fp8_recipe == "current":
        return ExpertGemms(fp8_grouped(axes), fp8_weight_gradient(axes), fp8_input_gradient(axes))
    if moe.grouped_gemm == "blocked":
        return ExpertGemms(blocked_matmul, _blocked_weights)
    if moe.grouped_gemm == "pallas":
        return ExpertGemms(kernel_matmul, kernel_weight_gradient, kernel_input_gradient)
    return RAGGED


def settled(moe: MoeConfig, platform: str, expert_ranks: int, fp8_recipe: str = "none") -> str:
    """`moe.grouped_gemm` as a step runs it: `auto` is `pallas` on a GPU where a device holds
    more than one expert and the layer is dropless in 16 bits (there XLA's dense GEMM over every
    expert costs E_local times the rows' FLOPs), else `ragged` (one expert per device: the dense
    GEMM is the routed one, and cuBLAS's; FP8's GEMMs are `ragged`'s; off a GPU Pallas only
    interprets)."""
    if moe.grouped_gemm != "auto":
        return moe.grouped_gemm
    several = moe.experts // max(expert_ranks, 1) > 1
    kernels = platform == "gpu" and fp8_recipe == "none" and not moe.capacity_factor
    return "pallas" if kernels and several else "ragged"


def differentiable_matmul(
    moe: MoeConfig, fp8_recipe: str = "none", scaling: dict | None = None,
    axes: tuple[str, ...] = (),
) -> GroupedMatmul:  # fmt: skip
    """The experts' grouped GEMM where jax differentiates it (one device; a capacity factor's
    exchange, over `axes`): `delayed_grouped` at the layer's `scaling`, `fp8_grouped`, or
    `grouped_gemm`'s 16-bit one."""
    if fp8_recipe == "delayed":
        return delayed_grouped(scaling, axes)
    if fp8_recipe == "current":
        return fp8_grouped(axes)
    return grouped_gemm(moe).matmul


def grouped_weight_gradient(
    rows, sizes, dy, grouped_gradient: Callable | None = None, name: str = ""
):  # fmt: skip
    """Each expert's X_e^T dY_e [E, in, out] of the expert weight `name`:
    `grouped_gradient(name, rows, sizes, dy)`, or the
    transpose of `jax.lax.ragged_dot(rows, w, sizes)` in w applied to dy, the grouped GEMM
    that the whole backward runs for the expert weights. The w it transposes at varies
    over the manual axes rows and dy vary over (inside a map): an invariant one would sum the
    gradient over them."""
    if grouped_gradient is not None:
        return grouped_gradient(name, rows, sizes, dy)
    w = varying_like(
        jnp.zeros((sizes.shape[0], rows.shape[-1], dy.shape[-1]), rows.dtype), rows, dy
    )
    transpose = jax.linear_transpose(lambda w_: jax.lax.ragged_dot(rows, w_, sizes), w)
    return transpose(dy.astype(rows.dtype))[0]
