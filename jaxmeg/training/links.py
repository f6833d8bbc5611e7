"""Compressed communication (`compression.*`): what the executor is told, and the state of the
compressed backward pipeline links (warm starts, lazy errors) and of PowerSGD (warm starts,
error feedback) as part of the train state, under the key `links`.

The state is per link or replica: one per (stage, data replica, chunk it sends from), so it
lives on (pipe, data) as [p, d, v, ...]. It is kept across steps and checkpointed; a run resumed on
another pipe, data, chunk or microbatch shape has other links and starts them afresh.

`Links` is the one place the train state (shapes, shardings, initial values), the step (what
the executor is told) and the checkpoint (what to start afresh) ask about it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmeg.config import Config
from jaxmeg.pipeline import compression, critical_path, powersgd


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
    lazy = comp.pipe_error_feedback != "none"
    return compression.PipeCompression(
        comp.pipe_grad_rank, lazy, compress, flush=comp.pipe_error_feedback == "lazy_flush"
    )


def data_compression(cfg: Config, block_shapes) -> powersgd.DataCompression | None:
    """PowerSGD on the data-parallel reduction (`compression.data_grad_*`), given the layer
    params in the run layout (leaves [v, p, Lc, ...]); None when off or when no matrix is worth
    compressing at the rank."""
    comp = cfg.compression
    if not comp.data_grad_rank:
        return None
    matrices = powersgd.compressed_matrices(
        _layer_shapes(block_shapes), cfg.model.hidden, comp.data_grad_rank
    )
    if not matrices:
        return None
    stages = comp.data_grad_stages
    return powersgd.DataCompression(
        comp.data_grad_rank, stages if stages > 0 else 1 << 30, comp.warmup_steps, matrices
    )


def _layer_shapes(block_shapes) -> dict[str, tuple[int, ...]]:
    """{leaf key: one layer's shape} from the layer params in the run layout."""
    leaves = jax.tree_util.tree_flatten_with_path(block_shapes)[0]
    return {powersgd.leaf_key(path): tuple(a.shape[3:]) for path, a in leaves}


def link_state_shapes(cfg: Config, mesh_shape, block_shapes) -> dict:
    """Global shapes of the compression state: the backward links' {"q": [p, d, v, h, r],
    "error": [p, d, v, b s, h] (lazy only)} and PowerSGD's {"data": {"q": {key: [p, d, v, Lc,
    m, r]}, "error": {key: [p, d, v, Lc, ...]}}}; {} when nothing is compressed.
    `block_shapes`: the layer params in the run layout (leaves [v, p, Lc, ...])."""
    comp = cfg.compression
    lead = (mesh_shape["pipe"], mesh_shape["data"], cfg.parallel.chunks)
    shapes = {}
    rows, cols = _matrix(cfg)
    if compression.worth_compressing(comp.pipe_grad_rank, rows, cols):
        shapes["q"] = (*lead, cols, comp.pipe_grad_rank)
        if comp.pipe_error_feedback != "none":
            shapes["error"] = (*lead, rows, cols)
    dc = data_compression(cfg, block_shapes)
    if dc is not None:
        layers = jax.tree.leaves(block_shapes)[0].shape[2]
        per_chunk = powersgd.state_shapes(dc, _layer_shapes(block_shapes), layers)
        shapes["data"] = jax.tree.map(
            lambda shape: (*lead, *shape), per_chunk, is_leaf=lambda x: isinstance(x, tuple)
        )
    return jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _replicated_noise(seed: int, shape: tuple[int, ...]):
    """Normal noise of a PowerSGD warm start [p, d, v, Lc, ..., r]: its own for every layer,
    matrix entry and rank column (full rank per leaf), the same on every data replica."""
    p, d, v, *rest = shape
    noise = jax.random.normal(jax.random.key(seed), (p, 1, v, *rest))
    return jnp.broadcast_to(noise, shape)


def initial_link_state(cfg: Config, mesh_shape, block_shapes) -> dict:
    """Zero errors and random warm starts from fixed keys (runs are reproducible whatever the
    seed): the backward links' the same [h, r] on every link; PowerSGD's full-shape noise per
    leaf, the same on every data replica (`_replicated_noise`)."""
    shapes = link_state_shapes(cfg, mesh_shape, block_shapes)
    state = {}
    if "q" in shapes:
        q = shapes["q"].shape
        state["q"] = jnp.broadcast_to(jax.random.normal(jax.random.key(0), q[-2:]), q)
    if "error" in shapes:
        state["error"] = jnp.zeros(shapes["error"].shape, jnp.float32)
    if "data" in shapes:
        data = shapes["data"]
        keys = sorted(data["q"])
        state["data"] = {
            "q": {k: _replicated_noise(1 + i, data["q"][k].shape) for i, k in enumerate(keys)},
            "error": {k: jnp.zeros(a.shape, jnp.float32) for k, a in data["error"].items()},
        }
    return state


@dataclasses.dataclass(frozen=True)
class Links:
    """A run's compression links. `block_shapes` / `block_specs`: the layer params in the run
    layout (leaves [v, p, Lc, ...]) and their PartitionSpecs."""

    cfg: Config
    mesh_shape: Mapping[str, int]
    block_shapes: Any
    block_specs: Any

    @functools.cached_property
    def data(self) -> powersgd.DataCompression | None:
        """What the executor's PowerSGD is told (`data_compression`)."""
        return data_compression(self.cfg, self.block_shapes)

    def pipe(self, table) -> compression.PipeCompression | None:
        """What the executor's compressed backward links are told (`pipe_compression`)."""
        return pipe_compression(self.cfg, table)

    @functools.cached_property
    def shapes(self) -> dict:
        """The state's global shapes (`link_state_shapes`); {} when nothing is compressed."""
        return link_state_shapes(self.cfg, self.mesh_shape, self.block_shapes)

    def specs(self) -> dict:
        """On (pipe, data); PowerSGD's error buffers also split over `tensor` like their
        params' gradients, so that keeping them costs no collective."""
        specs = jax.tree.map(lambda _: P("pipe", "data"), self.shapes)
        if "data" in specs:
            by_key = {
                powersgd.leaf_key(path): spec
                for path, spec in jax.tree_util.tree_flatten_with_path(
                    self.block_specs, is_leaf=lambda x: isinstance(x, P)
                )[0]
            }
            specs["data"]["error"] = {
                k: P("pipe", "data", None, None, *by_key[k][3:]) for k in specs["data"]["error"]
            }
        return specs

    def initial(self) -> dict:
        """The state a run starts with (`initial_link_state`)."""
        return initial_link_state(self.cfg, self.mesh_shape, self.block_shapes)
