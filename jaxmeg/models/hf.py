"""Hugging Face `transformers` checkpoints <-> jaxmeg parameters, in NumPy (no torch).

Four architectures: `GPT2LMHeadModel` (block `gpt`) and `LlamaForCausalLM` (block `llama`), and
the mixtures of experts `MixtralForCausalLM` and `Qwen2MoeForCausalLM` (`jaxmeg.models.hf_moe`). A
checkpoint directory holds `config.json` and `model.safetensors`, or shards listed in
`model.safetensors.index.json`. The jaxmeg side is the canonical parameter tree of
`jaxmeg.training.checkpoint`: layers stacked [L, ...] in order, vocabulary dims exactly
`model.vocab_size` long (no padding).

Layouts. torch `nn.Linear` stores [out, in] (y = x W^T); GPT-2's `Conv1D` stores [in, out]. GPT-2's
`c_attn` packs q, k, v along its output, each [N H] head-major, which is jaxmeg's `w_qkv`
[D, 3, N, H] flattened. Llama's q/k/v projections map to `w_qkv`, or with fewer kv heads to `w_q`
[D, N, H] and `w_kv` [D, 2, K, H]; query head n reads kv head n // (N / K) on both sides
(`repeat_kv`). Llama's rotary embedding rotates halves (`rotate_half`: pair i is (x[i],
x[i + H/2]) at frequency theta^(-2i/H)), as `jaxmeg.models.gpt.rotary` does, so q and k need no
permutation. GPT-2's `gelu_new` is the tanh GeLU of the `gpt` block.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxmeg.config import ModelConfig, MoeConfig
from jaxmeg.models import hf_moe
from jaxmeg.models.hf_files import (  # noqa: F401 (re-exported: the module's file half)
    CONFIG_FILE,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    copy_tokenizer,
    read_checkpoint,
    with_umask,
)
from jaxmeg.models.hf_moe import MOE_JSON_FIELDS, HFCheckpointError  # noqa: F401

ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt",
    "LlamaForCausalLM": "llama",
    **dict.fromkeys(hf_moe.MOE_ARCHITECTURES, "llama"),
}
"""Hugging Face architecture -> jaxmeg `model.block`."""
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""GPT-2 `activation_function`s equal to the `gpt` block's tanh GeLU."""
CONFIG_JSON_FIELDS = (
    "block", "vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "norm_eps",
    "rope_theta", "tie_embeddings", "qkv_bias",
)  # fmt: skip
"""The ModelConfig fields that config.json fixes (`model_config`); `model.seq_len` is free
(GPT-2: up to n_positions)."""

Params = dict[str, Any]
Tensors = dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _architecture(hf: dict) -> str:
    names = hf.get("architectures") or []
    by_type = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", **hf_moe.MOE_TYPES}
    known = [n for n in names if n in ARCHITECTURES]
    if known:
        return known[0]
    if not names and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise HFCheckpointError(
        f"config.json architectures {names or hf.get('model_type')!r}: only "
        f"{sorted(ARCHITECTURES)} can be converted"
    )


def _require(hf: dict, key: str, allowed: tuple, default: Any) -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise HFCheckpointError(
            f"config.json {key} = {value!r} is not supported (jaxmeg computes {allowed[0]!r})"
        )


def _rope_theta(hf: dict) -> float:
    """rope_theta of a Llama config: `rope_parameters` (transformers >= 5) or top-level keys;
    any scaled variant (Llama 3.1's `llama3`, linear, dynamic, yarn) is refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise HFCheckpointError(
            f"config.json rope type {rope_type!r} is not supported: jaxmeg's rotary embedding is "
            f"the default (unscaled) one"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config(hf: dict, seq_len: int | None = None, **fields: Any) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json, in float32 so that logits match.
    `seq_len`: the training sequence length (default: the model's maximum positions; at most
    that for GPT-2, whose position table is cut to it). `fields` set other ModelConfig fields.
    A config.json without a field the architecture needs is an HFCheckpointError naming it."""
    try:
        return _model_config(hf, seq_len, **fields)
    except KeyError as err:
        raise HFCheckpointError(
            f"config.json ({hf.get('model_type', 'unknown model_type')}) has no {err.args[0]!r}, "
            f"which the architecture needs"
        ) from None


def moe_config(hf: dict) -> MoeConfig:
    """The MoeConfig of a config.json: Mixtral's or Qwen2-MoE's (`jaxmeg.models.hf_moe`), a
    dense model's (experts 0) otherwise."""
    architecture = _architecture(hf)
    if architecture not in hf_moe.MOE_ARCHITECTURES:
        return MoeConfig()
    try:
        return hf_moe.moe_config(architecture, hf)
    except KeyError as err:
        raise HFCheckpointError(
            f"config.json ({hf.get('model_type')}) has no {err.args[0]!r}, which the "
            f"architecture needs"
        ) from None


def _model_config(hf: dict, seq_len: int | None = None, **fields: Any) -> ModelConfig:
    architecture = _architecture(hf)
    block = ARCHITECTURES[architecture]
    if block == "gpt":
        _require(hf, "activation_function", GPT2_ACTIVATIONS, "gelu_new")
        _require(hf, "scale_attn_weights", (True,), True)
        _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
        hidden, positions = hf["n_embd"], hf["n_positions"]
        shape = dict(
            hidden=hidden,
            layers=hf["n_layer"],
            heads=hf["n_head"],
            kv_heads=hf["n_head"],
            ffn_hidden=hf.get("n_inner") or 4 * hidden,
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
    else:
        _require(hf, "hidden_act", ("silu",), "silu")
        _require(hf, "attention_bias", (False,), False)
        _require(hf, "mlp_bias", (False,), False)
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        if hf.get("head_dim") not in (None, hidden // heads):
            raise HFCheckpointError(
                f"config.json head_dim = {hf['head_dim']}, but jaxmeg's head dim is hidden_size / "
                f"num_attention_heads = {hidden} / {heads} = {hidden // heads}"
            )
        positions = hf.get("max_position_embeddings", 2048)
        shape = dict(
            hidden=hidden,
            layers=hf["num_hidden_layers"],
            heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_hidden=hf["intermediate_size"],
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        if architecture in hf_moe.MOE_ARCHITECTURES:
            shape.update(hf_moe.model_fields(architecture, hf))
    seq_len = positions if seq_len is None else seq_len
    if block == "gpt" and not 1 <= seq_len <= positions:
        raise HFCheckpointError(
            f"seq_len {seq_len} must be in [1, n_positions = {positions}]: GPT-2 learns one "
            f"position embedding per position"
        )
    base = dict(compute_dtype="float32", param_dtype="float32", vocab_size=hf["vocab_size"])
    return ModelConfig(block=block, seq_len=seq_len, **{**base, **shape, **fields})


def hf_config(model: ModelConfig, moe: MoeConfig | None = None) -> dict:
    """The config.json of a jaxmeg model, for `transformers.AutoModelForCausalLM`."""
    moe = moe or MoeConfig()
    if model.qkv_bias and not moe.experts:
        raise HFCheckpointError(
            "model.qkv_bias: a dense llama block with q, k, v biases (Qwen2) is not exported; "
            "Llama's attention_bias would add an output bias too"
        )
    common = {"vocab_size": model.vocab_size, "tie_word_embeddings": model.tie_embeddings}
    if model.block == "gpt":
        if model.num_kv_heads != model.heads:
            raise HFCheckpointError(
                f"GPT-2 has no grouped-query attention: model.kv_heads = {model.kv_heads} is not "
                f"model.heads = {model.heads}"
            )
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": model.hidden,
            "n_layer": model.layers,
            "n_head": model.heads,
            "n_inner": model.mlp_hidden,
            "n_positions": model.seq_len,
            "layer_norm_epsilon": model.norm_eps,
            "activation_function": "gelu_new",
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "dtype": "float32",
            **common,
        }
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.mlp_hidden,
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
        **common,
    }
    return {**llama, **hf_moe.hf_fields(model, moe)} if moe.experts else llama


# ---------------------------------------------------------------------------------------------
# files


def write_checkpoint(
    directory: str | Path, model: ModelConfig, params: Params, moe: MoeConfig | None = None
) -> None:
    """Writes config.json and model.safetensors (float32) of canonical jaxmeg params, readable
    as the user's umask allows (as any file they write)."""
    directory = Path(directory)
    tensors = to_hf(params, model, moe)  # refuses what it cannot write before writing
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config(model, moe), indent=2) + "\n")
    with_umask(directory / WEIGHTS_FILE)


# ---------------------------------------------------------------------------------------------
# tensors <-> params
#
# Each architecture is two functions over ONE layer: `from_hf(get, cfg)` builds the jaxmeg layer
# tree from `get(suffix)` (the layer's tensor named by its suffix), `to_hf(layer, cfg)` returns
# {suffix: tensor}. Layers are then stacked or unstacked on the leading dim.


def _heads_in(w_DxNH: np.ndarray, heads: int) -> np.ndarray:
    return w_DxNH.reshape(w_DxNH.shape[0], heads, -1)


def _gpt2_layer_from_hf(get: Callable[[str], np.ndarray], cfg: ModelConfig) -> Params:
    d, n, h = cfg.hidden, cfg.heads, cfg.head_dim
    return {
        "norm1": {"scale": get("ln_1.weight"), "bias": get("ln_1.bias")},
        "norm2": {"scale": get("ln_2.weight"), "bias": get("ln_2.bias")},
        "attn": {
            "w_qkv": get("attn.c_attn.weight").reshape(d, 3, n, h),
            "b_qkv": get("attn.c_attn.bias").reshape(3, n, h),
            "w_out": get("attn.c_proj.weight").reshape(n, h, d),
            "b_out": get("attn.c_proj.bias"),
        },
        "mlp": {
            "w_in": get("mlp.c_fc.weight"),
            "b_in": get("mlp.c_fc.bias"),
            "w_out": get("mlp.c_proj.weight"),
            "b_out": get("mlp.c_proj.bias"),
        },
    }


def _gpt2_layer_to_hf(layer: Params, cfg: ModelConfig) -> Tensors:
    d = cfg.hidden
    attn, mlp = layer["attn"], layer["mlp"]
    return {
        "ln_1.weight": layer["norm1"]["scale"],
        "ln_1.bias": layer["norm1"]["bias"],
        "ln_2.weight": layer["norm2"]["scale"],
        "ln_2.bias": layer["norm2"]["bias"],
        "attn.c_attn.weight": attn["w_qkv"].reshape(d, 3 * d),
        "attn.c_attn.bias": attn["b_qkv"].reshape(3 * d),
        "attn.c_proj.weight": attn["w_out"].reshape(d, d),
        "attn.c_proj.bias": attn["b_out"],
        "mlp.c_fc.weight": mlp["w_in"],
        "mlp.c_fc.bias": mlp["b_in"],
        "mlp.c_proj.weight": mlp["w_out"],
        "mlp.c_proj.bias": mlp["b_out"],
    }


def _llama_layer_from_hf(
    get: Callable[[str], np.ndarray], cfg: ModelConfig, moe: MoeConfig
) -> Params:
    n, kv = cfg.heads, cfg.num_kv_heads
    q = _heads_in(get("self_attn.q_proj.weight").T, n)
    k = _heads_in(get("self_attn.k_proj.weight").T, kv)
    v = _heads_in(get("self_attn.v_proj.weight").T, kv)
    if kv == n:
        attn = {"w_qkv": np.stack([q, k, v], axis=1)}
    else:
        attn = {"w_q": q, "w_kv": np.stack([k, v], axis=1)}
    if cfg.qkv_bias:
        bq, bk, bv = (get(f"self_attn.{p}_proj.bias") for p in "qkv")
        bq, bk, bv = bq.reshape(n, -1), bk.reshape(kv, -1), bv.reshape(kv, -1)
        attn.update({"b_qkv": np.stack([bq, bk, bv])} if kv == n else
                    {"b_q": bq, "b_kv": np.stack([bk, bv])})  # fmt: skip
    attn["w_out"] = get("self_attn.o_proj.weight").T.reshape(n, cfg.head_dim, cfg.hidden)
    layer = {
        "norm1": {"scale": get("input_layernorm.weight")},
        "norm2": {"scale": get("post_attention_layernorm.weight")},
        "attn": attn,
    }
    if moe.experts:
        layer["moe"] = hf_moe.layer_from_hf(get, hf_moe.architecture_of(cfg, moe), moe)
    else:
        layer["mlp"] = {
            "w_in": get("mlp.up_proj.weight").T,
            "w_gate": get("mlp.gate_proj.weight").T,
            "w_out": get("mlp.down_proj.weight").T,
        }
    return layer


def _llama_layer_to_hf(layer: Params, cfg: ModelConfig, moe: MoeConfig) -> Tensors:
    d = cfg.hidden
    attn = layer["attn"]
    if "w_qkv" in attn:
        q, k, v = (attn["w_qkv"][:, i] for i in range(3))
    else:
        q, (k, v) = attn["w_q"], (attn["w_kv"][:, i] for i in range(2))
    tensors = {
        "input_layernorm.weight": layer["norm1"]["scale"],
        "post_attention_layernorm.weight": layer["norm2"]["scale"],
        "self_attn.q_proj.weight": q.reshape(d, -1).T,
        "self_attn.k_proj.weight": k.reshape(d, -1).T,
        "self_attn.v_proj.weight": v.reshape(d, -1).T,
        "self_attn.o_proj.weight": attn["w_out"].reshape(-1, d).T,
    }
    if cfg.qkv_bias:
        biases = attn["b_qkv"] if "b_qkv" in attn else [attn["b_q"], *attn["b_kv"]]
        for name, b in zip("qkv", biases, strict=True):
            tensors[f"self_attn.{name}_proj.bias"] = b.reshape(-1)
    if moe.experts:
        architecture = hf_moe.architecture_of(cfg, moe)
        return {**tensors, **hf_moe.layer_to_hf(layer["moe"], architecture, moe)}
    mlp = layer["mlp"]
    return {
        **tensors,
        "mlp.up_proj.weight": mlp["w_in"].T,
        "mlp.gate_proj.weight": mlp["w_gate"].T,
        "mlp.down_proj.weight": mlp["w_out"].T,
    }


GPT2_PREFIX = "transformer."
IGNORED = {"gpt": (".attn.bias", ".attn.masked_bias"), "llama": (".rotary_emb.inv_freq",)}
"""Buffers that old checkpoints store beside the weights (GPT-2's causal mask, Llama's rotary
frequencies): recomputed, not read."""


def _getter(tensors: Tensors, used: set[str]) -> Callable[[str], np.ndarray]:
    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise HFCheckpointError(f"the checkpoint has no tensor {name!r}")
        used.add(name)
        return tensors[name]

    return get


def _stack_layers(layers: list[Params]) -> Params:
    if isinstance(layers[0], dict):
        return {k: _stack_layers([layer[k] for layer in layers]) for k in layers[0]}
    return np.stack(layers)


def _layer(tree: Params, i: int) -> Params:
    if isinstance(tree, dict):
        return {k: _layer(v, i) for k, v in tree.items()}
    return tree[i]


def from_hf(tensors: Tensors, cfg: ModelConfig, moe: MoeConfig | None = None) -> Params:
    """Canonical jaxmeg params (float32) from a Hugging Face state dict, for `model_config`'s
    (and `moe_config`'s) config. Every tensor must be used: a leftover one means an unsupported
    variant."""
    moe = moe or MoeConfig()
    used: set[str] = set()
    if cfg.block == "gpt":
        names = {k.removeprefix(GPT2_PREFIX): v for k, v in tensors.items()}
        names = {k: v for k, v in names.items() if not k.endswith(IGNORED["gpt"])}
        get = _getter(names, used)
        layers = [
            _gpt2_layer_from_hf(lambda s, i=i: get(f"h.{i}.{s}"), cfg) for i in range(cfg.layers)
        ]
        embed = {"token": get("wte.weight"), "position": get("wpe.weight")[: cfg.seq_len]}
        final_norm = {"scale": get("ln_f.weight"), "bias": get("ln_f.bias")}
    else:
        names = {k: v for k, v in tensors.items() if not k.endswith(IGNORED["llama"])}
        get = _getter(names, used)
        layers = [
            _llama_layer_from_hf(
                lambda s, i=i: get(f"model.layers.{i}.{s}"), cfg, _layer_moe(moe, i)
            )
            for i in range(cfg.layers)
        ]
        embed = {"token": get("model.embed_tokens.weight")}
        final_norm = {"scale": get("model.norm.weight")}
    head: Params = {"final_norm": final_norm}
    if not cfg.tie_embeddings:
        head["unembed"] = get("lm_head.weight").T
    elif "lm_head.weight" in names:  # a tied model may still store its (equal) copy
        used.add("lm_head.weight")
    unused = sorted(set(names) - used)
    if unused:
        raise HFCheckpointError(
            f"the checkpoint has tensors that a {cfg.block} model of {cfg.layers} layers does "
            f"not use: {unused[:5]}{' ...' if len(unused) > 5 else ''}"
        )
    dense, n = moe.dense_layers, moe.layers_per_unit
    if n > 1:  # groups of n layers: layer_k of group g is layer dense + g n + k
        stacked = {f"layer_{k}": _stack_layers(layers[dense + k :: n]) for k in range(n)}
    else:
        stacked = _stack_layers(layers[dense:])
    params = {"embed": embed, "blocks": {"layers": stacked}, "head": head}
    if dense:
        params["dense_blocks"] = {"layers": _stack_layers(layers[:dense])}
    return _as_float32(params)


def _layer_moe(moe: MoeConfig, i: int) -> MoeConfig:
    """Layer i's MLP: `moe`'s experts, or the dense MLP in the dense leading layers and where
    `moe.unit` says."""
    dense, unit = moe.dense_layers, moe.unit
    return moe if i >= dense and unit[(i - dense) % len(unit)] else MoeConfig()


def _layer_params(params: Params, moe: MoeConfig, i: int) -> Params:
    """Layer i of the canonical params: of the dense leading stack or of the blocks (of its
    group's `layer_k` with units of n > 1 layers)."""
    dense, n = moe.dense_layers, moe.layers_per_unit
    if i < dense:
        return _layer(params["dense_blocks"]["layers"], i)
    group, k = divmod(i - dense, n)
    stacked = params["blocks"]["layers"]
    return _layer(stacked[f"layer_{k}"] if n > 1 else stacked, group)


def _as_float32(params: Params) -> Params:
    """The tree with every leaf a C-contiguous float32 NumPy array."""
    if isinstance(params, dict):
        return {k: _as_float32(v) for k, v in params.items()}
    return np.ascontiguousarray(params, dtype=np.float32)


def to_hf(params: Params, cfg: ModelConfig, moe: MoeConfig | None = None) -> Tensors:
    """The Hugging Face state dict of canonical jaxmeg params (the inverse of `from_hf`)."""
    moe = moe or MoeConfig()
    hf_config(cfg, moe)  # refuses what no architecture can express
    params = _as_float32(params)
    layers = params["blocks"]["layers"]
    head = params["head"]
    if cfg.block == "gpt":
        hf_config(cfg)  # refuses what GPT-2 cannot express
        tensors = {
            "transformer.wte.weight": params["embed"]["token"],
            "transformer.wpe.weight": params["embed"]["position"],
            "transformer.ln_f.weight": head["final_norm"]["scale"],
            "transformer.ln_f.bias": head["final_norm"]["bias"],
        }
        for i in range(cfg.layers):
            for suffix, t in _gpt2_layer_to_hf(_layer(layers, i), cfg).items():
                tensors[f"transformer.h.{i}.{suffix}"] = t
    else:
        tensors = {
            "model.embed_tokens.weight": params["embed"]["token"],
            "model.norm.weight": head["final_norm"]["scale"],
        }
        for i in range(cfg.layers):
            layer = _layer_params(params, moe, i)
            for suffix, t in _llama_layer_to_hf(layer, cfg, _layer_moe(moe, i)).items():
                tensors[f"model.layers.{i}.{suffix}"] = t
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = head["unembed"].T
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}
