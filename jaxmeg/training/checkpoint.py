"""Checkpoints that any mesh can read, written atomically, with a fallback past bad ones.

What is saved (orbax `CheckpointManager`, one directory per step): the train state (params,
optimizer state, step) in CANONICAL layout -- layer stacks as [layers, ...], whatever the pipe
size and chunks of the run that wrote them -- and a JSON item with the data-loader state, the
seed, the config and the mesh. Orbax writes each step to a temporary directory and renames it
when complete, so a crash or `kill -9` mid-save leaves no half-written step behind that the
next start would read.

Restore walks the steps newest first. A step that fails to read is reported (step and path),
moved aside to `<step>.unreadable` (kept for inspection, never deleted) and the next older step
is tried. Restoring onto another mesh is orbax resharding the canonical arrays onto the new
shardings, then a reshape into the new run's pipeline layout.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxmeg.parallel import named
from jaxmeg.training.state import (
    Trainable,
    abstract_state,
    canonical_specs,
    state_shardings,
    to_canonical_layout,
    to_pipeline_layout,
)


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxmeg: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """Saves and restores one run's train state under `directory`."""

    def __init__(self, directory: str | Path, trainable: Trainable, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.trainable = trainable
        self.keep = keep
        self.manager = self._open_manager()
        canonical = named(trainable.mesh, canonical_specs(trainable))
        pipe, chunks = trainable.pipe, trainable.chunks
        self._to_canonical = jax.jit(
            lambda s: to_canonical_layout(s, pipe), out_shardings=canonical
        )
        self._to_pipeline = jax.jit(
            lambda s: to_pipeline_layout(s, pipe, chunks), out_shardings=state_shardings(trainable)
        )
        self._abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(lambda s: to_canonical_layout(s, pipe), abstract_state(trainable)),
            canonical,
        )

    def _open_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True)
        return ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict[str, Any], wait: bool = False) -> None:
        """Starts an asynchronous save of `state` at `step` (waits for it if `wait`)."""
        canonical = self._to_canonical(state)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(meta)
        )
        self.manager.save(step, args=args, force=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore_latest(self) -> tuple[int, Any, dict] | None:
        """(step, state in this run's layout, meta) of the newest readable step, or None."""
        for step in reversed(self.steps()):
            path = self.directory / str(step)
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(self._abstract), meta=ocp.args.JsonRestore()
                    ),
                )
                meta = dict(restored["meta"])
                self._check_compatible(meta, path)
                return step, self._to_pipeline(restored["state"]), meta
            except (IncompatibleCheckpoint, KeyboardInterrupt):
                raise
            except Exception as err:  # noqa: BLE001 - any failure to read means "unreadable"
                _say(
                    f"checkpoint of step {step} at {path} is unreadable "
                    f"({type(err).__name__}: {str(err)[:300]}); moving it aside and falling "
                    f"back to the previous checkpoint"
                )
                self._move_aside(path)
        return None

    def _check_compatible(self, meta: dict, path: Path) -> None:
        saved = meta.get("padded_vocab")
        if saved is not None and saved != self.trainable.vocab:
            raise IncompatibleCheckpoint(
                f"checkpoint {path} has a padded vocabulary of {saved} rows, this run pads to "
                f"{self.trainable.vocab} (model.vocab_multiple * parallel.tensor); choose a "
                f"tensor size that pads the same"
            )

    def _move_aside(self, path: Path) -> None:
        if jax.process_index() == 0 and path.exists():
            os.replace(path, path.with_name(f"{path.name}.unreadable-{int(time.time())}"))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxmeg-checkpoint-moved-aside")
        self.manager = self._open_manager()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class IncompatibleCheckpoint(ValueError):
    """A readable checkpoint that this run's configuration cannot take."""
