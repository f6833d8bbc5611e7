"""Step timing for scripts/bench.py: compile, warm up, then the median of timed steps; and the
one step path against the plain autodiff step on one device, alternating in one process."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np

from jaxmeg.config import Config
from jaxmeg.training.compilation import compile_step, memory_report
from jaxmeg.training.flops import model_flops_per_step, peak_tflops_per_device
from jaxmeg.training.reference import make_plain_loss_and_grads
from jaxmeg.training.state import abstract_state, init_state
from jaxmeg.training.step import make_train_step
from jaxmeg.training.trainer import prepare


def benchmark(cfg: Config, *, steps: int = 10, warmup: int = 2) -> dict[str, Any]:
    trainable = prepare(cfg, dataset=None)
    cfg = trainable.cfg
    compiled, compile_seconds = compile_step(trainable)
    tokens = _random_tokens(trainable)
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
    flops = model_flops_per_step(cfg.model, cfg.train.global_batch, moe=cfg.moe)
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


def _random_tokens(trainable) -> jax.Array:
    cfg = trainable.cfg
    rng = np.random.default_rng(0)
    shape = (cfg.train.global_batch, cfg.model.seq_len)
    tokens = rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
    return jax.device_put(tokens, trainable.batch_sharding())


def compare_with_plain(cfg: Config, *, steps: int = 5, rounds: int = 5) -> dict[str, Any]:
    """Median step time of the one path (the executor) and of the plain autodiff step
    (`reference`), same optimizer update, on one device: `rounds` x `steps` timed steps of each,
    alternating, after one warm-up step each."""
    trainable = prepare(cfg, dataset=None)
    if trainable.mesh.size != 1:
        raise ValueError(
            f"--compare-plain runs on one device; the mesh has {trainable.mesh.size} (give "
            f"--cpu-devices 1 or a one-device layout)"
        )
    tokens = _random_tokens(trainable)
    batch = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=tokens.sharding)
    with jax.set_mesh(trainable.mesh):
        steps_by_path = {
            "one_path": make_train_step(trainable),
            "plain": make_train_step(trainable, make_plain_loss_and_grads(trainable)),
        }
        compiled = {
            name: step.lower(abstract_state(trainable), batch, batch).compile()
            for name, step in steps_by_path.items()
        }
        states = {name: init_state(trainable, trainable.cfg.train.seed) for name in compiled}
        times: dict[str, list[float]] = {name: [] for name in compiled}
        losses = {}
        for i in range(rounds + 1):
            for name, fn in compiled.items():
                for _ in range(steps if i else 1):
                    start = time.perf_counter()
                    states[name], metrics = fn(states[name], tokens, tokens)
                    jax.block_until_ready(metrics["loss"])
                    if i:
                        times[name].append(time.perf_counter() - start)
                losses[name] = float(metrics["loss"])
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "device": jax.devices()[0].device_kind,
        "microbatches": trainable.cfg.train.microbatches,
        "global_batch": trainable.cfg.train.global_batch,
        "seq_len": trainable.cfg.model.seq_len,
        "hidden": trainable.cfg.model.hidden,
        "layers": trainable.cfg.model.layers,
        "remat": trainable.cfg.model.remat,
        "step_seconds": {name: round(t, 5) for name, t in median.items()},
        "one_path_over_plain": round(median["one_path"] / median["plain"], 4),
        "last_loss": losses,
        "temp_bytes": {name: memory_report(c)["temp_bytes"] for name, c in compiled.items()},
    }
