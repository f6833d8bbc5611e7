"""The sharded train state: what a step is built from, parameter layout, sharded init.

Layer parameters are stacked on a leading `layers` dim in canonical order. With a pipeline
(p > 1) that dim is split as [v, p, L/(p v)] -- a reshape, so the order stays canonical -- and
the `p` dim is sharded over `pipe`: virtual stage c*p+s (chunk c on stage s) then holds layer
block c*p+s, Megatron's interleaved placement, with no data movement between steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmeg.config import Config, padded_vocab_size
from jaxmeg.models import GPT
from jaxmeg.parallel import named, param_rules, param_specs
from jaxmeg.training.optimizer import make_optimizer

TrainState = dict[str, Any]  # {"step": int32 scalar, "params": tree, "opt_state": tree}
BATCH_SPEC = P("data")


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Everything a train step is built from: the validated config, mesh and optimizer."""

    cfg: Config
    mesh: Mesh
    tx: optax.GradientTransformation
    vocab: int

    @classmethod
    def create(cls, cfg: Config, mesh: Mesh) -> Trainable:
        vocab = padded_vocab_size(cfg.model, mesh.shape["tensor"])
        return cls(cfg=cfg, mesh=mesh, tx=make_optimizer(cfg.optimizer), vocab=vocab)

    def model(self, constrain: Callable | None = None) -> GPT:
        if constrain is None:
            return GPT(self.cfg.model, self.vocab)
        return GPT(self.cfg.model, self.vocab, constrain)

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, BATCH_SPEC)

    @property
    def pipe(self) -> int:
        return self.mesh.shape["pipe"]

    @property
    def chunks(self) -> int:
        return self.cfg.parallel.chunks


def _in_blocks(path) -> bool:
    return any(getattr(key, "key", None) == "blocks" for key in path)


def map_layer_leaves(fn, tree, is_leaf=None):
    """Applies `fn` to the leaves under a `blocks` key (layer stacks) of any tree: params,
    gradients, optimizer state or their specs; other leaves pass through."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if _in_blocks(path) else x, tree, is_leaf=is_leaf
    )


def to_pipeline_layout(tree, pipe: int, chunks: int):
    """Layer leaves [L, ...] -> [v, p, L/(p v), ...] (a reshape: canonical order kept)."""
    if pipe == 1:
        return tree
    return map_layer_leaves(lambda a: a.reshape(chunks, pipe, -1, *a.shape[1:]), tree)


def to_canonical_layout(tree, pipe: int):
    """Inverse of `to_pipeline_layout`: layer leaves back to [L, ...]."""
    if pipe == 1:
        return tree
    return map_layer_leaves(lambda a: a.reshape(-1, *a.shape[3:]), tree)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _pipeline_specs(specs, pipe: int):
    """Layer specs (layers, *rest) -> (chunks, stages on pipe, layers, *rest)."""
    if pipe == 1:
        return specs
    return map_layer_leaves(lambda spec: P(None, "pipe", *spec), specs, is_leaf=_is_spec)


def canonical_specs(trainable: Trainable):
    """Specs of the state in canonical layout: layers [L, ...] split in contiguous blocks over
    `pipe` (for v = 1 exactly the executor's placement; for v > 1 one all-to-all away)."""
    specs = state_specs(trainable)
    if trainable.pipe == 1:
        return specs
    return map_layer_leaves(lambda spec: P("pipe", *spec[3:]), specs, is_leaf=_is_spec)


def _init_boxed_params(trainable: Trainable, key: jax.Array):
    tokens = jnp.zeros((1, trainable.cfg.model.seq_len), jnp.int32)
    return trainable.model().init(key, tokens)["params"]


NO_VOCAB_DIM = -1


def _vocab_dim(boxed: nn.Partitioned) -> int:
    return boxed.names.index("vocab") if "vocab" in boxed.names else NO_VOCAB_DIM


def vocab_dims(trainable: Trainable) -> TrainState:
    """For each leaf of the train state in canonical layout, the dim that runs over the padded
    vocabulary (embedding rows, unembedding columns and their Adam moments), else NO_VOCAB_DIM.
    The padding depends on the tensor size, so checkpoints trim these dims to the vocabulary."""
    boxed = jax.eval_shape(lambda key: _init_boxed_params(trainable, key), jax.random.key(0))
    param_dims = jax.tree.map(_vocab_dim, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    abstract_opt = jax.eval_shape(trainable.tx.init, nn.meta.unbox(boxed))
    opt_dims = optax.tree_map_params(
        trainable.tx,
        lambda _, dim: dim,
        abstract_opt,
        param_dims,
        transform_non_params=lambda _: NO_VOCAB_DIM,
    )
    return {"step": NO_VOCAB_DIM, "params": param_dims, "opt_state": opt_dims}


def state_specs(trainable: Trainable) -> TrainState:
    """PartitionSpecs of the train state, derived from the params' logical axes."""
    boxed = jax.eval_shape(lambda key: _init_boxed_params(trainable, key), jax.random.key(0))
    p_specs = _pipeline_specs(
        param_specs(boxed, param_rules(trainable.cfg.parallel)), trainable.pipe
    )
    abstract_params = jax.eval_shape(
        lambda params: to_pipeline_layout(params, trainable.pipe, trainable.chunks),
        nn.meta.unbox(boxed),
    )
    abstract_opt = jax.eval_shape(trainable.tx.init, abstract_params)
    opt_specs = optax.tree_map_params(
        trainable.tx,
        lambda _, spec: spec,
        abstract_opt,
        p_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    return {"step": P(), "params": p_specs, "opt_state": opt_specs}


def _state_from_key(trainable: Trainable, key: jax.Array) -> TrainState:
    params = nn.meta.unbox(_init_boxed_params(trainable, key))
    params = to_pipeline_layout(params, trainable.pipe, trainable.chunks)
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": trainable.tx.init(params),
    }


def state_shardings(trainable: Trainable) -> TrainState:
    return named(trainable.mesh, state_specs(trainable))


def init_state(trainable: Trainable, seed: int) -> TrainState:
    """Initialises params and optimizer state directly in their shardings (no full copy)."""
    init = jax.jit(
        lambda key: _state_from_key(trainable, key), out_shardings=state_shardings(trainable)
    )
    return init(jax.random.key(seed))


def abstract_state(trainable: Trainable) -> TrainState:
    """The train state as ShapeDtypeStructs with shardings (for compile-only and restore)."""
    shapes = jax.eval_shape(lambda key: _state_from_key(trainable, key), jax.random.key(0))
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        state_shardings(trainable),
    )
