"""Validation of a run configuration: every divisibility and product check, run once before
anything is compiled, and the resolution of the `-1` sentinels (mesh axes, batching, kv heads,
the learning-rate decay). Each error names the field and the numbers. Import it through
`jaxmeg.config`.

Words: axis = mesh axis (`data`, `pipe`, `tensor`); dim = tensor dimension.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from jaxmeg.config_moe_validation import validate_moe
from jaxmeg.config_sections import (
    DTYPES,
    ERROR_FEEDBACK,
    FP8_RECIPES,
    OUTER_AXES,
    PIPE_GRAD_PHASES,
    PLACEMENTS,
    REMAT_POLICIES,
    ZERO_STAGES,
    CompressionConfig,
    Config,
    ConfigError,
    ParallelConfig,
    TrainConfig,
    check_choice,
    check_positive,
)
from jaxmeg.pipeline import schedules
from jaxmeg.pipeline.layout import LayoutError, StageLayout


def resolve_mesh_shape(par: ParallelConfig, num_devices: int) -> tuple[int, int, int, int, int]:
    """(data, pipe, context, expert, tensor), the one `-1` axis filled in so that their product
    is num_devices."""
    for name in ("context", "expert"):
        if getattr(par, name) < 1:
            raise ConfigError(
                f"parallel.{name} must be a positive integer, got {getattr(par, name)}"
            )
    sizes = {"data": par.data, "pipe": par.pipe, "tensor": par.tensor}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"parallel.{name} must be a positive integer or -1, got {size}")
    unknown = [n for n, s in sizes.items() if s == -1]
    if len(unknown) > 1:
        raise ConfigError(f"only one of parallel.data/pipe/tensor may be -1, got {unknown}")
    inner = par.context * par.expert
    known = math.prod(s for s in sizes.values() if s != -1) * inner
    if unknown:
        if num_devices % known:
            raise ConfigError(
                f"cannot infer parallel.{unknown[0]}: {num_devices} devices are not divisible "
                f"by the product of the other axes ({known})"
            )
        sizes[unknown[0]] = num_devices // known
    product = sizes["data"] * sizes["pipe"] * inner * sizes["tensor"]
    if product != num_devices:
        axes = {"data": sizes["data"], "pipe": sizes["pipe"], "context": par.context,
                "expert": par.expert, "tensor": sizes["tensor"]}  # fmt: skip
        shown = {a: n for a, n in axes.items() if a not in ("context", "expert") or n > 1}
        named = " * ".join(f"parallel.{a}" for a in shown)
        values = " * ".join(str(n) for n in shown.values())
        raise ConfigError(f"{named} = {values} = {product}, but there are {num_devices} devices")
    return sizes["data"], sizes["pipe"], par.context, par.expert, sizes["tensor"]


def resolve_batching(
    train: TrainConfig, data: int, pipe: int = 1, expert: int = 1
) -> tuple[int, int]:
    """Returns (microbatch_size b, microbatches m) with global_batch == data * m * b.

    With both left at -1: one microbatch without a pipeline, microbatches of one sequence with
    one (the most microbatches, so the smallest bubble), of `expert` sequences with expert
    parallelism (one per expert rank)."""
    g, b, m = train.global_batch, train.microbatch_size, train.microbatches
    if g < 1:
        raise ConfigError(f"train.global_batch must be >= 1, got {g}")
    if g % data:
        raise ConfigError(f"train.global_batch ({g}) must be divisible by parallel.data ({data})")
    per_replica = g // data
    if b == -1 and m == -1:
        m = 1 if pipe == 1 else max(per_replica // expert, 1)
    if b == -1:
        if m < 1 or per_replica % m:
            raise ConfigError(
                f"train.global_batch / parallel.data = {g} / {data} = {per_replica} must be "
                f"divisible by train.microbatches ({m})"
            )
        b = per_replica // m
    elif m == -1:
        if b < 1 or per_replica % b:
            raise ConfigError(
                f"train.global_batch ({g}) must be divisible by parallel.data * "
                f"train.microbatch_size = {data} * {b} = {data * b}"
            )
        m = per_replica // b
    if b < 1 or m < 1 or data * m * b != g:
        raise ConfigError(
            f"train.global_batch ({g}) must equal parallel.data * train.microbatches * "
            f"train.microbatch_size = {data} * {m} * {b} = {data * m * b}"
        )
    return b, m


def resolve_decay_steps(cfg: Config) -> Config:
    """Fixes `optimizer.decay_steps = -1` to "until train.steps" for the current train.steps.

    Call it before changing train.steps to stop a run early: the schedule then stays that of
    the whole run, and resuming past warm-up reproduces the uninterrupted run's learning rates.
    """
    opt = cfg.optimizer
    if opt.decay_steps != -1:
        return cfg
    decay = max(cfg.train.steps - opt.warmup_steps, 1)
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(opt, decay_steps=decay))


def with_steps(cfg: Config, steps: int) -> Config:
    """The config with train.steps = `steps` and the learning-rate schedule left as it was."""
    cfg = resolve_decay_steps(cfg)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))


def kv_head_rules(kv_heads: int, tensor: int) -> tuple[dict, dict]:
    """(param, activation) rule overrides for `kv_heads` key/value heads on a tensor size t:
    none when t divides kv_heads (`jaxmeg.parallel.rules` splits the logical axes `kv_heads` and
    `act_kv_heads` over `tensor`), else both replicated. `validate` writes them into
    `parallel.param_rules` / `activation_rules` unless those name the axes already."""
    if kv_heads % tensor == 0:
        return {}, {}
    return {"kv_heads": None}, {"act_kv_heads": None}


class LazyErrorOnEverySendWarning(UserWarning):
    """Lazy error feedback on every compressed backward send (`compression.pipe_grad_phase =
    all`): measured to double the gradient error it should remove."""


def _validate_compression(comp: CompressionConfig, pipe: int, data: int, zero_stage: int) -> None:
    for name in ("pipe_grad_rank", "data_grad_rank", "warmup_steps"):
        if getattr(comp, name) < 0:
            raise ConfigError(f"compression.{name} must be >= 0, got {getattr(comp, name)}")
    check_choice("compression.pipe_error_feedback", comp.pipe_error_feedback, ERROR_FEEDBACK)
    check_choice("compression.pipe_grad_phase", comp.pipe_grad_phase, PIPE_GRAD_PHASES)
    if comp.pipe_grad_rank and pipe == 1:
        raise ConfigError(
            f"compression.pipe_grad_rank = {comp.pipe_grad_rank} compresses the gradients sent "
            f"between pipeline stages, but parallel.pipe is 1"
        )
    if comp.pipe_grad_rank and comp.pipe_error_feedback != "none" and comp.pipe_grad_phase == "all":
        warnings.warn(
            f"compression.pipe_error_feedback = {comp.pipe_error_feedback} with "
            f"compression.pipe_grad_phase = all: each microbatch's compression error goes into "
            f"the next microbatch's gradient on the same link and through its activations; "
            f"measured on gpt_tiny (1,2,1), rank 16: 8.5% gradient error at stage 0 against "
            f"4.3% with none, and +0.88 / +0.55 final loss over the baseline (none: +0.17 / "
            f"+0.07). The paper's setting is pipe_grad_phase = epilogue",
            LazyErrorOnEverySendWarning,
            stacklevel=3,
        )
    if comp.data_grad_rank and data == 1:
        raise ConfigError(
            f"compression.data_grad_rank = {comp.data_grad_rank} compresses the data-parallel "
            f"reduction, but parallel.data is 1"
        )
    for name in ("fused_embedding_sync", "data_grad_rank"):
        if getattr(comp, name) and zero_stage:
            raise ConfigError(
                f"compression.{name} = {getattr(comp, name)} works on whole gradients, but "
                f"parallel.zero_stage = {zero_stage} reduce-scatters them; use one or the other"
            )
    if not -1 <= comp.data_grad_stages <= pipe or comp.data_grad_stages == 0:
        raise ConfigError(
            f"compression.data_grad_stages must be -1 (all) or a stage count in [1, "
            f"parallel.pipe = {pipe}], got {comp.data_grad_stages}"
        )


def _validate_context(cfg: Config, context: int) -> None:
    """What context parallelism needs: 2c equal blocks of the sequence, attention that runs
    blockwise (the ring's kernel), and the features it has been proved with."""
    m, par, comp = cfg.model, cfg.parallel, cfg.compression
    if context == 1:
        return
    if m.seq_len % (2 * context):
        raise ConfigError(
            f"parallel.context = {context} splits the sequence into 2 x {context} blocks: "
            f"model.seq_len ({m.seq_len}) must be divisible by {2 * context}"
        )
    if par.tensor > 1 and (m.seq_len // context) % par.tensor:
        raise ConfigError(
            f"parallel.context = {context} with parallel.tensor = {par.tensor} needs "
            f"model.seq_len / context ({m.seq_len // context}) divisible by parallel.tensor "
            f"(sequence parallelism and scatter/gather split each rank's part over tensor)"
        )
    if m.attention == "cudnn":
        raise ConfigError(
            f"parallel.context = {context} runs attention as a ring of blocks merged by their "
            f"log-sum-exp, which model.attention=cudnn does not return; use auto or xla"
        )
    if schedules.splits_backward(par.schedule):
        raise ConfigError(
            f"parallel.context = {context} runs with gpipe, 1f1b, interleaved_1f1b and "
            f"breadth_first, not yet with parallel.schedule={par.schedule}"
        )
    compressed = [
        name for name, on in (("pipe_grad_rank", comp.pipe_grad_rank),
                              ("data_grad_rank", comp.data_grad_rank),
                              ("fused_embedding_sync", comp.fused_embedding_sync)) if on
    ]  # fmt: skip
    if compressed:
        raise ConfigError(
            f"parallel.context = {context} does not run with compression.{compressed[0]} yet"
        )


_SCHEDULE_FIELDS = {
    "num_stages": "parallel.pipe",
    "num_microbatches": "train.microbatches",
    "num_chunks": "parallel.chunks",
}


def _check_schedule(par: ParallelConfig, pipe: int, microbatches: int) -> None:
    """`schedules.check`'s rules for the layout, its errors led by the field at fault and
    spelled in the config's field names."""
    try:
        schedules.check(par.schedule, pipe, microbatches, par.chunks)
    except schedules.ScheduleCheckError as err:
        message = str(err)
        for word, field in _SCHEDULE_FIELDS.items():
            message = message.replace(word, field)
        raise ConfigError(f"{_SCHEDULE_FIELDS[err.field]}: {message}") from None


def _validate_schedule_layout(par: ParallelConfig, pipe: int) -> None:
    """What a schedule's row says of stages and `parallel.stage_layers`, before its numbers
    (`_check_schedule`)."""
    spec = schedules.spec(par.schedule)
    if par.chunks > 1 and not spec.chunked:
        chunked = [name for name, row in schedules.SPECS.items() if row.chunked]
        raise ConfigError(
            f"parallel.chunks = {par.chunks} needs parallel.schedule="
            f"{', '.join(chunked[:-1])} or {chunked[-1]}, got {par.schedule}"
        )
    if par.stage_layers and not spec.uneven_stages:
        uneven = [name for name, row in schedules.SPECS.items() if row.uneven_stages]
        raise ConfigError(
            f"parallel.stage_layers {list(par.stage_layers)} needs a schedule with one chunk per "
            f"stage ({', '.join(uneven)}), got parallel.schedule={par.schedule}"
        )


def validate(cfg: Config, num_devices: int) -> Config:
    """Checks every field and returns the config with all `-1` sentinels resolved.

    Needs `model.vocab_size` to be known (set it from the dataset first).
    """
    m, par, tr, opt = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    check_choice("model.block", m.block, ("gpt", "llama"))
    check_choice("model.compute_dtype", m.compute_dtype, DTYPES)
    check_choice("model.param_dtype", m.param_dtype, DTYPES)
    check_choice("model.remat", m.remat, REMAT_POLICIES)
    check_choice("model.attention", m.attention, ("auto", "xla", "cudnn"))
    check_choice("model.fp8", m.fp8, FP8_RECIPES)
    check_positive("model.fp8_history", m.fp8_history)
    if m.fp8_margin < 0:
        raise ConfigError(f"model.fp8_margin must be >= 0, got {m.fp8_margin}")
    check_choice("parallel.schedule", par.schedule, schedules.NAMES)
    check_choice("parallel.pipeline_warmup", par.pipeline_warmup, schedules.WARMUPS)
    check_choice("parallel.outer_axis", par.outer_axis, OUTER_AXES)
    check_choice("parallel.placement", par.placement, PLACEMENTS)
    if isinstance(par.stage_layers, str):
        raise ConfigError(
            f"parallel.stage_layers={par.stage_layers} is resolved by the trainer before "
            f"validation (jaxmeg.training.partitioning.resolve_stage_layers)"
        )
    for name in ("hidden", "layers", "heads", "mlp_ratio", "seq_len", "vocab_multiple"):
        check_positive(f"model.{name}", getattr(m, name))
    if m.vocab_size < 1:
        raise ConfigError(f"model.vocab_size must be set (>= 1), got {m.vocab_size}")
    if m.dropout != 0.0:
        raise ConfigError(
            f"model.dropout must be 0.0 (dropout is not implemented), got {m.dropout}"
        )
    if m.hidden % m.heads:
        raise ConfigError(f"model.hidden ({m.hidden}) must be divisible by model.heads ({m.heads})")
    if m.block == "llama" and m.head_dim % 2:
        raise ConfigError(f"rotary positions need an even head dim, got {m.head_dim}")
    if m.kv_heads != -1 and (m.kv_heads < 1 or m.heads % m.kv_heads):
        raise ConfigError(
            f"model.kv_heads must be -1 (= heads) or a divisor of model.heads ({m.heads}), "
            f"got {m.kv_heads}"
        )
    if m.qkv_bias and m.block != "llama":
        raise ConfigError(
            "model.qkv_bias adds q/k/v biases to the llama block; model.block=gpt has them already"
        )
    if m.ffn_hidden != -1 and m.ffn_hidden < 1:
        raise ConfigError(
            f"model.ffn_hidden must be -1 (= mlp_ratio x hidden) or >= 1, got {m.ffn_hidden}"
        )
    check_positive("model.rope_theta", m.rope_theta)

    data, pipe, context, expert, tensor = resolve_mesh_shape(par, num_devices)
    _validate_context(cfg, context)
    validate_moe(cfg, context, expert, tensor)
    if m.heads % tensor:
        raise ConfigError(
            f"model.heads ({m.heads}) must be divisible by parallel.tensor ({tensor})"
        )
    if m.mlp_hidden % tensor:
        raise ConfigError(
            f"model MLP width (model.ffn_hidden or model.mlp_ratio x model.hidden = "
            f"{m.mlp_hidden}) must be divisible by parallel.tensor ({tensor})"
        )
    if par.sequence_parallel and m.seq_len % tensor:
        raise ConfigError(
            f"sequence parallelism needs model.seq_len ({m.seq_len}) divisible by "
            f"parallel.tensor ({tensor})"
        )
    if par.chunks < 1:
        raise ConfigError(f"parallel.chunks must be >= 1, got {par.chunks}")
    if par.zero_stage not in ZERO_STAGES:
        raise ConfigError(
            f"parallel.zero_stage must be one of {list(ZERO_STAGES)}, got {par.zero_stage}"
        )
    if par.zero_stage and data == 1:
        raise ConfigError(
            f"parallel.zero_stage = {par.zero_stage} splits the optimizer over parallel.data, "
            f"which is 1; use parallel.data > 1 or zero_stage 0"
        )
    _validate_schedule_layout(par, pipe)
    b, micro = resolve_batching(tr, data, pipe, expert)
    if b % expert:
        raise ConfigError(
            f"parallel.expert = {expert} splits each microbatch's rows over {expert} devices: "
            f"train.microbatch_size ({b}) must be divisible by it"
        )
    _check_schedule(par, pipe, micro)
    try:
        StageLayout.create(cfg.stacked_layers, pipe, par.chunks, par.stage_layers,
                           placement=schedules.placement_of(par.schedule),
                           field=cfg.stacked_layers_field)  # fmt: skip
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    _validate_compression(cfg.compression, pipe, data, cfg.parallel.zero_stage)
    if schedules.placement_of(par.schedule) == "v" and cfg.compression.pipe_grad_rank:
        raise ConfigError(
            f"compression.pipe_grad_rank = {cfg.compression.pipe_grad_rank} compresses the "
            f"cotangents of one send direction; parallel.schedule={par.schedule} sends both "
            f"ways (its V): use zb_h1 or interleaved_zb, or pipe_grad_rank 0"
        )
    check_choice("train.nonfinite", tr.nonfinite, ("skip", "stop"))
    check_positive("train.max_nonfinite_in_row", tr.max_nonfinite_in_row)
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError(
            f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got "
            f"{cfg.checkpoint.every} and {cfg.checkpoint.keep}"
        )
    check_positive("train.steps", tr.steps)
    check_positive("train.log_every", tr.log_every)
    if not 0.0 <= cfg.data.eval_fraction < 0.5:
        raise ConfigError(f"data.eval_fraction must be in [0, 0.5), got {cfg.data.eval_fraction}")
    if tr.eval_every < 0:
        raise ConfigError(f"train.eval_every must be >= 0 (0 = never), got {tr.eval_every}")
    check_positive("train.eval_batches", tr.eval_batches)
    if tr.eval_every and cfg.data.eval_fraction == 0.0:
        raise ConfigError(
            f"train.eval_every = {tr.eval_every} evaluates the held-out split, but "
            f"data.eval_fraction is 0 (nothing held out); set it, e.g. data.eval_fraction=0.05"
        )
    check_positive("optimizer.lr", opt.lr)
    if opt.min_lr < 0 or opt.min_lr > opt.lr:
        raise ConfigError(f"optimizer.min_lr must be in [0, lr={opt.lr}], got {opt.min_lr}")
    if opt.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {opt.warmup_steps}")
    if opt.grad_clip < 0:
        raise ConfigError(f"optimizer.grad_clip must be >= 0, got {opt.grad_clip}")
    kv_params, kv_activations = kv_head_rules(m.num_kv_heads, tensor)
    return resolve_decay_steps(
        dataclasses.replace(
            cfg,
            model=dataclasses.replace(m, kv_heads=m.num_kv_heads, ffn_hidden=m.mlp_hidden),
            parallel=dataclasses.replace(
                par,
                data=data,
                pipe=pipe,
                tensor=tensor,
                param_rules={**kv_params, **par.param_rules},
                activation_rules={**kv_activations, **par.activation_rules},
            ),
            train=dataclasses.replace(tr, microbatch_size=b, microbatches=micro),
        )
    )


def settle_sequence_parallel(cfg: Config, platform: str) -> Config:
    """`cfg` with `parallel.sequence_parallel` resolved for a step on devices of `platform`
    (after `validate`, which resolves tensor = -1): None is on for GPUs where the field's
    docstring says, off elsewhere."""
    par, gpu = cfg.parallel, platform == "gpu"
    sequence_parallel = par.sequence_parallel
    if sequence_parallel is None:
        sequence_parallel = (
            gpu
            and par.tensor > 1
            and par.context == 1
            and not cfg.moe.experts
            and cfg.model.seq_len % par.tensor == 0
        )
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(par, sequence_parallel=sequence_parallel)
    )


def pinned_layout_problem(
    heads: int, tensor=None, pipe=None, chunks=None, schedule=None, context=None, gpus=None
) -> str | None:
    """What train.py would refuse in a layout pinned on plan.py's command line (None: not
    pinned), through the checks `validate` runs, or None: a layout train.py refuses is never
    planned."""
    if tensor is not None and tensor >= 1 and heads % tensor:
        return f"--tensor {tensor}: model.heads ({heads}) must be divisible by parallel.tensor"
    if context is not None and gpus is not None and context > gpus:
        return f"--context {context} needs at least {context} GPUs, got --gpus {gpus}"
    if schedule is not None and schedules.splits_backward(schedule):
        par = ParallelConfig(
            schedule=schedule, chunks=chunks or schedules.spec(schedule).min_chunks
        )
        p = pipe if pipe is not None else 2
        try:
            _validate_schedule_layout(par, p)
            _check_schedule(par, p, 2 * p)  # the microbatches are the planner's to choose
        except ConfigError as err:
            flags = {"parallel.schedule": "--schedule", "parallel.pipe": "--pipe",
                     "parallel.chunks": "--chunks"}  # fmt: skip
            text = str(err)
            for name, flag in flags.items():
                text = text.replace(name, flag)
            return text
    return None


def check_attention_runs_here(cfg, platform: str) -> None:
    """model.attention=cudnn runs cuDNN's fused kernel, which only a GPU has: a run on other
    devices is refused by name (compiling for a GPU target elsewhere still may use it)."""
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(
            f"model.attention=cudnn runs cuDNN's fused attention, which needs a GPU; these "
            f"devices are {platform}: use model.attention=auto (cuDNN where it runs) or xla"
        )
