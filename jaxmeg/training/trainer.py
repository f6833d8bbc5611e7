"""The training loop: dataset -> validated config -> mesh -> sharded state -> steps -> metrics."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmeg.config import Config, validate
from jaxmeg.parallel import make_mesh
from jaxmeg.training.flops import model_flops_per_step, peak_tflops_per_device
from jaxmeg.training.state import Trainable, abstract_state, init_state
from jaxmeg.training.step import make_train_step


def open_dataset(cfg: Config, show_progress: bool = True):
    """The configured token file, or the default corpus (built and cached on first use)."""
    from jaxmeg.data import TokenFile, prepare_default_dataset

    prefix = cfg.data.dataset
    if not prefix:
        prefix = prepare_default_dataset(
            Path(cfg.data.cache_dir).expanduser(),
            vocab_size=cfg.data.tokenizer_vocab,
            max_bytes=cfg.data.default_corpus_bytes,
            show_progress=show_progress,
        )
    return TokenFile.open(prefix)


def with_vocab(cfg: Config, vocab_size: int) -> Config:
    """Sets model.vocab_size from the data when the config leaves it at -1."""
    if cfg.model.vocab_size != -1:
        if cfg.model.vocab_size < vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the dataset's "
                f"vocabulary ({vocab_size})"
            )
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def global_batch_arrays(loader, step: int, sharding) -> tuple[jax.Array, jax.Array]:
    """Builds the global (inputs, targets) arrays; each process reads only its own rows."""
    shape = (loader.global_batch, loader.seq_len)
    cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def rows(index, which: int) -> np.ndarray:
        start, stop, _ = index[0].indices(shape[0])
        if (start, stop) not in cache:
            cache[(start, stop)] = loader.rows(step, start, stop)
        return cache[(start, stop)][which][:, index[1]]

    inputs = jax.make_array_from_callback(shape, sharding, lambda i: rows(i, 0))
    targets = jax.make_array_from_callback(shape, sharding, lambda i: rows(i, 1))
    return inputs, targets


def memory_report(compiled) -> dict[str, int]:
    mem = compiled.memory_analysis()
    return {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }


def compile_step(trainable: Trainable):
    """AOT-compiles the train step; returns (compiled, seconds)."""
    step = make_train_step(trainable)
    batch = jax.ShapeDtypeStruct(
        (trainable.cfg.train.global_batch, trainable.cfg.model.seq_len),
        np.int32,
        sharding=trainable.batch_sharding(),
    )
    start = time.perf_counter()
    with jax.set_mesh(trainable.mesh):
        compiled = step.lower(abstract_state(trainable), batch, batch).compile()
    return compiled, time.perf_counter() - start


def prepare(cfg: Config, dataset=None) -> Trainable:
    """Validated config (vocabulary from the dataset, else the config, else the default
    corpus's BPE size) -> mesh -> Trainable."""
    if dataset is not None:
        cfg = with_vocab(cfg, dataset.vocab_size)
    elif cfg.model.vocab_size == -1:
        cfg = with_vocab(cfg, cfg.data.tokenizer_vocab)
    cfg = validate(cfg, jax.device_count())
    return Trainable.create(cfg, make_mesh(cfg.parallel))


def compile_only(cfg: Config) -> dict[str, Any]:
    """Compiles the train step for the configured mesh without data or running it."""
    dataset = open_dataset(cfg) if cfg.data.dataset else None
    trainable = prepare(cfg, dataset)
    compiled, seconds = compile_step(trainable)
    return {"compile_seconds": round(seconds, 3), **memory_report(compiled)}


def _print(*args: Any) -> None:
    if jax.process_index() == 0:
        print(*args, file=sys.stderr, flush=True)


def train(
    cfg: Config,
    *,
    metrics_file: str | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Trains for `cfg.train.steps` steps and returns a summary (also the per-step losses)."""
    dataset = open_dataset(cfg, show_progress)
    trainable = prepare(cfg, dataset)
    cfg = trainable.cfg
    d, p, t = (trainable.mesh.shape[a] for a in ("data", "pipe", "tensor"))
    _print(
        f"jaxmeg: {jax.device_count()} x {jax.devices()[0].device_kind}, mesh data={d} pipe={p} "
        f"tensor={t}, vocab {cfg.model.vocab_size} (padded {trainable.vocab}), "
        f"batch {cfg.train.global_batch} = {d} x {cfg.train.microbatches} x "
        f"{cfg.train.microbatch_size}, {dataset.num_tokens:,} tokens"
    )
    from jaxmeg.data import BatchLoader

    loader = BatchLoader(dataset, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed)
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, cfg.train.seed)
    compiled, compile_seconds = compile_step(trainable)
    _print(f"jaxmeg: train step compiled in {compile_seconds:.1f} s")

    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    flops_per_step = model_flops_per_step(cfg.model, cfg.train.global_batch)
    peak = peak_tflops_per_device()
    sink = open(metrics_file, "a") if metrics_file and jax.process_index() == 0 else None
    losses: list[float] = []
    progress = _progress_bar(cfg.train.steps, show_progress and jax.process_index() == 0)
    start_time = time.perf_counter()
    try:
        for step in range(cfg.train.steps):
            inputs, targets = global_batch_arrays(loader, step, trainable.batch_sharding())
            step_start = time.perf_counter()
            with jax.set_mesh(trainable.mesh):
                state, metrics = compiled(state, inputs, targets)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            seconds = time.perf_counter() - step_start
            tflops = flops_per_step / seconds / jax.device_count() / 1e12
            record = {
                "step": step + 1,
                **metrics,
                "step_seconds": seconds,
                "tokens_per_sec": tokens_per_step / seconds,
                "tflops_per_device": tflops,
                "mfu": tflops / peak if peak else None,
            }
            losses.append(metrics["loss"])
            if sink and (step + 1) % cfg.train.log_every == 0:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            progress.update(record)
    finally:
        progress.close()
        if sink:
            sink.close()
    seconds = time.perf_counter() - start_time
    summary = {
        "steps": cfg.train.steps,
        "tokens": tokens_per_step * cfg.train.steps,
        "seconds": round(seconds, 2),
        "compile_seconds": round(compile_seconds, 2),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "losses": losses,
    }
    _print(
        f"jaxmeg: {summary['steps']} steps, {summary['tokens']:,} tokens in {seconds:.1f} s; "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    return summary


class _progress_bar:
    """tqdm on the terminal (process 0 only), with loss, tokens/s and MFU in the postfix."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        mfu = record["mfu"]
        self.bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            tok_s=f"{record['tokens_per_sec']:.0f}",
            mfu="n/a" if mfu is None else f"{100 * mfu:.1f}%",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
