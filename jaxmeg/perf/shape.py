"""The model's shape as the performance model reads it (h, l, a, s, V), and the one place a
model config becomes one. Its own module so that `jaxmeg.perf.model` and `jaxmeg.perf.context`
both import it, one way."""

from __future__ import annotations

import dataclasses

from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.config_moe import EXCHANGE_BOUNDS, EXCHANGE_KEPT_BOUND


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experts:
    """A mixture-of-experts layer in place of the MLP of every layer but the `dense_layers`
    leading ones (`moe` config section), as the performance model reads it
    (`jaxmeg.perf.experts`)."""

    count: int
    """Routed experts E."""
    top_k: int
    """Experts each token goes to, k."""
    width: int
    """One expert's FFN width f_e."""
    shared_width: int = 0
    """The shared experts' width together (0: none); every token goes through them."""
    gated: bool = True
    """SwiGLU experts (the llama block: three h x f matrices each), else GeLU (two)."""
    capacity_factor: float = 0.0
    """Slots per expert as a multiple of its even share of a sequence's choices (`moe`'s);
    0 = dropless."""
    dense_layers: int = 0
    """Leading layers that keep the dense MLP (`moe.first_dense`), counted as dense layers in
    the parameters and FLOPs. They run with the embedding on the first stage; the per-stage
    time and memory price the l - dense_layers MoE layers the stages split."""
    unit: tuple[bool, ...] = (True,)
    """One entry of the layer stack after the dense leading ones, a layer each, True where the
    MLP is the mixture of experts (`moe.unit`: MoE in every n-th layer with `moe.every`): a
    stage holds such units, and its per-layer figures are a unit's averages
    (`Shape.moe_share`)."""
    exchange_bounds: tuple[float, ...] = EXCHANGE_BOUNDS
    """The bounds of a dropless exchange (`moe.exchange_bounds`)."""
    exchange_kept_bound: float = EXCHANGE_KEPT_BOUND
    """The largest bound whose residuals the exchange keeps (`moe.exchange_kept_bound`)."""

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2


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
    experts: Experts | None = None
    """The MoE layers' shape; None: a dense model."""
    flash_attention: bool = False
    """Attention as one fused kernel (cuDNN's, what jaxmeg runs on GPUs where `model.attention`
    is auto or cudnn with 16-bit compute): no s x s scores through HBM. False prices the
    unfused softmax of the Megatron-LM 2021 measurements (a shape given without a config)."""
    backward_overlap: bool = False
    """A whole backward's tensor-parallel collectives run beside its weight-gradient GEMMs, as
    XLA's scheduler runs jaxmeg's step on GPUs (a config's shape); False: none overlapped, as
    in the Megatron-LM 2021 measurements."""

    @property
    def dense_layers(self) -> int:
        """Layers with the dense MLP before the MoE ones (0 for a dense model: all are)."""
        return self.experts.dense_layers if self.experts else 0

    @property
    def stacked_layers(self) -> int:
        """The entries of the layer stack, which the pipeline stages split: l less the dense
        leading ones, in units of `layers_per_entry`."""
        return (self.layers - self.dense_layers) // self.layers_per_entry

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the mixture of experts (0 for a dense model)."""
        return self.stacked_layers * sum(self.experts.unit) if self.experts else 0

    @property
    def layers_per_entry(self) -> int:
        """Layers per entry of the layer stack: `Experts.unit`'s, 1 for a dense model."""
        return len(self.experts.unit) if self.experts else 1

    @property
    def moe_share(self) -> float:
        """The share of a stage's layers whose MLP is the mixture of experts (a unit's MoE
        layers over its layers; 0 for a dense model): the per-layer figures of a stage weight
        the MoE block's by it and the dense MLP's by the rest."""
        return sum(self.experts.unit) / len(self.experts.unit) if self.experts else 0.0


def shape_of(model: ModelConfig, moe: MoeConfig | None = None) -> Shape:
    """The Shape of a model config (and its `moe` section): h, l, a, s, V (`vocab_size`, which
    must be set), the MLP ratio, the experts, and the program as jaxmeg runs it on GPUs (fused
    attention where `model.attention` runs it, the backward's collectives overlapped). The one
    place a config becomes a Shape."""
    if model.vocab_size < 1:
        raise ValueError(f"model.vocab_size must be set (>= 1), got {model.vocab_size}")
    return Shape(
        hidden=model.hidden, layers=model.layers, heads=model.heads, seq_len=model.seq_len,
        vocab=model.vocab_size, mlp_ratio=model.mlp_ratio,
        kv_heads=None if model.kv_heads == -1 else model.kv_heads,
        experts=experts_of(model, moe), flash_attention=model.attention_on("gpu") == "cudnn",
        backward_overlap=True,
    )  # fmt: skip


def experts_of(model: ModelConfig, moe: MoeConfig | None) -> Experts | None:
    if moe is None or moe.experts == 0:
        return None
    dense = model.mlp_hidden
    return Experts(
        count=moe.experts, top_k=moe.top_k, width=moe.expert_width(dense),
        shared_width=moe.shared_width(dense), gated=model.block != "gpt",
        capacity_factor=moe.capacity_factor, dense_layers=moe.dense_layers, unit=moe.unit,
        exchange_bounds=moe.exchange_bounds, exchange_kept_bound=moe.exchange_kept_bound,
    )  # fmt: skip
