"""Training: the train state, the step, the loop and checkpoints.

What a notebook needs is importable from here:

    from jaxmeg.training import Trainer
    trainer = Trainer(cfg)
    trainer.add_hook(lambda info: print(info.step, info.metrics["loss"]), every=10)
    for info in trainer.steps():
        ...
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Trainer": "jaxmeg.training.trainer",
    "train": "jaxmeg.training.trainer",
    "compile_only": "jaxmeg.training.trainer",
    "prepare": "jaxmeg.training.trainer",
    "StepInfo": "jaxmeg.training.hooks",
    "TrainingStopped": "jaxmeg.training.hooks",
    "compile_step": "jaxmeg.training.compilation",
    "memory_report": "jaxmeg.training.compilation",
    "Checkpointer": "jaxmeg.training.checkpoint",
    "Trainable": "jaxmeg.training.state",
    "init_state": "jaxmeg.training.state",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    # Imported on first use: `jaxmeg.training.links` and the other small modules stay cheap.
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jaxmeg.training' has no attribute {name!r}")
