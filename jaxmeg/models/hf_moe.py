"""Hugging Face mixtures of experts <-> jaxmeg (`jaxmeg.models.hf` for the rest of the model):
`MixtralForCausalLM` and `Qwen2MoeForCausalLM`, both a llama block with every MLP a
`jaxmeg.models.moe.MoeMlp`, but Qwen2-MoE's `mlp_only_layers` and, with its
`decoder_sparse_step` n, all but every n-th layer, which keep the dense one (jaxmeg's
`moe.first_dense` and `moe.every` where they say it, else `moe.pattern`).

  Mixtral     softmax router, top-k weights renormalised; experts w1 (gate), w3 (up), w2
              (down), each [f, h] or [h, f] as torch stores them; `intermediate_size` is one
              expert's width.
  Qwen2-MoE   softmax router, top-k weights renormalised only with `norm_topk_prob`; experts
              gate_proj, up_proj, down_proj; one shared expert of
              `shared_expert_intermediate_size` scaled by sigmoid(`shared_expert_gate` x);
              q, k, v biases (`qkv_bias`, jaxmeg's `model.qkv_bias`).
Both store one tensor per expert (transformers 5 saves them so too). jaxmeg's routing bias
(`router_bias`, DeepSeek-V3's loss-free balancing) has no place in either: it is zero on import
and an export of a model whose bias moved is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.config_moe import BOUND_SLOTS, LAYER_KINDS, stack_split

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")
MOE_TYPES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_JSON_FIELDS = ("experts", "top_k", "ffn_hidden", "shared_experts", "shared_ffn_hidden",
                   "shared_gate", "router", "normalize", "router_groups", "router_group_topk",
                   "routed_scaling")  # fmt: skip
"""The MoeConfig fields that config.json fixes (`moe_config`)."""
EXPERT_NAMES = {  # jaxmeg weight -> (HF module under the layer, its expert weights)
    "MixtralForCausalLM": ("block_sparse_moe", {"w_gate": "w1", "w_in": "w3", "w_out": "w2"}),
    "Qwen2MoeForCausalLM": (
        "mlp", {"w_gate": "gate_proj", "w_in": "up_proj", "w_out": "down_proj"}
    ),
}  # fmt: skip
Tensors = dict[str, np.ndarray]


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint or config that jaxmeg cannot map (the message says why)."""


def model_fields(architecture: str, hf: dict) -> dict[str, Any]:
    """ModelConfig fields besides the llama ones that hf.model_config reads: the dense MLP
    width (Mixtral's `intermediate_size` is an expert's; jaxmeg's MLP width is then that) and
    the q, k, v biases."""
    if architecture == "MixtralForCausalLM":
        window = hf.get("sliding_window")
        if window not in (None, 0) and window < hf.get("max_position_embeddings", 0):
            raise HFCheckpointError(
                f"config.json sliding_window = {window}: jaxmeg's attention is full (causal)"
            )
        return {"qkv_bias": False}
    if hf.get("use_sliding_window"):
        raise HFCheckpointError("config.json use_sliding_window = true: jaxmeg's attention is full")
    return {"qkv_bias": bool(hf.get("qkv_bias", True))}


def moe_config(architecture: str, hf: dict) -> MoeConfig:
    """The MoeConfig of a Mixtral or Qwen2-MoE config.json."""
    if architecture == "MixtralForCausalLM":
        return MoeConfig(
            experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], ffn_hidden=-1,
            normalize=True, aux_loss=float(hf.get("router_aux_loss_coef", 0.0)),
        )  # fmt: skip
    dense, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1)
    kinds = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"]))
    if True not in kinds:
        raise HFCheckpointError(
            f"config.json decoder_sparse_step = {step}, mlp_only_layers = {sorted(dense)}: no "
            f"layer of {len(kinds)} has experts"
        )
    shared = hf.get("shared_expert_intermediate_size") or 0
    return MoeConfig(
        experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], **_layer_fields(kinds),
        ffn_hidden=hf["moe_intermediate_size"], shared_experts=1 if shared else 0,
        shared_ffn_hidden=shared or -1, shared_gate=bool(shared),
        normalize=bool(hf.get("norm_topk_prob", False)),
        aux_loss=float(hf.get("router_aux_loss_coef", 0.0)),
    )  # fmt: skip


def _layer_fields(kinds: tuple[bool, ...]) -> dict[str, Any]:
    """The MoeConfig fields that place MoE layers where `kinds` says: `first_dense` and `every`
    where they can, else `pattern`."""
    dense, unit = stack_split(kinds)
    if unit == (False,) * (len(unit) - 1) + (True,):
        return {"first_dense": dense, "every": len(unit)}
    return {"pattern": tuple(LAYER_KINDS[kind] for kind in kinds)}


def architecture_of(model: ModelConfig, moe: MoeConfig) -> str:
    """The transformers class that holds a jaxmeg MoE model, or HFCheckpointError naming what none
    holds."""
    if moe.router != "softmax":
        raise HFCheckpointError(
            f"moe.router = {moe.router}: Mixtral and Qwen2-MoE route by softmax"
        )
    if model.block != "llama":
        raise HFCheckpointError("Mixtral and Qwen2-MoE are llama blocks; this model's block is gpt")
    if moe.router_groups > 1 or moe.routed_scaling != 1.0:
        raise HFCheckpointError(
            f"moe.router_groups = {moe.router_groups}, moe.routed_scaling = "
            f"{moe.routed_scaling}: Mixtral and Qwen2-MoE route over all experts, unscaled "
            f"(1 and 1.0)"
        )
    mixtral = moe.shared_experts == 0 and not model.qkv_bias and moe.normalize
    if mixtral and not all(moe.kinds(model.layers)):
        raise HFCheckpointError(
            f"moe.first_dense = {moe.first_dense}, moe.every = {moe.every}, moe.pattern = "
            f"{list(moe.pattern)}: Mixtral has no dense layers, and this model is no Qwen2-MoE "
            f"(which holds them as mlp_only_layers and decoder_sparse_step; it has q, k, v "
            f"biases or a gated shared expert)"
        )
    if mixtral:
        return "MixtralForCausalLM"
    if moe.shared_experts in (0, 1) and moe.shared_gate == bool(moe.shared_experts):
        return "Qwen2MoeForCausalLM"
    raise HFCheckpointError(
        f"moe.shared_experts = {moe.shared_experts}, shared_gate = {moe.shared_gate}: "
        f"Qwen2-MoE has one gated shared expert (Mixtral none)"
    )


def hf_fields(model: ModelConfig, moe: MoeConfig) -> dict[str, Any]:
    """The config.json entries of the MoE architecture (beside the llama ones)."""
    architecture = architecture_of(model, moe)
    width = moe.expert_width(model.mlp_hidden)
    if architecture == "MixtralForCausalLM":
        return {
            "architectures": [architecture], "model_type": "mixtral",
            "num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k,
            "intermediate_size": width, "router_aux_loss_coef": moe.aux_loss,
            "sliding_window": None,
        }  # fmt: skip
    return {
        "architectures": [architecture], "model_type": "qwen2_moe",
        "num_experts": moe.experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": width, "intermediate_size": model.mlp_hidden,
        "shared_expert_intermediate_size": moe.shared_width(model.mlp_hidden),
        "norm_topk_prob": moe.normalize, "qkv_bias": model.qkv_bias,
        **_sparse_layers(model, moe),
        "use_sliding_window": False,
        "router_aux_loss_coef": moe.aux_loss,
    }  # fmt: skip


def layer_from_hf(
    get: Callable[[str], np.ndarray], architecture: str, moe: MoeConfig
) -> dict[str, Any]:
    """One layer's `moe` params from `get(suffix)`."""
    module, names = EXPERT_NAMES[architecture]
    gate = get(f"{module}.gate.weight")  # [E, h]
    layer = {"w_router": gate.T, "router_bias": np.zeros(gate.shape[0], np.float32)}
    if moe.capacity_factor > 0:  # the never-trained slot that carries the kept shares
        layer["router_kept"] = np.zeros(gate.shape[0], np.float32)
    elif moe.record_exchange_bounds:  # the never-trained slot that counts exchange bounds
        layer["exchange_taken"] = np.zeros(BOUND_SLOTS, np.float32)
    for ours, theirs in names.items():
        layer[ours] = np.stack(
            [get(f"{module}.experts.{e}.{theirs}.weight").T for e in range(moe.experts)]
        )
    if moe.shared_experts:
        layer["shared"] = {
            "w_in": get(f"{module}.shared_expert.up_proj.weight").T,
            "w_gate": get(f"{module}.shared_expert.gate_proj.weight").T,
            "w_out": get(f"{module}.shared_expert.down_proj.weight").T,
        }
        layer["w_shared_gate"] = get(f"{module}.shared_expert_gate.weight").T
    return layer


def layer_to_hf(layer: dict[str, Any], architecture: str, moe: MoeConfig) -> Tensors:
    """{suffix: tensor} of one layer's `moe` params (the inverse of `layer_from_hf`)."""
    if np.any(layer["router_bias"] != 0):
        raise HFCheckpointError(
            f"the routing bias moved (moe.bias_update_rate; largest |bias| "
            f"{float(np.abs(layer['router_bias']).max()):.3g}), which {architecture} cannot hold: "
            f"its router would choose other experts"
        )
    module, names = EXPERT_NAMES[architecture]
    tensors = {f"{module}.gate.weight": layer["w_router"].T}
    for ours, theirs in names.items():
        for e in range(moe.experts):
            tensors[f"{module}.experts.{e}.{theirs}.weight"] = layer[ours][e].T
    if moe.shared_experts:
        shared = layer["shared"]
        tensors[f"{module}.shared_expert.up_proj.weight"] = shared["w_in"].T
        tensors[f"{module}.shared_expert.gate_proj.weight"] = shared["w_gate"].T
        tensors[f"{module}.shared_expert.down_proj.weight"] = shared["w_out"].T
        tensors[f"{module}.shared_expert_gate.weight"] = layer["w_shared_gate"].T
    return tensors


def _sparse_layers(model: ModelConfig, moe: MoeConfig) -> dict[str, Any]:
    """Qwen2-MoE's decoder_sparse_step and mlp_only_layers: `moe.every` and the leading dense
    layers where the step divides them, else a step of 1 and every dense layer listed."""
    if not moe.pattern and moe.first_dense % moe.every == 0:
        return {"decoder_sparse_step": moe.every, "mlp_only_layers": list(range(moe.first_dense))}
    kinds = moe.kinds(model.layers)
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, k in enumerate(kinds) if not k]}
