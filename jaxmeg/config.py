"""Typed run configuration: frozen dataclasses, YAML loading, `section.key=value` overrides.

Every field carries a docstring. Sentinels are spelled out: `-1` means "infer". All divisibility
and product checks run once, in `validate`, before anything is compiled; each error names the
field and the numbers.

Words: axis = mesh axis (`data`, `pipe`, `tensor`); dim = tensor dimension.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from jaxmeg.pipeline import schedules
from jaxmeg.pipeline.layout import LayoutError, StageLayout

MESH_AXES = ("data", "pipe", "tensor")
OUTER_AXES = ("pipe", "data")
"""The `parallel.outer_axis` choices: the mesh axis that varies slowest over devices."""
ZERO_STAGES = (0, 1, 3)
"""The sharded-optimizer stages `parallel.zero_stage` accepts (see `jaxmeg.parallel.zero`)."""
REMAT_POLICIES = ("none", "selective", "full")
"""The `model.remat` choices; the performance model and the planner take them from here."""
DTYPES = ("float32", "bfloat16", "float16")
PLACEMENTS = ("auto", "megatron")
"""The `parallel.placement` choices (see `jaxmeg.parallel.placement`)."""
STAGE_LAYERS_MODES = ("auto", "measured")
"""The words `parallel.stage_layers` accepts besides a list; resolved to a list before
`validate`."""


RUN_CONFIG = "config.yaml"
"""The config file a run directory may hold (`convert_hf.py import` writes it); `train.py --out
DIR` and the run readers use it when no --config is given."""


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    block: str = "gpt"
    """`gpt` (Megatron GPT: LayerNorm, GeLU MLP, learned positions) or `llama` (RMSNorm,
    SwiGLU MLP, rotary positions, untied head)."""
    vocab_size: int = -1
    """Tokenizer vocabulary size; -1 = take it from the dataset. Padded up to a multiple of
    `vocab_multiple * parallel.tensor` for the embedding table (Megatron's
    make-vocab-size-divisible-by); padded logits are masked out of the loss."""
    vocab_multiple: int = 128
    """The embedding table's row count is a multiple of this times the tensor-parallel size."""
    hidden: int = 128
    """Hidden size h."""
    layers: int = 8
    """Number of transformer layers L."""
    heads: int = 4
    """Attention (query) heads; must divide `hidden` and be divisible by `parallel.tensor`."""
    kv_heads: int = -1
    """Key/value heads of grouped-query attention (Ainslie et al., 2023): query head n reads kv
    head n // (heads / kv_heads), as in Hugging Face's Llama. -1 = heads: multi-head attention,
    whose parameters keep the fused `w_qkv` [hidden, 3, heads, head_dim]; fewer than heads gives
    `w_q` [hidden, heads, head_dim] and `w_kv` [hidden, 2, kv_heads, head_dim]. Must divide
    `heads`. The kv heads are split over `tensor` when parallel.tensor divides kv_heads and
    replicated on every tensor rank otherwise (`jaxmeg.parallel.rules.kv_head_rules`, applied
    by `validate`). `validate` resolves -1."""
    mlp_ratio: int = 4
    """MLP width as a multiple of hidden (Megatron: 4h), when `ffn_hidden` is -1."""
    ffn_hidden: int = -1
    """MLP width f, e.g. 11008 for Llama-2 7B; -1 = mlp_ratio x hidden. Must be divisible by
    `parallel.tensor`. `validate` resolves -1."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding (llama block): frequency i of a head of dim H is
    rope_theta^(-2i/H), i < H/2 (Llama 1-2: 10000, Llama 3: 500000)."""
    seq_len: int = 128
    """Sequence length s (also the number of learned positions)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection (Megatron GPT)."""
    dropout: float = 0.0
    """Dropout rate; only 0.0 is implemented (training runs are deterministic)."""
    compute_dtype: str = "bfloat16"
    """Dtype of activations and matmuls; parameters and optimizer state stay in `param_dtype`."""
    param_dtype: str = "float32"
    """Dtype of the master parameters."""
    remat: str = "none"
    """Activation recompute: `none`, `selective` (recompute attention internals, keep the weight
    matmul outputs) or `full` (keep only each layer's input)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init; output projections use
    init_std / sqrt(2 L) as in Megatron."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    attention: str = "auto"
    """`jax.nn.dot_product_attention` implementation: `auto` (cuDNN on GPU for 16-bit compute,
    XLA otherwise), `xla` or `cudnn`."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        """`kv_heads` with -1 resolved to `heads`."""
        return self.heads if self.kv_heads == -1 else self.kv_heads

    @property
    def mlp_hidden(self) -> int:
        """MLP width f: `ffn_hidden`, or mlp_ratio x hidden when it is -1."""
        return self.hidden * self.mlp_ratio if self.ffn_hidden == -1 else self.ffn_hidden


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    data: int = 1
    """Data-parallel size d (-1 = infer from the device count)."""
    pipe: int = 1
    """Pipeline stages p (-1 = infer)."""
    tensor: int = 1
    """Tensor-parallel size t (-1 = infer). A tensor group always sits inside one host."""
    sequence_parallel: bool = False
    """Shard the activations between blocks on the sequence dim over `tensor`, so each block's
    all-reduce becomes a reduce-scatter plus an all-gather (Korthikanti et al., 2022)."""
    schedule: str = "1f1b"
    """Pipeline schedule: `gpipe`, `1f1b`, `interleaved_1f1b` or `breadth_first` (layered
    gradient accumulation; with chunks = layers / pipe, modular pipeline parallelism)."""
    chunks: int = 1
    """Model chunks (virtual stages) per pipeline stage, v; > 1 only with interleaved_1f1b or
    breadth_first."""
    stage_layers: tuple | str = ()
    """Layers per pipeline stage, one entry per stage, e.g. [5, 3] (sum = model.layers, every
    entry >= 1; gpipe, 1f1b and breadth_first with chunks = 1). Empty = the even split L / (p v).
    Shorter stages are padded to the longest with identity layers that are never updated and
    counted nowhere. `auto`: the split that minimises the slowest stage's time by the performance
    model, given each stage's node group (`scripts/train.py --cluster`); `measured`: the same
    partitioner fed by a short probe on the devices, saved in the run directory and reused on
    resume (see `jaxmeg.training.stage_probe`)."""
    placement: str = "auto"
    """Which device takes which mesh coordinate: `auto` (with a cluster file, NIC-aware as in
    Holmes: node groups take whole pipeline stages in file order, so data-parallel groups stay
    inside one NIC type; without one, the same as `megatron`) or `megatron` (devices in process
    order, `outer_axis` slowest, blind to NICs)."""
    pipeline_warmup: str = "min_bubble"
    """1F1B warm-up: `min_memory` (Megatron's p-s-1 forwards) or `min_bubble` (more warm-up
    forwards so the lockstep executor reaches the asynchronous bubble)."""
    zero_stage: int = 0
    """Sharded optimizer (ZeRO, Megatron's distributed optimizer), needs parallel.data > 1: 0 =
    off; 1 = master weights (`model.param_dtype`) and Adam moments split over `data` (embedding
    and head over `pipe` x `data`), gradients reduce-scattered, weights all-gathered each step;
    3 = the weights also stay split in the tick loop and each slot gathers a chunk when its order
    moves to it (2 v gathers per stage and step with `breadth_first`). Gradient accumulators are
    not split."""
    outer_axis: str = "pipe"
    """Which of `pipe` and `data` varies slowest over devices and so spans hosts first
    (Megatron's default: pipe)."""
    param_rules: dict = dataclasses.field(default_factory=dict)
    """Overrides of the logical->mesh rules for parameters, e.g. {mlp: null}."""
    activation_rules: dict = dataclasses.field(default_factory=dict)
    """Overrides of the logical->mesh rules for activations."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to `lr`."""
    decay_steps: int = -1
    """Steps of cosine decay after warm-up; -1 = until `train.steps` as the config file and
    `--set` give it (`scripts/train.py --steps N` only says where to stop, so a run stopped early
    and resumed follows the same schedule)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to biases and norm scales)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 disables clipping."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    dataset: str = ""
    """Dataset prefix: a token file written by scripts/preprocess_data.py (PREFIX.bin,
    PREFIX.idx.npy, PREFIX.json) or a Megatron-LM indexed dataset as its preprocess_data.py
    writes it (PREFIX.bin + PREFIX.idx), told apart by their files. A Megatron pair records no
    vocabulary: its largest token id + 1 is the least model.vocab_size, and the one used when
    model.vocab_size is unset. Empty = the default corpus (this Python installation's
    standard-library sources), tokenized and cached on first use."""
    cache_dir: str = "~/.cache/jaxmeg"
    """Where the default corpus and its tokenizer are cached."""
    tokenizer_vocab: int = 4096
    """BPE vocabulary size trained for the default corpus."""
    default_corpus_bytes: int = 4_000_000
    """How many bytes of standard-library source the default corpus takes."""
    eval_fraction: float = 0.0
    """Share of the dataset's samples held out of training, in [0, 0.5): the last
    floor(eval_fraction x samples) fixed-length windows, never in a training batch; what
    `train.eval_every` and scripts/evaluate.py evaluate. 0 = nothing held out."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel replicas."""
    microbatch_size: int = -1
    """Sequences per microbatch per data-parallel replica, b; -1 = global_batch / (data *
    microbatches)."""
    microbatches: int = -1
    """Microbatches per step per replica, m (gradient accumulation, or pipeline microbatches);
    -1 = global_batch / (data * microbatch_size); if both are -1, 1 without a pipeline and
    global_batch / data (microbatches of one sequence) with one."""
    seed: int = 0
    """Seed of parameter init and data order."""
    log_every: int = 1
    """Print and record metrics every this many steps."""
    nonfinite: str = "skip"
    """On a non-finite loss or gradient: `skip` the update (params and optimizer state stay
    as they were; the step is counted in `skipped_steps`) or `stop` the run."""
    max_nonfinite_in_row: int = 5
    """Stop with an error after this many skipped steps in a row."""
    eval_every: int = 0
    """Evaluate the held-out split (`data.eval_fraction` > 0) every this many steps and record
    `eval_loss` and `eval_perplexity` with that step's metrics; 0 = never."""
    eval_batches: int = 4
    """Global batches of held-out samples per evaluation (at most as many as it holds): the
    same batches every time, so evaluations are comparable."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save every this many steps when an output directory is given (0 = only at the end and on
    SIGTERM/SIGINT)."""
    keep: int = 3
    """Checkpoints kept (older ones are deleted once a newer one is complete)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Pipeline-aware communication compression (Optimus-CC, Song et al., ASPLOS 2023); all off
    by default. Low-rank factors are fp32; a rank at or above a matrix's smaller side sends that
    matrix whole (exact), so one rank can serve a whole model."""

    pipe_grad_rank: int = 0
    """Rank r of the activation gradients a stage sends to the previous stage (0 = off): the
    cotangent, viewed as [b s, h], goes as factors P [b s, r] and Q [h, r] from one power
    iteration with a warm-started, orthogonalised Q kept per link; forward activations are never
    compressed."""
    pipe_error_feedback: str = "lazy"
    """`lazy`: the sender keeps what compression lost and adds it to the next microbatch's
    gradient on the same link (lazy error propagation; the buffers are training state, kept
    across steps and checkpointed); `none`: the loss is dropped."""
    pipe_grad_phase: str = "all"
    """`all`: every backward transfer is compressed; `epilogue`: only those on the critical path
    of the schedule (`jaxmeg.pipeline.critical_path`; for 1F1B the sender's cool-down transfers
    and its last steady-state one)."""
    fused_embedding_sync: bool = False
    """Reduce the embedding/head gradients (and the loss) of the first and last stage and their
    data-parallel average in ONE all-reduce over {first, last stage} x data; the middle stages
    take no part and receive the result by ppermute, as each keeps a replica of the shared
    params (without it, every pipe stage joins an all-reduce over pipe x data). Exact."""
    data_grad_rank: int = 0
    """PowerSGD rank of the data-parallel gradient reduction (0 = off): per weight matrix P = M Q,
    all-reduce P, orthogonalise, Q = M^T P, all-reduce Q, with error feedback; vectors (biases,
    norms) are all-reduced whole."""
    data_grad_stages: int = -1
    """Compress the data-parallel reduction only on pipeline stages < k (-1 = all stages)."""
    warmup_steps: int = 0
    """Optimizer steps at the start that reduce data-parallel gradients uncompressed."""


ERROR_FEEDBACK = ("lazy", "none")
PIPE_GRAD_PHASES = ("all", "epilogue")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The network."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """How the network is split over devices."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """AdamW and its schedule."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Where tokens come from."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """The loop."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    compression: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    """Compressed pipeline and data-parallel communication (off by default)."""


_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "compression": CompressionConfig,
}


def _coerce(section: str, field: dataclasses.Field, value: Any) -> Any:
    default = getattr(_SECTION_TYPES[section](), field.name)
    name = f"{section}.{field.name}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads `2e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        if value in STAGE_LAYERS_MODES and field.name == "stage_layers":
            return value
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            value = [value] if isinstance(value, int) else yaml.safe_load(f"[{value}]")
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{name} must be a list of integers, e.g. [5, 3], got {value!r}")
        return tuple(value)
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    return value


def from_dict(raw: dict) -> Config:
    """Builds a Config from nested dicts, rejecting unknown sections and keys by name."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    sections = {}
    for section, values in raw.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(
                f"unknown config section {section!r}; known: {sorted(_SECTION_TYPES)}"
            )
        cls = _SECTION_TYPES[section]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = values or {}
        for key in values:
            if key not in fields:
                raise ConfigError(f"unknown config key {section}.{key}; known: {sorted(fields)}")
        sections[section] = cls(**{k: _coerce(section, fields[k], v) for k, v in values.items()})
    return Config(**sections)


def to_dict(cfg: Config) -> dict:
    """Plain nested dicts and lists (YAML- and JSON-safe)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Applies `section.key=value` strings; values are parsed as YAML (`true`, `3`, `1e-3`)."""
    raw = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) != 2:
            raise ConfigError(f"override key {path!r} must be section.key, e.g. parallel.tensor")
        section, key = parts
        if section not in raw:
            raise ConfigError(f"unknown config section {section!r}; known: {sorted(raw)}")
        if key not in raw[section]:
            raise ConfigError(f"unknown config key {path}; known: {sorted(raw[section])}")
        raw[section][key] = yaml.safe_load(text) if text.strip() else ""
    return from_dict(raw)


def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Loads a YAML config file and applies overrides. Does not validate (see `validate`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config {str(path)!r} is a directory; pass a YAML file in it, e.g. "
            f"{str(path / 'gpt_tiny.yaml')!r}"
        )
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"config file {str(path)!r}{where}: {problem}") from None
    cfg = from_dict(raw)
    return apply_overrides(cfg, overrides or [])


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


def padded_vocab_size(model: ModelConfig, tensor: int) -> int:
    """Vocabulary rounded up to a multiple of `vocab_multiple * tensor` (Megatron's padding)."""
    multiple = model.vocab_multiple * tensor
    return -(-model.vocab_size // multiple) * multiple


def resolve_mesh_shape(par: ParallelConfig, num_devices: int) -> tuple[int, int, int]:
    """Fills in the one `-1` axis so that data * pipe * tensor == num_devices."""
    sizes = {"data": par.data, "pipe": par.pipe, "tensor": par.tensor}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"parallel.{name} must be a positive integer or -1, got {size}")
    unknown = [n for n, s in sizes.items() if s == -1]
    if len(unknown) > 1:
        raise ConfigError(f"only one of parallel.data/pipe/tensor may be -1, got {unknown}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if unknown:
        if num_devices % known:
            raise ConfigError(
                f"cannot infer parallel.{unknown[0]}: {num_devices} devices are not divisible "
                f"by the product of the other axes ({known})"
            )
        sizes[unknown[0]] = num_devices // known
    product = sizes["data"] * sizes["pipe"] * sizes["tensor"]
    if product != num_devices:
        raise ConfigError(
            f"parallel.data * parallel.pipe * parallel.tensor = {sizes['data']} * "
            f"{sizes['pipe']} * {sizes['tensor']} = {product}, but there are {num_devices} devices"
        )
    return sizes["data"], sizes["pipe"], sizes["tensor"]


def resolve_batching(train: TrainConfig, data: int, pipe: int = 1) -> tuple[int, int]:
    """Returns (microbatch_size b, microbatches m) with global_batch == data * m * b.

    With both left at -1: one microbatch without a pipeline, microbatches of one sequence with
    one (the most microbatches, so the smallest bubble)."""
    g, b, m = train.global_batch, train.microbatch_size, train.microbatches
    if g < 1:
        raise ConfigError(f"train.global_batch must be >= 1, got {g}")
    if g % data:
        raise ConfigError(f"train.global_batch ({g}) must be divisible by parallel.data ({data})")
    per_replica = g // data
    if b == -1 and m == -1:
        m = 1 if pipe == 1 else per_replica
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


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _validate_compression(comp: CompressionConfig, pipe: int, data: int, zero_stage: int) -> None:
    for name in ("pipe_grad_rank", "data_grad_rank", "warmup_steps"):
        if getattr(comp, name) < 0:
            raise ConfigError(f"compression.{name} must be >= 0, got {getattr(comp, name)}")
    _check_choice("compression.pipe_error_feedback", comp.pipe_error_feedback, ERROR_FEEDBACK)
    _check_choice("compression.pipe_grad_phase", comp.pipe_grad_phase, PIPE_GRAD_PHASES)
    if comp.pipe_grad_rank and pipe == 1:
        raise ConfigError(
            f"compression.pipe_grad_rank = {comp.pipe_grad_rank} compresses the gradients sent "
            f"between pipeline stages, but parallel.pipe is 1"
        )
    if comp.pipe_grad_phase != "all" and not comp.pipe_grad_rank:
        raise ConfigError(
            f"compression.pipe_grad_phase = {comp.pipe_grad_phase} needs "
            f"compression.pipe_grad_rank > 0"
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


def validate(cfg: Config, num_devices: int) -> Config:
    """Checks every field and returns the config with all `-1` sentinels resolved.

    Needs `model.vocab_size` to be known (set it from the dataset first).
    """
    m, par, tr, opt = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    _check_choice("model.block", m.block, ("gpt", "llama"))
    _check_choice("model.compute_dtype", m.compute_dtype, DTYPES)
    _check_choice("model.param_dtype", m.param_dtype, DTYPES)
    _check_choice("model.remat", m.remat, REMAT_POLICIES)
    _check_choice("model.attention", m.attention, ("auto", "xla", "cudnn"))
    _check_choice("parallel.schedule", par.schedule, schedules.NAMES)
    _check_choice("parallel.pipeline_warmup", par.pipeline_warmup, schedules.WARMUPS)
    _check_choice("parallel.outer_axis", par.outer_axis, OUTER_AXES)
    _check_choice("parallel.placement", par.placement, PLACEMENTS)
    if isinstance(par.stage_layers, str):
        raise ConfigError(
            f"parallel.stage_layers={par.stage_layers} is resolved by the trainer before "
            f"validation (jaxmeg.training.partitioning.resolve_stage_layers)"
        )
    for name in ("hidden", "layers", "heads", "mlp_ratio", "seq_len", "vocab_multiple"):
        _check_positive(f"model.{name}", getattr(m, name))
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
    if m.ffn_hidden != -1 and m.ffn_hidden < 1:
        raise ConfigError(
            f"model.ffn_hidden must be -1 (= mlp_ratio x hidden) or >= 1, got {m.ffn_hidden}"
        )
    _check_positive("model.rope_theta", m.rope_theta)

    data, pipe, tensor = resolve_mesh_shape(par, num_devices)
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
    if par.chunks > 1 and par.schedule not in schedules.CHUNKED:
        raise ConfigError(
            f"parallel.chunks = {par.chunks} needs parallel.schedule=interleaved_1f1b or "
            f"breadth_first, "
            f"got {par.schedule}"
        )
    if par.chunks > 1 and pipe == 1:
        raise ConfigError(f"parallel.chunks = {par.chunks} needs parallel.pipe > 1, got 1")
    if par.stage_layers and par.schedule == "interleaved_1f1b":
        raise ConfigError(
            f"parallel.stage_layers {list(par.stage_layers)} needs a schedule with one chunk per "
            f"stage (gpipe, 1f1b or breadth_first with chunks = 1), got "
            f"parallel.schedule=interleaved_1f1b"
        )
    try:
        StageLayout.create(m.layers, pipe, par.chunks, par.stage_layers)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    b, micro = resolve_batching(tr, data, pipe)
    if pipe > 1 and par.schedule == "interleaved_1f1b" and micro % pipe:
        raise ConfigError(
            f"interleaved_1f1b needs train.microbatches ({micro}) to be a multiple of "
            f"parallel.pipe ({pipe})"
        )
    _validate_compression(cfg.compression, pipe, data, cfg.parallel.zero_stage)
    _check_choice("train.nonfinite", tr.nonfinite, ("skip", "stop"))
    _check_positive("train.max_nonfinite_in_row", tr.max_nonfinite_in_row)
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError(
            f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got "
            f"{cfg.checkpoint.every} and {cfg.checkpoint.keep}"
        )
    _check_positive("train.steps", tr.steps)
    _check_positive("train.log_every", tr.log_every)
    if not 0.0 <= cfg.data.eval_fraction < 0.5:
        raise ConfigError(f"data.eval_fraction must be in [0, 0.5), got {cfg.data.eval_fraction}")
    if tr.eval_every < 0:
        raise ConfigError(f"train.eval_every must be >= 0 (0 = never), got {tr.eval_every}")
    _check_positive("train.eval_batches", tr.eval_batches)
    if tr.eval_every and cfg.data.eval_fraction == 0.0:
        raise ConfigError(
            f"train.eval_every = {tr.eval_every} evaluates the held-out split, but "
            f"data.eval_fraction is 0 (nothing held out); set it, e.g. data.eval_fraction=0.05"
        )
    _check_positive("optimizer.lr", opt.lr)
    if opt.min_lr < 0 or opt.min_lr > opt.lr:
        raise ConfigError(f"optimizer.min_lr must be in [0, lr={opt.lr}], got {opt.min_lr}")
    if opt.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {opt.warmup_steps}")
    if opt.grad_clip < 0:
        raise ConfigError(f"optimizer.grad_clip must be >= 0, got {opt.grad_clip}")
    from jaxmeg.parallel.rules import kv_head_rules  # the rules import this module

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
