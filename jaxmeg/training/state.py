"""The sharded train state: what a step is built from, parameter layout, sharded init.

Layer parameters are stacked on a leading `layers` dim in canonical order by the model. The run
keeps them in its stage layout, [v, p, Lc, ...] (`jaxmeg.pipeline.layout.StageLayout`: the one
object that knows which layer sits where), with the `p` dim sharded over `pipe`; pipe = 1 is the
layout [1, 1, L, ...]. Checkpoints convert back to canonical order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmeg.config import (
    Config,
    ModelConfig,
    MoeConfig,
    padded_vocab_size,
    settle_sequence_parallel,
)
from jaxmeg.models import GPT, moe_exchange
from jaxmeg.models.gpt import attention_implementation
from jaxmeg.models.grouped_gemm import settled
from jaxmeg.parallel import named, param_rules, param_specs, zero
from jaxmeg.pipeline import schedules
from jaxmeg.pipeline.layout import StageLayout
from jaxmeg.training import links
from jaxmeg.training.optimizer import make_optimizer

TrainState = dict[str, Any]
"""{"step": int32 scalar, "params": tree, "opt_state": tree, and with compressed backward
pipeline links "links": their state (`jaxmeg.training.links`)}."""
BATCH_SPEC = P(("data", "expert"))


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Everything a train step is built from: the validated config, mesh and optimizer."""

    cfg: Config
    mesh: Mesh
    tx: optax.GradientTransformation
    vocab: int

    @classmethod
    def create(cls, cfg: Config, mesh: Mesh) -> Trainable:
        cfg = settle_sequence_parallel(cfg, mesh.devices.flat[0].platform)
        vocab = padded_vocab_size(cfg.model, mesh.shape["tensor"])
        return cls(cfg=cfg, mesh=mesh, tx=make_optimizer(cfg.optimizer), vocab=vocab)

    @property
    def abstract_boxed_params(self):
        """The model's params as its init makes them (shapes, boxed with their logical axes),
        in canonical layout: traced once per model (`_abstract_boxed_params`)."""
        return _abstract_boxed_params(self.model_cfg, self.vocab, self.moe_cfg)

    @functools.cached_property
    def run_layout_params(self):
        """(PartitionSpecs from the rules, ShapeDtypeStructs) of the params in the run's
        layout."""
        boxed = self.abstract_boxed_params
        specs = _stage_specs(param_specs(boxed, param_rules(self.cfg.parallel)))
        shapes = jax.eval_shape(
            lambda params: to_stage_layout(params, self.layout), nn.meta.unbox(boxed)
        )
        return specs, shapes

    @property
    def platform(self) -> str:
        """Where the step runs: the mesh's devices (`gpu` also for compile-only GPUs)."""
        return self.mesh.devices.flat[0].platform

    @property
    def model_cfg(self) -> ModelConfig:
        """`cfg.model` with `attention: auto` settled for the mesh's devices, not the host's."""
        model = self.cfg.model
        impl = attention_implementation(model, self.platform)
        if model.attention == "auto" and model.num_kv_heads % self.mesh.shape["tensor"]:
            impl = "xla"  # cuDNN runs per tensor rank on whole key/value heads
        return dataclasses.replace(model, attention=impl)

    @property
    def moe_cfg(self) -> MoeConfig:
        """`cfg.moe` with `grouped_gemm: auto` and `exchange: auto` settled for the mesh's
        devices (`grouped_gemm.settled`, `moe_exchange.settled`)."""
        moe = self.cfg.moe
        form = settled(moe, self.platform, self.mesh.shape["expert"], self.cfg.model.fp8)
        exchange = moe_exchange.settled(moe.exchange, self.platform)
        return dataclasses.replace(moe, grouped_gemm=form, exchange=exchange)

    def model(self, constrain: Callable | None = None) -> GPT:
        if constrain is None:
            return GPT(self.model_cfg, self.vocab, moe=self.moe_cfg)
        return GPT(self.model_cfg, self.vocab, constrain, moe=self.moe_cfg)

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, BATCH_SPEC)

    @property
    def pipe(self) -> int:
        return self.mesh.shape["pipe"]

    @property
    def chunks(self) -> int:
        return self.cfg.parallel.chunks

    @functools.cached_property
    def layout(self) -> StageLayout:
        par = self.cfg.parallel
        return StageLayout.create(
            self.cfg.stacked_layers, self.pipe, par.chunks, par.stage_layers,
            placement=schedules.placement_of(par.schedule), field=self.cfg.stacked_layers_field,
        )  # fmt: skip


def _in_blocks(path) -> bool:
    return any(getattr(key, "key", None) == "blocks" for key in path)


def map_layer_leaves(fn, tree, is_leaf=None):
    """Applies `fn` to the leaves under a `blocks` key (layer stacks) of any tree: params,
    gradients, optimizer state or their specs; other leaves pass through."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if _in_blocks(path) else x, tree, is_leaf=is_leaf
    )


def to_stage_layout(tree, layout: StageLayout):
    """Layer leaves [L, ...] -> [v, p, Lc, ...] (zeros in padding slots)."""
    return map_layer_leaves(layout.to_stages, tree)


def to_canonical_layout(tree, layout: StageLayout):
    """Inverse of `to_stage_layout`: layer leaves back to [L, ...], padding dropped."""
    return map_layer_leaves(layout.to_canonical, tree)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _stage_specs(specs):
    """Layer specs (layers, *rest) -> (chunks, stages on pipe, layer slots, *rest)."""
    return map_layer_leaves(lambda spec: P(None, "pipe", *spec), specs, is_leaf=_is_spec)


def canonical_specs(trainable: Trainable):
    """Specs of the state in canonical layout: layers [L, ...] split in contiguous blocks over
    `pipe` where they divide evenly (for v = 1 exactly the executor's placement; for v > 1 one
    all-to-all away), else replicated over `pipe`; never split over the data group."""
    specs = jax.tree.map(zero.without_zero_axes, state_specs(trainable), is_leaf=_is_spec)
    layout = trainable.layout
    on_pipe = "pipe" if not layout.uneven and layout.num_stages > 1 else None
    return map_layer_leaves(lambda spec: P(on_pipe, *spec[3:]), specs, is_leaf=_is_spec)


def _init_boxed_params(trainable: Trainable, key: jax.Array):
    return _model_init(trainable.model_cfg, trainable.vocab, trainable.moe_cfg, key)


def _model_init(model_cfg: ModelConfig, vocab: int, moe: MoeConfig, key: jax.Array):
    """The model's params as its init makes them, boxed with their logical axes."""
    tokens = jnp.zeros((1, model_cfg.seq_len), jnp.int32)
    return GPT(model_cfg, vocab, moe=moe).init(key, tokens)["params"]


@functools.lru_cache(maxsize=32)
def _abstract_boxed_params(model_cfg: ModelConfig, vocab: int, moe: MoeConfig):
    """`Trainable.abstract_boxed_params` of every trainable with this model (an init traces the
    whole model, and a run, a restore or a test builds several trainables of one model on
    other meshes); the boxes and shapes are immutable."""
    return jax.eval_shape(functools.partial(_model_init, model_cfg, vocab, moe), jax.random.key(0))


NO_VOCAB_DIM = -1


def _vocab_dim(boxed: nn.Partitioned) -> int:
    return boxed.names.index("vocab") if "vocab" in boxed.names else NO_VOCAB_DIM


def vocab_dims(trainable: Trainable) -> TrainState:
    """For each leaf of the train state in canonical layout, the dim that runs over the padded
    vocabulary (embedding rows, unembedding columns and their Adam moments), else NO_VOCAB_DIM.
    The padding depends on the tensor size, so checkpoints trim these dims to the vocabulary."""
    boxed = trainable.abstract_boxed_params
    param_dims = jax.tree.map(_vocab_dim, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    abstract_opt = jax.eval_shape(trainable.tx.init, nn.meta.unbox(boxed))
    opt_dims = optax.tree_map_params(
        trainable.tx,
        lambda _, dim: dim,
        abstract_opt,
        param_dims,
        transform_non_params=lambda _: NO_VOCAB_DIM,
    )
    dims = {"step": NO_VOCAB_DIM, "params": param_dims, "opt_state": opt_dims}
    shapes = links_of(trainable).shapes
    if shapes:
        dims["links"] = jax.tree.map(lambda _: NO_VOCAB_DIM, shapes)
    return dims


def zero_dims(trainable: Trainable):
    """Per param leaf (run layout) the dim its data group splits (`jaxmeg.parallel.zero`);
    all NO_DIM with `parallel.zero_stage` 0."""
    specs, shapes = trainable.run_layout_params
    if trainable.cfg.parallel.zero_stage == 0:
        return jax.tree.map(lambda _: zero.NO_DIM, shapes)
    return zero.zero_dims(shapes, specs, trainable.mesh.shape, _in_blocks)


def state_specs(trainable: Trainable) -> TrainState:
    """PartitionSpecs of the train state, derived from the params' logical axes; with a sharded
    optimizer, params and optimizer state also split over the data group."""
    p_specs, abstract_params = trainable.run_layout_params
    p_specs = jax.tree_util.tree_map_with_path(
        lambda path, spec, dim, shape: zero.with_zero_axes(
            spec, dim, zero.STAGE_AXES if _in_blocks(path) else zero.SHARED_AXES, len(shape.shape)
        ),
        p_specs,
        zero_dims(trainable),
        abstract_params,
        is_leaf=_is_spec,
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
    specs = {"step": P(), "params": p_specs, "opt_state": opt_specs}
    run_links = links_of(trainable)
    if run_links.shapes:
        specs["links"] = run_links.specs()
    return specs


def links_of(trainable: Trainable) -> links.Links:
    """The run's compression links (`jaxmeg.training.links.Links`): the one place the state,
    the step and the checkpoint ask about them."""
    specs, shapes = trainable.run_layout_params
    return links.Links(
        trainable.cfg, trainable.mesh.shape, shapes["blocks"]["layers"], specs["blocks"]["layers"]
    )


def initial_link_state(trainable: Trainable):
    """The compression state a run starts with."""
    return links_of(trainable).initial()


def _state_from_key(trainable: Trainable, key: jax.Array) -> TrainState:
    params = nn.meta.unbox(_init_boxed_params(trainable, key))
    params = to_stage_layout(params, trainable.layout)
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": trainable.tx.init(params),
    }
    run_links = links_of(trainable)
    if run_links.shapes:
        state["links"] = run_links.initial()
    return state


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
