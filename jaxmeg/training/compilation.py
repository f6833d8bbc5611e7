"""Ahead-of-time compilation of the train step and what XLA reports of it."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import jax
import numpy as np

from jaxmeg.training.state import Trainable, abstract_state
from jaxmeg.training.step import make_train_step


def memory_report(compiled) -> dict[str, int]:
    """Per-device bytes of the compiled step (`memory_analysis()`)."""
    mem = compiled.memory_analysis()
    return {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }


_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hlo_text(compiled) -> str:
    """`compiled.as_text()`, printed once per compiled step (a second or two for a multi-GPU
    step; the hazard check and the cost report both read it)."""
    if compiled not in _TEXTS:
        _TEXTS[compiled] = compiled.as_text()
    return _TEXTS[compiled]


class DeadlockHazard(ValueError):
    """A compiled step holds what could hang it (`hlo_module.deadlock_hazards`)."""


_KNOBS = {
    "expert": "parallel.expert",
    "tensor": "parallel.tensor",
    "data": "parallel.data",
    "context": "parallel.context",
    "pipe": "parallel.pipe",
}


def layout_words(cfg) -> str:
    """`expert 2 x pipe 2 x tensor 2, sequence_parallel, 1f1b`: the layout a message names."""
    par = cfg.parallel
    sizes = [f"{axis} {getattr(par, axis)}" for axis in _KNOBS if getattr(par, axis, 1) > 1]
    words = [" x ".join(sizes) or "one device"]
    if par.sequence_parallel:
        words.append("sequence_parallel")
    return ", ".join([*words, par.schedule])


def check_hazards(compiled, trainable: Trainable, what: str = "train step") -> None:
    """Raises `DeadlockHazard` (one line: the first hazard, how many, the layout and the
    settings to change) where the compiled program could hang (`hlo_module.deadlock_hazards`:
    reading its HLO text took 0.4 s on gpt_tiny's (2,2,2) 1F1B step, beside a 12 s compile).
    Nothing to check on one device."""
    from jaxmeg.parallel import hlo_module

    if trainable.mesh.size == 1:  # no other device to wait for
        return
    found = hlo_module.deadlock_hazards(hlo_text(compiled), trainable.mesh)
    if not found:
        return
    first = found[0]
    axes = [axis for axis in _KNOBS if f"'{axis}'" in first.split(" in ")[0]]
    knobs = [_KNOBS[a] for a in axes if a != "pipe"] or ["parallel.schedule", "parallel.pipe"]
    if first.startswith("lapack"):  # a CPU LAPACK call: PowerSGD's QR
        knobs = ["compression.data_grad_rank"]
    if trainable.cfg.parallel.sequence_parallel and "tensor" in axes:
        knobs.append("parallel.sequence_parallel")
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise DeadlockHazard(
        f"the compiled {what} could hang on this layout ({layout_words(trainable.cfg)}): "
        f"{first}{more}; change {' or '.join(knobs)}"
    )


def compile_step(trainable: Trainable, loss_and_grads: Callable | None = None):
    """AOT-compiles the train step (for the mesh's devices: compile-only GPUs too), refusing a
    step that could hang (`check_hazards`); returns (compiled, seconds)."""
    step = make_train_step(trainable, loss_and_grads)
    batch = jax.ShapeDtypeStruct(
        (trainable.cfg.train.global_batch, trainable.cfg.model.seq_len),
        np.int32,
        sharding=trainable.batch_sharding(),
    )
    state = abstract_state(trainable)  # before set_mesh: it makes a PRNG key on the host
    start = time.perf_counter()
    with jax.set_mesh(trainable.mesh):
        compiled = step.lower(state, batch, batch).compile()
    seconds = time.perf_counter() - start
    check_hazards(compiled, trainable)
    return compiled, seconds
