"""Model FLOPs and MFU (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 5.1).

FLOPs per iteration for a batch of B sequences of length s, l layers, hidden h, vocabulary V:
  with full recompute (one extra forward):  96 B s l h^2 (1 + s/(6h) + V/(16 l h))
  without recompute:                        72 B s l h^2 (1 + s/(6h) + V/(12 l h))
MFU uses the formula WITHOUT recompute (model FLOPs, not hardware FLOPs), so recompute shows
up as a lower MFU rather than a higher one.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from jaxmeg.config import ModelConfig
from jaxmeg.perf.model import Shape, flops_per_iteration

# Dense bf16 tensor-core peak per device, TFLOP/s, from the vendor datasheets.
# Matched as substrings of the upper-cased, space-free device kind, first match wins.
PEAK_TFLOPS_BF16 = {
    "H100PCIE": 756.0,
    "H100NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "A100": 312.0,
    "GH200": 989.0,
    "B200": 2250.0,
}


def model_flops_per_step(model: ModelConfig, sequences: int, recompute: bool = False) -> float:
    """Eq. 3 of the paper for this model config (`jaxmeg.perf.model.flops_per_iteration`)."""
    shape = Shape(
        hidden=model.hidden, layers=model.layers, heads=model.heads, seq_len=model.seq_len,
        vocab=model.vocab_size, mlp_ratio=model.mlp_ratio,
    )  # fmt: skip
    return flops_per_iteration(shape, sequences, recompute)


@functools.cache
def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 5) -> float:
    """A float32 matmul's achieved TFLOP/s on one CPU device: the CPU 'peak' for MFU."""
    x = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops_per_device(device: jax.Device | None = None) -> float | None:
    """Datasheet bf16 peak for known GPUs, a measured matmul peak on CPU, else None."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measure_cpu_peak_tflops()
    kind = device.device_kind.upper()
    for name, peak in PEAK_TFLOPS_BF16.items():
        if name in kind.replace(" ", ""):
            return peak
    return None
