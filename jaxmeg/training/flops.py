"""Model FLOPs and MFU (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 5.1).

FLOPs per iteration for a batch of B sequences of length s, l layers, hidden h, vocabulary V:
  with full recompute (one extra forward):  96 B s l h^2 (1 + s/(6h) + V/(16 l h))
  without recompute:                        72 B s l h^2 (1 + s/(6h) + V/(12 l h))
MFU uses the formula WITHOUT recompute (model FLOPs, not hardware FLOPs), so recompute shows
up as a lower MFU rather than a higher one.

Mixture-of-experts layers count the FLOPs a token runs, not those of every expert: the dense
MLP's share of the formula (16 h^2 per token and forward pass) is replaced by the router
(2 h E), the k routed experts and the shared ones (4 h f each, 6 h f as SwiGLU):
`jaxmeg.perf.experts.mlp_flops_per_token`.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.perf.hardware import peak_tflops_for_device_kind
from jaxmeg.perf.model import flops_per_iteration, shape_of


def model_flops_per_step(
    model: ModelConfig, sequences: int, recompute: bool = False, moe: MoeConfig | None = None
) -> float:
    """Eq. 3 of the paper for this model config (`jaxmeg.perf.model.flops_per_iteration`), with
    MoE layers' active FLOPs in place of the dense MLP's (see the module docstring)."""
    return flops_per_iteration(shape_of(model, moe), sequences, recompute)


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
    """The datasheet bf16 peak of the hardware profile (configs/hardware/) that names this
    GPU, a measured matmul peak on CPU, else None."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measure_cpu_peak_tflops()
    return peak_tflops_for_device_kind(device.device_kind)
