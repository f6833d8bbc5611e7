"""Ahead-of-time compilation of the train step and what XLA reports of it."""

from __future__ import annotations

import time
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


def compile_step(trainable: Trainable, loss_and_grads: Callable | None = None):
    """AOT-compiles the train step (for the mesh's devices: compile-only GPUs too); returns
    (compiled, seconds)."""
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
    return compiled, time.perf_counter() - start
