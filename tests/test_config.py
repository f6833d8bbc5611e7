"""Every shipped YAML loads and validates; each validation error names the field and numbers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from jaxmeg import config as C

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"gpt_tiny", "gpt_125m", "gpt_350m", "gpt_1.3b", "megatron_1t"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_loads_and_validates(path):
    cfg = C.load(path)
    if cfg.model.vocab_size == -1:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=4096))
    par = cfg.parallel
    devices = max(par.data, 1) * max(par.pipe, 1) * max(par.tensor, 1) * par.context * par.expert
    resolved = C.validate(cfg, devices)
    b, m, d = resolved.train.microbatch_size, resolved.train.microbatches, resolved.parallel.data
    assert b * m * d == resolved.train.global_batch


def test_tiny_config_divides_every_test_mesh():
    cfg = C.load(CONFIGS[0].parent / "gpt_tiny.yaml", ["model.vocab_size=4096"])
    assert cfg.model.layers == 8 and cfg.model.heads % 4 == 0
    for data, pipe, tensor in [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 2, 4), (2, 4, 1), (1, 8, 1)]:
        C.validate(
            C.apply_overrides(
                cfg, [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}"]
            ),
            8,
        )


def test_overrides_parse_yaml_values():
    cfg = C.apply_overrides(
        C.Config(), ["parallel.sequence_parallel=true", "optimizer.lr=2e-4", "train.steps=7"]
    )
    assert cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.lr == pytest.approx(2e-4)
    assert cfg.train.steps == 7
    lists = C.apply_overrides(C.Config(), ["moe.exchange_bounds=[1.5, 2, 1e3]"])
    assert lists.moe.exchange_bounds == (1.5, 2.0, 1000.0)
    assert C.apply_overrides(C.Config(), ["moe.exchange_bounds=[]"]).moe.exchange_bounds == ()


def test_scatter_gather_resolves_from_tensor_and_sequence_parallel():
    def uses(**fields) -> bool:
        return C.ParallelConfig(**fields).uses_scatter_gather

    assert C.ParallelConfig().scatter_gather is None
    assert uses(tensor=2) and uses(tensor=2, scatter_gather=True)
    assert not uses(tensor=2, scatter_gather=False)
    assert not uses(tensor=2, sequence_parallel=True)  # the activation is already split
    assert not uses(tensor=2, sequence_parallel=True, scatter_gather=True)
    assert not uses() and not uses(scatter_gather=True)  # tensor = 1: a no-op, not an error
    cfg = C.Config(model=C.ModelConfig(vocab_size=1000), parallel=C.ParallelConfig(tensor=-1))
    assert not cfg.parallel.uses_scatter_gather
    assert C.validate(cfg, 4).parallel.uses_scatter_gather  # tensor -1 resolved to 4


def test_sequence_parallelism_left_unset_is_on_for_gpus_where_it_applies():
    def settled(platform="gpu", cfg=None, **par):
        cfg = cfg or C.Config(model=C.ModelConfig(vocab_size=1000))
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **par))
        return C.settle_sequence_parallel(cfg, platform).parallel.sequence_parallel

    assert C.ParallelConfig().sequence_parallel is None
    assert settled(tensor=2) is True
    assert settled("cpu", tensor=2) is False  # CPU programs as they were
    assert settled(tensor=1) is False
    assert settled(tensor=2, context=2) is False
    assert settled(tensor=2, sequence_parallel=False) is False  # a choice stays
    assert settled("cpu", tensor=2, sequence_parallel=True) is True
    moe = C.apply_overrides(C.Config(), ["moe.experts=4", "model.vocab_size=1000"])
    assert settled(cfg=moe, tensor=2) is False
    odd = C.apply_overrides(C.Config(), ["model.seq_len=126", "model.vocab_size=1000"])
    assert settled(cfg=odd, tensor=4) is False


@pytest.mark.parametrize("text,value", [("true", True), ("false", False), ("null", None)])
def test_scatter_gather_override_and_round_trip(text, value):
    cfg = C.apply_overrides(C.Config(), [f"parallel.scatter_gather={text}", "parallel.tensor=2"])
    assert cfg.parallel.scatter_gather is value
    assert cfg.parallel.uses_scatter_gather is (value is not False)
    assert C.from_dict(C.to_dict(cfg)) == cfg  # as checkpoints' metadata keep it
    assert C.from_dict(yaml.safe_load(yaml.safe_dump(C.to_dict(cfg)))) == cfg  # a run's config.yaml


def test_scatter_gather_rejects_non_bools():
    with pytest.raises(C.ConfigError, match="parallel.scatter_gather must be true, false or null"):
        C.apply_overrides(C.Config(), ["parallel.scatter_gather=1"])


def test_minus_one_infers_an_axis():
    cfg = C.Config(
        model=C.ModelConfig(vocab_size=1000),
        parallel=C.ParallelConfig(data=-1, pipe=2, tensor=2),
    )
    assert C.validate(cfg, 8).parallel.data == 2


def test_padded_vocab_is_megatron_style():
    model = C.ModelConfig(vocab_size=50257)
    assert C.padded_vocab_size(model, 1) == 50304
    assert C.padded_vocab_size(model, 8) == 51200


BAD = [
    (["model.bogus=1"], "unknown config key model.bogus"),
    (["nosuch.key=1"], "unknown config section 'nosuch'"),
    (["parallel.tensor=3"], r"parallel.data \* parallel.pipe \* parallel.tensor = 1 \* 1 \* 3 = 3"),
    (["parallel.tensor=8"], r"model.heads \(4\) must be divisible by parallel.tensor \(8\)"),
    (["model.heads=3"], r"model.hidden \(128\) must be divisible by model.heads \(3\)"),
    (
        ["parallel.data=8", "train.global_batch=12"],
        r"train.global_batch \(12\) must be divisible by parallel.data \(8\)",
    ),
    (["train.microbatch_size=3"], r"global_batch \(16\) must be divisible by parallel.data"),
    (
        ["parallel.pipe=8", "model.layers=12"],
        r"model.layers \(12\) must be divisible by parallel.pipe \* parallel.chunks = 8 \* 1 = 8",
    ),
    (["parallel.chunks=2"], r"parallel.chunks = 2 needs parallel.schedule=interleaved_1f1b"),
    (
        [
            "parallel.pipe=4",
            "parallel.schedule=interleaved_1f1b",
            "parallel.chunks=2",
            "parallel.data=2",
            "train.microbatches=2",
        ],
        r"interleaved_1f1b needs train.microbatches \(2\) to be a multiple of parallel.pipe \(4\)",
    ),
    (["parallel.schedule=zb"], r"parallel.schedule must be one of"),
    (["parallel.data=-1", "parallel.tensor=-1"], "only one of parallel.data/pipe/tensor may be -1"),
    (["model.compute_dtype=fp8"], "model.compute_dtype must be one of"),
    (["train.steps=x"], "train.steps must be an integer"),
    (["parallel.sequence_parallel=maybe"], "parallel.sequence_parallel must be true, false or"),
    (["parallel.data=-1", "parallel.tensor=3"], "cannot infer parallel.data: 8 devices"),
    (["optimizer.min_lr=1.0"], r"optimizer.min_lr must be in \[0, lr="),
    (
        ["parallel.tensor=4", "parallel.sequence_parallel=true", "model.seq_len=6"],
        r"sequence parallelism needs model.seq_len \(6\) divisible by parallel.tensor \(4\)",
    ),
    (
        ["parallel.schedule=interleaved_1f1b", "parallel.chunks=2"],
        r"parallel.chunks = 2 needs parallel.pipe > 1, got 1",
    ),
    (["model.vocab_size=-1"], r"model.vocab_size must be set \(>= 1\), got -1"),
    (["model.dropout=0.1"], r"model.dropout must be 0.0 \(dropout is not implemented\), got 0.1"),
    (["parallel.pipeline_warmup=eager"], "parallel.pipeline_warmup must be one of"),
    (["checkpoint.keep=0"], r"checkpoint.keep >= 1, got 0 and 0"),
    # Uneven stages (model.layers = 8 by default).
    (
        ["parallel.pipe=2", "parallel.stage_layers=[5,4]"],
        r"parallel.stage_layers \[5, 4\] sums to 9, but model.layers is 8",
    ),
    (
        ["parallel.pipe=2", "parallel.stage_layers=[8,0]"],
        r"parallel.stage_layers entries must be >= 1, got \[8, 0\] \(stage 1 has 0\)",
    ),
    (
        ["parallel.pipe=2", "parallel.stage_layers=[-2,10]"],
        r"parallel.stage_layers entries must be >= 1, got \[-2, 10\]",
    ),
    (
        ["parallel.pipe=2", "parallel.stage_layers=[4,2,2]"],
        r"parallel.stage_layers has 3 entries \[4, 2, 2\], but parallel.pipe is 2",
    ),
    (
        [
            "parallel.pipe=2",
            "parallel.schedule=interleaved_1f1b",
            "parallel.chunks=2",
            "parallel.stage_layers=[5,3]",
        ],
        r"parallel.stage_layers \[5, 3\] needs a schedule with one chunk per stage .* "
        r"got parallel.schedule=interleaved_1f1b",
    ),
    (["parallel.stage_layers=[a]"], r"parallel.stage_layers must be a list of integers"),
    (
        ["moe.experts=4", "moe.exchange_bounds=[2,1.5]"],
        r"moe.exchange_bounds must be increasing multiples >= 1 of an even load, got \[2.0, 1.5\]",
    ),
    (["moe.exchange_bounds=[x]"], r"moe.exchange_bounds must be a list of numbers, e.g. \[1.25"),
    (
        ["moe.experts=4", "moe.exchange_bounds=[1.5,.inf]"],
        r"moe.exchange_bounds must be increasing multiples >= 1 of an even load, got \[1.5, inf\]",
    ),
    (["parallel.stage_layers=fastest"], r"parallel.stage_layers must be a list of integers"),
    (["compression.pipe_grad_rank=-1"], r"compression.pipe_grad_rank must be >= 0, got -1"),
    (
        ["compression.pipe_grad_rank=4"],
        r"compression.pipe_grad_rank = 4 compresses the gradients "
        r"sent between pipeline stages, but parallel.pipe is 1",
    ),
    (
        ["parallel.pipe=2", "compression.pipe_grad_rank=4", "compression.pipe_grad_phase=cooldown"],
        r"compression.pipe_grad_phase must be one of \['all', 'epilogue'\]",
    ),
    (
        [
            "parallel.pipe=2",
            "compression.pipe_grad_rank=4",
            "compression.pipe_error_feedback=eager",
        ],
        r"compression.pipe_error_feedback must be one of \['lazy', 'lazy_flush', 'none'\]",
    ),
    (
        ["parallel.pipe=2", "compression.data_grad_stages=3"],
        r"compression.data_grad_stages must be -1 \(all\) or a stage count in "
        r"\[1, parallel.pipe = 2\], got 3",
    ),
    (
        ["parallel.data=8", "parallel.zero_stage=1", "compression.data_grad_rank=4"],
        r"compression.data_grad_rank = 4 works on whole gradients, but parallel.zero_stage = 1",
    ),
    (
        ["parallel.data=8", "parallel.zero_stage=3", "compression.fused_embedding_sync=true"],
        r"compression.fused_embedding_sync = True works on whole gradients, but "
        r"parallel.zero_stage = 3",
    ),
    (
        ["compression.data_grad_rank=4"],
        r"compression.data_grad_rank = 4 compresses the "
        r"data-parallel reduction, but parallel.data is 1",
    ),
    (["parallel.placement=holmes"], r"parallel.placement must be one of \['auto', 'megatron'\]"),
    (
        ["parallel.data=-1", "parallel.zero_stage=2"],
        r"parallel.zero_stage must be one of \[0, 1, 3\], got 2",
    ),
    (
        ["parallel.zero_stage=1"],
        r"parallel.zero_stage = 1 splits the optimizer over parallel.data, which is 1",
    ),
    (
        [
            "parallel.data=2",
            "parallel.pipe=4",
            "parallel.schedule=breadth_first",
            "parallel.chunks=3",
        ],
        r"model.layers \(8\) must be divisible by parallel.pipe \* parallel.chunks = 4 \* 3 = 12",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m[:40] for _, m in BAD])
def test_validation_errors_name_field_and_numbers(overrides, message):
    base = C.Config(model=C.ModelConfig(vocab_size=1000), train=C.TrainConfig(global_batch=16))
    devices = (
        8
        if any(
            o.startswith(("parallel.data", "parallel.pipe=8", "parallel.pipe=4")) for o in overrides
        )
        else None
    )
    with pytest.raises(C.ConfigError, match=message):
        cfg = C.apply_overrides(base, overrides)
        C.validate(cfg, devices or _devices(cfg))


def _devices(cfg: C.Config) -> int:
    p = cfg.parallel
    if p.tensor == 3:
        return 1
    return max(p.data, 1) * max(p.pipe, 1) * max(p.tensor, 1)


def test_missing_config_file():
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load("configs/nope.yaml")


def test_steps_override_keeps_the_schedule():
    cfg = C.apply_overrides(C.Config(), ["train.steps=300", "optimizer.warmup_steps=20"])
    stopped_early = C.with_steps(cfg, 3)
    assert stopped_early.train.steps == 3
    assert stopped_early.optimizer.decay_steps == 280  # from train.steps = 300, not 3
    assert C.resolve_decay_steps(cfg).optimizer.decay_steps == 280
    fixed = C.apply_overrides(cfg, ["optimizer.decay_steps=50"])
    assert C.with_steps(fixed, 3).optimizer.decay_steps == 50
    validated = C.validate(C.apply_overrides(stopped_early, ["model.vocab_size=512"]), 1)
    assert validated.optimizer.decay_steps == 280


def test_stage_layers_words_resolve_before_validation():
    from jaxmeg.training.partitioning import resolve

    cfg = C.apply_overrides(
        C.Config(), ["model.vocab_size=512", "parallel.pipe=2", "parallel.stage_layers=auto"]
    )
    assert cfg.parallel.stage_layers == "auto"
    with pytest.raises(C.ConfigError, match="resolved by the trainer before validation"):
        C.validate(cfg, 2)
    # Without a cluster file the stages are priced with the running devices' profile (here the
    # CPU's): a small head costs less than a layer, gpt_tiny's (vocab 4096) about 1.2 layers,
    # and [5, 3] is what measures fastest on 2 CPU devices (docs/benchmarks.md: [5, 3] 0.42 s,
    # [4, 4] 0.45 s, [7, 1] 0.49 s per step).
    layout = resolve(cfg, devices=2)
    assert layout.cfg.parallel.stage_layers == (4, 4)
    assert layout.source == "performance model"
    tiny = C.load(ROOT / "configs" / "gpt_tiny.yaml", ["model.vocab_size=4096", "parallel.pipe=2",
                  "train.microbatches=8", "parallel.stage_layers=auto"])  # fmt: skip
    assert resolve(tiny, devices=2).cfg.parallel.stage_layers == (5, 3)


def test_stage_layers_auto_names_a_device_no_profile_knows():
    from types import SimpleNamespace

    from jaxmeg.training.partitioning import local_cluster

    cpu = SimpleNamespace(platform="cpu", device_kind="cpu", process_index=0)
    assert local_cluster([cpu] * 4).groups[0].gpu == "cpu"
    h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", process_index=0)
    assert local_cluster([h100] * 8).groups[0].gpu == "h100_dgx"
    odd = SimpleNamespace(platform="gpu", device_kind="Radeon 9000", process_index=0)
    with pytest.raises(C.ConfigError, match="device kind 'Radeon 9000'.*--cluster"):
        local_cluster([odd])
