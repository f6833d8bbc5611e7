"""Where a run's metrics go: the terminal progress bar, JSON lines and TensorBoard event files.
Only process 0 writes anything.

A resumed run first drops what the interrupted run recorded after the step it resumes from
(those steps are trained again), so metrics.jsonl and TensorBoard hold each step once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax

from jaxmeg import paths


def say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxmeg: {message}", file=sys.stderr, flush=True)


def _recorded_at_or_before(line: str, step: int) -> bool:
    """Whether `line` is a complete record of a step <= `step` (a torn last line is not)."""
    if not line.endswith("\n"):
        return False
    try:
        return int(json.loads(line)["step"]) <= step
    except (ValueError, KeyError, TypeError):
        return False


def drop_records_after(path: str | Path, step: int) -> None:
    """Keeps the JSON lines of steps <= `step`; drops later ones and a torn last line."""
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _recorded_at_or_before(line, step)]
    if kept == lines:
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(kept))
    os.replace(temporary, path)  # atomic: a crash here leaves the old or the new file


@contextlib.contextmanager
def _named_os_errors(metrics_file: str):
    """An OS error on the metrics file (a full disk, /dev/full, a directory gone) as one line."""
    try:
        yield
    except OSError as err:
        raise paths.os_error(err, metrics_file, "metrics file") or err from err


class RunLog:
    def __init__(
        self,
        total_steps: int,
        first_step: int,
        metrics_file: str | None,
        tensorboard_dir: str | Path | None,
        progress: bool,
        log_every: int = 1,
        resumed: bool = False,
    ):
        """With `resumed`, records of steps after `first_step` (left by the interrupted run,
        about to be trained again) are dropped from the metrics file and TensorBoard, and the
        rest kept; otherwise the metrics file starts empty, so it never mixes two runs."""
        self.log_every = log_every
        lead = jax.process_index() == 0
        if metrics_file and lead and resumed:
            drop_records_after(metrics_file, first_step)
        mode = "a" if resumed else "w"
        self.metrics_file = metrics_file
        self.sink = None
        if metrics_file and lead:
            with _named_os_errors(metrics_file):
                self.sink = open(metrics_file, mode)
        self.writer = None
        if tensorboard_dir is not None and lead:
            from tensorboardX import SummaryWriter

            # purge_step makes TensorBoard discard earlier events of steps >= first_step + 1.
            purge_step = first_step + 1 if resumed else None
            self.writer = SummaryWriter(str(tensorboard_dir), purge_step=purge_step)
        self.bar = None
        if progress and lead:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=first_step, unit="step", dynamic_ncols=True,
                file=sys.stderr,
            )  # fmt: skip

    def record(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step % self.log_every == 0:
            if self.sink:
                with _named_os_errors(self.metrics_file):
                    self.sink.write(json.dumps(record) + "\n")
                    self.sink.flush()
            if self.writer:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.writer.add_scalar(f"train/{key}", value, step)
                    if isinstance(value, list):  # one per layer (moe_load_spread)
                        for i, v in enumerate(value):
                            self.writer.add_scalar(f"train/{key}/layer_{i}", v, step)
        if self.bar is not None:
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
        if self.sink:
            try:
                self.sink.close()
            except OSError:  # a failed flush of a full disk, already reported by record()
                pass
        if self.writer:
            self.writer.close()
