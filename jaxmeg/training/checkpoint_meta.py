"""What a checkpoint's `meta` says about the configurations that may resume from it: the fields
that fix the saved arrays' shapes (another value is refused, `IncompatibleCheckpoint`, naming
the field, both values and the path, before anything is read), and the learning-rate schedule,
whose changes a resume reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxmeg.config import Config, MoeConfig, to_dict
from jaxmeg.config_moe import LAYER_KINDS

# Config fields that fix the shapes or the tree of the saved arrays.
SHAPE_FIELDS = (
    "model.block",
    "model.vocab_size",
    "model.hidden",
    "model.layers",
    "model.heads",
    "model.mlp_ratio",
    "model.ffn_hidden",
    "model.kv_heads",
    "model.qkv_bias",
    "model.seq_len",
    "model.tie_embeddings",
    "model.param_dtype",
    "moe.experts",
    "moe.ffn_hidden",
    "moe.shared_experts",
    "moe.shared_ffn_hidden",
    "moe.shared_gate",
)
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "decay_steps")
# Fields that change what a mixture of experts computes with the same arrays: a resume says so.
ROUTING_FIELDS = (
    "moe.top_k", "moe.router", "moe.normalize", "moe.capacity_factor", "moe.router_groups",
    "moe.router_group_topk", "moe.routed_scaling",
)  # fmt: skip


class IncompatibleCheckpoint(ValueError):
    """A readable checkpoint that this run's configuration cannot take."""


def schedule_of(cfg: Config) -> dict[str, Any]:
    """The resolved learning-rate schedule, as stored in a checkpoint's meta."""
    return {name: getattr(cfg.optimizer, name) for name in SCHEDULE_FIELDS}


def schedule_changes(meta: dict, cfg: Config) -> list[str]:
    """'optimizer.FIELD saved -> now' for each schedule field that differs from the checkpoint's."""
    saved = meta.get("schedule") or meta.get("config", {}).get("optimizer", {})
    now = schedule_of(cfg)
    return [
        f"optimizer.{name} {saved[name]} -> {now[name]}"
        for name in SCHEDULE_FIELDS
        if name in saved and saved[name] != now[name]
    ]


def routing_changes(meta: dict, cfg: Config) -> list[str]:
    """'moe.FIELD saved -> now' for each routing field of an MoE model that differs from the
    checkpoint's (the arrays fit either way; the model computes something else)."""
    if not cfg.moe.experts:
        return []
    saved, now = meta.get("config", {}), to_dict(cfg)
    return [
        f"{name} {_field(saved, name)} -> {_field(now, name)}"
        for name in ROUTING_FIELDS
        if _field(saved, name) is not None and _field(saved, name) != _field(now, name)
    ]


def _field(config: dict, name: str) -> Any:
    section, key = name.split(".")
    if section == "moe" and "model" in config:  # saved before the moe section: a dense model
        return config.get(section, to_dict(Config())[section]).get(key)
    return config.get(section, {}).get(key)


def shape_mismatches(meta: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, this run's value) for each field that changes array shapes."""
    saved, now = meta.get("config", {}), to_dict(cfg)
    mismatches = [
        (name, _field(saved, name), _field(now, name))
        for name in SHAPE_FIELDS
        if _field(saved, name) is not None and _field(saved, name) != _field(now, name)
    ]
    # Which layers are MoE (`moe.first_dense`, `moe.every`, `moe.pattern`) fixes the tree.
    if _field(saved, "moe.experts") and cfg.moe.experts:
        saved_kinds = _layer_kinds(saved)
        if saved_kinds != _layer_kinds(now):
            mismatches.append(("moe layers (moe.pattern)", saved_kinds, _layer_kinds(now)))
    # A capacity factor on or off adds or removes the MoE layers' kept-share slot.
    saved_cf = _field(saved, "moe.capacity_factor")
    if saved_cf is not None and (saved_cf > 0) != (cfg.moe.capacity_factor > 0):
        mismatches.append(("moe.capacity_factor", saved_cf, cfg.moe.capacity_factor))
    # A dropless MoE layer's exchange-bound counts (absent in checkpoints older than them).
    if cfg.moe.experts and not cfg.moe.capacity_factor and _field(saved, "moe.experts"):
        saved_counts = bool(_field(saved, "moe.record_exchange_bounds"))
        if not _field(saved, "moe.capacity_factor") and saved_counts != (
            cfg.moe.record_exchange_bounds
        ):
            mismatches.append(
                ("moe.record_exchange_bounds", saved_counts, cfg.moe.record_exchange_bounds)
            )
    # Delayed FP8 scaling on or off adds or removes each linear's amax history and seen bins.
    saved_fp8 = _field(saved, "model.fp8") or "none"
    if (saved_fp8 == "delayed") != (cfg.model.fp8 == "delayed"):
        mismatches.append(("model.fp8", saved_fp8, cfg.model.fp8))
    elif saved_fp8 == "delayed" and _field(saved, "model.fp8_history") != cfg.model.fp8_history:
        mismatches.append(
            ("model.fp8_history", _field(saved, "model.fp8_history"), cfg.model.fp8_history)
        )
    # Clipping on or off adds or removes a state in the optimizer chain.
    saved_clip = _field(saved, "optimizer.grad_clip")
    if saved_clip is not None and (saved_clip > 0) != (cfg.optimizer.grad_clip > 0):
        mismatches.append(("optimizer.grad_clip", saved_clip, cfg.optimizer.grad_clip))
    return mismatches


def _layer_kinds(config: dict) -> list[str]:
    """Each layer's MLP, `dense` or `moe`, of an MoE model's saved config."""
    moe = MoeConfig(
        experts=1, first_dense=_field(config, "moe.first_dense") or 0,
        every=_field(config, "moe.every") or 1, pattern=tuple(_field(config, "moe.pattern") or ()),
    )  # fmt: skip
    return [LAYER_KINDS[kind] for kind in moe.kinds(_field(config, "model.layers"))]


def check_compatible(meta: dict, cfg: Config, path: Path) -> None:
    mismatches = shape_mismatches(meta, cfg)
    saved_data = _field(meta.get("config", {}), "data.dataset")
    vocab = next((m for m in mismatches if m[0] == "model.vocab_size"), None)
    if vocab and saved_data not in (None, cfg.data.dataset):  # name the cause, not its effect
        raise IncompatibleCheckpoint(
            f"checkpoint {path} was trained on data.dataset {saved_data}, this run reads "
            f"{cfg.data.dataset}, whose vocabulary differs (model.vocab_size {vocab[1]} there, "
            f"{vocab[2]} here). Nothing was changed; resume with the checkpoint's data.dataset, "
            f"or pass another --out"
        )
    if mismatches:
        fields = "; ".join(f"{name} is {was} there, {now} here" for name, was, now in mismatches)
        raise IncompatibleCheckpoint(
            f"checkpoint {path} was written for another model: {fields}. Nothing was changed; "
            f"resume with the checkpoint's values, or pass another --out"
        )
