"""Compressed backward pipeline links (`compression.pipe_grad_*`): what the executor is told, and
their state (warm starts, lazy errors) as part of the train state, under the key `links`.

The state is per link: one per (stage, data replica, chunk it sends from), so it lives on
(pipe, data) as [p, d, v, ...]. It is kept across steps and checkpointed; a run resumed on
another pipe, data, chunk or microbatch shape has other links and starts them afresh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmeg.config import Config
from jaxmeg.pipeline import compression, critical_path, schedules
from jaxmeg.pipeline.tick_table import build_tick_table


def build_schedule(cfg: Config, pipe: int) -> schedules.Schedule:
    par = cfg.parallel
    return schedules.build(
        par.schedule, pipe, cfg.train.microbatches, num_chunks=par.chunks,
        warmup=par.pipeline_warmup,
    )  # fmt: skip


def _matrix(cfg: Config) -> tuple[int, int]:
    """The cotangent a stage sends, viewed as a matrix: (b s, h)."""
    return cfg.train.microbatch_size * cfg.model.seq_len, cfg.model.hidden


def pipe_compression(cfg: Config, table) -> compression.PipeCompression | None:
    """None when nothing is compressed: off, or a rank at or above the cotangent matrix's
    smaller side (it goes whole, exactly)."""
    comp = cfg.compression
    if not compression.worth_compressing(comp.pipe_grad_rank, *_matrix(cfg)):
        return None
    if comp.pipe_grad_phase == "epilogue":
        compress = critical_path.exposed_backward_sends(table) > 0
    else:
        compress = np.ones(table.b_mb.shape, bool)
    lazy = comp.pipe_error_feedback == "lazy"
    return compression.PipeCompression(comp.pipe_grad_rank, lazy, compress)


def link_state_shapes(cfg: Config, mesh_shape) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shapes of the links' state: {"q": [p, d, v, h, r], "error": [p, d, v, b s, h]
    (lazy only)}; {} when nothing is compressed."""
    comp = cfg.compression
    rows, cols = _matrix(cfg)
    if not compression.worth_compressing(comp.pipe_grad_rank, rows, cols):
        return {}
    lead = (mesh_shape["pipe"], mesh_shape["data"], cfg.parallel.chunks)
    shapes = {"q": (*lead, cols, comp.pipe_grad_rank)}
    if comp.pipe_error_feedback == "lazy":
        shapes["error"] = (*lead, rows, cols)
    return {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}


def initial_link_state(cfg: Config, mesh_shape) -> dict[str, jax.Array]:
    """Zero errors; the same random warm start on every link (a fixed key, so that runs are
    reproducible whatever the seed)."""
    shapes = link_state_shapes(cfg, mesh_shape)
    state = {}
    if "q" in shapes:
        q = shapes["q"].shape
        state["q"] = jnp.broadcast_to(jax.random.normal(jax.random.key(0), q[-2:]), q)
    if "error" in shapes:
        state["error"] = jnp.zeros(shapes["error"].shape, jnp.float32)
    return state
