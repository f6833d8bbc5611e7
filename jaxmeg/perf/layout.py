"""The layout the performance model prices: how many GPUs go to each mesh axis, the batching,
the schedule, recompute and ZeRO. Its own module so that `jaxmeg.perf.model` and
`jaxmeg.perf.collectives` both import it, and the model imports the collectives one way.

Words: t tensor, p pipe, c context, e expert, d data, v chunks, b microbatch, m microbatches per
replica (a replica: one of the d e groups that split the batch).
"""

from __future__ import annotations

import dataclasses

from jaxmeg.config import FP8_RECIPES, OUTER_AXES, REMAT_POLICIES, ZERO_STAGES
from jaxmeg.pipeline import schedules

EXPERT_EXCHANGES = ("bounded", "padded", "routed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    tensor: int
    pipe: int
    data: int
    context: int = 1
    """Context-parallel size c (`parallel.context`): each sequence split over c GPUs, which
    pass its keys and values around a ring for attention (`jaxmeg.perf.context`). The mesh
    axis sits between pipe and tensor: a context group is c consecutive tensor groups."""
    expert: int = 1
    """Expert-parallel size e (`parallel.expert`): each MoE layer's experts split over e GPUs,
    which are data-parallel replicas for every other weight (the batch splits over d e). The
    mesh axis sits between context and tensor (`jaxmeg.perf.experts`)."""
    expert_exchange: str = "bounded"
    """How tokens reach their experts' GPUs (one of `EXPERT_EXCHANGES`): `bounded`, jaxmeg's
    dropless all-to-all at the smallest bound the step's load fits (priced at a balanced load);
    `padded`, at its largest bound; `routed`, the routed rows only (a ragged all-to-all,
    `moe.exchange: ragged`, what jaxmeg runs on a GPU). See `jaxmeg.perf.experts`."""
    exchange_kept_bound: float | None = None
    """The largest bound whose residuals the dropless exchange keeps, as a multiple of the even
    load (`moe.exchange_kept_bound`); None = the model's (`Experts.exchange_kept_bound`). 1 keeps
    buffers for the even load only, so a balanced step (1.25x) reruns the exchange's forward in
    the backward: less memory, more time (`jaxmeg.perf.experts`)."""
    chunks: int = 1
    microbatch: int = 1
    """b, sequences of one microbatch on one GPU (`train.microbatch_size` / e)."""
    microbatches: int = 1
    recompute: str = "full"
    """What a layer keeps for its backward, one of `config.REMAT_POLICIES` (`model.remat`)."""
    pipe_scatter_gather: bool = True
    """Megatron splits each pipeline message over the t ranks of a tensor group, and so does
    jaxmeg's executor with `parallel.scatter_gather` (its default with tensor > 1)."""
    sequence_parallel: bool = False
    """Shard the residual stream on the sequence over `tensor` (Korthikanti et al., 2022); off
    in the Megatron-LM 2021 measurements. Pipeline messages are always scatter/gathered (/t)."""
    outer_axis: str = "pipe"
    """Which of pipe and data varies slowest over the GPUs (`parallel.outer_axis`), and so
    crosses nodes first."""
    schedule: str = "1f1b"
    """Pipeline schedule (`parallel.schedule`); `interleaved_1f1b` when chunks > 1."""
    warmup: str = "min_bubble"
    """1F1B warm-up (`parallel.pipeline_warmup`); sets how many inputs a stage keeps."""
    stage_layers: tuple[int, ...] = ()
    """Layers per stage (`parallel.stage_layers`); empty = the even split l / p."""
    zero_stage: int = 0
    """ZeRO sharding over the data group (Rajbhandari et al., 2020), one of `config.ZERO_STAGES`:
    0 none; 1 the fp32 master weights and Adam moments; 3 also the weights and gradients, the
    weights all-gathered per chunk per use and the gradients reduce-scattered. Modelled here
    only (jaxmeg's config has no such field)."""
    fp8: str = "none"
    """`model.fp8`: `current` and `delayed` price the linears' GEMMs at the GPU's FP8 peak, with
    the passes and (current only) the amax reductions on the way that scaling adds
    (`model.fp8_scaling_seconds`)."""

    def __post_init__(self) -> None:
        for name in ("context", "expert"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_exchange not in EXPERT_EXCHANGES:
            raise ValueError(
                f"expert_exchange must be one of {list(EXPERT_EXCHANGES)}, got "
                f"{self.expert_exchange!r}"
            )
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {list(FP8_RECIPES)}, got {self.fp8!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"zero_stage must be one of {list(ZERO_STAGES)}, got {self.zero_stage!r}"
            )
        if self.recompute not in REMAT_POLICIES:
            raise ValueError(
                f"recompute must be one of {list(REMAT_POLICIES)}, got {self.recompute!r}"
            )
        if self.outer_axis not in OUTER_AXES:
            raise ValueError(
                f"outer_axis must be one of {list(OUTER_AXES)}, got {self.outer_axis!r}"
            )
        if self.schedule not in schedules.NAMES or self.warmup not in schedules.WARMUPS:
            raise ValueError(
                f"schedule must be one of {list(schedules.NAMES)} and warmup one of "
                f"{list(schedules.WARMUPS)}, got {self.schedule!r} / {self.warmup!r}"
            )
        spec = schedules.SPECS[self.schedule]
        if self.pipe > 1 and (
            (self.chunks > 1 and not spec.chunked) or (spec.interleaved and self.chunks == 1)
        ):
            chunked = [n for n, row in schedules.SPECS.items() if row.chunked]
            single = [n for n, row in schedules.SPECS.items() if not row.interleaved]
            raise ValueError(
                f"chunks = {self.chunks} goes with schedule {', '.join(chunked)} (chunks > 1), "
                f"or {', '.join(single)} (chunks = 1), got {self.schedule!r}"
            )

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipe * self.context * self.expert * self.data

    @property
    def replicas(self) -> int:
        """d e: the groups that split the batch."""
        return self.data * self.expert

    @property
    def gradient_group(self) -> int:
        """d c e: the GPUs that hold the same dense parameters and reduce their gradients
        together (and share ZeRO's shards); they are replicated over context and expert as
        over data."""
        return self.data * self.context * self.expert

    @property
    def expert_gradient_group(self) -> int:
        """d c: the GPUs that hold the same experts (`jaxmeg.perf.experts`)."""
        return self.data * self.context

    @property
    def global_batch(self) -> int:
        return self.replicas * self.microbatches * self.microbatch


def config_layout(cfg) -> Layout:
    """The layout a run config asks for (`jaxmeg.config.Config`), as the planner prices it. A
    microbatch of `train.microbatch_size` rows splits over the expert ranks: b is each GPU's
    share. `moe.exchange: ragged` sends the routed rows (`routed`); otherwise the bounded
    exchange (`auto` as off a GPU: a caller that knows the devices settles it first)."""
    par = cfg.parallel
    return Layout(
        tensor=par.tensor, pipe=par.pipe, data=par.data, context=par.context,
        expert=par.expert, exchange_kept_bound=cfg.moe.exchange_kept_bound, chunks=par.chunks,
        expert_exchange="routed" if cfg.moe.exchange == "ragged" else "bounded",
        microbatch=cfg.train.microbatch_size // par.expert, microbatches=cfg.train.microbatches,
        recompute=cfg.model.remat, pipe_scatter_gather=par.uses_scatter_gather,
        sequence_parallel=bool(par.sequence_parallel),
        schedule=par.schedule if par.pipe > 1 else "1f1b", warmup=par.pipeline_warmup,
        stage_layers=tuple(par.stage_layers or ()), zero_stage=par.zero_stage,
        outer_axis=par.outer_axis,
    )  # fmt: skip
