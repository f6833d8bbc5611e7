"""GPT decoder as single-device Flax code that names logical axes only.

Shapes live in names; the letters are B batch, S sequence, D hidden, N heads, K key/value
heads, H head dim, F MLP width, V (padded) vocabulary, L layers. Parameters are annotated with
logical axes (`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `qkv`, `positions`,
`layers`); activations are passed through `constrain(x, logical_axes)`, a hook that the caller
supplies (identity by default). The model never sees a mesh: the parallel package maps
logical axes to mesh axes.

Decoding (`GPT.decode`) runs the same parameters on a few new tokens at a time against a
key/value cache [L, 2, B, T, K, H] (T = the cache's length, keys after rotary), written at the
tokens' positions; the training path and its parameter tree are unchanged.

Context parallelism hands the model a `SequenceOrder`: the rows of the sequence come in another
order than 0..S-1 (the model reads each row's position from it: learned position rows, rotary
angles) and attention is its `attend` (causal by those positions, across the devices that hold
the sequence's parts); the model never learns where the rows are.

Megatron's tensor-parallel split follows from the axes alone: QKV and fc1 are column-parallel
(`heads`, `mlp` on the output dim), attention-out and fc2 are row-parallel (same axes on the
input dim), the embedding table is vocab-parallel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.models.moe import MOE_STATS, Dispatch, MoeMlp
from jaxmeg.models.moe_exchange import UNIT_KEPT
from jaxmeg.models.parts import (  # noqa: F401 (MATMUL_INPUTS, TAPS, RESIDUAL_AXES: re-exported)
    MATMUL_INPUTS,
    RESIDUAL_AXES,
    TAPS,
    Array,
    Constrain,
    Mlp,
    dtype_of,
    fan_out,
    lookup,
    no_constraint,
    normal,
    param,
    stacked_matmul,
    weight_matmul,
)
from jaxmeg.models.remat import REMAT_POLICY


@dataclasses.dataclass(frozen=True)
class SequenceOrder:
    """The sequence's rows as the model sees them: `positions()` [S] int is each row's position,
    and `attend(q [B, S, N, H], k, v [B, S, K, H]) -> o [B, S, N, H]` is causal attention by
    those positions (context parallelism: the rows a context rank holds, and the ring that
    attends them to the whole sequence; `jaxmeg.parallel.context`)."""

    positions: Callable[[], Array]
    attend: Callable[[Array, Array, Array], Array]


class Norm(nn.Module):
    """LayerNorm (gpt) or RMSNorm (llama), computed in float32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxSxD: Array) -> Array:
        d = self.cfg.hidden
        scale = param(self, "scale", (d,), ("embed",), nn.initializers.ones)
        x = x_BxSxD.astype(jnp.float32)
        if self.cfg.block == "llama":
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
            return (x * scale).astype(x_BxSxD.dtype)
        bias = param(self, "bias", (d,), ("embed",), nn.initializers.zeros)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.cfg.norm_eps)
        return (x * scale + bias).astype(x_BxSxD.dtype)


def rotary(x_BxSxNxH: Array, theta: float = 10000.0, start: Array | int = 0, order=None) -> Array:
    """Rotary position embedding (Su et al., 2021) over the head dim, halves rotated: pair i is
    (x[i], x[i + H/2]) at frequency theta^(-2i/H), Hugging Face Llama's `rotate_half` layout.
    Token s sits at position start + s, or at `order.positions()[s]` (a `SequenceOrder`)."""
    seq, half = x_BxSxNxH.shape[1], x_BxSxNxH.shape[-1] // 2
    freq_H = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    position_S = jnp.arange(seq, dtype=jnp.float32)
    if order is not None:
        position_S = order.positions().astype(jnp.float32)
    elif not isinstance(start, int) or start:  # decoding; training traces as it always did
        position_S = position_S + start
    angle_SxH = position_S[:, None] * freq_H[None, :]
    cos, sin = jnp.cos(angle_SxH)[None, :, None, :], jnp.sin(angle_SxH)[None, :, None, :]
    x = x_BxSxNxH.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxSxNxH.dtype)


QKV_AXES = ("embed", "qkv", "heads", "head_dim")
KV_CACHE_AXES = (None, None, "act_batch", None, "act_kv_heads", None)
"""Logical axes of a key/value cache [L, 2, B, T, K, H]: its kv heads split like the params'."""


def kv_cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    """[L, 2, B, T, K, H]: keys (after rotary) and values of every layer for `length` positions."""
    return (cfg.layers, 2, batch, length, cfg.num_kv_heads, cfg.head_dim)


def _fused_qkv(module: nn.Module, x_BxSxD: Array, w_qkv: Array) -> tuple[Array, Array, Array]:
    """Multi-head attention's q, k, v [B, S, N, H] from one `w_qkv` [D, 3, N, H]."""
    cfg = module.cfg
    n, h = cfg.heads, cfg.head_dim
    compute = dtype_of(cfg.compute_dtype)
    b_qkv = None
    if cfg.block == "gpt" or cfg.qkv_bias:
        b_qkv = param(module, "b_qkv", (3, n, h), QKV_AXES[1:], nn.initializers.zeros)
        b_qkv = b_qkv.astype(compute)
    q, k, v = stacked_matmul(
        module, "w_qkv", x_BxSxD, w_qkv.astype(compute), b_qkv, "input", qkv_in_parts(cfg)
    )
    return q, k, v


def _grouped_qkv(module: nn.Module, x_BxSxD: Array) -> tuple[Array, Array, Array]:
    """Grouped-query attention's q [B, S, N, H] from `w_q` [D, N, H] and k, v [B, S, K, H] from
    `w_kv` [D, 2, K, H]; the kv heads have their own logical axis, so they can stay replicated
    over `tensor` where it does not divide K."""
    cfg = module.cfg
    d, n, kv, h = cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.head_dim
    compute = dtype_of(cfg.compute_dtype)
    q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "qkv", "kv_heads", "head_dim")
    w_q = param(module, "w_q", (d, n, h), q_axes, normal(cfg.init_std)).astype(compute)
    w_kv = param(module, "w_kv", (d, 2, kv, h), kv_axes, normal(cfg.init_std)).astype(compute)
    x_q, x_kv = fan_out(x_BxSxD, 2)  # q's input gradient added in its GEMM to k and v's
    q_BxSxNxH = weight_matmul(module, "w_q", "bsd,dnh->bsnh", x_q, w_q, "input")
    b_kv = None
    if cfg.block == "gpt" or cfg.qkv_bias:
        b_q = param(module, "b_q", (n, h), q_axes[1:], nn.initializers.zeros)
        b_kv = param(module, "b_kv", (2, kv, h), kv_axes[1:], nn.initializers.zeros)
        q_BxSxNxH = q_BxSxNxH + b_q.astype(compute)
        b_kv = b_kv.astype(compute)
    kv_axes_act = ("act_batch", "act_tokens", "act_kv_heads", None)
    per_part = qkv_in_parts(cfg)
    k, v = stacked_matmul(module, "w_kv", x_kv, w_kv, b_kv, "input", per_part, kv_axes_act)
    q_BxSxNxH = module.constrain(q_BxSxNxH, ("act_batch", "act_tokens", "act_heads", None))
    return q_BxSxNxH, k, v


class Attention(nn.Module):
    """Causal self-attention. QKV column-parallel over heads, output row-parallel.

    Multi-head (kv_heads = heads) keeps the fused `w_qkv`; grouped-query attention has `w_q` and
    `w_kv`, and query head n reads kv head n // (N / K) (`jax.nn.dot_product_attention`'s
    grouping, the same as Hugging Face's `repeat_kv`)."""

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    order: SequenceOrder | None = None

    @nn.compact
    def __call__(
        self, x_BxSxD: Array, cache_2xBxTxKxH: Array | None = None, start: Array | int = 0
    ) -> Array | tuple[Array, Array]:
        """y [B, S, D]; with a cache, the S tokens sit at positions start.. and attend to the
        cache's keys up to their own position: (y, the cache with their keys and values)."""
        cfg = self.cfg
        d, n, h = cfg.hidden, cfg.heads, cfg.head_dim
        compute = dtype_of(cfg.compute_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        out_axes = ("heads", "head_dim", "embed")
        if cfg.num_kv_heads != n:
            q, k, v = _grouped_qkv(self, x_BxSxD)
            w_out = param(self, "w_out", (n, h, d), out_axes, normal(out_std))
        else:
            # Init draws its random keys in creation order: w_qkv, w_out, b_qkv as always, so
            # a seed gives multi-head models the initial params it always gave.
            w_qkv = param(self, "w_qkv", (d, 3, n, h), QKV_AXES, normal(cfg.init_std))
            w_out = param(self, "w_out", (n, h, d), out_axes, normal(out_std))
            q, k, v = _fused_qkv(self, x_BxSxD, w_qkv)
        if cfg.block == "llama":
            q = rotary(q, cfg.rope_theta, start, self.order)
            k = rotary(k, cfg.rope_theta, start, self.order)
        if self.order is not None:
            o_BxSxNxH = self.order.attend(q, k, v)
        elif cache_2xBxTxKxH is None:
            impl = attention_implementation(cfg)
            o_BxSxNxH = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        else:
            o_BxSxNxH, cache_2xBxTxKxH = _attend_cached(self, q, k, v, cache_2xBxTxKxH, start)
        o_BxSxNxH = self.constrain(o_BxSxNxH, ("act_batch", "act_tokens", "act_heads", None))
        y_BxSxD = weight_matmul(
            self, "w_out", "bsnh,nhd->bsd", o_BxSxNxH, w_out.astype(compute), "output"
        )
        if cfg.block == "gpt":
            b_out = param(self, "b_out", (d,), ("embed",), nn.initializers.zeros)
            y_BxSxD = y_BxSxD + b_out.astype(compute)
        if cache_2xBxTxKxH is None:
            return y_BxSxD
        return y_BxSxD, cache_2xBxTxKxH


def _attend_cached(
    module: nn.Module, q_BxSxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array,
    cache_2xBxTxKxH: Array, start: Array | int,
) -> tuple[Array, Array]:  # fmt: skip
    """Writes k, v at positions start.. of the cache; query s attends to cache positions
    <= start + s. The XLA implementation, as cuDNN's takes no mask of this form."""
    kv_2xBxSxKxH = jnp.stack([k_BxSxKxH, v_BxSxKxH]).astype(cache_2xBxTxKxH.dtype)
    cache = jax.lax.dynamic_update_slice(cache_2xBxTxKxH, kv_2xBxSxKxH, (0, 0, start, 0, 0))
    cache = module.constrain(cache, KV_CACHE_AXES[1:])
    seq, length = q_BxSxNxH.shape[1], cache.shape[2]
    query_S = start + jnp.arange(seq)
    mask_1x1xSxT = (jnp.arange(length)[None, :] <= query_S[:, None])[None, None]
    o_BxSxNxH = jax.nn.dot_product_attention(
        q_BxSxNxH, cache[0], cache[1], mask=mask_1x1xSxT, implementation="xla"
    )
    return o_BxSxNxH, cache


def attention_implementation(cfg: ModelConfig, platform: str | None = None) -> str:
    """`model.attention` as run on `platform` (default: jax's default backend): `auto` is cuDNN
    on a GPU with 16-bit compute, XLA otherwise."""
    return cfg.attention_on(platform or jax.default_backend())


def qkv_in_parts(cfg: ModelConfig) -> bool:
    """Whether q, k and v come out of their own GEMMs (`parts.stacked_matmul`): where attention
    is cuDNN's, which reads them as three arrays."""
    return attention_implementation(cfg) == "cudnn"


def weight_gemms(cfg: ModelConfig) -> dict[str, tuple[int | None, int]]:
    """{leaf name: (parts axis, split)} of the weights whose gradient comes out of GEMMs shaped
    otherwise than the leaf: `w_qkv` [D, 3, N, H] and `w_kv` [D, 2, K, H] where q, k and v
    come out of their own GEMMs (`qkv_in_parts`), each part's output [D, N H]; the attention's
    `w_out` [N, H, D], its output [N H, D] (the MLP's `w_out` [F, D] is one already)."""
    gemms: dict[str, tuple[int | None, int]] = {"w_out": (None, -1)}
    if qkv_in_parts(cfg):
        gemms.update({"w_qkv": (1, 1), "w_kv": (1, 1)})
    return gemms


class StackEntry(nn.Module):
    """The fields of one entry of the layer stack (`Block`, `LayerGroup`), which keeps for its
    backward REMAT_POLICY[cfg.remat] (its caller's, `BlockStack` or the pipeline's chunk).
    `moe_grad_scale`: the weight of the MoE layers' auxiliary losses in the backward
    (`jaxmeg.models.moe.into_backward`); `moe_dispatch`: how the MoE layer runs experts split
    over devices (None: all here)."""

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    order: SequenceOrder | None = None
    moe: MoeConfig = MoeConfig()
    moe_grad_scale: float = 0.0
    moe_dispatch: Dispatch | None = None


class Block(StackEntry):
    """Pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(x)), the MLP a
    mixture of experts (`MoeMlp`, named `moe`) when `moe.experts` > 0. With this layer's
    key/value cache [2, B, T, K, H] (decoding), also returns the cache the new tokens wrote."""

    @nn.compact
    def __call__(
        self, x_BxSxD: Array, cache_2xBxTxKxH: Array | None = None, start: Array | int = 0
    ) -> tuple[Array, Array | None]:
        x = x_BxSxD
        attn = Attention(self.cfg, self.constrain, self.order, name="attn")
        if cache_2xBxTxKxH is None:
            x = x + attn(Norm(self.cfg, name="norm1")(x))
        else:
            y, cache_2xBxTxKxH = attn(Norm(self.cfg, name="norm1")(x), cache_2xBxTxKxH, start)
            x = x + y
        x = self.constrain(x, RESIDUAL_AXES)
        if self.moe.experts:
            mlp = MoeMlp(self.cfg, self.moe, self.constrain, self.moe_grad_scale,
                         self.moe_dispatch, name="moe")  # fmt: skip
        else:
            mlp = Mlp(self.cfg, self.constrain, name="mlp")
        x = x + mlp(Norm(self.cfg, name="norm2")(x))
        x = self.constrain(x, RESIDUAL_AXES)
        return x, cache_2xBxTxKxH


class LayerGroup(StackEntry):
    """`moe.unit`'s n > 1 layers as one stack entry, params {'layer_0': .., 'layer_{n-1}': ..}
    (an MoE block's output named `UNIT_KEPT` but the last's). With a key/value cache
    [n, 2, B, T, K, H] (decoding), also returns the cache its layers wrote."""

    @nn.compact
    def __call__(
        self, x_BxSxD: Array, cache_Nx2xBxTxKxH: Array | None = None, start: Array | int = 0
    ) -> tuple[Array, Array | None]:
        caches = []
        for k, is_moe in enumerate(self.moe.unit):
            moe = self.moe if is_moe else MoeConfig()
            block = Block(self.cfg, self.constrain, self.order, moe, self.moe_grad_scale,
                          self.moe_dispatch, name=f"layer_{k}")  # fmt: skip
            cache = None if cache_Nx2xBxTxKxH is None else cache_Nx2xBxTxKxH[k]
            x_BxSxD, cache = block(x_BxSxD, cache, start)
            if is_moe and k < len(self.moe.unit) - 1:
                x_BxSxD = checkpoint_name(x_BxSxD, UNIT_KEPT)
            caches.append(cache)
        return x_BxSxD, None if cache_Nx2xBxTxKxH is None else jnp.stack(caches)


def layer_unit(moe: MoeConfig) -> type[nn.Module]:
    """One entry of the layer stack: a `Block`, or a `LayerGroup` of `moe.unit`'s n > 1."""
    return LayerGroup if moe.layers_per_unit > 1 else Block


class BlockStack(nn.Module):
    """`num_layers` stack entries (`layer_unit`) with parameters stacked on a leading `layers`
    dim, applied by scan (what the MoE layers sow, stacked likewise). A key/value cache has
    one entry per layer, [num_layers x n, 2, ...]."""

    cfg: ModelConfig
    num_layers: int
    constrain: Constrain = no_constraint
    order: SequenceOrder | None = None
    moe: MoeConfig = MoeConfig()

    @nn.compact
    def __call__(
        self, x_BxSxD: Array, cache_Lx2xBxTxKxH: Array | None = None, start: Array | int = 0
    ) -> Array | tuple[Array, Array]:
        """x; with a key/value cache (decoding, no remat), (x, the updated cache)."""
        block, n = layer_unit(self.moe), self.moe.layers_per_unit
        if cache_Lx2xBxTxKxH is None:
            block = nn.remat(block, policy=REMAT_POLICY[self.cfg.remat], prevent_cse=False)
        elif n > 1:  # one cache entry per group: [L / n, n, 2, ...]
            cache_Lx2xBxTxKxH = cache_Lx2xBxTxKxH.reshape(-1, n, *cache_Lx2xBxTxKxH.shape[1:])
        scanned = nn.scan(
            block,
            variable_axes={"params": 0, MOE_STATS: 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, cache = scanned(self.cfg, self.constrain, self.order, self.moe, name="layers")(
            x_BxSxD, cache_Lx2xBxTxKxH, start
        )
        if cache_Lx2xBxTxKxH is None:
            return x
        return x, cache.reshape(-1, *cache.shape[2:]) if n > 1 else cache


class Embed(nn.Module):
    """Vocab-parallel token embedding plus learned positions (gpt)."""

    cfg: ModelConfig
    vocab: int
    constrain: Constrain = no_constraint
    order: SequenceOrder | None = None

    def setup(self) -> None:
        cfg = self.cfg
        init = normal(cfg.init_std)
        self.token = param(self, "token", (self.vocab, cfg.hidden), ("vocab", "embed"), init)
        if cfg.block == "gpt":
            self.position = param(
                self, "position", (cfg.seq_len, cfg.hidden), ("positions", "embed"), init
            )

    def __call__(self, tokens_BxS: Array, start: Array | int = 0) -> Array:
        """Embeddings of tokens at positions start, start + 1, ..."""
        compute = dtype_of(self.cfg.compute_dtype)
        x_BxSxD = lookup(self.token, tokens_BxS)
        # whole sequences on every tensor rank: the vocab-parallel lookup's own form (each rank
        # its vocab slice, then a sum over tensor). With sequence parallelism the residual's
        # split would otherwise reach the gather, which XLA then partitioned with a permute
        # that crossed the (manual) expert axis inside the first stage's slot
        x_BxSxD = self.constrain(x_BxSxD, ("act_batch", None, "act_embed")).astype(compute)
        if self.cfg.block == "gpt":
            seq = tokens_BxS.shape[1]
            if self.order is not None:
                position_SxD = jnp.take(self.position, self.order.positions(), axis=0)
            elif isinstance(start, int):  # training: a static slice, as always
                position_SxD = self.position[start : start + seq]
            else:
                position_SxD = jax.lax.dynamic_slice_in_dim(self.position, start, seq)
            x_BxSxD = x_BxSxD + position_SxD.astype(compute)[None]
        return self.constrain(x_BxSxD, RESIDUAL_AXES)


def output_weight(cfg: ModelConfig, params) -> Array:
    """The output projection's weight in the model's params: the token table [V, D] when tied
    to the embedding, else the head's own [D, V]."""
    return params["embed"]["token"] if cfg.tie_embeddings else params["head"]["unembed"]


def output_projection(cfg: ModelConfig, z_BxSxD: Array, w: Array) -> Array:
    """Logits [B, S, V] of the final norm's output z by `output_weight` w (in the compute
    dtype)."""
    spec = "bsd,vd->bsv" if cfg.tie_embeddings else "bsd,dv->bsv"
    return jnp.einsum(spec, z_BxSxD, w.astype(dtype_of(cfg.compute_dtype)))


class Head(nn.Module):
    """Final norm and the vocab-parallel output projection (tied to `Embed` unless untied)."""

    cfg: ModelConfig
    vocab: int
    constrain: Constrain = no_constraint

    def setup(self) -> None:
        self.final_norm = Norm(self.cfg)
        if not self.cfg.tie_embeddings:
            self.unembed = param(
                self, "unembed", (self.cfg.hidden, self.vocab), ("embed", "vocab"),
                normal(self.cfg.init_std),
            )  # fmt: skip

    def __call__(self, x_BxSxD: Array, embed: Embed | None = None) -> Array:
        w = embed.token if self.cfg.tie_embeddings else self.unembed
        return self.project(self.final_norm(x_BxSxD), w)

    def normed(self, x_BxSxD: Array) -> Array:
        """What the output projection reads: the final norm's output."""
        return self.final_norm(x_BxSxD)

    def project(self, z_BxSxD: Array, w: Array) -> Array:
        """The logits of z by the weight w (`output_weight`)."""
        logits_BxSxV = output_projection(self.cfg, z_BxSxD, w)
        return self.constrain(logits_BxSxV, ("act_batch", "act_tokens", "act_vocab"))


class GPT(nn.Module):
    """Embedding -> L blocks -> head. Returns logits over the padded vocabulary.

    Parameters: {'embed': {token, position}, 'blocks': {'layers': stacked [L, ...]},
    'head': {final_norm, unembed?}}; `moe` makes every layer's MLP a mixture of experts, but
    for its `first_dense` leading layers, which keep the dense MLP and are a stack of their own,
    {'dense_blocks': {'layers': [first_dense, ...]}}, run with the embedding (`embed_tokens`):
    'blocks' then holds the L - first_dense others, the ones a pipeline splits over stages;
    in units of n layers (`moe.unit`; n > 1: `LayerGroup`); first_dense is `moe.dense_layers`.
    """

    cfg: ModelConfig
    vocab: int
    constrain: Constrain = no_constraint
    order: SequenceOrder | None = None
    moe: MoeConfig = MoeConfig()

    def setup(self) -> None:
        self.embed = Embed(self.cfg, self.vocab, self.constrain, self.order)
        dense = self.moe.dense_layers
        if dense:
            self.dense_blocks = BlockStack(self.cfg, dense, self.constrain, self.order)
        entries = (self.cfg.layers - dense) // self.moe.layers_per_unit
        self.blocks = BlockStack(self.cfg, entries, self.constrain, self.order, self.moe)
        self.head = Head(self.cfg, self.vocab, self.constrain)

    def __call__(self, tokens_BxS: Array) -> Array:
        return self.head(self.blocks(self.embed_tokens(tokens_BxS)), self.embed)

    def decode(
        self, tokens_BxS: Array, cache_Lx2xBxTxKxH: Array, start: Array | int
    ) -> tuple[Array, Array]:
        """(logits [B, V] of the last token, the cache with the keys and values of all S): the
        S tokens sit at positions start..start + S - 1 and attend to the cache's earlier
        positions. A prompt goes in one call (start 0), then one token per call."""
        x_BxSxD = self.embed(tokens_BxS, start)
        dense = self.moe.dense_layers
        if dense:
            x_BxSxD, dense_cache = self.dense_blocks(x_BxSxD, cache_Lx2xBxTxKxH[:dense], start)
        x_BxSxD, cache = self.blocks(x_BxSxD, cache_Lx2xBxTxKxH[dense:], start)
        if dense:
            cache = jnp.concatenate([dense_cache, cache])
        return self.head(x_BxSxD[:, -1:], self.embed)[:, 0], cache

    def embed_tokens(self, tokens_BxS: Array) -> Array:
        """The first layer's input: the embedding, then the dense leading layers if any."""
        x_BxSxD = self.embed(tokens_BxS)
        return self.dense_blocks(x_BxSxD) if self.moe.dense_layers else x_BxSxD

    def logits(self, x_BxSxD: Array) -> Array:
        return self.head(x_BxSxD, self.embed)

    def head_input(self, x_BxSxD: Array) -> Array:
        """What the output projection reads (`logits` = `head_project(head_input(x), w)`)."""
        return self.head.normed(x_BxSxD)

    def head_project(self, z_BxSxD: Array, w: Array) -> Array:
        """The logits of `head_input`'s z by the weight w (`output_weight` of the params)."""
        return self.head.project(z_BxSxD, w)
