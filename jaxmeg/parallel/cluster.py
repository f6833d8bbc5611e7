"""Cluster descriptions (configs/clusters/*.yaml): groups of nodes by NIC type, and their links.

A cluster is a list of node groups in the order pipeline stages are laid out on them, each with
its node count, GPUs per node, GPU kind (a configs/hardware profile), NIC type and bandwidth,
optional host names and NCCL settings; and the links between groups. Holmes (Yang et al., 2024)
trains over such clusters: nodes behind different NICs cannot speak RDMA to each other, so the
only traffic that crosses groups should be pipeline sends.

    name: holmes_ib_roce
    groups:
      - {name: ib, nodes: 4, gpus_per_node: 8, gpu: a100_dgx, nic: infiniband, nic_gbps: 200,
         nics_per_node: 8}
      - {name: roce, nodes: 4, gpus_per_node: 8, gpu: a100_dgx, nic: roce, nic_gbps: 200,
         nics_per_node: 8}
    links:
      - {groups: [ib, roce], nic: ethernet, gbps: 25}

Which group a process is in, first match wins: the variable JAXMEG_NODE_GROUP (a group name);
this node's name in a group's `hosts` (`node[01-04]` ranges as SLURM writes them); the node's
position in the job (SLURM_NODEID, else the process id when there is one process per node),
counted through the groups in file order. A node's name is JAXMEG_NODE_NAME, else the host name
(scripts/launch_local.sh names each local process a node of its own).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from pathlib import Path

import yaml

from jaxmeg.config import ConfigError
from jaxmeg.shipped import find_shipped, shipped_dir, shipped_names

CLUSTER_DIR = shipped_dir("clusters")
NIC_TYPES = ("infiniband", "roce", "ethernet")
"""NIC types a group or link may name. RDMA (InfiniBand, RoCE) works only inside one type."""

NCCL_DEFAULTS = {
    "infiniband": {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "0"},
    "roce": {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3"},
    "ethernet": {"NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1"},
}
"""NCCL environment per NIC type, before a group's `nccl` overrides: verbs transport on
InfiniBand; on RoCE also the GID index of RoCE v2 (3 on most Mellanox setups); sockets on plain
Ethernet. `NCCL_IB_HCA` and `NCCL_SOCKET_IFNAME` name local devices, so only the file sets them."""


class ClusterError(ConfigError):
    """A cluster file is malformed, or the job does not fit it."""


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    name: str
    nodes: int
    gpus_per_node: int
    gpu: str
    """configs/hardware profile of the group's GPUs (peak, memory, NVLink)."""
    nic: str
    nic_gbps: float
    """Bandwidth of one NIC port, Gb/s."""
    nics_per_node: int = 1
    hosts: tuple[str, ...] = ()
    """Host names of the group's nodes, ranges expanded; empty = not listed."""
    nccl: tuple[tuple[str, str], ...] = ()
    """NCCL variables that override the NIC type's defaults, as (name, value) pairs."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node_gb_per_s(self) -> float:
        """A node's network bandwidth per direction, GB/s."""
        return self.nic_gbps * self.nics_per_node / 8

    def nccl_environment(self) -> dict[str, str]:
        return {**NCCL_DEFAULTS[self.nic], **dict(self.nccl)}


@dataclasses.dataclass(frozen=True)
class Link:
    groups: tuple[str, str]
    nic: str
    gbps: float
    """Bandwidth per node pair, Gb/s."""
    latency_us: float = 50.0


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[NodeGroup, ...]
    links: tuple[Link, ...] = ()

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    def group(self, name: str) -> NodeGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise ClusterError(
            f"cluster {self.name!r} has no node group {name!r}; groups: {self.group_names}"
        )

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def link(self, a: str, b: str) -> Link:
        """The link between groups a and b (a != b)."""
        for link in self.links:
            if set(link.groups) == {a, b}:
                return link
        raise ClusterError(f"cluster {self.name!r} has no link between groups {a!r} and {b!r}")

    def node_groups(self) -> list[str]:
        """The group of each node, by node position (file order)."""
        return [g.name for g in self.groups for _ in range(g.nodes)]

    def group_of_host(self, host: str) -> str | None:
        short = host.split(".")[0]
        for g in self.groups:
            if host in g.hosts or short in g.hosts:
                return g.name
        return None


def expand_hosts(spec: str) -> list[str]:
    """`node[01-03,7]` -> node01 node02 node03 node7 (SLURM's host-list notation, one bracket)."""
    match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", spec)
    if not match:
        return [spec]
    prefix, ranges, suffix = match.groups()
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not high:
            names.append(f"{prefix}{low}{suffix}")
            continue
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ClusterError(f"host range {spec!r}: {part!r} is not a range like 01-04")
        names += [f"{prefix}{i:0{len(low)}d}{suffix}" for i in range(int(low), int(high) + 1)]
    return names


def _number(where: str, raw: dict, key: str, kind=int, default=None, minimum=1):
    value = raw.get(key, default)
    if value is None:
        raise ClusterError(f"{where}: missing `{key}`")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where}: `{key}` must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise ClusterError(f"{where}: `{key}` must be an integer, got {value!r}")
    if value < minimum:
        raise ClusterError(f"{where}: `{key}` must be >= {minimum}, got {value!r}")
    return kind(value)


def _nic(where: str, value) -> str:
    if value not in NIC_TYPES:
        raise ClusterError(f"{where}: unknown NIC type {value!r}; known: {list(NIC_TYPES)}")
    return value


def _known_keys(where: str, raw, known: set[str]) -> None:
    if not isinstance(raw, dict):
        raise ClusterError(f"{where} must be a mapping, got {raw!r}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ClusterError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")


_GROUP_KEYS = {"name", "nodes", "gpus_per_node", "gpu", "nic", "nic_gbps", "nics_per_node",
               "hosts", "nccl"}  # fmt: skip


def _group(where: str, raw: dict) -> NodeGroup:
    from jaxmeg.perf.hardware import load_hardware

    _known_keys(where, raw, _GROUP_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ClusterError(f"{where}: every group needs a `name`")
    where = f"{where} ({name})"
    gpu = raw.get("gpu")
    try:
        load_hardware(str(gpu))
    except ValueError as err:
        raise ClusterError(f"{where}: `gpu`: {err}") from None
    hosts = [h for spec in raw.get("hosts", []) or [] for h in expand_hosts(str(spec))]
    group = NodeGroup(
        name=name,
        nodes=_number(where, raw, "nodes"),
        gpus_per_node=_number(where, raw, "gpus_per_node"),
        gpu=str(gpu),
        nic=_nic(where, raw.get("nic")),
        nic_gbps=_number(where, raw, "nic_gbps", float, minimum=1e-9),
        nics_per_node=_number(where, raw, "nics_per_node", default=1),
        hosts=tuple(hosts),
        nccl=tuple((str(k), str(v)) for k, v in (raw.get("nccl") or {}).items()),
    )
    if hosts and len(hosts) != group.nodes:
        raise ClusterError(f"{where}: {len(hosts)} hosts listed for {group.nodes} nodes")
    return group


def _link(where: str, raw: dict, names: list[str]) -> Link:
    _known_keys(where, raw, {"groups", "nic", "gbps", "latency_us"})
    pair = raw.get("groups")
    if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
        raise ClusterError(f"{where}: `groups` must name two different groups, got {pair!r}")
    for name in pair:
        if name not in names:
            raise ClusterError(f"{where}: unknown group {name!r}; groups: {names}")
    return Link(
        groups=(pair[0], pair[1]),
        nic=_nic(where, raw.get("nic")),
        gbps=_number(where, raw, "gbps", float, minimum=1e-9),
        latency_us=_number(where, raw, "latency_us", float, default=50.0, minimum=0),
    )


def from_dict(raw: dict, source: str = "cluster") -> Cluster:
    _known_keys(source, raw, {"name", "description", "groups", "links"})
    groups_raw = raw.get("groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ClusterError(f"{source}: `groups` must be a non-empty list")
    groups = tuple(_group(f"{source}: groups[{i}]", g) for i, g in enumerate(groups_raw))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ClusterError(f"{source}: group names repeat: {names}")
    hosts = [h for g in groups for h in g.hosts]
    repeated = sorted({h for h in hosts if hosts.count(h) > 1})
    if repeated:
        raise ClusterError(f"{source}: hosts listed in more than one group: {repeated}")
    links = tuple(
        _link(f"{source}: links[{i}]", link, names) for i, link in enumerate(raw.get("links") or [])
    )
    cluster = Cluster(str(raw.get("name", source)), groups, links)
    for a, b in zip(names, names[1:], strict=False):
        if not any(set(link.groups) == {a, b} for link in links):
            raise ClusterError(
                f"{source}: no link between neighbouring groups {a!r} and {b!r} (pipeline "
                f"stages cross from one to the next); add one to `links`"
            )
    return cluster


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A cluster file by path, or by name from configs/clusters/."""
    path = find_shipped("clusters", name_or_path)
    if path is None:
        known = shipped_names("clusters")
        raise ClusterError(f"cluster file {str(name_or_path)!r} does not exist; shipped: {known}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ClusterError(f"{path}: not valid YAML: {err}") from None
    return from_dict(raw, str(path))


def node_name(env=None) -> str:
    """This process's node: JAXMEG_NODE_NAME, else the host name."""
    env = os.environ if env is None else env
    return env.get("JAXMEG_NODE_NAME") or socket.gethostname()


def group_of_this_node(
    cluster: Cluster,
    process_id: int = 0,
    num_processes: int = 1,
    env: dict | None = None,
    host: str | None = None,
) -> tuple[str, str]:
    """(group name, how it was found) for the node this process runs on."""
    env = os.environ if env is None else env
    host = node_name(env) if host is None else host
    if env.get("JAXMEG_NODE_GROUP"):
        return cluster.group(env["JAXMEG_NODE_GROUP"]).name, "JAXMEG_NODE_GROUP"
    listed = any(g.hosts for g in cluster.groups)
    if listed:
        found = cluster.group_of_host(host)
        if found is None:
            raise ClusterError(
                f"host {host!r} is in no group of cluster {cluster.name!r} (listed hosts: "
                f"{[h for g in cluster.groups for h in g.hosts]}); add it to a group's `hosts` "
                f"or set JAXMEG_NODE_GROUP"
            )
        return found, f"host {host}"
    by_node = cluster.node_groups()
    if "SLURM_NODEID" in env:
        position, source = int(env["SLURM_NODEID"]), "SLURM_NODEID"
    elif num_processes == cluster.nodes:
        position, source = process_id, "process id"
    elif num_processes == 1:
        return cluster.groups[0].name, "single process"
    else:
        raise ClusterError(
            f"cannot tell which group of cluster {cluster.name!r} this process's node is in: "
            f"{num_processes} processes for {cluster.nodes} nodes, no host names in the file, "
            f"no SLURM_NODEID; set JAXMEG_NODE_GROUP"
        )
    if not 0 <= position < len(by_node):
        raise ClusterError(
            f"node position {position} ({source}) is outside cluster {cluster.name!r}, which "
            f"has {len(by_node)} nodes"
        )
    return by_node[position], source


def apply_nccl_environment(group: NodeGroup, env: dict | None = None) -> dict[str, str]:
    """Sets this process's NCCL variables for its group's NIC; returns what was set. Must run
    before the GPU backend starts: NCCL reads them once, for every communicator of the process."""
    env = os.environ if env is None else env
    settings = group.nccl_environment()
    env.update(settings)
    return settings
