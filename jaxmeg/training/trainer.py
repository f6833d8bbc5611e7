"""The training loop as a library: `Trainer` runs one run step by step (a notebook iterates
`steps()` and adds hooks), `train` runs it to the end (the CLI).

Start-up: dataset -> validated config -> mesh -> sharded state (restored from the run's newest
checkpoint, else initialised) -> compiled step. Nothing is written before the first step: a stop
signal during start-up leaves no checkpoint directory, metrics file or TensorBoard events.
The loop dispatches step n + 1 before it reads step n's scalars, so the host never stalls the
device; a step whose state a hook needs (a checkpoint) is finished before the next is dispatched.
So is a step that evaluates the held-out split (`train.eval_every`): its `eval_loss` and
`eval_perplexity` join that step's metrics record (`jaxmeg.training.evaluation`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmeg.config import Config, to_dict
from jaxmeg.config_moe import LAYER_KINDS
from jaxmeg.config_validation import check_attention_runs_here
from jaxmeg.parallel import distributed, make_mesh
from jaxmeg.parallel.mesh import mesh_words
from jaxmeg.training import partitioning, pipeline_step
from jaxmeg.training.batches import (
    DEFAULT_CORPUS,
    expected_vocab,
    global_batch_arrays,
    open_dataset,
    with_vocab,
)
from jaxmeg.training.compilation import compile_step, memory_report
from jaxmeg.training.flops import model_flops_per_step, peak_tflops_per_device
from jaxmeg.training.hooks import Hook, StepInfo, TrainingStopped, check_finite
from jaxmeg.training.run_log import RunLog, say
from jaxmeg.training.signals import StopSignals
from jaxmeg.training.state import Trainable, init_state

__all__ = [
    "StepInfo", "Trainer", "TrainingStopped", "compile_only", "compile_step", "memory_report",
    "prepare", "train", "with_vocab",
]  # fmt: skip


def prepare(
    cfg: Config, dataset=None, cluster_job=None, out_dir: str | None = None, devices=None
) -> Trainable:
    """Validated config (vocabulary from the dataset, else the config, else the default
    corpus's BPE size) -> placement and stage partition (`partitioning`) -> mesh over `devices`
    (default: jax's; compile-only GPUs of a `GpuTarget`) -> Trainable."""
    cfg = with_vocab(cfg, dataset.vocab_size) if dataset is not None else expected_vocab(cfg)
    layout = partitioning.resolve(cfg, cluster_job, out_dir, devices=devices)
    if cluster_job is not None:
        say(cluster_job.describe())
        say(layout.placement.describe())
    if layout.costs:
        costs = ", ".join(f"{c.per_layer_s:.3g}/layer + {c.fixed_s:.3g}" for c in layout.costs)
        say(
            f"stage_layers={cfg.parallel.stage_layers}: {list(layout.cfg.parallel.stage_layers)} "
            f"from the {layout.source} (stage costs {costs})"
        )
    mesh = make_mesh(layout.cfg.parallel, devices, placement=layout.placement)
    return Trainable.create(layout.cfg, mesh)


def compile_only(cfg: Config, cluster_job=None, target=None) -> dict[str, Any]:
    """Compiles the train step for the configured mesh without data or running it: compile
    time and per-device memory. With `target` (a `jaxmeg.parallel.gpu_target.GpuTarget`), for
    its GPUs: also whether the step fits their memory and the planner's prediction beside it
    (`jaxmeg.training.fit`)."""
    dataset = None if cfg.data.dataset in DEFAULT_CORPUS else open_dataset(cfg)
    trainable = prepare(cfg, dataset, cluster_job, devices=target.devices if target else None)
    compiled, seconds = compile_step(trainable)
    report = {"compile_seconds": round(seconds, 3), **memory_report(compiled)}
    if target is not None:
        from jaxmeg.training.fit import fit_report

        report.update(fit_report(trainable, compiled, target))
    return report


def _local_scalars(metrics) -> dict[str, float]:
    """Replicated metrics as floats, a vector's as a list (each process reads its own copy)."""
    values = {k: np.asarray(v.addressable_data(0)) for k, v in metrics.items()}
    return {k: float(v) if v.ndim == 0 else v.tolist() for k, v in values.items()}


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
    d, p = trainable.mesh.shape["data"], trainable.mesh.shape["pipe"]
    say(
        f"{jax.device_count()} x {jax.devices()[0].device_kind} in {jax.process_count()} "
        f"process(es), mesh {mesh_words(trainable.mesh)}, vocab {cfg.model.vocab_size} "
        f"(padded {trainable.vocab}), batch {cfg.train.global_batch} = {d} x "
        f"{cfg.train.microbatches} x {cfg.train.microbatch_size}, {dataset.num_tokens:,} tokens"
    )
    if p > 1:
        say(f"pipeline {cfg.parallel.schedule}: {trainable.layout.describe()}")
    if cfg.moe.experts:
        summed_once = pipeline_step.splits_experts(trainable)
        say(experts_words(trainable.moe_cfg, trainable.mesh.shape["expert"], summed_once))
        if not all(cfg.moe.kinds(cfg.model.layers)):
            say(layers_words(cfg.moe, cfg.model.layers))


def experts_words(moe, expert: int, summed_once: bool = False) -> str:
    """The start-up line of an MoE run: how its experts run as settled for the devices
    (`Trainable.moe_cfg`: `moe.grouped_gemm` and `moe.exchange` past `auto`), and with an
    expert axis where the dense gradients are summed over it (`summed_once`:
    `pipeline_step.splits_experts`)."""
    words = f"experts: {moe.experts} per MoE layer, top-{moe.top_k}"
    if expert > 1:
        words += f", {moe.experts // expert} per device over expert={expert}"
    if moe.capacity_factor:
        words += f", capacity factor {moe.capacity_factor:g} (batched GEMMs)"
    else:
        words += f", dropless, grouped GEMMs {moe.grouped_gemm}"
    if expert > 1 and not moe.capacity_factor:
        how = "ragged all-to-all" if moe.exchange == "ragged" else "all-to-all in bounded blocks"
        words += f", tokens by {how}"
    if expert > 1:
        when = "once per step" if summed_once else "in each microbatch's backward"
        words += f"; dense gradients summed over expert {when}"
    return words


def layers_words(moe, layers: int) -> str:
    """Where an MoE model's dense layers are, and how its layer stack holds them."""
    kinds = moe.kinds(layers)
    unit = ", ".join(LAYER_KINDS[kind] for kind in moe.unit)
    entries = (layers - moe.dense_layers) // len(moe.unit)
    words = f"MoE in {sum(kinds)} of {layers} layers; "
    if moe.dense_layers:
        words += f"{moe.dense_layers} dense leading with the embedding, then "
    return words + f"{entries} stack entries of [{unit}]"


def _meta(trainable: Trainable, loader, progress: _Progress) -> dict[str, Any]:
    from jaxmeg.training.checkpoint_meta import schedule_of

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
    from jaxmeg.training.checkpoint_meta import routing_changes, schedule_changes

    restored = checkpointer.restore_latest()
    if restored is None:
        return None
    step, state, meta = restored
    if meta.get("loader") is not None:
        loader.restore(meta["loader"])
    elif step:
        raise ValueError(f"the checkpoint of step {step} records no data loader position")
    progress.first_step = progress.step = step
    progress.skipped_steps = int(meta.get("skipped_steps", 0))
    progress.skipped_in_row = int(meta.get("skipped_in_row", 0))
    say(f"resumed from step {step} in {checkpointer.directory}")
    for what, changes in (
        ("the learning-rate schedule", schedule_changes(meta, trainable.cfg)),
        ("the experts' routing", routing_changes(meta, trainable.cfg)),
    ):
        if changes:
            say(
                f"warning: {what} differs from the checkpoint's ({', '.join(changes)}); "
                f"continuing with this run's"
            )
    return state


class Trainer:
    """One run. `Trainer(cfg, out_dir=...)` prepares the data, mesh and layout; `steps()`
    restores or initialises the state, compiles the step and yields a `StepInfo` per step;
    `run()` does that to `train.steps` (or a stop signal), saves the last step and returns a
    summary. With `out_dir` it resumes from the newest readable checkpoint (unless `resume` is
    False), checkpoints every `checkpoint.every` steps and writes metrics.jsonl and TensorBoard
    events there. `signals`: a `StopSignals` the caller entered (the CLI), else none is heeded.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        out_dir: str | None = None,
        resume: bool = True,
        metrics_file: str | None = None,
        show_progress: bool = True,
        cluster_job=None,
        signals: StopSignals | None = None,
    ):
        from jaxmeg.data import BatchLoader

        # Bad layouts and batches are reported before the dataset is built (minutes of
        # tokenizing on a first run), with the vocabulary the data is expected to have.
        partitioning.resolve(expected_vocab(cfg), cluster_job, partition=False)
        check_attention_runs_here(cfg, jax.devices()[0].platform)
        self.dataset = open_dataset(cfg, show_progress)
        self.trainable = prepare(cfg, self.dataset, cluster_job, out_dir)
        self.cfg = cfg = self.trainable.cfg
        _describe(self.trainable, self.dataset)
        self.loader = BatchLoader(
            self.dataset, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
            cfg.data.eval_fraction,
        )  # fmt: skip
        self.evaluator = None
        if cfg.train.eval_every:
            from jaxmeg.training.evaluation import Evaluator

            held_out = self.loader.held_out()
            self.evaluator = Evaluator(self.trainable, held_out, cfg.train.eval_batches)
        self.out_dir, self.resume, self.show_progress = out_dir, resume, show_progress
        if out_dir is not None:
            say(f"run directory {out_dir}: checkpoints/, metrics.jsonl, tensorboard/")
        default_metrics = str(Path(out_dir) / "metrics.jsonl") if out_dir else None
        self.metrics_file = metrics_file or default_metrics
        self.signals = signals or StopSignals()
        self.progress = _Progress()
        self.state = self.compiled = self.checkpointer = self.log = None
        self.compile_seconds = 0.0
        self.peer_watch = distributed.watch_peers()
        self.hooks: list[Hook] = []
        self._last_ready = 0.0
        if out_dir is not None:
            self.add_hook(self._save_checkpoint, every=cfg.checkpoint.every, needs_state=True)

    def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1, needs_state=False):
        """Calls `fn(StepInfo)` after every `every`-th step (0 = never)."""
        self.hooks.append(Hook(fn, every, needs_state))

    # -- start-up ------------------------------------------------------------------------------

    def start(self) -> bool:
        """Restores (or initialises) the state and compiles the step; False when a stop signal
        came first (then nothing was compiled after it, and nothing was written)."""
        if self.compiled is not None:
            return True
        if self.out_dir is not None and (Path(self.out_dir) / "checkpoints").exists():
            self.checkpointer = _open_checkpointer(self.out_dir, self.trainable, self.resume)
            if self.resume:
                self.state = _resume(self.checkpointer, self.trainable, self.loader, self.progress)
        if self.state is not None and self.progress.step >= self.cfg.train.steps:
            say(f"the checkpoint is at step {self.progress.step} and the run stops at step "
                f"{self.cfg.train.steps} (--steps / train.steps): nothing to train, nothing "
                f"compiled or written")  # fmt: skip
            return False
        if self._stopped():
            return False
        if self.out_dir is not None:
            from jaxmeg.training.checkpoint import check_room

            check_room(Path(self.out_dir) / "checkpoints", self.trainable)
        if self.state is None:
            with jax.set_mesh(self.trainable.mesh):
                self.state = init_state(self.trainable, self.cfg.train.seed)
        self.compiled, self.compile_seconds = compile_step(self.trainable)
        say(f"train step compiled in {self.compile_seconds:.1f} s")
        # once per run, not per step: the MFU's numerator and the device's peak
        flops = model_flops_per_step(self.cfg.model, self.cfg.train.global_batch, moe=self.cfg.moe)
        self._flops_per_device = flops / jax.device_count()
        self._peak_tflops = peak_tflops_per_device()
        return not self._stopped()

    def _stopped(self) -> bool:
        if self.signals.stop_agreed():
            self.progress.stopped_by = self.signals.name()
            return True
        return False

    def _open_log(self) -> RunLog:
        """The metrics sinks, opened at the first step (so the progress bar's rate and ETA
        count steps, not the compile)."""
        if self.log is None:
            cfg, out = self.cfg, self.out_dir
            if out is not None and jax.process_index() == 0:
                Path(out).mkdir(parents=True, exist_ok=True)
            self.log = RunLog(
                cfg.train.steps, self.progress.first_step, self.metrics_file,
                Path(out) / "tensorboard" if out else None, self.show_progress,
                cfg.train.log_every, resumed=out is not None,
            )  # fmt: skip
        return self.log

    # -- the loop ------------------------------------------------------------------------------

    def steps(self) -> Iterator[StepInfo]:
        """Trains until `train.steps` or an agreed stop signal, yielding each finished step."""
        if not self.start():
            return
        self._open_log()
        self._last_ready = time.perf_counter()
        pending = None
        while self.progress.step < self.cfg.train.steps and not self._stopped():
            current = self._dispatch()
            if pending is not None:
                yield self._finish(*pending)
                pending = None
            if self._evaluates(current[0]) or any(
                h.needs_state and h.due(current[0]) for h in self.hooks
            ):
                yield self._finish(*current, state=self.state)
            else:
                pending = current
        if pending is not None:
            yield self._finish(*pending)

    def _dispatch(self):
        """Starts the next step on the devices; returns (step, metrics arrays, start time)."""
        step = self.progress.step
        inputs, targets = global_batch_arrays(self.loader, step, self.trainable.batch_sharding())
        started = time.perf_counter()
        with jax.set_mesh(self.trainable.mesh):
            self.state, metrics = self.compiled(self.state, inputs, targets)
        self.progress.step = self.loader.step = step + 1
        return step + 1, metrics, started

    def _evaluates(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return self.evaluator is not None and step % every == 0

    def _finish(self, step: int, metrics, started: float, state=None) -> StepInfo:
        """Reads a dispatched step's scalars (waiting for it), records and checks them, runs the
        hooks due."""
        cfg, progress = self.cfg, self.progress
        scalars = _local_scalars(metrics)
        ready = time.perf_counter()
        seconds = ready - max(started, self._last_ready)
        self._last_ready = ready
        progress.count(bool(scalars["skipped"]))
        tflops = self._flops_per_device / seconds / 1e12
        peak = self._peak_tflops
        record = {
            "step": step,
            **scalars,
            "skipped_steps": progress.skipped_steps,
            "step_seconds": seconds,
            "tokens_per_sec": cfg.train.global_batch * cfg.model.seq_len / seconds,
            "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None,
        }
        if state is not None and self._evaluates(step):
            held_out = self.evaluator(state["params"])
            record.update(eval_loss=held_out["loss"], eval_perplexity=held_out["perplexity"])
        progress.losses.append(scalars["loss"])
        if record["mfu"] is not None:
            progress.mfus.append(record["mfu"])
        self._open_log().record(record)
        if scalars["skipped"]:
            check_finite(cfg, step, scalars, progress.skipped_in_row)
        info = StepInfo(step, record)
        for hook in self.hooks:
            if hook.due(step):
                hook.fn(dataclasses.replace(info, state=state) if hook.needs_state else info)
        return info

    # -- checkpoints and the end ---------------------------------------------------------------

    def _save_checkpoint(self, info: StepInfo, wait: bool = False) -> None:
        if self.checkpointer is None:  # the run's first checkpoint creates the directory
            self.checkpointer = _open_checkpointer(self.out_dir, self.trainable, self.resume)
        meta = _meta(self.trainable, self.loader, self.progress)
        self.checkpointer.save(info.step, info.state, meta, wait=wait)
        self.progress.checkpoints.append(info.step)

    def run(self) -> dict[str, Any]:
        """Trains to the end (see the class docstring) and returns the summary."""
        start = time.perf_counter()
        try:
            for _ in self.steps():
                pass
            progress = self.progress
            if self.out_dir is not None and progress.step > progress.first_step:
                if progress.step not in progress.checkpoints:
                    self._save_checkpoint(StepInfo(progress.step, {}, self.state), wait=True)
                self.checkpointer.wait()
        except Exception as err:
            if distributed.is_peer_loss(err):  # before closing waits on the lost peer
                distributed.exit_on_peer_loss(err)
            raise
        finally:
            self.close()
        summary = _summary(self.cfg, self.progress, time.perf_counter() - start,
                           self.compile_seconds)  # fmt: skip
        if self.out_dir is not None and self.progress.checkpoints:
            out = self.out_dir
            say(f"saved in {out}; next: scripts/generate.py --out {out} --prompt TEXT "
                f"--max-new-tokens N, scripts/evaluate.py --out {out}")  # fmt: skip
        return summary

    def close(self) -> None:
        if self.peer_watch:
            self.peer_watch.stop()
        if self.log:
            self.log.close()
        if self.checkpointer:
            self.checkpointer.close()


def train(cfg: Config, *, out_dir: str | None = None, **options) -> dict[str, Any]:
    """Trains up to step `cfg.train.steps` and returns a summary with the per-step losses:
    `Trainer(cfg, out_dir=..., **options).run()` (options: resume, metrics_file,
    show_progress, cluster_job). SIGTERM/SIGINT handlers are installed first, so a signal during
    start-up (data preparation, restore, compile) also ends the run cleanly, having written
    nothing."""
    with StopSignals(checkpointing=out_dir is not None) as signals:
        return Trainer(cfg, out_dir=out_dir, signals=signals, **options).run()


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
        f"{seconds:.1f} s (of it {compile_seconds:.1f} s compiling the step), loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}, mean MFU "
        + ("n/a" if not progress.mfus else f"{100 * summary['mean_mfu']:.1f}%")
        + f", {progress.skipped_steps} skipped, checkpoints {progress.checkpoints or 'none'}"
        + stopped
    )
    return summary
