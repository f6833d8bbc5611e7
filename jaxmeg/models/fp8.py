"""FP8 weight matmuls with per-tensor scaling: current (`model.fp8: current`) or delayed
(`model.fp8: delayed`).

Each operand of a transformer linear goes through FP8 on its way into the GEMM: scaled by its
own absolute maximum so that it fills the format (amax / the format's largest value), cast to
FP8, cast back and multiplied by the scale. Activations and weights use E4M3 (more mantissa),
the output's cotangent E5M2 (more range), as Micikevicius et al. (2022, "FP8 Formats for Deep
Learning") and Transformer Engine do; the scale is this step's amax ("current" scaling).

XLA's GPU compiler (H100, cuBLASLt GEMMs) fuses that pattern, `(x / s).astype(f8).astype(bf16)
* s` with a scalar s per operand and at least one E4M3 operand, into one
`__cublas$lt$matmul$f8` call; elsewhere (CPU) the same rounding runs and the GEMM is a bf16 or
f32 one, so a CPU run's numerics are the GPU recipe's up to the GEMM's accumulation order.

All three GEMMs of a linear run on FP8 operands: the forward (x and w in E4M3), and in the
backward the input gradient (dy in E5M2 against w) and the weight gradient (x against dy); a
MoE layer's grouped GEMMs the same way (`ragged_dot`, one scale per operand over all groups,
and `einsum` for a capacity factor's batched ones; `delayed_ragged_dot` at delayed scales). The
backward keeps x and w as FP8 with their scales, a quarter (fp32) or half (bf16) of their
bytes. A tensor split over an automatic mesh axis (tensor parallelism, sequence parallelism)
takes its amax over the whole tensor, so every rank uses one scale; data-parallel replicas and
microbatches each scale their own activations, as on one device per microbatch.

Delayed scaling (Transformer Engine's default recipe; flax's FP8 ops) takes each operand's
scale from the largest amax of the last H steps instead, so the cast needs no reduction over
the tensor first. Each linear keeps, beside its weight `w`, `w_amax_history` [3, H] (x, w and
dy; the newest step first) and `w_amax_seen` [3, BINS], never trained, whose "gradient" is
what the step saw: per operand a one-hot over power-of-two bins of its amax, summed over
microbatches and replicas by the step's own gradient reduction (so no collective of its own,
and exact: the highest non-empty bin is the step's amax rounded up to a power of two). The
train step shifts that bound into the history (`advance`). A scale is a power of two: the
history's bound over the format's largest power of two, times 2^`fp8_margin`; a value beyond
the format saturates. An empty history (the first step) scales by 1, as Transformer Engine
and flax do.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _same(t: jax.Array) -> jax.Array:
    return t


def quantize(x: jax.Array, fp8, reduce_amax: Callable = _same) -> tuple[jax.Array, jax.Array]:
    """(x / scale as `fp8`, scale): scale = amax(|x|) / the format's largest value (1 where x is
    all zero), an fp32 scalar; `reduce_amax` takes a device's amax to the whole tensor's (a
    `pmax` over the map's axes where x is one device's block)."""
    amax = reduce_amax(jnp.max(jnp.abs(x)).astype(jnp.float32))
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(fp8).max), 1.0)
    return (x / scale.astype(x.dtype)).astype(fp8), scale


HISTORY = "_amax_history"
SEEN = "_amax_seen"
"""The suffixes of a linear's delayed-scaling leaves, after its weight's name."""
SOWN_INPUT, SOWN_SCALES = "fp8_input", "fp8_scales"
"""A delayed-scaling linear's input as the split backward keeps it for W
(`jaxmeg.models.split_backward`): with the scales its forward used."""
FORMATS = (E4M3, E4M3, E5M2)
"""The formats of a linear's three operands, in history order: x, w, dy."""
LOWEST = -100
"""The exponent of the lowest bin: an amax at or below 2^LOWEST counts there."""
BINS = 127 - LOWEST + 1
"""Power-of-two bins of an amax, 2^LOWEST ... 2^127."""


def exponent(amax: jax.Array) -> jax.Array:
    """The smallest integer e with amax <= 2^e (amax > 0), exactly (`frexp`)."""
    mantissa, e = jnp.frexp(jnp.asarray(amax, jnp.float32))
    return jnp.where(mantissa == 0.5, e - 1, e)


def seen(amax: jax.Array) -> jax.Array:
    """[..., BINS]: one at each amax's bin (`exponent`, clipped to the bins), all zero for a
    zero amax."""
    amax = jnp.asarray(amax, jnp.float32)
    e = jnp.clip(exponent(amax), LOWEST, 127)
    return jnp.where(amax[..., None] > 0, jax.nn.one_hot(e - LOWEST, BINS, dtype=jnp.float32), 0.0)


def bound(counts: jax.Array) -> jax.Array:
    """[...]: 2^e of the highest non-empty bin of counts [..., BINS] (0 where all are empty)."""
    top = BINS - 1 - jnp.argmax(jnp.flip(counts > 0, -1), axis=-1)
    return jnp.where(jnp.any(counts > 0, -1), jnp.ldexp(1.0, top + LOWEST), 0.0)


def advance(history: jax.Array, counts: jax.Array) -> jax.Array:
    """history [..., 3, H] with this step's bounds (`bound` of counts [..., 3, BINS]) first, the
    oldest dropped."""
    new = bound(counts).astype(history.dtype)[..., None]
    return jnp.concatenate([new, history[..., :-1]], axis=-1)


def delayed_scales(history: jax.Array, margin: int = 0) -> jax.Array:
    """[3] fp32 scales from history [3, H]: the largest amax over the format's largest power of
    two, times 2^margin; 1 where the history is empty."""
    top = jnp.array([2.0 ** int(np.log2(float(jnp.finfo(f).max))) for f in FORMATS])
    amax = jnp.max(history.astype(jnp.float32), axis=-1)
    return jnp.where(amax > 0, amax / top * 2.0**margin, 1.0)


def quantize_scaled(x: jax.Array, scale: jax.Array, fp8) -> jax.Array:
    """x / scale as `fp8`, saturated at the format's largest value."""
    top = float(jnp.finfo(fp8).max)
    return jnp.clip(x / scale.astype(x.dtype), -top, top).astype(fp8)


def round_trip_scaled(x: jax.Array, scale: jax.Array, fp8) -> jax.Array:
    """x as it comes out of FP8 at a given scale (`quantize_scaled`, then `dequantize`)."""
    return dequantize(quantize_scaled(x, scale, fp8), scale, x.dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q back in `dtype`, times its scale: what the GEMM reads."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, fp8, reduce_amax: Callable = _same) -> jax.Array:
    """x as it comes out of FP8 (`quantize`, then `dequantize`)."""
    return dequantize(*quantize(x, fp8, reduce_amax), x.dtype)


def weight_gradient_operands(x, dy, scales=None, reduce_amax: Callable = _same):
    """(x in E4M3, dy in E5M2) as a weight gradient's GEMM reads them, for a backward written
    out (a split backward's W, the experts' exchange): at delayed `scales` [3] (the forward's),
    or at current ones (their amaxes reduced by `reduce_amax`) where scales is None."""
    if scales is None:
        return round_trip(x, E4M3, reduce_amax), round_trip(dy, E5M2, reduce_amax)
    return round_trip_scaled(x, scales[0], E4M3), round_trip_scaled(dy, scales[2], E5M2)


@dataclasses.dataclass(frozen=True)
class Layouts:
    """Where a linear's 16-bit operand is put into FP8 and where its FP8 values go for the GEMM.
    With sequence parallelism a column-parallel linear's x (a row-parallel one's dy) is split
    over `tensor` on the sequence and gathered for the GEMM: `x_split` (`dy_split`) puts it in
    the split layout to be quantized there, `x_whole` (`dy_whole`) puts its FP8 values in the
    gathered one, so the all-gather moves FP8 bytes and nothing sits between the FP8 values and
    the GEMM, which XLA's cuBLASLt FP8 rewrite needs (with the gather on the 16-bit values
    between them, those GEMMs ran 16-bit). Identities elsewhere."""

    x_split: Callable = _same
    x_whole: Callable = _same
    dy_split: Callable = _same
    dy_whole: Callable = _same
    amax: Callable = _same
    """A device's amaxes to the whole tensor's, where the operands are one device's blocks
    inside a map (the experts' GEMMs under expert parallelism): current scaling reduces each
    before its cast, delayed scaling the three it reports, once, in the backward."""


SAME = Layouts()


def einsum(spec: str, x: jax.Array, w: jax.Array, layouts: Layouts = SAME) -> jax.Array:
    """jnp.einsum(spec, x, w) on FP8 operands with current scales (see the module docstring)."""
    return _current(spec, layouts, x, w)


def ragged_dot(rows: jax.Array, w: jax.Array, sizes: jax.Array, layouts: Layouts = SAME):
    """`jax.lax.ragged_dot(rows, w, sizes)` (rows sorted by group, `sizes` [E] rows each, times
    their group's w [E, in, out]) on FP8 operands with current scales, one per operand over
    all groups: XLA's GPU compiler makes each of its three GEMMs one cuBLASLt FP8 GEMM."""
    return _current_ragged(layouts, rows, w, sizes)


def _product(spec, groups):
    """The GEMM of an FP8 matmul: an einsum `spec`, or a ragged dot over `groups` (sizes)."""
    if spec is None:
        return lambda a, b: jax.lax.ragged_dot(a, b, groups)
    return functools.partial(jnp.einsum, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _current(spec, layouts, x, w):
    return _current_forward(spec, layouts, x, w)[0]


def _current_forward(spec, layouts, x, w, groups=None):
    xq, xs = quantize(layouts.x_split(x), E4M3, layouts.amax)
    wq, ws = quantize(w, E4M3, layouts.amax)
    y = _product(spec, groups)(
        dequantize(layouts.x_whole(xq), xs, x.dtype), dequantize(wq, ws, w.dtype)
    )
    return y, (xq, xs, wq, ws, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _current_backward(spec, layouts, kept, dy, groups=None):
    xq, xs, wq, ws, x_like, w_like = kept
    x = dequantize(layouts.x_whole(xq), xs, x_like.dtype)
    _, pullback = jax.vjp(_product(spec, groups), x, dequantize(wq, ws, w_like.dtype))
    dyq, dys = quantize(layouts.dy_split(dy), E5M2, layouts.amax)
    return pullback(dequantize(layouts.dy_whole(dyq), dys, dy.dtype))


_current.defvjp(_current_forward, _current_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _current_ragged(layouts, rows, w, sizes):
    return _current_forward(None, layouts, rows, w, sizes)[0]


def _current_ragged_forward(layouts, rows, w, sizes):
    y, kept = _current_forward(None, layouts, rows, w, sizes)
    return y, (kept, sizes)


def _current_ragged_backward(layouts, saved, dy):
    kept, sizes = saved
    return (*_current_backward(None, layouts, kept, dy, sizes), None)


_current_ragged.defvjp(_current_ragged_forward, _current_ragged_backward)


def delayed_einsum(
    spec: str, x: jax.Array, w: jax.Array, scales: jax.Array, counts: jax.Array,
    layouts: Layouts = SAME,
) -> jax.Array:  # fmt: skip
    """jnp.einsum(spec, x, w) on FP8 operands scaled by `scales` [3] (`delayed_scales`); the
    cotangent of `counts` [3, BINS] (the linear's never-trained `_amax_seen`) is what the
    operands' amaxes were (`seen` of x, w and dy), the scales' is zero."""
    return _delayed(spec, layouts, x, w, scales, counts)


def delayed_ragged_dot(
    rows: jax.Array, w: jax.Array, sizes: jax.Array, scales: jax.Array, counts: jax.Array,
    layouts: Layouts = SAME,
) -> jax.Array:  # fmt: skip
    """`ragged_dot` at delayed scales, one per operand over all groups, reporting the operands'
    amaxes as `delayed_einsum` does."""
    return _delayed_ragged(layouts, rows, w, sizes, scales, counts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _delayed(spec, layouts, x, w, scales, counts):
    return _delayed_forward(spec, layouts, x, w, scales, counts)[0]


def _delayed_forward(spec, layouts, x, w, scales, counts, groups=None):
    x = layouts.x_split(x)
    xq, wq = quantize_scaled(x, scales[0], E4M3), quantize_scaled(w, scales[1], E4M3)
    y = _product(spec, groups)(
        dequantize(layouts.x_whole(xq), scales[0], x.dtype),
        dequantize(wq, scales[1], w.dtype),
    )
    amaxes = jnp.stack([jnp.max(jnp.abs(a)).astype(jnp.float32) for a in (x, w)])
    like = (jnp.zeros((), x.dtype), jnp.zeros((), w.dtype), jnp.zeros((), counts.dtype))
    return y, (xq, wq, scales, amaxes, like)


def _delayed_backward(spec, layouts, kept, dy, groups=None):
    xq, wq, scales, amaxes, (x_like, w_like, counts_like) = kept
    x = dequantize(layouts.x_whole(xq), scales[0], x_like.dtype)
    w = dequantize(wq, scales[1], w_like.dtype)
    _, pullback = jax.vjp(_product(spec, groups), x, w)
    dy = layouts.dy_split(dy)
    dyq = quantize_scaled(dy, scales[2], E5M2)
    dx, dw = pullback(dequantize(layouts.dy_whole(dyq), scales[2], dy.dtype))
    dy_amax = jnp.max(jnp.abs(dy)).astype(jnp.float32)
    amaxes = layouts.amax(jnp.concatenate([amaxes, dy_amax[None]]))
    return dx, dw, jnp.zeros_like(scales), seen(amaxes).astype(counts_like.dtype)


_delayed.defvjp(_delayed_forward, _delayed_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delayed_ragged(layouts, rows, w, sizes, scales, counts):
    return _delayed_forward(None, layouts, rows, w, scales, counts, sizes)[0]


def _delayed_ragged_forward(layouts, rows, w, sizes, scales, counts):
    y, kept = _delayed_forward(None, layouts, rows, w, scales, counts, sizes)
    return y, (kept, sizes)


def _delayed_ragged_backward(layouts, saved, dy):
    kept, sizes = saved
    dx, dw, d_scales, d_counts = _delayed_backward(None, layouts, kept, dy, sizes)
    return dx, dw, None, d_scales, d_counts


_delayed_ragged.defvjp(_delayed_ragged_forward, _delayed_ragged_backward)
