"""Which device holds which (data, pipe, tensor) coordinate: Megatron's order or NIC-aware (Holmes).

Pure Python over device records (id, host, node group), so the rules are tested without devices.

`megatron`: devices in jax's order (process, id), `tensor` fastest, `parallel.outer_axis`
slowest; blind to NICs, so with mixed clusters a data-parallel group may span two NIC types.

`auto` (Holmes): the node groups in cluster order each take whole pipeline stages, n_k =
gpus_k / (data * tensor) of them, so stages run group by group; inside a group the devices go
host by host, `tensor` fastest. Then every tensor group sits in one host, every data-parallel
group (and so every gradient all-reduce) inside one node group, and only the pipeline sends
between the last stage of one group and the first of the next cross groups: boundaries * data *
tensor device pairs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmeg.config import PLACEMENTS, ConfigError


@dataclasses.dataclass(frozen=True)
class DeviceRecord:
    id: int
    host: str
    group: str
    """The node group (NIC type) of the device's host."""


@dataclasses.dataclass(frozen=True)
class Placement:
    mode: str
    grid: np.ndarray
    """Device ids, [data, pipe, tensor]."""
    records: tuple[DeviceRecord, ...]

    def _by_id(self) -> dict[int, DeviceRecord]:
        return {r.id: r for r in self.records}

    def stage_groups(self) -> list[str]:
        """Each stage's node group; stages spanning several groups get them joined by '+'."""
        by_id = self._by_id()
        out = []
        for s in range(self.grid.shape[1]):
            names = dict.fromkeys(by_id[int(i)].group for i in self.grid[:, s, :].ravel())
            out.append("+".join(names))
        return out

    def describe(self) -> str:
        """One line per run of stages on the same group(s), with their hosts."""
        by_id = self._by_id()
        groups = self.stage_groups()
        lines, start = [], 0
        for s in range(1, len(groups) + 1):
            if s == len(groups) or groups[s] != groups[start]:
                hosts = dict.fromkeys(by_id[int(i)].host for i in self.grid[:, start:s, :].ravel())
                stages = f"stage {start}" if s - start == 1 else f"stages {start}-{s - 1}"
                lines.append(f"  {stages}: {groups[start]} ({', '.join(hosts)})")
                start = s
        head = (
            f"placement {self.mode}: {self.grid.shape[1]} stages over {len(set(groups))} group(s)"
        )
        return "\n".join([head, *lines])


def _megatron_grid(ids: list[int], data: int, pipe: int, tensor: int, outer_axis: str):
    grid = np.array(ids, dtype=np.int64)
    if outer_axis == "pipe":
        return grid.reshape(pipe, data, tensor).transpose(1, 0, 2)
    return grid.reshape(data, pipe, tensor)


def megatron_grid(ids: list[int], data: int, pipe: int, tensor: int, outer_axis: str = "pipe"):
    """Megatron's device order over `ids` (already in process, id order): [data, pipe, tensor]."""
    return _megatron_grid(list(ids), data, pipe, tensor, outer_axis)


def _check_shape(records, data: int, pipe: int, tensor: int) -> None:
    if data * pipe * tensor != len(records):
        raise ConfigError(
            f"placement: data * pipe * tensor = {data} * {pipe} * {tensor} = "
            f"{data * pipe * tensor}, but there are {len(records)} devices"
        )


def _hosts_in_order(records) -> dict[str, list[DeviceRecord]]:
    hosts: dict[str, list[DeviceRecord]] = {}
    for r in records:
        hosts.setdefault(r.host, []).append(r)
    return hosts


def _check_hosts(records, tensor: int) -> None:
    for host, devices in _hosts_in_order(records).items():
        groups = sorted({r.group for r in devices})
        if len(groups) > 1:
            raise ConfigError(f"placement: host {host!r} is in several node groups: {groups}")
        if len(devices) % tensor:
            raise ConfigError(
                f"placement: host {host!r} has {len(devices)} devices, which do not split into "
                f"tensor groups of parallel.tensor = {tensor} inside one host"
            )


def auto_grid(
    records, order: list[str], data: int, pipe: int, tensor: int, outer_axis: str = "pipe"
) -> np.ndarray:
    """The Holmes placement: node groups in `order` take whole stages, group by group."""
    _check_shape(records, data, pipe, tensor)
    unknown = sorted({r.group for r in records} - set(order))
    if unknown:
        raise ConfigError(f"placement: devices in node groups {unknown}, which the cluster lacks")
    _check_hosts(records, tensor)
    per_stage = data * tensor
    blocks = []
    for name in order:
        members = [r for r in records if r.group == name]
        if not members:
            continue
        if len(members) % per_stage:
            raise ConfigError(
                f"placement: node group {name!r} has {len(members)} GPUs, which do not split "
                f"into whole pipeline stages of parallel.data * parallel.tensor = {data} * "
                f"{tensor} = {per_stage} GPUs"
            )
        ids = [r.id for devices in _hosts_in_order(members).values() for r in devices]
        blocks.append(_megatron_grid(ids, data, len(members) // per_stage, tensor, outer_axis))
    return np.concatenate(blocks, axis=1)


def place(
    records,
    order: list[str],
    data: int,
    pipe: int,
    tensor: int,
    mode: str = "auto",
    outer_axis: str = "pipe",
) -> Placement:
    """Assigns mesh coordinates to `records` (in jax's device order)."""
    records = tuple(records)
    if mode not in PLACEMENTS:
        raise ConfigError(f"parallel.placement must be one of {list(PLACEMENTS)}, got {mode!r}")
    if mode == "auto":
        grid = auto_grid(records, order, data, pipe, tensor, outer_axis)
    else:
        _check_shape(records, data, pipe, tensor)
        grid = megatron_grid([r.id for r in records], data, pipe, tensor, outer_axis)
    return Placement(mode, grid, records)


# Rules a placement can break, as counts (tests and the planner read them).


def tensor_groups_across_hosts(p: Placement) -> int:
    """Tensor groups whose devices sit on more than one host (Holmes and Megatron: 0)."""
    by_id = p._by_id()
    d, s, _ = p.grid.shape
    return sum(
        len({by_id[int(i)].host for i in p.grid[a, b, :]}) > 1 for a in range(d) for b in range(s)
    )


def data_groups_across_groups(p: Placement) -> int:
    """Data-parallel groups whose devices sit in more than one node group (Holmes: 0)."""
    by_id = p._by_id()
    _, s, t = p.grid.shape
    return sum(
        len({by_id[int(i)].group for i in p.grid[:, b, c]}) > 1 for b in range(s) for c in range(t)
    )


def cross_group_pipeline_edges(p: Placement) -> int:
    """Device pairs (stage s, stage s + 1) at the same (data, tensor) in different node groups."""
    by_id = p._by_id()
    group = np.vectorize(lambda i: by_id[int(i)].group)(p.grid)
    return int(np.sum(group[:, 1:, :] != group[:, :-1, :]))


def cluster_records(cluster, ids=None) -> list[DeviceRecord]:
    """One record per GPU of `cluster` (a `jaxmeg.parallel.cluster.Cluster`), nodes in file order,
    with device ids `ids` (default 0, 1, ...); hosts are the listed names or `<group><node>`.
    Stands in for a job that fills the cluster (the planner, simulated devices)."""
    ids = list(range(cluster.gpus) if ids is None else ids)
    records = []
    for g in cluster.groups:
        for node in range(g.nodes):
            host = g.hosts[node] if g.hosts else f"{g.name}{node}"
            records += [DeviceRecord(ids[len(records) + k], host, g.name)
                        for k in range(g.gpus_per_node)]  # fmt: skip
    return records
