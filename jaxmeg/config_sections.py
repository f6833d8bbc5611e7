"""The run configuration's sections: frozen dataclasses, every field with a docstring (reading
and writing them: `jaxmeg.config_io`).

Every field carries a docstring. Sentinels are spelled out: `-1` means "infer"; `None` means
"decided from the other fields" (see the field). Nothing here checks that the fields agree with
one another: that is `jaxmeg.config_validation.validate`. Import both through `jaxmeg.config`.

Words: axis = mesh axis (`data`, `pipe`, `tensor`); dim = tensor dimension.
"""

from __future__ import annotations

import dataclasses

from jaxmeg.config_moe import MoeConfig

MESH_AXES = ("data", "pipe", "context", "expert", "tensor")
OUTER_AXES = ("pipe", "data")
"""The `parallel.outer_axis` choices: the mesh axis that varies slowest over devices."""
ZERO_STAGES = (0, 1, 3)
"""The sharded-optimizer stages `parallel.zero_stage` accepts (see `jaxmeg.parallel.zero`)."""
REMAT_POLICIES = ("none", "selective", "full")
"""The `model.remat` choices; the performance model and the planner take them from here."""
DTYPES = ("float32", "bfloat16", "float16")
FP8_RECIPES = ("none", "current", "delayed")
"""`model.fp8`: none (16-bit GEMMs), current (per-tensor scales from this step's amax) or
delayed (scales from an amax history kept in the train state)."""
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


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ConfigError naming the field `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_positive(name: str, value: float) -> None:
    """ConfigError naming the field `name` unless `value` > 0."""
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


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
    replicated on every tensor rank otherwise (`jaxmeg.config_validation.kv_head_rules`,
    applied by `validate`). `validate` resolves -1."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections of the llama block (Qwen2, Qwen2-MoE);
    the gpt block has every bias anyway."""
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
    fp8: str = "none"
    """FP8 GEMMs for the attention projections, the dense MLPs and, with a capacity factor, the
    routed experts (current scales over all experts, whatever the recipe; dropless experts,
    the embedding, the LM head, norms and attention scores stay 16-bit): `none`, `current`
    (per-tensor scales from this step's amax) or `delayed` (per-tensor scales from the largest
    amax of the last `fp8_history` steps, kept in the train state, as Transformer Engine's
    delayed scaling); E4M3 activations and weights, E5M2 gradients (`jaxmeg/models/fp8.py`).
    On an H100 each linear's three GEMMs are cuBLASLt FP8 GEMMs; on a CPU the same rounding
    runs in 16/32-bit GEMMs."""
    fp8_history: int = 1024
    """`fp8: delayed`: the steps of amax history each tensor keeps (Transformer Engine's and
    flax's default length)."""
    fp8_margin: int = 0
    """`fp8: delayed`: a tensor's scale is 2^margin times the smallest power of two that maps its
    history's amax into the format (a margin for amaxes that grow faster than the history)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        """`kv_heads` with -1 resolved to `heads`."""
        return self.heads if self.kv_heads == -1 else self.kv_heads

    def attention_on(self, platform: str) -> str:
        """`attention` as a run on `platform` ("gpu", "cpu", ...) runs it: `auto` is cuDNN on a
        GPU with 16-bit compute, XLA otherwise."""
        if self.attention != "auto":
            return self.attention
        sixteen_bit = self.compute_dtype in ("bfloat16", "float16")
        return "cudnn" if platform == "gpu" and sixteen_bit else "xla"

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
    context: int = 1
    """Context-parallel size c: each sequence split over c devices, rank i holding blocks i and
    2c - 1 - i of 2c (causal load balance); attention runs as a ring of key/value blocks
    (`jaxmeg.parallel.context`). The mesh axis sits between pipe and tensor; parameters are
    replicated over it and their gradients summed over it. model.seq_len must be divisible by
    2c."""
    expert: int = 1
    """Expert-parallel size: the MoE layers' experts split over this many devices (moe.experts
    divisible by it), which are data-parallel replicas for every other weight (each takes
    1/expert of a microbatch's rows). Tokens reach their experts' devices and come back by
    all-to-all inside the layer (`jaxmeg.models.moe`). The axis sits beside tensor, inside a
    node."""
    sequence_parallel: bool | None = None
    """Shard the activations between blocks on the sequence dim over `tensor`, so each block's
    all-reduce becomes a reduce-scatter plus an all-gather (Korthikanti et al., 2022). None = on
    where the step compiles for GPUs, for a dense model with tensor > 1, context = 1 and
    model.seq_len divisible by tensor (the layer norms, residual adds and dropout-free
    elementwise work then run on 1/t of the rows: docs/benchmarks.md), off elsewhere; a train
    step's config holds the resolved value (`settle_sequence_parallel`)."""
    scatter_gather: bool | None = None
    """Megatron-LM's scatter/gather optimization (SC21 section 4.1): each tensor rank sends its
    1/t slice of the activation and of the cotangent between pipeline stages, and the receiver
    all-gathers over `tensor`. None = on when tensor > 1 and sequence parallelism is off (with
    sequence parallelism the activation between stages is already split). `true` with tensor = 1
    changes nothing. Read the resolved value from `uses_scatter_gather`."""
    overlap_sends: bool | None = None
    """Pipe sends a GPU overlaps with compute: each direction's send is one collective per tick
    on all its pairs, outside any conditional (idle pairs send what the receiver drops), and a
    backward's cotangent leaves at the start of the next tick, so F's send runs beside the B
    slot and B's beside the next F. `false`: each tick sends only on the pairs that carry
    something, inside a conditional that no compute can overlap. None = on when the step
    compiles for GPUs (`--target` included), off on CPUs, whose collectives are synchronous.
    Values are the same either way."""
    schedule: str = "1f1b"
    """Pipeline schedule: `gpipe`, `1f1b`, `interleaved_1f1b` or `breadth_first` (layered
    gradient accumulation; with chunks = layers / pipe, modular pipeline parallelism); or a
    zero-bubble one, whose backward splits into I and W: `zb_h1` (chunks 1), `interleaved_zb`
    (chunks >= 2), `zbv` (chunks 2 in a V, the loss on stage 0); or `dualpipev` (DeepSeek-V3's
    DualPipe in a V, chunks 2: one microbatch's forward overlapped with another's backward;
    train.microbatches >= 2 x pipe). See docs/schedules.md."""
    chunks: int = 1
    """Model chunks (virtual stages) per pipeline stage, v; > 1 only with interleaved_1f1b,
    breadth_first, interleaved_zb, zbv or dualpipev (2)."""
    stage_layers: tuple | str = ()
    """Layers per pipeline stage, one entry per stage, e.g. [5, 3] (sum = model.layers, every
    entry >= 1; gpipe, 1f1b and breadth_first with chunks = 1). Empty = the even split L / (p v).
    Shorter stages are padded to the longest with identity layers that are never updated and
    counted nowhere. `auto`: the split that minimises the slowest stage's time by the performance
    model, given each stage's node group (`scripts/train.py --cluster`), else the profile of the
    run's devices (configs/hardware/: `cpu`, or the one that names the GPU); `measured`: the same
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

    @property
    def uses_scatter_gather(self) -> bool:
        """`scatter_gather` resolved: whether stage-to-stage messages go as 1/t slices. Only
        with tensor > 1 (read it after `validate`, which resolves tensor = -1) and sequence
        parallelism off; then on unless `scatter_gather` is false."""
        if self.tensor <= 1 or self.sequence_parallel:
            return False
        return self.scatter_gather is not False


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
    model.vocab_size is unset. Empty or `default` = the default corpus (this Python installation's
    standard-library sources), tokenized and cached on first use: with the run's tokenizer
    (data.tokenizer) when it has one, else with a BPE of data.tokenizer_vocab trained on it.
    A token file made by another tokenizer than data.tokenizer is refused."""
    tokenizer: str = ""
    """The model's tokenizer.json, for text in and out (scripts/generate.py --prompt, the text it
    prints): empty = the dataset's (the one its token file records, the default corpus's
    BPE); `none` = the model has none (ids only). scripts/convert_hf.py import sets it to the
    copy it makes in the run directory, or to `none`."""
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
    pipe_error_feedback: str = "none"
    """`none` (the default): what compression loses is dropped. `lazy` (Optimus-CC's lazy error
    propagation, as the authors' code runs it): a compressed send keeps what compression lost on
    its link and adds it to the next compressed send's gradient there; uncompressed sends
    neither add nor clear it (the buffers are training state, kept across steps and
    checkpointed). `lazy_flush`: the error also goes out with the next uncompressed send, which
    clears it. Measured (docs/compression.md): `lazy` lost quality on every seed (+1.1 to +2.0
    held-out loss at rank 8 on (1,4,1); +15.3% loss at rank 4 on (2,2,2), where `none` was
    +2.9%), `none` stayed within the noise floor, so `lazy` is kept only as the paper's option."""
    pipe_grad_phase: str = "epilogue"
    """`epilogue` (the paper's setting): only the backward transfers on the critical path of
    the schedule are compressed (`jaxmeg.pipeline.critical_path`; for 1F1B the sender's
    cool-down transfers and its last steady-state one); `all`: every backward transfer. With
    `all` a lazy error is pushed through the next microbatch's activations (measured: 2x the
    gradient error of `none`), so that combination warns (`LazyErrorOnEverySendWarning`)."""
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


ERROR_FEEDBACK = ("lazy", "lazy_flush", "none")
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
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)
    """Mixture-of-experts layers in place of the dense MLP (off: experts 0)."""

    @property
    def stacked_layers(self) -> int:
        """The entries of the layer stack, which the pipeline splits over stages: model.layers
        but the dense leading ones of an MoE model (`moe.dense_layers`), which run with the
        embedding, in units of `moe.layers_per_unit` layers (`moe.every`, or `moe.pattern`'s)."""
        return (self.model.layers - self.moe.dense_layers) // self.moe.layers_per_unit

    @property
    def stacked_layers_field(self) -> str:
        """How errors name `stacked_layers`."""
        if self.moe.experts and self.moe.pattern:
            return f"moe.pattern's stack entries (units of {self.moe.layers_per_unit} layers)"
        name = "model.layers - moe.first_dense" if self.moe.dense_layers else "model.layers"
        if self.moe.layers_per_unit > 1:
            return f"({name}) / moe.every (layer groups)"
        return name


SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "compression": CompressionConfig,
    "moe": MoeConfig,
}


def padded_vocab_size(model: ModelConfig, tensor: int) -> int:
    """Vocabulary rounded up to a multiple of `vocab_multiple * tensor` (Megatron's padding)."""
    multiple = model.vocab_multiple * tensor
    return -(-model.vocab_size // multiple) * multiple
