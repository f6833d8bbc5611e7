"""Validation of the `moe` section (`jaxmeg.config_moe`): its own ranges, the expert axis, and
what MoE layers do not run with yet. Part of `jaxmeg.config_validation.validate`; each error
names the field and the numbers."""

from __future__ import annotations

import math

from jaxmeg.config_moe import BOUND_SLOTS, EXCHANGES, GROUPED_GEMMS, LAYER_KINDS, MOE_ROUTERS
from jaxmeg.config_sections import Config, ConfigError, check_choice


def validate_moe(cfg: Config, context: int, expert: int, tensor: int) -> None:
    """The `moe` section: its own ranges, the expert axis, and what MoE layers do not run with
    yet."""
    moe, comp = cfg.moe, cfg.compression
    if moe.experts < 0:
        raise ConfigError(f"moe.experts must be >= 0 (0 = a dense model), got {moe.experts}")
    if expert > 1 and not moe.experts:
        raise ConfigError(
            f"parallel.expert = {expert} splits a mixture of experts over {expert} devices, but "
            f"the model is dense (moe.experts = 0): set parallel.expert = 1, or give it experts"
        )
    if expert > 1 and moe.experts % expert:
        raise ConfigError(
            f"parallel.expert = {expert} splits the experts over {expert} devices: moe.experts "
            f"({moe.experts}) must be divisible by it"
        )
    if moe.experts == 0:
        if moe.pattern:
            raise ConfigError(
                "moe.pattern places MoE layers, but the model is dense (moe.experts = 0): give "
                "it experts, or set moe.pattern = []"
            )
        return
    check_choice("moe.router", moe.router, MOE_ROUTERS)
    check_choice("moe.grouped_gemm", moe.grouped_gemm, GROUPED_GEMMS)
    check_choice("moe.exchange", moe.exchange, EXCHANGES)
    explicit = moe.grouped_gemm not in ("auto", "ragged")
    if cfg.model.fp8 != "none" and explicit and not moe.capacity_factor:
        raise ConfigError(
            f"model.fp8 = {cfg.model.fp8} runs a dropless layer's grouped GEMMs as FP8 ragged "
            f"GEMMs; moe.grouped_gemm = {moe.grouped_gemm} has no FP8 form: set "
            f"moe.grouped_gemm = ragged or model.fp8 = none"
        )
    bounds = moe.exchange_bounds
    increasing = all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
    if not (all(math.isfinite(f) and f >= 1 for f in bounds) and increasing):
        raise ConfigError(
            f"moe.exchange_bounds must be increasing multiples >= 1 of an even load, got "
            f"{list(bounds)}"
        )
    if len(bounds) >= BOUND_SLOTS:
        raise ConfigError(
            f"moe.exchange_bounds holds {len(bounds)} factors; at most {BOUND_SLOTS - 1} "
            f"(each a branch of the step)"
        )
    if not (math.isfinite(moe.exchange_kept_bound) and moe.exchange_kept_bound >= 1):
        raise ConfigError(
            f"moe.exchange_kept_bound must be a multiple >= 1 of an even load, got "
            f"{moe.exchange_kept_bound}"
        )
    if not 1 <= moe.top_k <= moe.experts:
        raise ConfigError(
            f"moe.top_k must be between 1 and moe.experts ({moe.experts}), got {moe.top_k}"
        )
    _validate_groups(moe)
    if moe.pattern:
        _validate_pattern(moe, cfg.model.layers)
    if not 0 <= moe.first_dense < cfg.model.layers:
        raise ConfigError(
            f"moe.first_dense (dense leading layers) must be between 0 and model.layers - 1 "
            f"({cfg.model.layers - 1}), got {moe.first_dense}"
        )
    if moe.every < 1 or (cfg.model.layers - moe.first_dense) % moe.every:
        raise ConfigError(
            f"moe.every = {moe.every}: the layers after the dense leading ones, model.layers - "
            f"moe.first_dense = {cfg.model.layers} - {moe.first_dense}, come in groups of "
            f"moe.every (the last of each MoE): make it a divisor >= 1"
        )
    for name in ("ffn_hidden", "shared_ffn_hidden"):
        if getattr(moe, name) != -1 and getattr(moe, name) < 1:
            raise ConfigError(f"moe.{name} must be -1 or >= 1, got {getattr(moe, name)}")
    for name in ("shared_experts", "capacity_factor", "aux_loss", "z_loss", "bias_update_rate"):
        if getattr(moe, name) < 0:
            raise ConfigError(f"moe.{name} must be >= 0, got {getattr(moe, name)}")
    widths = {
        "moe.ffn_hidden": moe.expert_width(cfg.model.mlp_hidden),
        "moe.shared_ffn_hidden x moe.shared_experts": moe.shared_width(cfg.model.mlp_hidden),
    }
    for name, width in widths.items():  # fmt: skip
        if width % tensor:
            raise ConfigError(
                f"{name} ({width}) is split over parallel.tensor ({tensor}): make it divisible"
            )
    not_yet = [
        (context > 1, f"parallel.context = {context} (the balance loss is per whole sequence)"),
        (bool(comp.pipe_grad_rank), f"compression.pipe_grad_rank = {comp.pipe_grad_rank}"),
        (bool(comp.data_grad_rank), f"compression.data_grad_rank = {comp.data_grad_rank} (it "
                                    f"would compress the routing bias's expert loads)"),
    ]  # fmt: skip
    for on, what in not_yet:
        if on:
            raise ConfigError(f"moe.experts = {moe.experts} does not run with {what} yet")


def _validate_groups(moe) -> None:
    """Group-limited routing and the routed scaling factor."""
    groups, topk = moe.router_groups, moe.router_group_topk
    if groups < 1 or moe.experts % groups:
        raise ConfigError(
            f"moe.router_groups ({groups}) splits the {moe.experts} experts (moe.experts) into "
            f"equal groups: make it a divisor >= 1 (1 = no groups)"
        )
    per = moe.experts // groups
    if groups > 1 and not (1 <= topk <= groups and topk * per >= moe.top_k):
        raise ConfigError(
            f"moe.router_group_topk ({topk}) must be between 1 and moe.router_groups ({groups}), "
            f"and its groups must hold moe.top_k ({moe.top_k}) experts: {topk} x {per} experts "
            f"per group = {topk * per}"
        )
    if not (math.isfinite(moe.routed_scaling) and moe.routed_scaling > 0):
        raise ConfigError(f"moe.routed_scaling must be > 0, got {moe.routed_scaling}")


def _validate_pattern(moe, layers: int) -> None:
    """`moe.pattern`: a kind per layer, some MoE, and `first_dense` and `every` left alone."""
    wrong = sorted({kind for kind in moe.pattern if kind not in LAYER_KINDS})
    if wrong:
        raise ConfigError(f"moe.pattern entries must be dense or moe, got {wrong}")
    if len(moe.pattern) != layers:
        raise ConfigError(
            f"moe.pattern names {len(moe.pattern)} layers' MLPs; model.layers is {layers}"
        )
    if "moe" not in moe.pattern:
        raise ConfigError(
            f"moe.pattern has no moe layer (moe.experts = {moe.experts}): name one, or set "
            f"moe.experts = 0 for a dense model"
        )
    if moe.first_dense or moe.every != 1:
        raise ConfigError(
            f"moe.pattern replaces moe.first_dense ({moe.first_dense}) and moe.every "
            f"({moe.every}): leave them at 0 and 1"
        )
