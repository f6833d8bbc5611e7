"""The planner on a cluster of node groups (`scripts/plan.py --cluster FILE`): every (t, p, d,
b, recompute) that the NIC-aware placement can lay out and that fits in memory, with its
self-adapting partition, ranked by predicted step time, next to the same layout under Megatron's
NIC-blind placement and even split (`jaxmeg.perf.cluster_model`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from jaxmeg.parallel.cluster import Cluster
from jaxmeg.perf.cluster_model import (
    ClusterStepTime,
    cluster_step_time,
    group_hardware,
    one_transport,
)
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.memory import memory_per_gpu
from jaxmeg.perf.model import Shape
from jaxmeg.perf.planner import MICROBATCH_SIZES, check_inputs


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    layout: Layout
    """Without stage_layers; each placement's partition is in its step time."""
    auto: ClusterStepTime
    megatron: ClusterStepTime
    """Megatron-LM as it runs on the cluster: its order, even split, one transport."""
    megatron_per_group: ClusterStepTime
    """Megatron's order and split with per-group NCCL transports (Holmes's)."""
    memory_per_gpu_gb: float
    """The busiest stage's, under the auto partition."""
    one_transport: bool = False
    """Whether `megatron` runs over one shared transport (`cluster_model.one_transport`)."""

    @staticmethod
    def _figures(lay: Layout, step: ClusterStepTime) -> dict:
        return {
            "tensor": lay.tensor,
            "pipe": lay.pipe,
            "data": lay.data,
            "placement": step.placement,
            "stage_layers": list(step.stage_layers),
            "stage_groups": list(step.stage_groups),
            "tflops_per_gpu": round(step.tflops_per_gpu, 2),
            "step_time_s": round(step.total, 4),
        }

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            **self._figures(lay, self.auto),
            "microbatch": lay.microbatch,
            "microbatches": lay.microbatches,
            "recompute": lay.recompute,
            "memory_per_gpu_gb": round(self.memory_per_gpu_gb, 2),
            "megatron": self._figures(lay, self.megatron),
            "megatron_per_group": self._figures(lay, self.megatron_per_group),
            "megatron_transport": (
                "sockets over the shared Ethernet for every inter-node hop (one NCCL "
                "configuration; the groups' RDMA NICs differ)"
                if self.one_transport
                else "each group's NIC (one NIC type: one configuration serves all)"
            ),
        }


def cluster_layouts(
    shape: Shape,
    cluster: Cluster,
    batch: int,
    *,
    tensor: int | None = None,
    pipe: int | None = None,
    microbatch: int | None = None,
    recompute: tuple[str, ...] = ("full", "selective"),
    sequence_parallel: bool = False,
    outer_axis: str = "pipe",
) -> Iterator[Layout]:
    """Layouts of the whole cluster that the NIC-aware placement can lay out: t dividing the
    heads and every group's node, d t dividing every group's GPUs (whole stages per group), p
    (their sum) at most the layers; b and m as `planner.candidate_layouts`; one chunk."""
    node = math.gcd(*(g.gpus_per_node for g in cluster.groups))
    group_gpus = [g.gpus for g in cluster.groups]
    tensors = (
        [tensor]
        if tensor
        else [t for t in range(1, node + 1) if node % t == 0 and shape.heads % t == 0]
    )
    for t in tensors:
        for d in range(1, cluster.gpus // t + 1):
            if any(n % (d * t) for n in group_gpus):
                continue
            p = cluster.gpus // (d * t)
            if p > shape.stacked_layers or (pipe and p != pipe):
                continue
            for b in [microbatch] if microbatch else MICROBATCH_SIZES:
                if batch % (d * b):
                    continue
                for r in recompute:
                    yield Layout(
                        tensor=t,
                        pipe=p,
                        data=d,
                        microbatch=b,
                        microbatches=batch // (d * b),
                        recompute=r,
                        sequence_parallel=sequence_parallel,
                        outer_axis=outer_axis,
                    )


def evaluate(shape: Shape, cluster: Cluster, layout: Layout) -> ClusterPlan:
    auto = cluster_step_time(shape, cluster, layout, "auto")
    megatron = cluster_step_time(shape, cluster, layout, "megatron")
    per_group = cluster_step_time(shape, cluster, layout, "megatron_per_group")
    hw = min((group_hardware(cluster, g.name) for g in cluster.groups), key=lambda h: h.memory_gb)
    partitioned = dataclasses.replace(layout, stage_layers=auto.stage_layers)
    memory = memory_per_gpu(shape, partitioned, hw).total / 1e9
    return ClusterPlan(layout, auto, megatron, per_group, memory, one_transport(cluster))


def plan_cluster(shape: Shape, cluster: Cluster, batch: int, **pins) -> list[ClusterPlan]:
    """Plans that fit in the smallest GPU memory of the cluster, fastest (auto) first."""
    check_inputs(shape, cluster.gpus, batch, **pins)
    memory = min(group_hardware(cluster, g.name).memory_gb for g in cluster.groups)
    plans = []
    for layout in cluster_layouts(shape, cluster, batch, **pins):
        plan = evaluate(shape, cluster, layout)
        if plan.memory_per_gpu_gb <= memory:
            plans.append(plan)
    return sorted(plans, key=lambda p: (p.auto.total, p.layout.tensor * p.layout.pipe))
