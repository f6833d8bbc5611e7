"""Mixture-of-experts settings checked without compiling anything: refused by name (bad `moe`
fields, dense leading layers and layer groups that do not fit the stages, an expert axis that
does not fit the batch or the devices, what MoE does not run yet: compression, context), the
model FLOPs the MFU counts for them, and what a resume says of another routing or refuses of a
dense checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxmeg import config as C
from jaxmeg.training import checkpoint_meta
from tests.test_moe_step import CAPACITY, FIRST_DENSE, GPT, LLAMA, TOP2, config

BAD = [
    ({"experts": 4, "top_k": 5}, "moe.top_k must be between 1 and moe.experts (4), got 5"),
    ({"experts": -2}, "moe.experts must be >= 0"),
    ({"experts": 4, "capacity_factor": -1.0}, "moe.capacity_factor must be >= 0, got -1.0"),
    ({"experts": 4, "router": "relu"}, "moe.router"),
    ({"experts": 4, "ffn_hidden": 18}, "moe.ffn_hidden (18) is split over parallel.tensor (4)"),
    ({"experts": 4, "every": 0}, "moe.every = 0: the layers after the dense leading ones"),
    ({"experts": 4, "grouped_gemm": "dense"}, "moe.grouped_gemm"),
    ({"experts": 4, "exchange": "padded"}, "moe.exchange must be one of"),
    ({"experts": 4, "router_groups": 3}, "moe.router_groups (3) splits the 4 experts"),
    (
        {"experts": 8, "top_k": 4, "router_groups": 4, "router_group_topk": 1},
        "moe.router_group_topk (1) must be between 1 and moe.router_groups (4), and its groups "
        "must hold moe.top_k (4) experts: 1 x 2 experts per group = 2",
    ),
    ({"experts": 4, "router_groups": 2, "router_group_topk": 3}, "moe.router_group_topk (3)"),
    ({"experts": 4, "routed_scaling": 0.0}, "moe.routed_scaling must be > 0, got 0.0"),
    ({"experts": 4, "exchange_kept_bound": 0.5}, "moe.exchange_kept_bound must be a multiple >= 1"),
    ({"experts": 6}, "parallel.expert = 4 splits the experts over 4 devices: moe.experts (6)"),
    # a dense model passed the divisibility check (0 % e = 0) and trained on without a word
    (
        {"experts": 0},
        "parallel.expert = 4 splits a mixture of experts over 4 devices, but the "
        "model is dense (moe.experts = 0)",
    ),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_moe_settings_are_named_before_compiling(fields, message):
    cfg = config((1, 1, 4), C.MoeConfig(**fields))
    if "parallel.expert" in message:
        cfg = config((1, 1, 1), C.MoeConfig(**fields), expert=4)
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        C.validate(cfg, 4)


def test_dense_leading_layers_and_layer_groups_are_named_where_they_do_not_fit():
    cfg = config((1, 2, 1), FIRST_DENSE)  # 3 layers: 1 dense, 2 over the stages

    def varied(layers, **moe):
        model = dataclasses.replace(cfg.model, layers=layers)
        return dataclasses.replace(cfg, model=model, moe=dataclasses.replace(FIRST_DENSE, **moe))

    def pattern(kinds, **moe):
        return varied(len(kinds), **{"first_dense": 0, "pattern": tuple(kinds), **moe})

    for bad, message in [
        (varied(3, first_dense=3), r"moe.first_dense \(dense leading layers\) must be between "
                                   r"0 and model.layers - 1 \(2\), got 3"),
        (varied(4), r"model.layers - moe.first_dense \(3\) must be divisible by parallel.pipe "
                    r"\* parallel.chunks = 2 \* 1 = 2"),
        (varied(4, every=2), r"moe.every = 2: the layers after the dense leading ones, "
                             r"model.layers - moe.first_dense = 4 - 1, come in groups"),
        (varied(7, every=2), r"\(model.layers - moe.first_dense\) / moe.every \(layer groups\) "
                             r"\(3\) must be divisible by parallel.pipe"),
        (pattern(["moe", "mlp", "moe"]),
         r"moe.pattern entries must be dense or moe, got \['mlp'\]"),
        (varied(3, first_dense=0, pattern=("moe", "dense")),
         r"moe.pattern names 2 layers' MLPs; model.layers is 3"),
        (pattern(["dense"] * 3), r"moe.pattern has no moe layer \(moe.experts = 4\)"),
        (pattern(["dense", "moe", "moe"], first_dense=1),
         r"moe.pattern replaces moe.first_dense \(1\) and moe.every \(1\)"),
        # repeats no shorter unit after its leading dense layer: one entry for two stages
        (pattern(["moe", "moe", "dense"]), r"moe.pattern's stack entries \(units of 3 layers\) "
                                           r"\(1\) must be divisible by parallel.pipe"),
        (pattern(["moe"] * 3, experts=0), r"moe.pattern places MoE layers, but the model is dense"),
    ]:  # fmt: skip
        with pytest.raises(C.ConfigError, match=message):
            C.validate(bad, 2)


def test_an_expert_axis_that_does_not_fit_is_named():
    rows = dataclasses.replace(config((1, 1, 1), TOP2, expert=4), train=C.TrainConfig(
        global_batch=4, microbatches=2))  # fmt: skip
    with pytest.raises(C.ConfigError, match=r"train.microbatch_size \(2\) must be divisible"):
        C.validate(rows, 4)
    with pytest.raises(
        C.ConfigError, match=r"parallel.expert \* parallel.tensor = 1 \* 1 \* 4 \* 1 = 4, but"
    ):
        C.validate(config((1, 1, 1), TOP2, expert=4), 6)


def test_moe_refuses_what_it_does_not_run_yet_by_name():
    cfg = dataclasses.replace(
        config((1, 2, 1), TOP2), compression=C.CompressionConfig(data_grad_rank=4)
    )
    with pytest.raises(C.ConfigError, match="moe.experts = 4 does not run with compression"):
        C.validate(cfg, 2)
    context = dataclasses.replace(config((1, 1, 1), TOP2), parallel=C.ParallelConfig(context=2))
    with pytest.raises(C.ConfigError, match="does not run with parallel.context = 2"):
        C.validate(context, 2)


def test_mfu_counts_the_active_experts_not_all_of_them():
    """A GeLU top-1 expert as wide as the dense MLP runs the dense MLP's FLOPs plus the router's
    (2 h E per token and pass); the expert count does not enter otherwise, nor do the dense
    leading layers (`moe.first_dense`), which have no router."""
    from jaxmeg.training.flops import model_flops_per_step

    model = dataclasses.replace(GPT, ffn_hidden=128)
    dense = model_flops_per_step(model, 8)
    for experts in (4, 64):
        moe = C.MoeConfig(experts=experts, top_k=1)
        router = 3 * 8 * model.seq_len * model.layers * 2 * model.hidden * experts
        assert model_flops_per_step(model, 8, moe=moe) == pytest.approx(dense + router)
    # a dense leading layer: the router runs in the other layer only
    lead = C.MoeConfig(experts=4, top_k=1, first_dense=1)
    router = 3 * 8 * model.seq_len * (model.layers - 1) * 2 * model.hidden * 4
    assert model_flops_per_step(model, 8, moe=lead) == pytest.approx(dense + router)


def test_a_resume_with_other_routing_says_so_and_the_banner_names_the_expert_axis():
    """Another moe.top_k (or router, normalisation, capacity) fits the checkpoint's arrays, so
    it is not refused, as another moe.experts is: the resume names it. The start-up line and
    generate.py's name every axis that splits anything, `expert` included."""
    from jaxmeg import config as C
    from jaxmeg.config import to_dict
    from jaxmeg.parallel import make_mesh
    from jaxmeg.parallel.mesh import mesh_words
    from jaxmeg.training.checkpoint_meta import routing_changes

    saved = config((1, 2, 1), TOP2, expert=4)
    meta = {"config": to_dict(saved)}
    top1 = dataclasses.replace(saved, moe=dataclasses.replace(TOP2, top_k=1))
    assert routing_changes(meta, saved) == []
    assert routing_changes(meta, top1) == ["moe.top_k 2 -> 1"]
    assert routing_changes(meta, dataclasses.replace(saved, moe=C.MoeConfig())) == []  # dense
    mesh = make_mesh(C.ParallelConfig(pipe=2, expert=4), jax.devices())
    assert mesh_words(mesh) == "data=1 pipe=2 expert=4 tensor=1"


def test_a_dense_checkpoint_does_not_resume_as_a_mixture_of_experts():
    dense = C.validate(config((1, 1, 1), C.MoeConfig()), 1)
    saved = {"config": {k: v for k, v in C.to_dict(dense).items() if k != "moe"}}
    mismatches = checkpoint_meta.shape_mismatches(saved, C.validate(config((1, 1, 1), TOP2), 1))
    assert ("moe.experts", 0, 4) in mismatches
    # a capacity factor on or off adds or removes the kept-share slot; another factor does not
    dropless = {"config": C.to_dict(C.validate(config((1, 1, 1), TOP2), 1))}
    capped = C.validate(config((1, 1, 1), CAPACITY), 1)
    assert checkpoint_meta.shape_mismatches(dropless, capped) == [("moe.capacity_factor", 0.0, 1.0)]
    more = C.validate(config((1, 1, 1), dataclasses.replace(CAPACITY, capacity_factor=1.5)), 1)
    assert checkpoint_meta.shape_mismatches({"config": C.to_dict(capped)}, more) == []
    # dense leading layers move layers out of the stack the checkpoint saved
    dense = C.validate(dataclasses.replace(config((1, 1, 1), FIRST_DENSE), model=LLAMA), 1)
    assert checkpoint_meta.shape_mismatches(dropless, dense) == [
        ("moe layers (moe.pattern)", ["moe", "moe"], ["dense", "moe"])
    ]
    # the same layers as a pattern hold the same arrays: it resumes
    same = dataclasses.replace(FIRST_DENSE, first_dense=0, pattern=("dense", "moe"))
    same = C.validate(dataclasses.replace(dense, moe=same), 1)
    assert checkpoint_meta.shape_mismatches({"config": C.to_dict(dense)}, same) == []


def test_auto_runs_the_kernels_where_a_gpu_holds_several_experts_in_16_bits():
    """`moe.grouped_gemm: auto` settles per step (`grouped_gemm.settled`): the kernels of our
    own on a GPU holding several experts, dropless, in 16 bits; `ragged` with one expert per
    GPU (the dense GEMM is the routed one), with FP8 (only `ragged` has an FP8 form), with a
    capacity factor (batched GEMMs), and off a GPU; an explicit choice stays."""
    from jaxmeg.models.grouped_gemm import settled

    eight = C.MoeConfig(experts=8, top_k=2)
    assert settled(eight, "gpu", 1) == settled(eight, "gpu", 4) == "pallas"
    assert settled(eight, "gpu", 8) == "ragged"
    assert settled(eight, "gpu", 1, "delayed") == "ragged"
    assert settled(dataclasses.replace(eight, capacity_factor=1.0), "gpu", 1) == "ragged"
    assert settled(eight, "cpu", 1) == "ragged"
    assert settled(dataclasses.replace(eight, grouped_gemm="blocked"), "gpu", 1) == "blocked"


def test_auto_exchanges_by_ragged_all_to_all_on_a_gpu_and_by_blocks_elsewhere():
    """`moe.exchange: auto` settles per step (`moe_exchange.settled`, `Trainable.moe_cfg`):
    `ragged` on a GPU, `blocks` where XLA has no ragged all-to-all (CPU); an explicit choice
    stays; the planner's layout of a run prices what runs (`routed` for `ragged`)."""
    from jaxmeg.models.moe_exchange import settled
    from jaxmeg.perf.layout import config_layout

    assert (settled("auto", "gpu"), settled("auto", "cpu")) == ("ragged", "blocks")
    assert settled("blocks", "gpu") == "blocks" and settled("ragged", "cpu") == "ragged"
    cfg = C.Config(moe=C.MoeConfig(experts=4), parallel=C.ParallelConfig(expert=2))
    assert config_layout(cfg).expert_exchange == "bounded"
    ragged = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, exchange="ragged"))
    assert config_layout(ragged).expert_exchange == "routed"


def test_the_start_up_line_says_how_the_experts_run():
    """An MoE run's start-up line names the forms `auto` settled to (`trainer.experts_words`)."""
    from jaxmeg.training.trainer import experts_words

    moe = C.MoeConfig(experts=8, top_k=2, grouped_gemm="pallas", exchange="ragged")
    assert experts_words(moe, 4, summed_once=True) == (
        "experts: 8 per MoE layer, top-2, 2 per device over expert=4, dropless, grouped GEMMs "
        "pallas, tokens by ragged all-to-all; dense gradients summed over expert once per step"
    )
    blocks = dataclasses.replace(moe, grouped_gemm="ragged", exchange="blocks")
    assert experts_words(blocks, 1).endswith("dropless, grouped GEMMs ragged")
    assert experts_words(blocks, 2).endswith(
        "tokens by all-to-all in bounded blocks; dense gradients summed over expert in each "
        "microbatch's backward"
    )
    capped = dataclasses.replace(moe, capacity_factor=1.0)
    assert experts_words(capped, 4, True).endswith(
        "capacity factor 1 (batched GEMMs); dense gradients summed over expert once per step"
    )


def test_the_start_up_line_says_where_the_dense_layers_are():
    """An MoE model with dense layers says how its stack holds them (`trainer.layers_words`)."""
    from jaxmeg.training.trainer import layers_words

    every = C.MoeConfig(experts=4, first_dense=1, every=2)
    assert layers_words(every, 5) == (
        "MoE in 2 of 5 layers; 1 dense leading with the embedding, then 2 stack entries of "
        "[dense, moe]"
    )
    pattern = C.MoeConfig(experts=4, pattern=("moe", "dense", "moe") * 2)
    assert layers_words(pattern, 6) == "MoE in 4 of 6 layers; 2 stack entries of [moe, dense, moe]"
