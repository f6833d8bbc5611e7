"""The model's shape as the performance model reads it (h, l, a, s, V), and the one place a
model config becomes one. Its own module so that `jaxmeg.perf.model` and `jaxmeg.perf.context`
both import it, one way."""

from __future__ import annotations

import dataclasses

from jaxmeg.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    seq_len: int
    vocab: int
    mlp_ratio: int = 4
    kv_heads: int | None = None
    """Key/value heads of grouped-query attention (`model.kv_heads`); None = heads. Only the
    context ring's block size reads it (the parameters and FLOPs are multi-head attention's)."""


def shape_of(model: ModelConfig) -> Shape:
    """The Shape of a model config: h, l, a, s, V (`vocab_size`, which must be set) and the
    MLP ratio. The one place a config becomes a Shape."""
    if model.vocab_size < 1:
        raise ValueError(f"model.vocab_size must be set (>= 1), got {model.vocab_size}")
    return Shape(
        hidden=model.hidden, layers=model.layers, heads=model.heads, seq_len=model.seq_len,
        vocab=model.vocab_size, mlp_ratio=model.mlp_ratio,
        kv_heads=None if model.kv_heads == -1 else model.kv_heads,
    )  # fmt: skip
