"""Where a run's metrics go: the terminal progress bar, JSON lines and TensorBoard event files.
Only process 0 writes anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax


def say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxmeg: {message}", file=sys.stderr, flush=True)


class RunLog:
    def __init__(
        self,
        total_steps: int,
        first_step: int,
        metrics_file: str | None,
        tensorboard_dir: str | Path | None,
        progress: bool,
        log_every: int = 1,
    ):
        self.log_every = log_every
        lead = jax.process_index() == 0
        self.sink = open(metrics_file, "a") if metrics_file and lead else None
        self.writer = None
        if tensorboard_dir is not None and lead:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard_dir))
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
                self.sink.write(json.dumps(record) + "\n")
                self.sink.flush()
            if self.writer:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.writer.add_scalar(f"train/{key}", value, step)
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
            self.sink.close()
        if self.writer:
            self.writer.close()
