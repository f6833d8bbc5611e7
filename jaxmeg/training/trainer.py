"""The training loop: dataset -> validated config -> mesh -> sharded state -> steps -> metrics."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmeg.config import Config, to_dict
from jaxmeg.parallel import make_mesh
from jaxmeg.training import partitioning
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


def _expected_vocab(cfg: Config) -> Config:
    """The config with the vocabulary it will train with when no dataset says otherwise: its
    own, else the default corpus's BPE size."""
    if cfg.model.vocab_size == -1:
        return with_vocab(cfg, cfg.data.tokenizer_vocab)
    return cfg


def prepare(cfg: Config, dataset=None, cluster_job=None, out_dir: str | None = None) -> Trainable:
    """Validated config (vocabulary from the dataset, else the config, else the default
    corpus's BPE size) -> placement and stage partition (`partitioning`) -> mesh -> Trainable."""
    cfg = with_vocab(cfg, dataset.vocab_size) if dataset is not None else _expected_vocab(cfg)
    layout = partitioning.resolve(cfg, cluster_job, out_dir)
    if cluster_job is not None:
        say(cluster_job.describe())
        say(layout.placement.describe())
    if layout.costs:
        costs = ", ".join(f"{c.per_layer_s:.3g}/layer + {c.fixed_s:.3g}" for c in layout.costs)
        say(
            f"stage_layers={cfg.parallel.stage_layers}: {list(layout.cfg.parallel.stage_layers)} "
            f"from the {layout.source} (stage costs {costs})"
        )
    return Trainable.create(layout.cfg, make_mesh(layout.cfg.parallel, placement=layout.placement))


def compile_only(cfg: Config, cluster_job=None) -> dict[str, Any]:
    """Compiles the train step for the configured mesh without data or running it."""
    dataset = open_dataset(cfg) if cfg.data.dataset else None
    trainable = prepare(cfg, dataset, cluster_job)
    compiled, seconds = compile_step(trainable)
    return {"compile_seconds": round(seconds, 3), **memory_report(compiled)}


class TrainingStopped(RuntimeError):
    """The run stopped on non-finite values (the message says which steps)."""


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_DEFAULT_HANDLERS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


class StopSignals:
    """SIGTERM / SIGINT ask the run to stop: it finishes the current step, checkpoints and
    returns (exit 0); a signal during start-up stops it before the first step.

    The first signal puts the default handlers back, so a second one ends a hung run at once.
    Python runs signal handlers only between bytecodes, so a main thread stuck in XLA would
    never run them; a watcher thread on the signal wake-up fd counts signals as they arrive
    and ends the process on the second one in that case too."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}
        self._wakeup: tuple[int, int, int] | None = None  # read fd, write fd, previous fd

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # handlers can only be installed from the main thread
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._start_watcher()
        return self

    def _handle(self, signum, _frame) -> None:
        # No printing here: the handler may interrupt the main thread inside a stderr write,
        # and a reentrant write raises. The watcher thread announces the signal instead.
        self.received = signum
        for sig in _STOP_SIGNALS:
            signal.signal(sig, _DEFAULT_HANDLERS[sig])

    def _start_watcher(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wakeup = (read_fd, write_fd, previous)
        threading.Thread(
            target=_exit_on_second_signal, args=(read_fd,), daemon=True, name="jaxmeg-signals"
        ).start()

    def stop_agreed(self) -> bool:
        """Whether to stop now. Every process gets the same answer: a signal can reach the
        processes of a job at different steps, and all must save the same step."""
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(local))))

    def name(self) -> str:
        if self.received is None:
            return "a signal to another process"
        return signal.Signals(self.received).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            _, write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the watcher reads end-of-file and returns


def _exit_on_second_signal(read_fd: int) -> None:
    seen = 0
    while byte := os.read(read_fd, 1):
        if byte[0] not in _STOP_SIGNALS:
            continue
        seen += 1
        if seen == 1:
            say(
                f"{signal.Signals(byte[0]).name}: finishing this step, then checkpointing and "
                f"exiting; send it again to stop at once"
            )
        if seen >= 2:
            name = signal.Signals(byte[0]).name
            print(f"jaxmeg: second {name}: exiting now, without a checkpoint", file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + byte[0])
    os.close(read_fd)


def _local_scalars(metrics) -> dict[str, float]:
    """Replicated scalar metrics as floats (each process reads its own copy)."""
    return {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}


@dataclasses.dataclass
class _Progress:
    """Where a run stands; the counters go into each checkpoint's meta and come back on resume."""

    first_step: int = 0
    step: int = 0
    skipped_steps: int = 0
    skipped_in_row: int = 0
    losses: list = dataclasses.field(default_factory=list)
    mfus: list = dataclasses.field(default_factory=list)
    checkpoints: list = dataclasses.field(default_factory=list)
    stopped_by: str | None = None

    def count(self, skipped: bool) -> None:
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        self.skipped_steps += int(skipped)


def _describe(trainable: Trainable, dataset) -> None:
    cfg = trainable.cfg
    d, p, t = (trainable.mesh.shape[a] for a in ("data", "pipe", "tensor"))
    say(
        f"{jax.device_count()} x {jax.devices()[0].device_kind} in {jax.process_count()} "
        f"process(es), mesh data={d} pipe={p} tensor={t}, vocab {cfg.model.vocab_size} "
        f"(padded {trainable.vocab}), batch {cfg.train.global_batch} = {d} x "
        f"{cfg.train.microbatches} x {cfg.train.microbatch_size}, {dataset.num_tokens:,} tokens"
    )
    if p > 1:
        say(f"pipeline {cfg.parallel.schedule}: {trainable.layout.describe()}")


def _meta(trainable: Trainable, loader, progress: _Progress) -> dict[str, Any]:
    from jaxmeg.training.checkpoint import schedule_of

    cfg = trainable.cfg
    return {
        "step": progress.step,
        "loader": loader.state(),
        "seed": cfg.train.seed,
        "schedule": schedule_of(cfg),
        "skipped_steps": progress.skipped_steps,
        "skipped_in_row": progress.skipped_in_row,
        "mesh": {**trainable.mesh.shape, "chunks": cfg.parallel.chunks},
        "config": to_dict(cfg),
    }


def _open_checkpointer(out_dir: str, trainable: Trainable, resume: bool):
    from jaxmeg.training.checkpoint import Checkpointer

    directory = Path(out_dir) / "checkpoints"
    checkpointer = Checkpointer(directory, trainable, trainable.cfg.checkpoint.keep)
    steps = checkpointer.steps()
    if not resume and steps:
        checkpointer.close()
        raise ValueError(
            f"{out_dir} already holds checkpoints {steps}; resume, or pass another --out "
            f"(nothing is overwritten)"
        )
    return checkpointer


def _resume(checkpointer, trainable: Trainable, loader, progress: _Progress):
    """The restored train state (None when there is no checkpoint); sets loader and counters."""
    from jaxmeg.training.checkpoint import schedule_changes

    restored = checkpointer.restore_latest()
    if restored is None:
        return None
    step, state, meta = restored
    loader.restore(meta["loader"])
    progress.first_step = progress.step = step
    progress.skipped_steps = int(meta.get("skipped_steps", 0))
    progress.skipped_in_row = int(meta.get("skipped_in_row", 0))
    say(f"resumed from step {step} in {checkpointer.directory}")
    changes = schedule_changes(meta, trainable.cfg)
    if changes:
        say(
            "warning: the learning-rate schedule differs from the checkpoint's ("
            + ", ".join(changes)
            + "); continuing with this run's"
        )
    return state


def train(
    cfg: Config,
    *,
    out_dir: str | None = None,
    resume: bool = True,
    metrics_file: str | None = None,
    show_progress: bool = True,
    cluster_job=None,
) -> dict[str, Any]:
    """Trains up to step `cfg.train.steps` and returns a summary with the per-step losses.

    With `out_dir`: resumes from its newest readable checkpoint (unless `resume` is False),
    saves every `checkpoint.every` steps, at the end and on SIGTERM/SIGINT, and writes
    TensorBoard event files and metrics.jsonl there. `cluster_job` (a
    `jaxmeg.parallel.cluster_job.ClusterJob`) places the devices by node group. The signal
    handlers are installed first,
    so a signal during start-up (data preparation, restore, compile) also ends the run cleanly.
    """
    with StopSignals() as signals:
        return _train(cfg, signals, out_dir, resume, metrics_file, show_progress, cluster_job)


def _train(
    cfg, signals, out_dir, resume, metrics_file, show_progress, cluster_job
) -> dict[str, Any]:
    from jaxmeg.data import BatchLoader

    # Bad layouts and batches are reported before the dataset is built (minutes of tokenizing on
    # a first run), with the vocabulary the data is expected to have; the real one follows.
    partitioning.resolve(_expected_vocab(cfg), cluster_job, partition=False)
    dataset = open_dataset(cfg, show_progress)
    trainable = prepare(cfg, dataset, cluster_job, out_dir)
    cfg = trainable.cfg
    _describe(trainable, dataset)
    loader = BatchLoader(dataset, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed)
    progress = _Progress()
    checkpointer = state = log = None
    try:
        if out_dir is not None:
            checkpointer = _open_checkpointer(out_dir, trainable, resume)
            state = _resume(checkpointer, trainable, loader, progress) if resume else None
            metrics_file = metrics_file or str(Path(out_dir) / "metrics.jsonl")
        log = RunLog(
            cfg.train.steps, progress.first_step, metrics_file,
            Path(out_dir) / "tensorboard" if out_dir else None, show_progress, cfg.train.log_every,
            resumed=out_dir is not None,
        )  # fmt: skip
        start_time = time.perf_counter()
        compile_seconds = 0.0
        if signals.stop_agreed():
            progress.stopped_by = signals.name()
        else:
            if state is None:
                with jax.set_mesh(trainable.mesh):
                    state = init_state(trainable, cfg.train.seed)
            compiled, compile_seconds = compile_step(trainable)
            say(f"train step compiled in {compile_seconds:.1f} s")
            state = _run_steps(
                trainable, compiled, state, loader, progress, log, checkpointer, signals
            )
        if checkpointer and progress.step > progress.first_step:
            _save_final(checkpointer, trainable, state, loader, progress)
    finally:
        if log:
            log.close()
        if checkpointer:
            checkpointer.close()
    return _summary(cfg, progress, time.perf_counter() - start_time, compile_seconds)


def _save_final(checkpointer, trainable: Trainable, state, loader, progress: _Progress) -> None:
    """Saves the last step (unless `checkpoint.every` just did) and waits until it is on disk."""
    if progress.step in progress.checkpoints:
        return
    checkpointer.save(progress.step, state, _meta(trainable, loader, progress), wait=True)
    progress.checkpoints.append(progress.step)


def _run_steps(trainable, compiled, state, loader, progress, log, checkpointer, signals):
    """Steps until train.steps or an agreed stop; returns the last state."""
    cfg = trainable.cfg
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    flops_per_step = model_flops_per_step(cfg.model, cfg.train.global_batch)
    peak = peak_tflops_per_device()
    while progress.step < cfg.train.steps:
        if signals.stop_agreed():
            progress.stopped_by = signals.name()
            break
        inputs, targets = global_batch_arrays(loader, progress.step, trainable.batch_sharding())
        step_start = time.perf_counter()
        with jax.set_mesh(trainable.mesh):
            state, metrics = compiled(state, inputs, targets)
        metrics = _local_scalars(metrics)
        seconds = time.perf_counter() - step_start
        progress.step += 1
        loader.step = progress.step
        progress.count(bool(metrics["skipped"]))
        tflops = flops_per_step / seconds / jax.device_count() / 1e12
        record = {
            "step": progress.step,
            **metrics,
            "skipped_steps": progress.skipped_steps,
            "step_seconds": seconds,
            "tokens_per_sec": tokens_per_step / seconds,
            "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None,
        }
        progress.losses.append(metrics["loss"])
        if record["mfu"] is not None:
            progress.mfus.append(record["mfu"])
        log.record(record)
        if metrics["skipped"]:
            _handle_nonfinite(cfg, progress.step, metrics, progress.skipped_in_row)
        if checkpointer and cfg.checkpoint.every and progress.step % cfg.checkpoint.every == 0:
            checkpointer.save(progress.step, state, _meta(trainable, loader, progress))
            progress.checkpoints.append(progress.step)
    return state


def _summary(cfg: Config, progress: _Progress, seconds: float, compile_seconds: float) -> dict:
    steps = progress.step - progress.first_step
    tokens = cfg.train.global_batch * cfg.model.seq_len * steps
    summary = {
        "first_step": progress.first_step,
        "steps": steps,
        "last_step": progress.step,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "compile_seconds": round(compile_seconds, 2),
        "mean_mfu": float(np.mean(progress.mfus)) if progress.mfus else None,
        "skipped_steps": progress.skipped_steps,
        "checkpoints": progress.checkpoints,
        "stopped_by": progress.stopped_by,
        "losses": progress.losses,
    }
    stopped = f", stopped by {progress.stopped_by}" if progress.stopped_by else ""
    if not progress.losses:
        say(f"no step trained (at step {progress.step}){stopped}")
        return summary
    losses = progress.losses
    say(
        f"{steps} steps ({progress.first_step} -> {progress.step}), {tokens:,} tokens in "
        f"{seconds:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}, mean MFU "
        + ("n/a" if not progress.mfus else f"{100 * summary['mean_mfu']:.1f}%")
        + f", {progress.skipped_steps} skipped, checkpoints {progress.checkpoints or 'none'}"
        + stopped
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
