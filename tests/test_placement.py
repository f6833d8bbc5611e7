"""NIC-aware placement (Holmes) over fake device records, cluster files and node-group discovery:
pure Python, no compile."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from jaxmeg.config import ConfigError
from jaxmeg.parallel import cluster as cl
from jaxmeg.parallel.cluster_job import ClusterJob
from jaxmeg.parallel.placement import (
    DeviceRecord,
    cluster_records,
    cross_group_pipeline_edges,
    data_groups_across_groups,
    place,
    tensor_groups_across_hosts,
)


def shuffled_records(seed: int, hosts: int = 4, per_host: int = 4) -> list[DeviceRecord]:
    """`hosts` hosts of `per_host` devices, half InfiniBand and half RoCE in random order."""
    types = ["ib", "roce"] * (hosts // 2)
    random.Random(seed).shuffle(types)
    return [
        DeviceRecord(i, f"h{i // per_host}", types[i // per_host]) for i in range(hosts * per_host)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_auto_keeps_tensor_in_host_data_in_one_nic_type(seed):
    records = shuffled_records(seed)
    p = place(records, ["ib", "roce"], data=2, pipe=2, tensor=4, mode="auto")
    assert sorted(p.grid.ravel().tolist()) == list(range(16))
    assert tensor_groups_across_hosts(p) == 0
    assert data_groups_across_groups(p) == 0
    assert cross_group_pipeline_edges(p) == 1 * 2 * 4  # boundaries * data * tensor
    assert p.stage_groups() == ["ib", "roce"]  # the cluster's order, whatever the hosts' order


@pytest.mark.parametrize("outer_axis", ["pipe", "data"])
@pytest.mark.parametrize("seed", [1, 3, 5])  # shuffles that process order does not line up
def test_megatron_order_breaks_the_data_group_rule(seed, outer_axis):
    records = shuffled_records(seed)  # the same input as the auto test above
    megatron = place(records, ["ib", "roce"], 2, 2, 4, mode="megatron", outer_axis=outer_axis)
    assert data_groups_across_groups(megatron) > 0
    assert tensor_groups_across_hosts(megatron) == 0
    auto = place(records, ["ib", "roce"], 2, 2, 4, mode="auto", outer_axis=outer_axis)
    assert data_groups_across_groups(auto) == 0


def test_three_groups_pipeline_crosses_only_between_neighbours():
    records = [DeviceRecord(i, f"h{i // 2}", ["eth", "ib", "roce"][i // 2 % 3]) for i in range(12)]
    p = place(records, ["ib", "roce", "eth"], data=2, pipe=3, tensor=2, mode="auto")
    assert p.stage_groups() == ["ib", "roce", "eth"]
    assert data_groups_across_groups(p) == 0
    assert cross_group_pipeline_edges(p) == 2 * 2 * 2


def test_groups_of_unequal_size_take_stages_in_proportion():
    records = [DeviceRecord(i, f"h{i // 4}", "ib" if i < 12 else "roce") for i in range(16)]
    p = place(records, ["ib", "roce"], data=1, pipe=4, tensor=4, mode="auto")
    assert p.stage_groups() == ["ib", "ib", "ib", "roce"]
    assert "stages 0-2: ib (h0, h1, h2)" in p.describe()


@pytest.mark.parametrize(
    "records, shape, message",
    [
        ([DeviceRecord(i, f"h{i // 4}", "ib" if i < 12 else "roce") for i in range(16)],
         (2, 2, 4), "node group 'ib' has 12 GPUs, which do not split into whole pipeline stages"),
        ([DeviceRecord(i, f"h{i // 2}", "ib" if i < 8 else "roce") for i in range(16)],
         (2, 2, 4), "host 'h0' has 2 devices, which do not split into tensor groups"),
        ([DeviceRecord(i, f"h{i // 4}", "ib" if i < 8 else "eth") for i in range(16)],
         (2, 2, 4), "node groups ['eth'], which the cluster lacks"),
        (shuffled_records(0), (2, 4, 4), "data * pipe * tensor = 2 * 4 * 4 = 32"),
    ],
)  # fmt: skip
def test_impossible_placements_are_named(records, shape, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        place(records, ["ib", "roce"], *shape, mode="auto")


LOCAL = {
    "name": "local",
    "groups": [
        {"name": "ib", "nodes": 1, "gpus_per_node": 4, "gpu": "a100_dgx", "nic": "infiniband",
         "nic_gbps": 200},
        {"name": "roce", "nodes": 1, "gpus_per_node": 4, "gpu": "a100_dgx", "nic": "roce",
         "nic_gbps": 200, "nccl": {"NCCL_IB_HCA": "mlx5_0"}},
    ],
    "links": [{"groups": ["ib", "roce"], "nic": "ethernet", "gbps": 25}],
}  # fmt: skip


def with_group(index: int, **changes) -> dict:
    raw = {**LOCAL, "groups": [dict(g) for g in LOCAL["groups"]]}
    raw["groups"][index].update(changes)
    return raw


@pytest.mark.parametrize(
    "raw, message",
    [
        (with_group(0, nic="omnipath"), "unknown NIC type 'omnipath'"),
        (with_group(1, gpu="tpu_v9"), r"groups\[1\] \(roce\): `gpu`: unknown hardware 'tpu_v9'"),
        (with_group(0, nodes=0), r"\(ib\): `nodes` must be >= 1, got 0"),
        (with_group(0, hosts=["a", "b"]), "2 hosts listed for 1 nodes"),
        ({**LOCAL, "links": []}, "no link between neighbouring groups 'ib' and 'roce'"),
        (with_group(0, name="roce"), "group names repeat"),
        (with_group(0, speed=3), r"unknown keys \['speed'\]"),
    ],
)
def test_bad_cluster_files_are_named(raw, message):
    with pytest.raises(cl.ClusterError, match=message):
        cl.from_dict(raw, "local.yaml")


def test_node_group_sources_in_order():
    local = cl.from_dict(LOCAL)
    named = cl.from_dict(with_group(0, hosts=["gpu01"]) | {})
    raw = with_group(0, hosts=["gpu[01-01]"])
    raw["groups"][1]["hosts"] = ["gpu02.cluster"]
    listed = cl.from_dict(raw)
    assert cl.group_of_this_node(local, env={"JAXMEG_NODE_GROUP": "roce"})[0] == "roce"
    assert cl.group_of_this_node(listed, env={}, host="gpu01.cluster.org")[0] == "ib"
    assert cl.group_of_this_node(local, env={"SLURM_NODEID": "1"})[0] == "roce"
    assert cl.group_of_this_node(local, 1, 2, env={}) == ("roce", "process id")
    with pytest.raises(cl.ClusterError, match="host 'elsewhere' is in no group"):
        cl.group_of_this_node(named, env={}, host="elsewhere")
    with pytest.raises(cl.ClusterError, match="no node group 'eth'"):
        cl.group_of_this_node(local, env={"JAXMEG_NODE_GROUP": "eth"})
    with pytest.raises(cl.ClusterError, match="3 processes for 2 nodes"):
        cl.group_of_this_node(local, 0, 3, env={})


def test_host_ranges_expand_like_slurm():
    assert cl.expand_hosts("node[01-03,7]") == ["node01", "node02", "node03", "node7"]
    assert cl.expand_hosts("login") == ["login"]


def test_nccl_environment_per_nic_type_with_overrides():
    local = cl.from_dict(LOCAL)
    env: dict[str, str] = {}
    job = ClusterJob.start(local, 1, 2, env=env)
    assert job.group == "roce"
    assert env == {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3",
                   "NCCL_IB_HCA": "mlx5_0"}  # fmt: skip
    ethernet = cl.from_dict(with_group(0, nic="ethernet", nccl={"NCCL_SOCKET_IFNAME": "eth0"}))
    env = {}
    ClusterJob.start(ethernet, 0, 2, env=env)
    assert env == {"NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}


class FakeDevice:
    def __init__(self, id: int, process_index: int):
        self.id, self.process_index = id, process_index


def test_device_records_from_processes_and_simulated_nodes():
    local = cl.from_dict(LOCAL)
    job = ClusterJob(local, "ib", "test", {}, processes=(("a", "roce"), ("b", "ib")))
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    records = job.device_records(devices)
    assert [r.group for r in records] == ["roce"] * 4 + ["ib"] * 4
    p = place(records, local.group_names, 2, 2, 2)
    assert p.stage_groups() == ["ib", "roce"]
    assert np.array_equal(np.sort(p.grid[:, 0, :].ravel()), [4, 5, 6, 7])  # process 1 first
    one_process = ClusterJob(local, "ib", "test", {}, processes=(("a", "ib"),))
    simulated = one_process.device_records([FakeDevice(i, 0) for i in range(8)])
    assert simulated == cluster_records(local)
    with pytest.raises(
        cl.ClusterError, match=r"has 8 GPUs \(ib 1 x 4 \+ roce 1 x 4\), but the job has 4"
    ):
        job.device_records(devices[:4])
    unbalanced = ClusterJob(local, "ib", "test", {}, processes=(("a", "ib"), ("b", "ib")))
    with pytest.raises(cl.ClusterError, match="node group 'ib' .* has 4 GPUs .* but 8 devices"):
        unbalanced.device_records(devices)
