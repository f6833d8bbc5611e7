"""FP8 weight matmuls with per-tensor current scaling (`model.fp8: current`).

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
backward the input gradient (dy in E5M2 against w) and the weight gradient (x against dy). The
backward keeps x and w as FP8 with their scales, a quarter (fp32) or half (bf16) of their
bytes. A tensor split over an automatic mesh axis (tensor parallelism, sequence parallelism)
takes its amax over the whole tensor, so every rank uses one scale; data-parallel replicas and
microbatches each scale their own activations, as on one device per microbatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def quantize(x: jax.Array, fp8) -> tuple[jax.Array, jax.Array]:
    """(x / scale as `fp8`, scale): scale = amax(|x|) / the format's largest value (1 where x is
    all zero), an fp32 scalar."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(fp8).max), 1.0)
    return (x / scale.astype(x.dtype)).astype(fp8), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q back in `dtype`, times its scale: what the GEMM reads."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, fp8) -> jax.Array:
    """x as it comes out of FP8 (`quantize`, then `dequantize`)."""
    return dequantize(*quantize(x, fp8), x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w) on FP8 operands (see the module docstring)."""
    return _forward(spec, x, w)[0]


def _forward(spec, x, w):
    xq, xs = quantize(x, E4M3)
    wq, ws = quantize(w, E4M3)
    y = jnp.einsum(spec, dequantize(xq, xs, x.dtype), dequantize(wq, ws, w.dtype))
    return y, (xq, xs, wq, ws, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _backward(spec, kept, dy):
    xq, xs, wq, ws, x_like, w_like = kept
    x, w = dequantize(xq, xs, x_like.dtype), dequantize(wq, ws, w_like.dtype)
    _, pullback = jax.vjp(functools.partial(jnp.einsum, spec), x, w)
    return pullback(round_trip(dy, E5M2))


einsum.defvjp(_forward, _backward)
