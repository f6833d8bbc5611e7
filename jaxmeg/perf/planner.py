"""The parallel-configuration planner: every (t, p, c, e, d, v, b, recompute) that fits in memory,
ranked by predicted step time for a fixed global batch, with communication compression off, on
or where it saves (`compression`); and, per pipeline method, the layout that reaches a target
loss soonest at the critical batch (`shortest_time`, without context parallelism)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from jaxmeg.config import REMAT_POLICIES, CompressionConfig
from jaxmeg.perf.compression import (
    DEFAULT_RANK,
    CompressionCost,
    check_mode,
    choose,
    compression_cost,
)
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.memory import memory_per_gpu
from jaxmeg.perf.model import Shape, paper_training_days, step_time, tflops_per_gpu
from jaxmeg.perf.scaling import Target
from jaxmeg.perf.traffic import bytes_per_step
from jaxmeg.pipeline import schedules

MICROBATCH_SIZES = (1, 2, 4, 8)
MAX_CHUNKS = 8
MIN_CONTEXT_TOKENS = 2048
"""The fewest tokens of a sequence a context rank holds in the search (`context_sizes`): context
parallelism is searched for long sequences only, which keeps the search cheap (c = 1 alone up
to s = 2048, c up to 16 at s = 32768). A ring step's attention grows as (s / c)^2 and its send
as s / c; on the h100_dgx profile a step of 2048 tokens no longer hides its send over the
network (c t beyond a node), and smaller shares only shorten the GEMMs further."""


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout
    tflops_per_gpu: float
    percent_of_peak: float
    step_time_s: float
    memory_per_gpu_gb: float
    bubble: float
    bytes_per_step: dict
    training_days: float | None
    paper_days: float | None
    compression: CompressionCost | None = None
    """What compression turns on and saves; step time, TFLOP/s, days and the pipe and data
    bytes above are with it. None: compression off."""

    def as_dict(self) -> dict:
        lay = self.layout
        compression = (
            {} if self.compression is None else {"compression": self.compression.as_dict()}
        )
        return {
            "tensor": lay.tensor,
            "pipe": lay.pipe,
            "context": lay.context,
            "expert": lay.expert,
            "expert_exchange": lay.expert_exchange,
            "exchange_kept_bound": lay.exchange_kept_bound,
            "data": lay.data,
            "chunks": lay.chunks,
            "microbatch": lay.microbatch,
            "microbatches": lay.microbatches,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "outer_axis": lay.outer_axis,
            "zero_stage": lay.zero_stage,
            "tflops_per_gpu": round(self.tflops_per_gpu, 2),
            "percent_of_peak": round(self.percent_of_peak, 2),
            "step_time_s": round(self.step_time_s, 4),
            "memory_per_gpu_gb": round(self.memory_per_gpu_gb, 2),
            "bubble": round(self.bubble, 4),
            "tensor_bytes_per_step": self.bytes_per_step["tensor"],
            "pipe_bytes_per_step": self.bytes_per_step["pipe"],
            "data_bytes_per_step": self.bytes_per_step["data"],
            "context_bytes_per_step": self.bytes_per_step["context"],
            "context_bytes_per_layer": self.bytes_per_step["context_per_layer"],
            "expert_bytes_per_step": self.bytes_per_step["expert"],
            "training_days": None if self.training_days is None else round(self.training_days, 2),
            "paper_estimate_days": None if self.paper_days is None else round(self.paper_days, 2),
            **compression,
        }


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def expert_sizes(shape: Shape, expert: int | None = None) -> list[int]:
    """e the search tries: `expert` if pinned; 1 for a dense model; else every divisor of E
    (the experts split evenly over the expert ranks)."""
    if expert:
        return [expert]
    return _divisors(shape.experts.count) if shape.experts else [1]


def context_sizes(shape: Shape, context: int | None = None) -> list[int]:
    """c the search tries: `context` if pinned; else 1 and the powers of two whose 2c blocks
    split s evenly (`parallel.context`'s load balance) and leave each rank at least
    MIN_CONTEXT_TOKENS tokens."""
    if context:
        return [context]
    sizes, c = [1], 2
    while shape.seq_len % (2 * c) == 0 and shape.seq_len // c >= MIN_CONTEXT_TOKENS:
        sizes.append(c)
        c *= 2
    return sizes


def candidate_layouts(
    shape: Shape,
    gpus: int,
    batch: int,
    hw: Hardware,
    *,
    tensor: int | None = None,
    pipe: int | None = None,
    context: int | None = None,
    expert: int | None = None,
    expert_exchange: str = "bounded",
    chunks: int | None = None,
    microbatch: int | None = None,
    recompute: tuple[str, ...] = ("full", "selective"),
    sequence_parallel: bool = False,
    outer_axis: str = "pipe",
    zero_stage: int = 0,
    schedule: str | None = None,
    fp8: str = "none",
) -> Iterator[Layout]:
    """Every layout whose sizes divide the model, the GPUs and the batch; pinned values only.
    The schedule is Megatron's (1f1b, interleaved_1f1b with chunks), or `schedule` where its
    chunks allow (a zero-bubble schedule: zb_h1 at v = 1, interleaved_zb at v >= 2, zbv at 2;
    dualpipev at 2), or with `schedule` ANY every schedule that runs the layout.
    c over `context_sizes`; c > 1 as training runs it: s / c divisible by t, and no
    split-backward schedule. e over `expert_sizes` (an MoE model's); the batch splits over the
    d e replicas, b sequences per GPU."""
    # A tensor group stays inside a node and splits it evenly (t divides the GPUs per node).
    tensors = (
        [tensor] if tensor else [t for t in _divisors(shape.heads) if hw.gpus_per_node % t == 0]
    )
    for t, p, c, e in itertools.product(
        tensors, [pipe] if pipe else _divisors(shape.stacked_layers), context_sizes(shape, context),
        expert_sizes(shape, expert),
    ):  # fmt: skip
        if gpus % (t * p * c * e):
            continue
        if c > 1 and (shape.seq_len // c) % t:
            continue
        d = gpus // (t * p * c * e)
        for b in [microbatch] if microbatch else MICROBATCH_SIZES:
            if batch % (d * e * b):
                continue
            m = batch // (d * e * b)
            for v in [chunks] if chunks else _divisors(shape.stacked_layers // p):
                if v > MAX_CHUNKS and not chunks:
                    continue
                if (shape.stacked_layers % (p * v)) or (v > 1 and p == 1):
                    continue
                for name, r in itertools.product(_schedules_for(schedule, p, m, v, c), recompute):
                    yield Layout(
                        tensor=t, pipe=p, context=c, expert=e, expert_exchange=expert_exchange,
                        data=d, chunks=v, microbatch=b,
                        microbatches=m, recompute=r, sequence_parallel=sequence_parallel,
                        outer_axis=outer_axis, zero_stage=zero_stage, schedule=name, fp8=fp8,
                    )  # fmt: skip


ANY = "any"
"""`schedule` for the planner to price every schedule that runs a layout (`--schedule any`)."""


def _schedules_for(schedule: str | None, p: int, m: int, v: int, c: int = 1) -> list[str]:
    """The schedules a layout of p stages, m microbatches, v chunks and context c runs:
    Megatron's by default, `schedule` if given, every one with ANY; none where it cannot run
    (Megatron's interleaving needs m a multiple of p; a split backward no context)."""
    if p == 1:
        names = ["interleaved_1f1b" if v > 1 else "1f1b"]
    elif schedule == ANY:
        names = list(schedules.NAMES)
    else:
        names = [schedule or ("interleaved_1f1b" if v > 1 else "1f1b")]
    runs = []
    for name in names:
        if (c > 1 and schedules.splits_backward(name)) or (
            v == 1 and schedules.spec(name).interleaved
        ):
            continue
        try:
            schedules.check(name, p, m, v)
        except ValueError:
            continue
        runs.append(name)
    return runs


def evaluate(
    shape: Shape,
    layout: Layout,
    hw: Hardware,
    tokens: float | None = None,
    compression: CompressionConfig | None = None,
) -> Plan:
    """The plan of one layout; with `compression` (a `compression` section), its step time,
    TFLOP/s, days and pipe and data bytes are those of `jaxmeg.perf.compression`."""
    timing = step_time(shape, layout, hw)
    memory = memory_per_gpu(shape, layout, hw)
    traffic = bytes_per_step(shape, layout)
    cost, seconds = None, timing.total
    if compression is not None:
        cost = compression_cost(shape, layout, hw, compression, timing)
        seconds = cost.step_s
        traffic = {
            **traffic,
            "pipe": cost.pipe_grad.per_gpu_bytes[1],
            "data": cost.data_grad.per_gpu_bytes[1],
        }
    tflops = tflops_per_gpu(shape, layout, hw) * timing.total / seconds
    days = paper = None
    if tokens:
        steps = tokens / (layout.global_batch * shape.seq_len)
        days = steps * seconds / 86400
        paper = paper_training_days(shape, layout.gpus, tflops, tokens)
    return Plan(
        layout=layout,
        tflops_per_gpu=tflops,
        percent_of_peak=100 * tflops / hw.peak_tflops,
        step_time_s=seconds,
        memory_per_gpu_gb=memory.total / 1e9,
        bubble=timing.bubble,
        bytes_per_step=traffic,
        training_days=days,
        paper_days=paper,
        compression=cost,
    )


def check_inputs(shape: Shape, gpus: int, batch: int, **pins) -> None:
    """Raises ValueError naming the field and value of the first impossible input."""
    fields = {"gpus": gpus, "batch": batch, **{f"shape.{k}": v for k, v in vars(shape).items()}}
    fields.update({k: v for k, v in pins.items() if type(v) is int and k != "zero_stage"})
    for name, value in fields.items():
        if type(value) is int and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if shape.hidden % shape.heads:
        raise ValueError(f"hidden ({shape.hidden}) must be divisible by heads ({shape.heads})")
    if shape.kv_heads is not None and shape.heads % shape.kv_heads:
        raise ValueError(f"heads ({shape.heads}) must be divisible by kv_heads ({shape.kv_heads})")
    context = pins.get("context")
    if context and shape.seq_len % (2 * context):
        raise ValueError(
            f"context = {context} splits the sequence into {2 * context} blocks: seq_len "
            f"({shape.seq_len}) must be divisible by {2 * context}"
        )
    expert = pins.get("expert")
    if expert and expert > 1 and (shape.experts is None or shape.experts.count % expert):
        count = shape.experts.count if shape.experts else 0
        raise ValueError(
            f"expert = {expert} splits the experts over {expert} GPUs: the model's experts "
            f"({count}) must be divisible by it"
        )
    unknown = [r for r in pins.get("recompute", ()) if r not in REMAT_POLICIES]
    if unknown:
        raise ValueError(f"recompute must be among {list(REMAT_POLICIES)}, got {unknown}")


def plan(
    shape: Shape,
    gpus: int,
    batch: int,
    hw: Hardware,
    tokens: float | None = None,
    *,
    compression: str = "off",
    compression_rank: int = DEFAULT_RANK,
    pipe_grad_phase: str = "all",
    **pins,
) -> list[Plan]:
    """Plans that fit in memory, fastest step first (same global batch, so same tokens).
    `compression` off, on or auto, per layout (`jaxmeg.perf.compression.choose`) at
    `compression_rank`, the pipeline's transfers compressed by `pipe_grad_phase`; compression
    comes without context parallelism (as training runs it), so it searches c = 1 only."""
    check_inputs(shape, gpus, batch, **pins)
    check_mode(compression, compression_rank, pipe_grad_phase)
    if pins.get("fp8", "none") != "none" and not hw.fp8_peak_tflops:
        raise ValueError(f"--fp8 {pins['fp8']} needs FP8 GEMMs, which {hw.name} does not have")
    if compression != "off" and shape.experts:
        raise ValueError(
            f"compression is priced for dense models (jaxmeg does not run it with experts), "
            f"got {shape.experts.count} experts"
        )
    if compression != "off":
        if pins.get("context", 1) not in (None, 1):
            raise ValueError(
                f"compression is priced without context parallelism, got context = "
                f"{pins['context']}"
            )
        pins["context"] = 1
    plans = []
    for layout in _with_kept_bounds(shape, candidate_layouts(shape, gpus, batch, hw, **pins)):
        if memory_per_gpu(shape, layout, hw).total > hw.memory_gb * 1e9:
            continue  # timed for nothing (a split backward's builds its tick table)
        comp = None
        if compression != "off":
            comp = choose(shape, layout, hw, compression, compression_rank, pipe_grad_phase)
        plans.append(evaluate(shape, layout, hw, tokens, comp))
    return sorted(plans, key=lambda p: (p.step_time_s, _model_parallel(p.layout)))


RERUN_KEPT_BOUND = 1.0
"""The kept bound the planner also prices for a dropless exchange: buffers for the even load
only, so a balanced step reruns the exchange's forward in its backward (the memory of a rerun)."""


def _with_kept_bounds(shape: Shape, layouts: Iterator[Layout]) -> Iterator[Layout]:
    """Each layout; where it runs a dropless exchange (e > 1) with its kept bound named
    (`Layout.exchange_kept_bound`, the model's unless pinned) and also with `RERUN_KEPT_BOUND`:
    keeping the exchange's residuals costs memory a layout may not have, rerunning costs time."""
    x = shape.experts
    for layout in layouts:
        if x is None or x.capacity_factor or layout.expert == 1:
            yield layout
            continue
        kept = layout.exchange_kept_bound or x.exchange_kept_bound
        yield dataclasses.replace(layout, exchange_kept_bound=kept)
        if kept != RERUN_KEPT_BOUND:
            yield dataclasses.replace(layout, exchange_kept_bound=RERUN_KEPT_BOUND)


def _model_parallel(layout: Layout) -> int:
    """t p c e: the GPUs one model copy spans; of two equally fast plans the one with fewer."""
    return layout.tensor * layout.pipe * layout.context * layout.expert


# ---------------------------------------------------------------------------------------------
# Shortest training time to a target (Lamy-Poirier, 2021, section 6)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    schedule: str
    """Pipeline schedule (`parallel.schedule`); runs of one stage and one chunk are plain."""
    zero_stage: int
    """`Layout.zero_stage`."""


METHODS = (
    Method("1f1b", "1f1b", 0),
    Method("interleaved_1f1b", "interleaved_1f1b", 0),
    Method("interleaved_1f1b+zero1", "interleaved_1f1b", 1),
    Method("breadth_first+zero1", "breadth_first", 1),
    Method("breadth_first+zero3", "breadth_first", 3),
)
"""Depth-first Megatron (Narayanan et al., 2021) without and with a sharded optimizer, and
breadth-first modular pipelines (Lamy-Poirier, 2021) with ZeRO stages 1 and 3."""

BATCH_WINDOW = 2.0
"""A layout's batch d m b must lie within this factor of the critical batch."""


@dataclasses.dataclass(frozen=True)
class FastestRun:
    method: Method
    plan: Plan
    steps: float
    """S = S_min (1 + B_crit / B) (`scaling.Target.steps`)."""
    tokens: float
    """E = E_min (1 + B / B_crit)."""

    @property
    def days(self) -> float:
        return self.steps * self.plan.step_time_s / 86400

    def as_dict(self) -> dict:
        return {
            "method": self.method.name,
            "schedule": self.method.schedule,
            "zero_stage": self.plan.layout.zero_stage,
            "days": round(self.days, 3),
            "gpus": self.plan.layout.gpus,
            "batch": self.plan.layout.global_batch,
            "steps": round(self.steps),
            "tokens": float(f"{self.tokens:.4g}"),
            **self.plan.as_dict(),
        }


def _data_sizes(limit: int) -> list[int]:
    """2^k and 3 x 2^k up to `limit`, and `limit` itself."""
    sizes = {limit} | {f << k for f in (1, 3) for k in range(limit.bit_length()) if f << k <= limit}
    return sorted(sizes)


def _chunk_options(method: Method, stage_layers: int, pipe: int) -> list[int]:
    """v: 1 for 1f1b; 2 .. MAX_CHUNKS dividing l / p for interleaved; every divisor of l / p
    for breadth-first, up to one layer per chunk (modular pipeline parallelism)."""
    spec = schedules.spec(method.schedule)
    if not spec.chunked:
        return [1]
    if spec.interleaved:
        most = min(spec.max_chunks or MAX_CHUNKS, MAX_CHUNKS)
        chunks = [v for v in _divisors(stage_layers) if max(2, spec.min_chunks) <= v <= most]
        return chunks if pipe > 1 else []
    return _divisors(stage_layers)


def _microbatches(method: Method, target_batch: float, d: int, b: int, p: int, v: int) -> int:
    """m nearest target_batch / (d b): a multiple of p for interleaved, at least p for
    breadth-first with chunks (below it every stage stalls before each chunk)."""
    spec = schedules.spec(method.schedule)
    step = p if spec.microbatches == "multiple_of_stages" else 1
    m = max(step, step * round(target_batch / (d * b * step)))
    if spec.layered and v > 1:
        m = max(m, p)
    if spec.microbatches == "twice_stages":
        m = max(m, 2 * p)
    return m


def shortest_time_layouts(
    shape: Shape, max_gpus: int, target: Target, hw: Hardware, method: Method,
    *, recompute: tuple[str, ...] = ("full", "selective"), sequence_parallel: bool = False,
    outer_axis: str = "pipe",
) -> Iterator[Layout]:  # fmt: skip
    """Layouts of up to `max_gpus` GPUs for `method` whose batch d m b lies within
    BATCH_WINDOW of the critical batch: t dividing the heads and a node, p the layers, d over
    `_data_sizes`, b in MICROBATCH_SIZES, v per `_chunk_options`, m per `_microbatches`."""
    target_batch = target.critical_batch_tokens / shape.seq_len
    for t in [t for t in _divisors(shape.heads) if hw.gpus_per_node % t == 0]:
        for p in _divisors(shape.stacked_layers):
            if t * p > max_gpus:
                continue
            for d in _data_sizes(max_gpus // (t * p)):
                for b in MICROBATCH_SIZES:
                    if d * b > BATCH_WINDOW * target_batch:
                        continue
                    for v in _chunk_options(method, shape.stacked_layers // p, p):
                        m = _microbatches(method, target_batch, d, b, p, v)
                        if not 1 / BATCH_WINDOW <= d * m * b / target_batch <= BATCH_WINDOW:
                            continue
                        schedule = method.schedule if p > 1 or v > 1 else "1f1b"
                        for r in recompute:
                            yield Layout(
                                tensor=t, pipe=p, data=d, chunks=v, microbatch=b,
                                microbatches=m, recompute=r, sequence_parallel=sequence_parallel,
                                outer_axis=outer_axis, schedule=schedule,
                                zero_stage=method.zero_stage,
                            )  # fmt: skip


def shortest_time(
    shape: Shape, max_gpus: int, target: Target, hw: Hardware,
    methods: tuple[Method, ...] = METHODS, **options,
) -> list[FastestRun]:  # fmt: skip
    """Per method, the layout that reaches `target` soonest: the least S(B) x step time over
    the layouts that fit in memory, S(B) = S_min (1 + B_crit / B) for B = d m b s tokens
    (`scaling`). A method with no fitting layout is left out."""
    check_inputs(shape, max_gpus, 1)
    runs = []
    for method in methods:
        best, best_seconds = None, float("inf")
        for layout in shortest_time_layouts(shape, max_gpus, target, hw, method, **options):
            if memory_per_gpu(shape, layout, hw).total > hw.memory_gb * 1e9:
                continue
            batch_tokens = layout.global_batch * shape.seq_len
            seconds = target.steps(batch_tokens) * step_time(shape, layout, hw).total
            if seconds < best_seconds:
                best, best_seconds = layout, seconds
        if best is not None:
            batch_tokens = best.global_batch * shape.seq_len
            runs.append(FastestRun(method, evaluate(shape, best, hw), target.steps(batch_tokens),
                                   target.tokens(batch_tokens)))  # fmt: skip
    return runs
