"""The training loop: dataset -> validated config -> mesh -> sharded state -> steps -> metrics."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmeg.config import Config, to_dict, validate
from jaxmeg.parallel import make_mesh
from jaxmeg.training.flops import model_flops_per_step, peak_tflops_per_device
from jaxmeg.training.run_log import RunLog, say
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


class TrainingStopped(RuntimeError):
    """The run stopped on non-finite values (the message says which steps)."""


class _StopSignals:
    """SIGTERM / SIGINT set a flag: the loop finishes its step, checkpoints and returns."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _local_scalars(metrics) -> dict[str, float]:
    """Replicated scalar metrics as floats (each process reads its own copy)."""
    return {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}


def train(
    cfg: Config,
    *,
    out_dir: str | None = None,
    resume: bool = True,
    metrics_file: str | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Trains up to `cfg.train.steps` steps and returns a summary with the per-step losses.

    With `out_dir`: resumes from its newest readable checkpoint (unless `resume` is False),
    saves every `checkpoint.every` steps, at the end and on SIGTERM/SIGINT, and writes
    TensorBoard event files and metrics.jsonl there.
    """
    dataset = open_dataset(cfg, show_progress)
    trainable = prepare(cfg, dataset)
    cfg = trainable.cfg
    d, p, t = (trainable.mesh.shape[a] for a in ("data", "pipe", "tensor"))
    say(
        f"{jax.device_count()} x {jax.devices()[0].device_kind} in {jax.process_count()} "
        f"process(es), mesh data={d} pipe={p} tensor={t}, vocab {cfg.model.vocab_size} "
        f"(padded {trainable.vocab}), batch {cfg.train.global_batch} = {d} x "
        f"{cfg.train.microbatches} x {cfg.train.microbatch_size}, {dataset.num_tokens:,} tokens"
    )
    from jaxmeg.data import BatchLoader

    loader = BatchLoader(dataset, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed)
    checkpointer = None
    first_step = 0
    state = None
    if out_dir is not None:
        from jaxmeg.training.checkpoint import Checkpointer

        checkpointer = Checkpointer(Path(out_dir) / "checkpoints", trainable, cfg.checkpoint.keep)
        if not resume and checkpointer.steps():
            raise ValueError(
                f"{out_dir} already holds checkpoints {checkpointer.steps()}; resume, or pass "
                f"another --out (nothing is overwritten)"
            )
        restored = checkpointer.restore_latest() if resume else None
        if restored is not None:
            first_step, state, meta = restored
            loader.restore(meta["loader"])
            say(f"resumed from step {first_step} in {checkpointer.directory}")
        if metrics_file is None:
            metrics_file = str(Path(out_dir) / "metrics.jsonl")
    if state is None:
        with jax.set_mesh(trainable.mesh):
            state = init_state(trainable, cfg.train.seed)
    compiled, compile_seconds = compile_step(trainable)
    say(f"train step compiled in {compile_seconds:.1f} s")

    def meta(step: int) -> dict[str, Any]:
        return {
            "step": step,
            "loader": loader.state(),
            "seed": cfg.train.seed,
            "padded_vocab": trainable.vocab,
            "mesh": {"data": d, "pipe": p, "tensor": t, "chunks": cfg.parallel.chunks},
            "config": to_dict(cfg),
        }

    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    flops_per_step = model_flops_per_step(cfg.model, cfg.train.global_batch)
    peak = peak_tflops_per_device()
    log = RunLog(
        cfg.train.steps, first_step, metrics_file,
        Path(out_dir) / "tensorboard" if out_dir else None, show_progress, cfg.train.log_every,
    )  # fmt: skip
    losses, mfus, saved = [], [], []
    skipped_total = skipped_in_row = 0
    step = first_step
    stopped_by = None
    start_time = time.perf_counter()
    try:
        with _StopSignals() as signals:
            while step < cfg.train.steps:
                inputs, targets = global_batch_arrays(loader, step, trainable.batch_sharding())
                step_start = time.perf_counter()
                with jax.set_mesh(trainable.mesh):
                    state, metrics = compiled(state, inputs, targets)
                metrics = _local_scalars(metrics)
                seconds = time.perf_counter() - step_start
                step += 1
                loader.step = step
                skipped_in_row = skipped_in_row + 1 if metrics["skipped"] else 0
                skipped_total += int(metrics["skipped"])
                tflops = flops_per_step / seconds / jax.device_count() / 1e12
                record = {
                    "step": step,
                    **metrics,
                    "skipped_steps": skipped_total,
                    "step_seconds": seconds,
                    "tokens_per_sec": tokens_per_step / seconds,
                    "tflops_per_device": tflops,
                    "mfu": tflops / peak if peak else None,
                }
                losses.append(metrics["loss"])
                if record["mfu"] is not None:
                    mfus.append(record["mfu"])
                log.record(record)
                if metrics["skipped"]:
                    _handle_nonfinite(cfg, step, metrics, skipped_in_row)
                if signals.received is not None:
                    stopped_by = signal.Signals(signals.received).name
                    break
                if checkpointer and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    checkpointer.save(step, state, meta(step))
                    saved.append(step)
        if checkpointer and step not in saved and step > first_step:
            checkpointer.save(step, state, meta(step), wait=True)
            saved.append(step)
    finally:
        log.close()
        if checkpointer:
            checkpointer.close()
    seconds = time.perf_counter() - start_time
    summary = {
        "first_step": first_step,
        "steps": step - first_step,
        "last_step": step,
        "tokens": tokens_per_step * (step - first_step),
        "seconds": round(seconds, 2),
        "compile_seconds": round(compile_seconds, 2),
        "mean_mfu": float(np.mean(mfus)) if mfus else None,
        "skipped_steps": skipped_total,
        "checkpoints": saved,
        "stopped_by": stopped_by,
        "losses": losses,
    }
    if losses:
        say(
            f"{summary['steps']} steps ({first_step} -> {step}), {summary['tokens']:,} tokens in "
            f"{seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}, mean MFU "
            + ("n/a" if not mfus else f"{100 * summary['mean_mfu']:.1f}%")
            + f", {skipped_total} skipped, checkpoints {saved or 'none'}"
            + (f", stopped by {stopped_by}" if stopped_by else "")
        )
    return summary


def _handle_nonfinite(cfg: Config, step: int, metrics: dict, in_row: int) -> None:
    what = (
        f"non-finite loss or gradient at step {step} (loss {metrics['loss']}, grad norm "
        f"{metrics['grad_norm']})"
    )
    if cfg.train.nonfinite == "stop":
        raise TrainingStopped(f"{what}; train.nonfinite=stop")
    if in_row >= cfg.train.max_nonfinite_in_row:
        raise TrainingStopped(
            f"{what}: {in_row} steps in a row skipped (train.max_nonfinite_in_row = "
            f"{cfg.train.max_nonfinite_in_row}); stopping"
        )
    say(f"{what}: update skipped")
