"""Pipeline-aware communication compression in the performance model (Optimus-CC: Song et al.,
2023, "Optimus-CC: Efficient Large NLP Model Training with 3D Parallelism Aware Communication
Compression", ASPLOS): for each technique of jaxmeg's `compression` section
(`config.CompressionConfig`), the bytes per link per step, the compute it adds and its effect
on the step time of `jaxmeg.perf.model.step_time`.

Words as `jaxmeg.perf.model`; r a rank; elements of 2 bytes (the model's compute and wire
dtype), low-rank factors fp32 (4 bytes). A rank at or above a matrix's smaller side sends the
matrix whole (exact), as jaxmeg does.

pipe_grad       (`pipe_grad_rank`, `pipe_grad_phase`, `pipe_error_feedback`) The cotangent a
                stage sends back, one tensor rank's [n, h] matrix (n = b s, b s / t with
                sequence parallelism), goes as P [n, r] and Q [h, r]: 4 r (n + h) bytes instead
                of 2 n h, split over t like the dense message (`model.pipe_message_seconds`);
                per compressed transfer the sender runs one power iteration (two matmuls and
                the QR of both factors), the receiver rebuilds P Q^T, and lazy error feedback
                adds the sender's rebuild and an fp32 add and subtract over n h (no bytes; an
                fp32 [n, h] buffer per chunk, beside each link's Q [h, r]). Counts:
                `all` every backward transfer, m v per link (m (v - 1) on the wrap-around link
                from stage 0 to p - 1); `epilogue` those of
                `jaxmeg.pipeline.critical_path.exposed_backward_sends` (the executor's ticks from
                the step's last forward on; p - s - 1 on the link from stage s + 1 to s for
                1F1B). Time: the executor runs in lockstep, so a tick's backward ppermute is
                shorter only when every send in it is compressed: of the model's m v + p - 1
                backward sends (`model.step_time`, every one on the critical path), the fraction
                of the table's sending ticks that are all compressed saves t_dense - t_comp
                each (t_comp with its compute); a tick mixing both sends both, t_comp more.
embedding_sync  (`fused_embedding_sync`) jaxmeg reduces the tied embedding/head and position
                gradients, S = V h / t + s h per GPU, in one all-reduce over pipe x data (every
                GPU, a ring of p d); fused, over {first, last stage} x data (a ring of 2 d),
                and since every jaxmeg stage keeps a replica of the shared params, the p - 2
                middle stages then receive the result, S each, in ceil(log2((p - 2) / 2 + 1))
                rounds of ppermute (`gradients.broadcast_rounds`). Megatron-LM's middle stages
                hold no embedding. Megatron-LM's own synchronisation, for comparison:
                the all-reduce of the word embedding V h / t between the first and last stage (a
                ring of 2; its data-parallel average rides in those stages' gradient reduction).
                Time: the change of that all-reduce (ring size, latency steps, link), plus
                the middle stages' rounds, each S over the pipeline's link.
data_grad       (`data_grad_rank`, `data_grad_stages`, `warmup_steps`) PowerSGD on the stage's
                layer gradients: each weight matrix [n, m] a tensor rank holds (QKV [h, 3h/t],
                attention output [h/t, h], fc1 [h, f/t], fc2 [f/t, h]) is reduced as two
                all-reduces of fp32 factors, P [n, r] and Q [m, r], in place of its share of
                the gradient collective (`collectives.data_parallel_collectives`); vectors and
                the shared parameters stay in that collective, whole. Compute per matrix: two
                matmuls, the QR of both factors, the rebuild P Q^T and the error feedback's
                fp32 add and subtract. Only stages < k compress (`data_grad_stages`): in 1F1B's
                cool-down stage s ends its backward s chunk-backwards before stage 0, so its
                reduction may run that much longer without delaying the step; the step waits
                for max(R_comp, R_dense - k b) where b is one chunk's backward of one
                microbatch (stage 0 has no slack, as the model's flush-then-reduce has none).
                ZeRO-3's per-use gathers are not modelled with it (ValueError).
                `warmup_steps` runs the first steps uncompressed; the figures here are the
                steady state's (average over a run of N steps: W dense steps, N - W compressed).

Step time with compression = `model.step_time(...).total` + each technique's change (negative
when it saves). The model counts every pipeline send as exposed (Megatron-LM's accounting, as
`model.step_time`); the executor's premise for `epilogue` is that sends in ticks with a forward
overlap it, in which case `all` would save no more than `epilogue` does here.
"""

from __future__ import annotations

import dataclasses

from jaxmeg.config import ERROR_FEEDBACK, PIPE_GRAD_PHASES, CompressionConfig, ConfigError
from jaxmeg.perf.compression_techniques import (  # noqa: F401 (FACTOR_BYTES .. phase_counts: re-exported)
    FACTOR_BYTES,
    TechniqueCost,
    data_grad_cost,
    embedding_sync_cost,
    fewest_stages,
    layer_matrices,
    matrix_bytes,
    phase_counts,
    pipe_grad_cost,
)
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import (
    Shape,
    StepTime,
    step_time,
)
from jaxmeg.pipeline import critical_path

MODES = ("off", "on", "auto")
"""`planner.plan(compression=...)`: none; every technique wherever it applies; each technique
where it predicts a saving (`choose`)."""
DEFAULT_RANK = 16
"""Rank `on` and `auto` give both low-rank techniques (`plan.py --compression-rank`)."""
AUTO_MIN_SAVING = 0.01
"""`auto` turns on a lossy technique (pipe_grad, data_grad) only where it saves at least this
fraction of the step; the exact fused embedding sync, wherever it saves anything."""


# ---------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass(frozen=True)
class CompressionCost:
    config: CompressionConfig
    pipe_grad: TechniqueCost
    embedding_sync: TechniqueCost
    data_grad: TechniqueCost
    base_step_s: float
    """`model.step_time(...).total`, nothing compressed."""

    @property
    def techniques(self) -> tuple[TechniqueCost, ...]:
        return (self.pipe_grad, self.embedding_sync, self.data_grad)

    @property
    def saved_s(self) -> float:
        return sum(t.saved_s for t in self.techniques)

    @property
    def step_s(self) -> float:
        return self.base_step_s - self.saved_s

    @property
    def on(self) -> list[str]:
        return [t.name for t in self.techniques if t.on]

    def as_dict(self) -> dict:
        return {
            "on": self.on,
            "config": dataclasses.asdict(self.config),
            "base_step_time_s": round(self.base_step_s, 4),
            "step_time_s": round(self.step_s, 4),
            "saved_s": round(self.saved_s, 4),
            **{t.name: t.as_dict() for t in self.techniques},
        }


# ---------------------------------------------------------------------------------------------
# The whole step, and the planner's choice


def check_section(comp: CompressionConfig, layout: Layout) -> None:
    """`config.ConfigError` naming a field of `comp` the model cannot take: a negative rank or
    warm-up, an unknown phase or error feedback, `data_grad_stages` neither -1 nor in [1, p].
    The model prices every technique, including those training does not run yet (the config's
    own checks say which); one that does not apply to the layout (pipe_grad with p = 1,
    data_grad with d = 1) is off."""
    for name in ("pipe_grad_rank", "data_grad_rank", "warmup_steps"):
        if getattr(comp, name) < 0:
            raise ConfigError(f"compression.{name} must be >= 0, got {getattr(comp, name)}")
    for name, value, choices in (
        ("pipe_error_feedback", comp.pipe_error_feedback, ERROR_FEEDBACK),
        ("pipe_grad_phase", comp.pipe_grad_phase, PIPE_GRAD_PHASES),
    ):
        if value not in choices:
            raise ConfigError(f"compression.{name} must be one of {list(choices)}, got {value!r}")
    if not -1 <= comp.data_grad_stages <= layout.pipe or comp.data_grad_stages == 0:
        raise ConfigError(
            f"compression.data_grad_stages must be -1 (all) or a stage count in [1, "
            f"pipe = {layout.pipe}], got {comp.data_grad_stages}"
        )
    if layout.context > 1 and (
        comp.pipe_grad_rank or comp.data_grad_rank or comp.fused_embedding_sync
    ):
        raise ConfigError(
            f"compression is priced without context parallelism (as training runs it), got "
            f"context = {layout.context}"
        )


def compression_cost(
    shape: Shape,
    layout: Layout,
    hw: Hardware,
    comp: CompressionConfig,
    timing: StepTime | None = None,
) -> CompressionCost:
    """Every technique's bytes, compute and saving for `comp` on `layout` (`check_section`),
    and the step time with them."""
    check_section(comp, layout)
    timing = timing or step_time(shape, layout, hw)
    return CompressionCost(
        comp,
        pipe_grad_cost(shape, layout, hw, comp),
        embedding_sync_cost(shape, layout, hw, comp),
        data_grad_cost(shape, layout, hw, comp, timing),
        timing.total,
    )


def check_mode(mode: str, rank: int, phase: str) -> None:
    """ValueError naming a bad `choose` argument."""
    if mode not in MODES:
        raise ValueError(f"compression must be one of {list(MODES)}, got {mode!r}")
    if rank < 1:
        raise ValueError(f"compression rank must be >= 1, got {rank}")
    if phase not in critical_path.PHASES:
        raise ValueError(
            f"pipe_grad_phase must be one of {list(critical_path.PHASES)}, got {phase!r}"
        )


def choose(
    shape: Shape,
    layout: Layout,
    hw: Hardware,
    mode: str,
    rank: int = DEFAULT_RANK,
    phase: str = "all",
    timing: StepTime | None = None,
) -> CompressionConfig:
    """The `compression` section `mode` gives `layout`: `off` none; `on` every technique that
    applies (pipe_grad at `rank` and `phase` with lazy error feedback and the fused sync where
    p > 1, PowerSGD at `rank` on every stage where d > 1 and no ZeRO-3); `auto` each of those
    where it saves: pipe_grad if it saves AUTO_MIN_SAVING of the step, the fused sync if it
    saves anything, PowerSGD on the fewest first stages k that give its best saving, if that
    is AUTO_MIN_SAVING of the step."""
    check_mode(mode, rank, phase)
    if mode == "off":
        return CompressionConfig()
    p, d = layout.pipe, layout.data
    pipe = {"pipe_grad_rank": rank, "pipe_grad_phase": phase} if p > 1 else {}
    fused = {"fused_embedding_sync": True} if p > 1 else {}
    data = {"data_grad_rank": rank} if d > 1 and layout.zero_stage != 3 else {}
    if mode == "on":
        return CompressionConfig(**pipe, **fused, **data)
    timing = timing or step_time(shape, layout, hw)
    floor = AUTO_MIN_SAVING * timing.total
    chosen: dict = {}
    if pipe and pipe_grad_cost(shape, layout, hw, CompressionConfig(**pipe)).saved_s >= floor:
        chosen |= pipe
    if fused and embedding_sync_cost(shape, layout, hw, CompressionConfig(**fused)).saved_s > 0:
        chosen |= fused
    if data:
        every = data_grad_cost(shape, layout, hw, CompressionConfig(**data), timing)
        if every.on and every.saved_s >= floor:
            chosen |= {**data, "data_grad_stages": fewest_stages(every, p)}
    return CompressionConfig(**chosen)
