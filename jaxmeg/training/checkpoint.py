"""Checkpoints that any mesh can read, written atomically, with a fallback past corrupt ones.

What is saved (orbax `CheckpointManager`, one directory per step):
- `state`: params, optimizer state (AdamW moments and counts) and the step, in a CANONICAL layout
  that no mesh choice changes. Layer stacks are [layers, ...] whatever the pipe size and chunks.
  Vocabulary dims (embedding rows, unembedding columns and their Adam moments) are trimmed to
  `model.vocab_size`, because the padding up to a multiple of `vocab_multiple * tensor` depends on
  the tensor size. Restore zero-pads them again: no input token selects a padded row and padded
  logits are masked out of the loss (`cross_entropy`), so those rows carry no information.
- `meta` (JSON): the data-loader state, the seed, the resolved config and learning-rate schedule,
  the mesh, and the non-finite-step counters.

RNG: nothing draws random numbers after initialisation (dropout is not implemented, see
`model.dropout`). The parameter init uses `train.seed` once, and the loader derives each epoch's
order from (seed, epoch), so the seed and the loader step in `meta` are the whole random state of
a run; no PRNG key is saved because none is used.

Orbax writes each step to a temporary directory and renames it when complete, so a crash or
`kill -9` mid-save leaves no half-written step behind that the next start would read.

Restore reads a step's small `meta` first and refuses, touching nothing, a checkpoint written for
another model shape (`IncompatibleCheckpoint` names the field, both values and the path). A step
that cannot be read is reported (step and path), moved aside to `<step>.unreadable-<time>` (kept
for inspection, never deleted) and the next older step is tried -- but only while an older step
exists: the oldest is never moved, and if it cannot be read either the run stops with
`UnreadableCheckpoint` instead of silently starting again from step 0. Restoring onto another
mesh is orbax resharding the canonical arrays onto the new shardings, then zero-padding and a
reshape into the new run's pipeline layout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxmeg import paths
from jaxmeg.parallel import named
from jaxmeg.pipeline.powersgd import leaf_key
from jaxmeg.training.checkpoint_meta import IncompatibleCheckpoint, check_compatible
from jaxmeg.training.run_log import say
from jaxmeg.training.state import (
    NO_VOCAB_DIM,
    Trainable,
    abstract_state,
    canonical_specs,
    initial_link_state,
    state_shardings,
    to_canonical_layout,
    to_stage_layout,
    vocab_dims,
)


class UnreadableCheckpoint(RuntimeError):
    """No checkpoint in the directory can be read, and none is left to fall back to."""


_REPR_MARKERS = (" See full TensorStore details", " [tensorstore_spec", "TensorStore({", " {'")


ITEM_NAMES = ("state", "meta", "links")
"""The items of a checkpoint step: the train state (canonical layout), its metadata (JSON: the
config, the schedule) and the compression state."""


def read_meta(checkpoints: str | Path, step: int | None = None) -> tuple[int, dict] | None:
    """(step, meta) of checkpoint `step` (default: the newest) under the `checkpoints`
    directory, read without the state; None where it holds no checkpoint."""
    manager = ocp.CheckpointManager(Path(checkpoints).absolute(), item_names=ITEM_NAMES)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            return None
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return step, dict(manager.restore(step, args=args)["meta"])
    finally:
        manager.close()


def read_error_reason(err: Exception, limit: int = 240) -> str:
    """One readable line for an orbax/TensorStore read error: its kind and message, without the
    TensorStore spec reprs (hundreds of characters of JSON) that the message carries."""
    text = " ".join(str(err).split())
    for marker in _REPR_MARKERS:
        text = text.split(marker)[0]
    text = text.rstrip(" .:(")
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {text}"


def _quiet_orbax() -> None:
    """Orbax reports a failed read or write many times over: each of the step's other reads
    finishes after its asyncio loop closed and reports 'Event loop is closed' or an ignored
    coroutine exception as an unraisable exception, and its background threads log tracebacks
    at ERROR level. Hundreds of lines that bury the one line saying which checkpoint failed and
    what to do; this drops exactly those reports and logs (everything else still reaches the
    previous hook), unless `JAXMEG_DEBUG` asks for them."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_orbax_reports", False) or paths.debugging():
        return

    def hook(unraisable) -> None:
        err, where = unraisable.exc_value, unraisable.object
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        if asyncio.iscoroutine(where) and "orbax" in getattr(where, "__qualname__", "") + str(
            getattr(getattr(where, "cr_code", None), "co_filename", "")
        ):
            return
        previous(unraisable)

    hook.drops_orbax_reports = True
    sys.unraisablehook = hook
    logging.getLogger("absl").addFilter(_drop_orbax_errors)
    # a read task the failed restore left behind, reported when it is collected ("Task exception
    # was never retrieved"): when that happens is up to the garbage collector
    logging.getLogger("asyncio").addFilter(_drop_orbax_task_errors)


def _drop_orbax_errors(record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname)


def _drop_orbax_task_errors(record: logging.LogRecord) -> bool:
    """False for an asyncio error whose exception was raised inside orbax."""
    err = record.exc_info[1] if record.exc_info else None
    frame = err.__traceback__ if err is not None else None
    while frame is not None:
        if "/orbax/" in frame.tb_frame.f_code.co_filename:
            return False
        frame = frame.tb_next
    return True


def _release_waiting_threads() -> None:
    """A save that fails before its directory exists leaves orbax's commit threads (which are
    not daemons) waiting for a signal that never comes, and the interpreter would wait for them
    at exit for the coordination timeout. Cancels them and gives them their signals, so they
    return at once."""
    try:
        from orbax.checkpoint._src.futures import future
    except ImportError:  # another orbax: nothing to release that we know of
        return
    if not paths.debugging():  # the cancelled threads' coroutines, reported at exit
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    for thread in threading.enumerate():
        if isinstance(thread, future._SignalingThread) and thread.is_alive():
            thread.cancel()
            try:
                future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
            except Exception:  # noqa: BLE001 - best effort; the thread may have finished
                pass


def _unless_out_of_memory(err: Exception) -> Exception:
    if isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err):
        raise err
    return err


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process: all must fall back past the same steps, or the
    processes that read a step would wait forever for those that could not."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _trim_vocab(tree, dims, vocab_size: int):
    def trim(x, dim):
        if dim == NO_VOCAB_DIM:
            return x
        return jax.lax.slice_in_dim(x, 0, vocab_size, axis=dim)

    return jax.tree.map(trim, tree, dims)


def _pad_vocab(tree, dims, padded_vocab: int):
    def pad(x, dim):
        if dim == NO_VOCAB_DIM:
            return x
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, padded_vocab - x.shape[dim])
        return jnp.pad(x, widths)

    return jax.tree.map(pad, tree, dims)


def _unsplit_vocab_spec(spec: P, dim: int, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` with the vocab dim unsharded, since a trimmed vocabulary rarely divides the tensor
    size. Its mesh axes move to another unsharded dim that they divide (so a save stays spread
    over the devices), or are dropped if there is none."""
    if dim == NO_VOCAB_DIM:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    axes, entries[dim] = entries[dim], None
    if axes is not None:
        size = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
        free = [i for i, e in enumerate(entries) if i != dim and e is None and shape[i] % size == 0]
        if free:
            entries[free[0]] = axes
    return P(*entries)


def _without_links(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "links"}


def _link_shapes(links) -> dict[str, list[int]]:
    leaves = jax.tree_util.tree_flatten_with_path(links or {})[0]
    return {leaf_key(path): list(v.shape) for path, v in leaves}


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def check_room(directory: str | Path, trainable: Trainable) -> None:
    """Refuses, before anything compiles, a checkpoint directory whose disk cannot take one
    checkpoint of this model (a new one is written before the oldest is removed)."""
    needed, free = _nbytes(abstract_state(trainable)), paths.free_bytes(directory)
    if free < needed:
        raise paths.PathError(
            f"{directory}: a checkpoint of this model needs about {paths.size_text(needed)} "
            f"and only {paths.size_text(free)} are free there; free space or pass another --out"
        )


class Checkpointer:
    """Saves and restores one run's train state under `directory`."""

    def __init__(self, directory: str | Path, trainable: Trainable, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.trainable = trainable
        self.keep = keep
        self._saving: int | None = None  # the step of the save in flight
        self._failure: Exception | None = None
        _quiet_orbax()
        try:
            self.manager = self._open_manager()
        except OSError as err:  # a directory that cannot be made: read-only, a file on the way
            raise paths.os_error(err, self.directory) or err from err
        layout, dims = trainable.layout, _without_links(vocab_dims(trainable))
        vocab_size, padded = trainable.cfg.model.vocab_size, trainable.vocab
        abstract = abstract_state(trainable)
        self._links = abstract.get("links")

        def to_stored(state):
            return _trim_vocab(to_canonical_layout(state, layout), dims, vocab_size)

        stored = jax.eval_shape(to_stored, _without_links(abstract))
        stored_shardings = named(
            trainable.mesh,
            jax.tree.map(
                lambda spec, s, dim: _unsplit_vocab_spec(spec, dim, s.shape, trainable.mesh),
                _without_links(canonical_specs(trainable)),
                stored,
                dims,
                is_leaf=lambda x: isinstance(x, P),
            ),
        )
        self._to_stored = jax.jit(to_stored, out_shardings=stored_shardings)
        self._from_stored = jax.jit(
            lambda s: to_stage_layout(_pad_vocab(s, dims, padded), layout),
            out_shardings=_without_links(state_shardings(trainable)),
        )
        self._abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            stored,
            stored_shardings,
        )

    def _open_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True)
        return ocp.CheckpointManager(self.directory, options=options, item_names=ITEM_NAMES)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict[str, Any], wait: bool = False) -> None:
        """Starts an asynchronous save of `state` at `step` (waits for it if `wait`). A save
        that fails (now, or while it runs in the background: then the next save or wait says
        so) raises a PathError that names the directory and the space a checkpoint needs."""
        items = {
            "state": ocp.args.StandardSave(self._to_stored(_without_links(state))),
            "meta": ocp.args.JsonSave({**meta, "links": _link_shapes(self._links)}),
        }
        if self._links:  # per-link compression state, saved as it is (not canonical)
            items["links"] = ocp.args.StandardSave(state["links"])
        self._check_not_failed()
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as err:
            self._failed(err, self._saving or step)
        self._saving = step
        if wait:
            self.wait()

    def wait(self) -> None:
        self._check_not_failed()
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            self._failed(err, self._saving)
        self._saving = None

    def _check_not_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def needed_bytes(self) -> int:
        """About how many bytes one checkpoint takes (its arrays, before compression)."""
        return _nbytes([self._abstract, self._links or {}])

    def _failed(self, err: Exception, step: int | None) -> None:
        """Ends a failed save: orbax's threads released, its temporary directories removed
        (they would keep a full disk full), and one PathError (or `err` itself, when it is no
        OS error) raised, then and at every later save, wait or close."""
        _release_waiting_threads()
        if jax.process_index() == 0:
            for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        problem = paths.os_error(err, self.directory)
        if problem is None:
            self._failure = err
            raise err
        needed, free = self.needed_bytes(), paths.free_bytes(self.directory)
        earlier = self.steps()
        kept = f"the checkpoints of steps {earlier} are intact" if earlier else "none is kept"
        self._failure = paths.PathError(
            f"could not save the checkpoint of step {step} in {problem}. A checkpoint "
            f"needs about {paths.size_text(needed)} ({paths.size_text(free)} free there); "
            f"its partial files were removed and {kept}"
        )
        raise self._failure from err

    def restore_latest(self) -> tuple[int, Any, dict] | None:
        """(step, state in this run's layout, meta) of the newest readable step; None when the
        directory holds no checkpoint."""
        steps = self.steps()
        for age, step in enumerate(reversed(steps)):
            path = self.directory / str(step)
            stored, err = self._read(step, path)
            if _everywhere(err is None):
                state, meta = stored
                return step, self._with_links(self._from_stored(state), step, meta), meta
            why = read_error_reason(err) if err else "on another process"
            if age == len(steps) - 1:
                raise UnreadableCheckpoint(
                    f"checkpoint of step {step} at {path} is unreadable ({why}) and there is "
                    f"no older checkpoint to fall back to; it was left in place. Move it "
                    f"aside to start from scratch, or pass another --out"
                ) from err
            say(
                f"checkpoint of step {step} at {path} is unreadable ({why}); moving it aside "
                f"and falling back to the previous checkpoint"
            )
            self._move_aside(path)
        return None

    def _read(self, step: int, path: Path) -> tuple[tuple[Any, dict] | None, Exception | None]:
        """((stored state, meta), None), or (None, the error) when orbax cannot read the step.
        A checkpoint of another model raises IncompatibleCheckpoint; running out of memory
        while reading is raised as it is (the checkpoint is fine, the run is not)."""
        try:
            meta = self._read_meta(step)
        except Exception as err:  # noqa: BLE001 - any failure to read is "unreadable"
            return None, _unless_out_of_memory(err)
        check_compatible(meta, self.trainable.cfg, path)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(self._abstract))
        try:
            restored = self.manager.restore(step, args=args)
        except ValueError as err:
            # A checkpoint whose meta predates the shape fields: still not a corrupt one.
            if "not compatible with the stored shape" in str(err):
                raise IncompatibleCheckpoint(
                    f"checkpoint {path} holds arrays of other shapes than this run's model "
                    f"({err}). Nothing was changed; resume with the config it was written with"
                ) from err
            # Nor is one whose arrays are another tree (a leaf this code adds or drops).
            if "tree structures do not match" in str(err):
                raise IncompatibleCheckpoint(
                    f"checkpoint {path} holds another tree of arrays than this run's model "
                    f"({read_error_reason(err)}). Nothing was changed; resume with the config "
                    f"or the code it was written with"
                ) from err
            return None, err
        except Exception as err:  # noqa: BLE001
            return None, _unless_out_of_memory(err)
        return (restored["state"], meta), None

    def _with_links(self, state, step: int, meta: dict):
        """The state with the compressed links' state: the checkpoint's where it was saved for
        the same links (any tensor size), else fresh, with a line saying so."""
        if not self._links:
            return state
        saved, now = meta.get("links") or {}, _link_shapes(self._links)
        if saved == now:
            target = ocp.args.StandardRestore(self._links)
            links = self.manager.restore(step, args=ocp.args.Composite(links=target))["links"]
            return {**state, "links": links}
        say(
            f"compressed pipeline links start afresh: the checkpoint holds link state of shapes "
            f"{saved or 'none'}, this run needs {now} (other pipe, data, chunks or microbatch)"
        )
        fresh = jax.jit(
            lambda: initial_link_state(self.trainable),
            out_shardings=state_shardings(self.trainable)["links"],
        )
        return {**state, "links": fresh()}

    def _read_meta(self, step: int) -> dict:
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def _move_aside(self, path: Path) -> None:
        if jax.process_index() == 0 and path.exists():
            os.replace(path, path.with_name(f"{path.name}.unreadable-{int(time.time())}"))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxmeg-checkpoint-moved-aside")
        self.manager.close()
        self.manager = self._open_manager()

    def close(self) -> None:
        if self._failure is None:
            self.wait()
        try:
            self.manager.close()
        except Exception:  # noqa: BLE001 - after a failed save, closing only re-reports it
            if self._failure is None:
                raise
