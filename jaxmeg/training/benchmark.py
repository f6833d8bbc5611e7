"""Step timing for scripts/bench.py: compile, warm up, then the median of timed steps."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np

from jaxmeg.config import Config
from jaxmeg.training.flops import model_flops_per_step, peak_tflops_per_device
from jaxmeg.training.state import init_state
from jaxmeg.training.trainer import compile_step, memory_report, prepare


def benchmark(cfg: Config, *, steps: int = 10, warmup: int = 2) -> dict[str, Any]:
    trainable = prepare(cfg, dataset=None)
    cfg = trainable.cfg
    compiled, compile_seconds = compile_step(trainable)
    rng = np.random.default_rng(0)
    shape = (cfg.train.global_batch, cfg.model.seq_len)
    sharding = trainable.batch_sharding()
    tokens = jax.device_put(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), sharding)
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, cfg.train.seed)
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, metrics = compiled(state, tokens, tokens)
            jax.block_until_ready(metrics["loss"])
            if i >= warmup:
                times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = model_flops_per_step(cfg.model, cfg.train.global_batch)
    tflops = flops / seconds / jax.device_count() / 1e12
    peak = peak_tflops_per_device()
    par = cfg.parallel
    return {
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "mesh": {"data": par.data, "pipe": par.pipe, "tensor": par.tensor},
        "schedule": par.schedule if par.pipe > 1 else None,
        "chunks": par.chunks,
        "microbatches": cfg.train.microbatches,
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.model.seq_len,
        "compute_dtype": cfg.model.compute_dtype,
        "remat": cfg.model.remat,
        "step_seconds": round(seconds, 5),
        "tokens_per_sec": round(cfg.train.global_batch * cfg.model.seq_len / seconds, 1),
        "tflops_per_device": round(tflops, 3),
        "mfu": round(tflops / peak, 4) if peak else None,
        "peak_tflops_per_device": peak,
        "compile_seconds": round(compile_seconds, 2),
        "loss": float(metrics["loss"]),
        **memory_report(compiled),
    }
