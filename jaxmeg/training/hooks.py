"""What a run does around its steps, as hooks: each is called with the step's `StepInfo` every
`every` steps. The trainer's own (metrics, checkpoints) are hooks like a user's; a notebook adds
its own with `Trainer.add_hook(fn, every=n)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxmeg.config import Config
from jaxmeg.training.run_log import say


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One finished step.

    step: optimizer steps done (the step just finished is `step`).
    metrics: the step's record as floats: loss, grad_norm, lr, skipped, skipped_steps,
        step_seconds, tokens_per_sec, tflops_per_device, mfu (None without a known peak).
    state: the train state after the step, only for hooks added with `needs_state=True` (the
        loop keeps the next step waiting for them); else None, as the next step may already
        be running on it.
    """

    step: int
    metrics: dict[str, Any]
    state: Any = None


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[StepInfo], None]
    every: int = 1
    needs_state: bool = False

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


class TrainingStopped(RuntimeError):
    """The run stopped on non-finite values (the message says which steps)."""


def check_finite(cfg: Config, step: int, metrics: dict, in_row: int) -> None:
    """After a step whose update was skipped (non-finite loss or gradient): a line, or
    TrainingStopped under `train.nonfinite=stop` or past `train.max_nonfinite_in_row`."""
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
