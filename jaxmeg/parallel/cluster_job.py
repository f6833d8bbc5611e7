"""A job on a cluster file: each process's node group, found before the backend starts and
exchanged at start-up, and the device records that `jaxmeg.parallel.placement` lays out.

Start-up order (scripts/train.py): `ClusterJob.start` finds this process's group and sets its
NCCL environment (NCCL reads it once, when the first communicator is made, so this must precede
any GPU work); `jax.distributed.initialize` joins the processes; `ClusterJob.exchange` shares
every process's (host, group) through the coordinator's key-value store, which needs no device
computation, so no communicator exists before every process has its NCCL settings.
"""

from __future__ import annotations

import dataclasses
import json

import jax

from jaxmeg.parallel.cluster import (
    Cluster,
    ClusterError,
    apply_nccl_environment,
    group_of_this_node,
    node_name,
)
from jaxmeg.parallel.placement import DeviceRecord, cluster_records

EXCHANGE_TIMEOUT_MS = 120_000


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    cluster: Cluster
    group: str
    """This process's node group."""
    source: str
    """How the group was found (JAXMEG_NODE_GROUP, host name, SLURM_NODEID, process id)."""
    nccl: dict
    """The NCCL variables this process set."""
    processes: tuple[tuple[str, str], ...] = ()
    """(host, group) of every process, by process index; filled by `exchange`."""

    @classmethod
    def start(
        cls, cluster: Cluster, process_id: int = 0, num_processes: int = 1, env=None
    ) -> ClusterJob:
        group, source = group_of_this_node(cluster, process_id, num_processes, env)
        nccl = apply_nccl_environment(cluster.group(group), env)
        return cls(cluster, group, source, nccl)

    def exchange(self) -> ClusterJob:
        """Every process's (host, group), shared through jax.distributed's key-value store."""
        mine = (node_name(), self.group)
        if jax.process_count() == 1:
            return dataclasses.replace(self, processes=(mine,))
        from jax._src.distributed import global_state  # the coordinator's key-value store

        client = global_state.client
        client.key_value_set(f"jaxmeg/node_group/{jax.process_index()}", json.dumps(mine))
        processes = tuple(
            tuple(json.loads(client.blocking_key_value_get(f"jaxmeg/node_group/{i}",
                                                           EXCHANGE_TIMEOUT_MS)))
            for i in range(jax.process_count())
        )  # fmt: skip
        return dataclasses.replace(self, processes=processes)

    def device_records(self, devices=None) -> list[DeviceRecord]:
        """A record per device in jax's order (process, id). One process holding the whole
        cluster (simulated devices) is split into the file's nodes in order; otherwise a device
        takes its process's host and group. Raises ClusterError when the devices do not fill the
        cluster exactly, group by group."""
        devices = sorted(jax.devices() if devices is None else devices,
                         key=lambda d: (d.process_index, d.id))  # fmt: skip
        cluster = self.cluster
        if len(devices) != cluster.gpus:
            raise ClusterError(
                f"cluster {cluster.name!r} has {cluster.gpus} GPUs ("
                + " + ".join(f"{g.name} {g.nodes} x {g.gpus_per_node}" for g in cluster.groups)
                + f"), but the job has {len(devices)} devices"
            )
        processes = self.processes or ((node_name(), self.group),)
        if len(processes) == 1 and cluster.nodes > 1:
            return cluster_records(cluster, [d.id for d in devices])
        records = [DeviceRecord(d.id, *processes[d.process_index]) for d in devices]
        for g in cluster.groups:
            found = sum(r.group == g.name for r in records)
            if found != g.gpus:
                raise ClusterError(
                    f"node group {g.name!r} of cluster {cluster.name!r} has {g.gpus} GPUs "
                    f"({g.nodes} x {g.gpus_per_node}), but {found} devices are in it"
                )
        return records

    def describe(self) -> str:
        """Which process is in which group and the NCCL variables each group's processes set."""
        lines = [f"cluster {self.cluster.name}: this process in {self.group} (from {self.source})"]
        for g in self.cluster.groups:
            members = [f"{i} ({node})" for i, (node, name) in enumerate(self.processes)
                       if name == g.name]  # fmt: skip
            settings = " ".join(f"{k}={v}" for k, v in g.nccl_environment().items())
            who = f"processes {', '.join(members)}" if members else "no process"
            if len(self.processes) == 1 and self.cluster.nodes > 1:
                who = "simulated by the one process"
            lines.append(f"  {g.name} ({g.nic}): {who}; {settings}")
        return "\n".join(lines)
