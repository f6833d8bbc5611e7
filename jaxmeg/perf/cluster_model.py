"""Performance model of a 3D-parallel GPT step on a cluster of node groups with different NICs
(Holmes: Yang et al., 2024, "Towards Distributed Training Across Clusters with Heterogeneous NIC
Environment"), built on `jaxmeg.perf.model`'s per-layer times and ring collectives.

Assumptions:
- A stage runs at its group's GPU profile (configs/hardware), tensor groups inside a host on
  NVLink; a stage spread over several groups runs at its slowest GPU.
- Between the hosts of one group a GPU gets its node's network (`nic_gbps x nics_per_node`)
  shared by the node's GPUs, which all run their collectives at once, times the profile's
  collective efficiency; Ethernet NICs (sockets) have at least SOCKET_LATENCY_US per step.
- Nodes of different groups reach each other only over the cluster's links (no RDMA across NIC
  types): a link's bandwidth is per node pair, shared by the GPUs of a host that use it at once.
  A ring or a pipeline moves at the pace of its slowest hop, so a data-parallel group that spans
  two NIC types runs at the link's speed (Holmes' argument against NIC-blind placement).
- Step = max_s ((m + p - 1) c_s + r_s + o_s) + p2p + shared, where c_s is stage s's forward
  and backward of one microbatch (its layers at its group's speed, the embedding on the first
  stage, the LM head on the last): m of them and the p - 1 slots of 1F1B's fill and drain,
  paced by the slowest stage; r_s its layers' data-parallel reduction over its data group after
  the flush; o_s its optimizer step; p2p 2 (m + p - 1) sends at the slowest boundary (as
  `model.step_time`); shared jaxmeg's one all-reduce of the embedding and head gradients over
  pipe x data at that ring's slowest hop. Nothing overlaps compute (as `jaxmeg.perf.model`).
  On one group this is `model.step_time` (the data-parallel traffic split in two rings).
- The partition (`stage_costs` -> `jaxmeg.perf.partition.balance`) minimises the first term,
  the only one a partition changes, so the chosen split is never slower than the even one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Sequence

from jaxmeg.config import Config, ModelConfig
from jaxmeg.parallel.cluster import Cluster, ClusterError
from jaxmeg.parallel.placement import DeviceRecord, Placement, cluster_records, place
from jaxmeg.perf.collectives import data_parallel_collectives
from jaxmeg.perf.hardware import Hardware, load_hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import (
    Shape,
    flops_per_iteration,
    hardware_link,
    layer_parameters_per_gpu,
    layer_seconds,
    leading_dense_seconds,
    logits_seconds,
    optimizer_seconds,
    pipe_message_seconds,
    shape_of,
    shared_parameters_per_gpu,
)
from jaxmeg.perf.partition import StageCost, balance

Link = tuple[float, float]
"""(achievable GB/s per GPU, latency us), as `jaxmeg.perf.model` links."""
SOCKET_LATENCY_US = 50.0
"""Latency of one collective step over TCP sockets (as configs/hardware/a100_ethernet.yaml)."""
EMBEDDING_BYTES_PER_TOKEN_ELEMENT = 14
"""HBM bytes per s b h element of the embedding: the forward gathers rows (2 read, 2 written),
the backward reads the cotangent (2) and adds it into fp32 table rows (4 read, 4 written)."""


@functools.cache
def group_hardware(cluster: Cluster, name: str) -> Hardware:
    """The GPU profile of group `name` with its node's GPU count and network: per GPU, the
    node's NIC bandwidth over its GPUs."""
    group = cluster.group(name)
    hw = load_hardware(group.gpu)
    latency = hw.inter_node_latency_us
    if group.nic == "ethernet":
        latency = max(latency, SOCKET_LATENCY_US)
    return dataclasses.replace(
        hw,
        gpus_per_node=group.gpus_per_node,
        inter_node_gb_per_s=group.node_gb_per_s / group.gpus_per_node,
        inter_node_latency_us=latency,
    )


def _slowest(links: Sequence[Link]) -> Link:
    return min(links, key=lambda link: (link[0], -link[1]))


def cross_link(cluster: Cluster, groups: Sequence[str], sharing: int) -> Link:
    """The link a hop between `groups` takes, per GPU when `sharing` GPUs of a host use it at
    once: the slowest link between any two of them (the slowest of the cluster when two have
    none, the traffic then going through others)."""
    names = sorted(set(groups))
    links = []
    for a, b in itertools.combinations(names, 2):
        try:
            links.append(cluster.link(a, b))
        except ClusterError:
            links = list(cluster.links)
            break
    if not links:
        raise ClusterError(f"cluster {cluster.name!r} has no link between groups {names}")
    link = min(links, key=lambda k: k.gbps)
    efficiency = min(group_hardware(cluster, n).collective_efficiency for n in names)
    return link.gbps / 8 * efficiency / max(sharing, 1), link.latency_us


def one_transport(cluster: Cluster) -> bool:
    """Whether one NCCL configuration for every process (Megatron-LM's: one environment for the
    job) must give up RDMA: the groups' NICs differ, and RDMA fabrics of different types
    cannot reach each other, so inter-node traffic runs over what every node shares."""
    return len({g.nic for g in cluster.groups}) > 1


def shared_transport_link(cluster: Cluster, sharing: int) -> Link:
    """An inter-node hop under one transport for the whole job: sockets over the Ethernet every
    node shares (the cluster's links between groups: the slowest, per node pair, shared by
    `sharing` GPUs of a host), at least SOCKET_LATENCY_US per step."""
    gb_per_s, latency = cross_link(cluster, cluster.group_names, sharing)
    return gb_per_s, max(latency, SOCKET_LATENCY_US)


def members_link(
    cluster: Cluster, members: Sequence[DeviceRecord], sharing: int, shared: bool = False
) -> Link:
    """The slowest hop among `members` (a ring or a send pair): NVLink inside one host, the
    group's NIC inside one group, else the link between their groups; with `shared` (one
    transport for the job, `one_transport`) every hop between hosts is `shared_transport_link`."""
    groups = {r.group for r in members}
    if shared and len({r.host for r in members}) > 1:
        return shared_transport_link(cluster, sharing)
    if len(groups) > 1:
        return cross_link(cluster, sorted(groups), sharing)
    hw = group_hardware(cluster, next(iter(groups)))
    return hardware_link(hw, inside_node=len({r.host for r in members}) == 1)


def _busiest_host(records: Sequence[DeviceRecord]) -> int:
    """Devices of the host with the most among `records` (how many share its link)."""
    return max(collections.Counter(r.host for r in records).values(), default=1)


@dataclasses.dataclass(frozen=True)
class PlacementLinks:
    data: tuple[Link, ...]
    """Per stage, its data-parallel rings' slowest hop."""
    boundaries: tuple[Link, ...]
    """Per boundary s -> s + 1, the slowest send pair's link."""
    shared: Link
    """The slowest hop of the pipe x data rings that reduce the embedding and head."""


def placement_links(cluster: Cluster, placement: Placement, shared: bool = False) -> PlacementLinks:
    """The links a placement's collectives and sends take (grid [data, pipe, tensor]); with
    `shared`, under one transport for the job (`members_link`)."""
    by_id = {r.id: r for r in placement.records}
    grid = placement.grid
    d, p, t = grid.shape
    rings = [[[by_id[int(i)] for i in grid[:, s, c]] for c in range(t)] for s in range(p)]
    crossing = [
        r for stage in rings for ring in stage if len({x.group for x in ring}) > 1 for r in ring
    ]
    sharing = _busiest_host(crossing)
    if shared:  # every ring between hosts takes the shared network at once
        sharing = _busiest_host(
            [
                r
                for stage in rings
                for ring in stage
                if len({x.host for x in ring}) > 1
                for r in ring
            ]
        )
    data = tuple(
        _slowest([members_link(cluster, ring, sharing, shared) for ring in stage])
        for stage in rings
    )
    boundaries = []
    for s in range(p - 1):
        pairs = [
            (by_id[int(grid[a, s, c])], by_id[int(grid[a, s + 1, c])])
            for a in range(d)
            for c in range(t)
        ]
        crosses = (lambda x, y: x.host != y.host) if shared else (lambda x, y: x.group != y.group)
        senders = _busiest_host([x for x, y in pairs if crosses(x, y)])
        boundaries.append(
            _slowest([members_link(cluster, pair, senders, shared) for pair in pairs])
        )
    shared_rings = [[by_id[int(i)] for i in grid[:, :, c].ravel()] for c in range(t)]
    everyone = _busiest_host(placement.records)  # every GPU reduces them at once
    return PlacementLinks(
        data,
        tuple(boundaries),
        _slowest([members_link(cluster, ring, everyone, shared) for ring in shared_rings]),
    )


def assumed_data_links(
    cluster: Cluster, stage_groups: Sequence[str], data: int, tensor: int
) -> list[Link]:
    """Data-parallel links without a placement, as `place(mode="auto")` lays a stage out: its
    d t devices consecutive in one group, so inside a host when they fit one (d t dividing the
    node); a stage over several groups ('a+b') has rings that span them, at the link's speed."""
    links = []
    for joined in stage_groups:
        names = joined.split("+")
        if len(names) > 1:
            sharing = max(cluster.group(n).gpus_per_node for n in names)
            links.append(cross_link(cluster, names, sharing))
            continue
        group = cluster.group(names[0])
        inside = group.gpus_per_node % (data * tensor) == 0
        links.append(hardware_link(group_hardware(cluster, group.name), inside))
    return links


def pipeline_slots(layout: Layout) -> int:
    """m + p - 1: the microbatch slots of a one-chunk pipeline, fill and drain included (m (1 +
    bubble) for gpipe, 1f1b and breadth_first)."""
    return layout.microbatches + layout.pipe - 1


@dataclasses.dataclass(frozen=True)
class StageTimes:
    groups: tuple[str, ...]
    layer_compute: float
    """One layer's forward and backward (recompute included) for one microbatch."""
    fixed_compute: float
    """Per microbatch: the embedding (first stage), the LM head (last stage)."""
    layer_after_flush: float
    """One layer's gradient collectives over the stage's data group (bandwidth part) and its
    optimizer step."""
    fixed_after_flush: float
    """Once per step: those collectives' latency, the shared parameters' optimizer step."""

    def microbatch(self, layers: int) -> float:
        """c_s: one microbatch's forward and backward through the stage."""
        return self.fixed_compute + layers * self.layer_compute

    def cost(self, slots: int) -> StageCost:
        """`slots` c_s + r_s + o_s as a function of the stage's layers (slots = m + p - 1)."""
        return StageCost(
            per_layer_s=slots * self.layer_compute + self.layer_after_flush,
            fixed_s=slots * self.fixed_compute + self.fixed_after_flush,
        )


def embedding_seconds(shape: Shape, layout: Layout, hw: Hardware) -> float:
    """The embedding's forward and backward for one microbatch, memory bound."""
    elements = shape.seq_len * layout.microbatch * shape.hidden
    return EMBEDDING_BYTES_PER_TOKEN_ELEMENT * elements / (hw.hbm_tb_per_s * 1e12)


def stage_times(
    shape: Shape,
    cluster: Cluster,
    layout: Layout,
    stage_groups: Sequence[str],
    data_links: Sequence[Link],
) -> list[StageTimes]:
    """Per stage, its compute and optimizer step at its group's speed (the slowest of its
    groups) and its reduction over `data_links`."""
    p = len(stage_groups)
    params = layer_parameters_per_gpu(shape, layout)
    shared = shared_parameters_per_gpu(shape, layout.tensor)
    out = []
    for s, (joined, link) in enumerate(zip(stage_groups, data_links, strict=True)):
        names = tuple(joined.split("+"))
        layer = fixed = update = shared_update = 0.0
        for hw in (group_hardware(cluster, n) for n in names):
            ls = layer_seconds(shape, layout, hw)
            layer = max(layer, ls.forward + ls.backward + ls.recompute(layout.recompute))
            head = 3 * logits_seconds(shape, layout, hw) if s == p - 1 else 0.0
            embed = 0.0
            if s == 0:  # the embedding, and the dense leading layers run with it
                embed = embedding_seconds(shape, layout, hw)
                embed += sum(leading_dense_seconds(shape, layout, hw))
            fixed = max(fixed, head + embed)
            update = max(update, optimizer_seconds(params, layout, hw))
            shared_update = max(shared_update, optimizer_seconds(shared, layout, hw))
        # A layer's bytes at the link's bandwidth; the collectives' latency once per step.
        bandwidth_only = (link[0], 0.0)
        reduce = sum(
            c.seconds(layout.data, bandwidth_only)
            for c in data_parallel_collectives(params, params, layout)
        )
        latency = sum(
            c.seconds(layout.data, link) for c in data_parallel_collectives(0.0, 0.0, layout)
        )
        out.append(StageTimes(names, layer, fixed, reduce + update, latency + shared_update))
    return out


def _shape_and_recompute(model, recompute: str | None) -> tuple[Shape, str]:
    if isinstance(model, ModelConfig):
        return shape_of(model), recompute or model.remat
    return model, recompute or "full"


def stage_costs(
    model: ModelConfig | Shape,
    cluster: Cluster,
    stage_groups: Sequence[str],
    data: int,
    tensor: int,
    microbatches: int,
    microbatch_size: int,
    *,
    recompute: str | None = None,
    sequence_parallel: bool = False,
    zero_stage: int = 0,
    schedule: str = "1f1b",
    placement: Placement | None = None,
    expert: int = 1,
) -> list[StageCost]:
    """Each stage's cost for `jaxmeg.perf.partition.balance`: per layer, (m + p - 1) x one
    layer's forward + backward on its group's GPU at tensor t (m microbatches and the fill and
    drain slots), plus one layer's gradient reduction over its data group and its optimizer
    step; fixed, (m + p - 1) x the embedding (first stage) and the LM head (last), plus the
    reduction's latency and the embedding's optimizer step. `stage_groups`: each stage's node
    group (`Placement.stage_groups()`, 'a+b' for a stage over two). `recompute`: default the
    config's `model.remat`, or `full` for a Shape. With `placement` the data links come from
    its device grid, else as `place(mode="auto")` lays stages out (`assumed_data_links`).
    `expert`: the expert ranks of an MoE model (a Shape with experts): a GPU holds 1/e of the
    experts and of the microbatch's rows."""
    shape, recompute = _shape_and_recompute(model, recompute)
    layout = Layout(
        tensor=tensor,
        pipe=len(stage_groups),
        data=data,
        expert=expert,
        microbatch=microbatch_size // expert,
        microbatches=microbatches,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        zero_stage=zero_stage,
        schedule=schedule,
    )
    if placement is not None:
        if list(placement.stage_groups()) != list(stage_groups):
            raise ValueError(
                f"stage_costs: stage_groups {list(stage_groups)} differ from the placement's "
                f"{placement.stage_groups()}"
            )
        links = placement_links(cluster, placement).data
    else:
        links = assumed_data_links(cluster, stage_groups, data, tensor)
    times = stage_times(shape, cluster, layout, stage_groups, links)
    return [st.cost(pipeline_slots(layout)) for st in times]


def stage_costs_for_config(
    cfg: Config, cluster: Cluster, stage_groups: Sequence[str], placement: Placement | None = None
) -> list[StageCost]:
    """`stage_costs` for a validated config (parallel sizes and train.microbatches /
    microbatch_size resolved, model.vocab_size set)."""
    par, train = cfg.parallel, cfg.train
    if par.chunks != 1:
        raise ValueError(f"stage costs need one chunk per stage, got parallel.chunks={par.chunks}")
    if len(stage_groups) != par.pipe:
        raise ValueError(
            f"{len(stage_groups)} stage groups for parallel.pipe = {par.pipe}: {list(stage_groups)}"
        )
    return stage_costs(
        shape_of(cfg.model, cfg.moe),
        cluster,
        stage_groups,
        par.data,
        par.tensor,
        train.microbatches,
        train.microbatch_size,
        recompute=cfg.model.remat,
        sequence_parallel=par.sequence_parallel,
        zero_stage=par.zero_stage,
        schedule=par.schedule,
        placement=placement,
        expert=par.expert,
    )


# ---------------------------------------------------------------------------------------------
# Step time of a layout, a placement and a partition


@dataclasses.dataclass(frozen=True)
class ClusterStepTime:
    placement: str
    stage_groups: tuple[str, ...]
    stage_layers: tuple[int, ...]
    microbatch_seconds: tuple[float, ...]
    """c_s per stage."""
    stage_seconds: tuple[float, ...]
    """(m + p - 1) c_s + r_s + o_s per stage (what the partition balances)."""
    p2p: float
    shared: float
    """The embedding and head gradients' all-reduce over pipe x data."""
    flops: float
    """Model FLOPs per step (eq. 3, recompute counted when the run recomputes)."""
    gpus: int

    @property
    def total(self) -> float:
        return max(self.stage_seconds) + self.p2p + self.shared

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / self.total / self.gpus / 1e12


def even_stage_layers(layers: int, pipe: int) -> tuple[int, ...]:
    """Megatron's split: l / p each, the first stages one more when p does not divide l."""
    return balance([StageCost(1.0)] * pipe, layers)


PLACEMENTS = ("auto", "megatron", "megatron_per_group")
"""`auto`: jaxmeg's NIC-aware placement, per-group NCCL transports and the self-adapting
partition (Holmes). `megatron`: Megatron-LM as it runs there: its rank order, the even split,
and one NCCL configuration for the job, so with NICs of different types every inter-node hop
goes over sockets on the shared Ethernet (`one_transport`). `megatron_per_group`: Megatron's
order and split with Holmes's per-group transports."""


def cluster_step_time(
    shape: Shape, cluster: Cluster, layout: Layout, placement: str = "auto"
) -> ClusterStepTime:
    """Step time of `layout` on the whole `cluster` under `placement` (`PLACEMENTS`). Layers per
    stage: `layout.stage_layers` when set, else `balance` of `stage_costs` for `auto` and the
    even split for Megatron's. One chunk per stage (uneven stages need it)."""
    if layout.chunks != 1:
        raise ValueError(f"the cluster model takes one chunk per stage, got {layout.chunks}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    d, p, t, slots = layout.data, layout.pipe, layout.tensor, pipeline_slots(layout)
    mode = "auto" if placement == "auto" else "megatron"
    placed = place(cluster_records(cluster), cluster.group_names, d, p, t, mode, layout.outer_axis)
    groups = placed.stage_groups()
    links = placement_links(cluster, placed, placement == "megatron" and one_transport(cluster))
    times = stage_times(shape, cluster, layout, groups, links.data)
    stage_layers = tuple(layout.stage_layers)
    if not stage_layers:
        stage_layers = (
            balance([st.cost(slots) for st in times], shape.stacked_layers)
            if placement == "auto"
            else even_stage_layers(shape.stacked_layers, p)
        )
    layout = dataclasses.replace(layout, stage_layers=stage_layers)
    micro = [st.microbatch(n) for st, n in zip(times, stage_layers, strict=True)]
    p2p = 0.0
    if p > 1:
        sends = [
            pipe_message_seconds(shape, layout, group_hardware(cluster, st.groups[0]), link)
            for st, link in zip(times[1:], links.boundaries, strict=True)
        ]
        p2p = 2 * slots * max(sends)  # one send each way per slot
    shared_params = shared_parameters_per_gpu(shape, t)
    shared = sum(
        c.seconds(d * p, links.shared)
        for c in data_parallel_collectives(shared_params, shared_params, layout)
    )
    return ClusterStepTime(
        placement=placement,
        stage_groups=tuple(groups),
        stage_layers=stage_layers,
        microbatch_seconds=tuple(micro),
        stage_seconds=tuple(
            st.cost(slots).seconds(n) for st, n in zip(times, stage_layers, strict=True)
        ),
        p2p=p2p,
        shared=shared,
        flops=flops_per_iteration(shape, layout.global_batch, layout.recompute == "full"),
        gpus=layout.gpus,
    )
