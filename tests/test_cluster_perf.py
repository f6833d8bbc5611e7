"""Heterogeneous clusters in the performance model: the self-adapting partitioner against brute
force, stage costs by node group, the cluster files, and `plan.py --cluster`. Pure Python."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmeg import config
from jaxmeg.parallel.cluster import CLUSTER_DIR, from_dict, load_cluster
from jaxmeg.perf.cluster_model import (
    cluster_step_time,
    cross_link,
    group_hardware,
    placement_links,
    stage_costs,
    stage_costs_for_config,
)
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.model import hardware_link, shape_of, step_time
from jaxmeg.perf.partition import StageCost, balance, slowest

ROOT = Path(__file__).resolve().parent.parent
GPT_7_5B = shape_of(config.load(ROOT / "configs" / "megatron_7.5b.yaml").model)
SHIPPED = ("holmes_ib_roce", "ethernet", "three_groups", "ib_only", "roce_only", "local_2x4")


# ---------------------------------------------------------------------------------------------
# The partitioner


def _brute_force(costs, layers, min_layers):
    splits = [
        c
        for c in itertools.product(range(min_layers, layers + 1), repeat=len(costs))
        if sum(c) == layers
    ]
    return min(slowest(costs, split) for split in splits)


def test_balance_finds_the_least_slowest_stage_on_small_random_cases():
    rng = random.Random(0)
    for _ in range(400):
        stages = rng.randint(1, 4)
        min_layers = rng.choice([1, 1, 2])
        layers = rng.randint(min_layers * stages, 10)
        costs = [
            StageCost(
                rng.choice([0.0, rng.uniform(0.1, 3), rng.randint(1, 3)]),
                rng.choice([0.0, rng.uniform(0, 5)]),
            )
            for _ in range(stages)
        ]
        split = balance(costs, layers, min_layers)
        assert sum(split) == layers and min(split) >= min_layers
        assert slowest(costs, split) == pytest.approx(_brute_force(costs, layers, min_layers))


def test_balance_is_even_on_equal_stages_and_gives_ties_to_earlier_stages():
    assert balance([StageCost(1.0)] * 4, 36) == (9, 9, 9, 9)
    assert balance([StageCost(1.0)] * 2, 7) == (4, 3)
    assert balance([StageCost(1.0)] * 3, 8) == (3, 3, 2)
    # A stage twice as fast takes twice the layers; the head's fixed cost moves layers away.
    assert balance([StageCost(1.0), StageCost(2.0)], 12) == (8, 4)
    assert balance([StageCost(1.0), StageCost(1.0, fixed_s=2.0)], 12) == (7, 5)
    assert balance([StageCost(1.0), StageCost(1.0)], 12, min_layers=3) == (6, 6)


def test_balance_names_impossible_inputs():
    with pytest.raises(ValueError, match=r"5 layers cannot give each of 3 stages at least 2"):
        balance([StageCost(1.0)] * 3, 5, min_layers=2)
    with pytest.raises(ValueError, match="no stages"):
        balance([], 4)
    with pytest.raises(ValueError, match="stage 1 has a negative"):
        balance([StageCost(1.0), StageCost(-1.0)], 4)
    with pytest.raises(ValueError, match="3 stage layer counts for 2 stage costs"):
        slowest([StageCost(1.0)] * 2, [1, 1, 1])


# ---------------------------------------------------------------------------------------------
# Stage costs by node group


@pytest.mark.parametrize("order", [("ib", "ib", "roce", "roce"), ("roce", "roce", "ib", "ib")])
def test_faster_nic_group_gets_more_layers_on_the_holmes_setting(order):
    # t 8, d 2: each data group spans two nodes, so its gradients cross the group's NIC (IB:
    # 8 x 200 Gb/s per node, RoCE 4 x 200). Few microbatches, so the reduction matters.
    cluster = load_cluster("holmes_ib_roce")
    costs = stage_costs(
        GPT_7_5B, cluster, order, data=2, tensor=8, microbatches=2, microbatch_size=1
    )
    per_layer = {g: c.per_layer_s for g, c in zip(order, costs, strict=True)}
    assert per_layer["ib"] < per_layer["roce"]
    split = balance(costs, GPT_7_5B.layers)
    by_group = {
        g: sum(n for n, h in zip(split, order, strict=True) if h == g) for g in ("ib", "roce")
    }
    assert by_group["ib"] > by_group["roce"]
    # The middle two stages (no embedding, no head) differ only by their group.
    ib_middle, roce_middle = (split[1], split[2]) if order[1] == "ib" else (split[2], split[1])
    assert ib_middle > roce_middle


def test_stage_costs_for_a_validated_config():
    cfg = config.load(
        ROOT / "configs" / "megatron_7.5b.yaml",
        [
            "parallel.data=2",
            "parallel.tensor=8",
            "parallel.pipe=4",
            "train.global_batch=8",
            "train.microbatch_size=1",
        ],
    )
    cfg = config.validate(cfg, 64)
    groups = ["ib", "ib", "roce", "roce"]
    cluster = load_cluster("holmes_ib_roce")
    got = stage_costs_for_config(cfg, cluster, groups)
    want = stage_costs(
        cfg.model, cluster, groups, 2, 8, cfg.train.microbatches, 1, recompute=cfg.model.remat
    )
    assert got == want and len(got) == 4
    assert got[0].fixed_s < got[3].fixed_s  # the embedding is cheap, the head is not
    with pytest.raises(ValueError, match="3 stage groups for parallel.pipe = 4"):
        stage_costs_for_config(cfg, cluster, groups[:3])


def test_stage_costs_of_an_moe_config_price_its_experts():
    """An MoE config's stage costs are its Shape's, experts and expert ranks included (they
    were the dense model's): each GPU's MoE layers, its share of the experts' parameters."""
    cfg = config.load(
        ROOT / "configs" / "moe_tiny.yaml",
        ["parallel.pipe=2", "parallel.expert=2", "parallel.data=2", "model.vocab_size=4096"],
    )
    cfg = config.validate(cfg, 8)
    cluster, groups = load_cluster("holmes_ib_roce"), ["ib", "roce"]
    par, train = cfg.parallel, cfg.train
    got = stage_costs_for_config(cfg, cluster, groups)
    sizes = (par.data, par.tensor, train.microbatches, train.microbatch_size)
    want = stage_costs(shape_of(cfg.model, cfg.moe), cluster, groups, *sizes,
                       recompute=cfg.model.remat, expert=2)  # fmt: skip
    dense = stage_costs(cfg.model, cluster, groups, *sizes, recompute=cfg.model.remat)
    assert got == want
    assert all(g.per_layer_s != d.per_layer_s for g, d in zip(got, dense, strict=True))


def test_a_data_group_across_nic_types_runs_at_the_link_speed():
    # Megatron's order with data outermost puts IB and RoCE nodes in every data group; the
    # NIC-aware placement keeps each inside one group, on that group's NIC.
    cluster = load_cluster("holmes_ib_roce")
    layout = Layout(tensor=4, pipe=2, data=8, microbatches=64, outer_axis="data")
    from jaxmeg.parallel.placement import cluster_records, place

    for mode in ("auto", "megatron"):
        placed = place(cluster_records(cluster), ["ib", "roce"], 8, 2, 4, mode, "data")
        links = placement_links(cluster, placed)
        if mode == "auto":
            assert links.data == tuple(
                hardware_link(group_hardware(cluster, g), False) for g in ("ib", "roce")
            )
            assert links.boundaries == (cross_link(cluster, ["ib", "roce"], 8),)
        else:
            assert links.data == (cross_link(cluster, ["ib", "roce"], 8),) * 2
    auto = cluster_step_time(GPT_7_5B, cluster, layout, "auto")
    megatron = cluster_step_time(GPT_7_5B, cluster, layout, "megatron")
    assert megatron.stage_groups == ("ib+roce", "ib+roce") and megatron.stage_layers == (18, 18)
    assert auto.stage_groups == ("ib", "roce")
    assert megatron.total > 1.5 * auto.total


def test_one_group_cluster_agrees_with_the_single_profile_model():
    # ib_only is eight a100_dgx nodes (8 x 200 Gb/s each): the profile the model is checked on.
    cluster = load_cluster("ib_only")
    from jaxmeg.perf.hardware import load_hardware

    hw = load_hardware("a100_dgx")
    for t, p, d, b in [(8, 4, 2, 1), (4, 2, 8, 1), (2, 1, 32, 8)]:
        layout = Layout(tensor=t, pipe=p, data=d, microbatch=b, microbatches=512 // (d * b))
        ours = cluster_step_time(GPT_7_5B, cluster, layout, "megatron").total
        assert ours == pytest.approx(step_time(GPT_7_5B, layout, hw).total, rel=0.005)


# ---------------------------------------------------------------------------------------------
# Cluster files


def test_every_shipped_cluster_file_loads():
    shipped = sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))
    assert set(SHIPPED) <= set(shipped)
    for name in shipped:
        cluster = load_cluster(CLUSTER_DIR / f"{name}.yaml")
        assert cluster.name == name and cluster.gpus > 0
    holmes = load_cluster("holmes_ib_roce")
    assert holmes.group_names == ["ib", "roce"]
    assert [(g.nodes, g.gpus_per_node, g.gpu, g.nic) for g in holmes.groups] == [
        (4, 8, "a100_dgx", "infiniband"),
        (4, 8, "a100_dgx", "roce"),
    ]
    assert holmes.link("ib", "roce").nic == "ethernet"
    assert {g.nic for g in load_cluster("three_groups").groups} == {
        "infiniband",
        "roce",
        "ethernet",
    }
    assert {g.nic for g in load_cluster("ethernet").groups} == {"ethernet"}
    local = load_cluster("local_2x4")
    assert [(g.name, g.nodes, g.gpus_per_node) for g in local.groups] == [
        ("ib", 1, 4),
        ("roce", 1, 4),
    ]


def _two_groups(**changes):
    ib = {
        "name": "ib",
        "nodes": 2,
        "gpus_per_node": 8,
        "gpu": "a100_dgx",
        "nic": "infiniband",
        "nic_gbps": 200,
    }
    roce = {**ib, "name": "roce", "nic": "roce"}
    raw = {
        "name": "c",
        "groups": [ib, roce],
        "links": [{"groups": ["ib", "roce"], "nic": "ethernet", "gbps": 25}],
    }
    for path, value in changes.items():
        where, key = path.split(".")
        target = raw if where == "cluster" else raw["groups"][int(where)]
        target[key] = value
    return raw


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"1.nic": "omnipath"}, r"groups\[1\] \(roce\): unknown NIC type 'omnipath'"),
        ({"cluster.links": []}, "no link between neighbouring groups 'ib' and 'roce'"),
        ({"0.hosts": ["node[01-03]"]}, r"groups\[0\] \(ib\): 3 hosts listed for 2 nodes"),
        ({"0.gpu": "tpu_v9"}, r"groups\[0\] \(ib\): `gpu`: unknown hardware 'tpu_v9'"),
    ],
)
def test_cluster_validation_names_the_problem(changes, message):
    from jaxmeg.parallel.cluster import ClusterError

    with pytest.raises(ClusterError, match=message):
        from_dict(_two_groups(**changes))


# ---------------------------------------------------------------------------------------------
# plan.py --cluster


def _plan_cluster(*flags):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "scripts/plan.py", "--config", "configs/megatron_7.5b.yaml", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


FIGURES = ("tensor", "pipe", "data", "placement", "stage_layers", "tflops_per_gpu", "step_time_s")


def test_plan_cluster_json_ranks_auto_against_megatron_on_holmes():
    result = _plan_cluster("--cluster", "holmes_ib_roce", "--json")
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)
    rows = best["ranked"]
    assert {k: best[k] for k in FIGURES} == {k: rows[0][k] for k in FIGURES}
    for row in rows:
        for key in FIGURES:
            assert key in row and key in row["megatron"], key
        assert row["placement"] == "auto" and row["megatron"]["placement"] == "megatron"
        assert row["megatron_per_group"]["placement"] == "megatron_per_group"
        assert row["megatron"]["tflops_per_gpu"] <= row["megatron_per_group"]["tflops_per_gpu"]
        assert "sockets" in row["megatron_transport"]
        assert row["tensor"] * row["pipe"] * row["data"] == 64
        assert sum(row["stage_layers"]) == sum(row["megatron"]["stage_layers"]) == 36
        assert row["tflops_per_gpu"] >= row["megatron"]["tflops_per_gpu"]
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    # The fastest layout splits unevenly: the IB stage (faster reduction, no head) takes more.
    assert best["stage_layers"][0] > best["stage_layers"][-1]
    assert best["tflops_per_gpu"] > best["megatron"]["tflops_per_gpu"]
    assert best["megatron"]["stage_layers"] == [18] * best["pipe"]


def test_megatron_runs_over_one_transport_where_nics_differ():
    """Megatron-LM's one NCCL configuration: on the IB + RoCE cluster every inter-node hop goes
    over sockets on the shared Ethernet (slower than its order with per-group transports); on
    a cluster of one NIC type the two are the same model."""
    layout = Layout(tensor=4, pipe=2, data=8, microbatch=2, microbatches=32, recompute="full")
    holmes = load_cluster("holmes_ib_roce")
    one = cluster_step_time(GPT_7_5B, holmes, layout, "megatron")
    per_group = cluster_step_time(GPT_7_5B, holmes, layout, "megatron_per_group")
    assert one.stage_layers == per_group.stage_layers == (18, 18)
    assert one.total > 1.5 * per_group.total
    ib = load_cluster("ib_only")
    equal = [
        cluster_step_time(GPT_7_5B, ib, layout, mode).total
        for mode in ("megatron", "megatron_per_group")
    ]
    assert equal[0] == equal[1]
    with pytest.raises(ValueError, match="placement must be one of"):
        cluster_step_time(GPT_7_5B, ib, layout, "nccl")


def test_plan_cluster_three_groups_text_table_and_errors():
    result = _plan_cluster("--cluster", "three_groups", "--top", "3")
    assert result.returncode == 0, result.stderr
    assert "cluster three_groups" in result.stdout and "ethernet" in result.stdout
    bad = _plan_cluster("--cluster", "no_such_cluster")
    assert bad.returncode == 2 and "cluster file 'no_such_cluster' does not exist" in bad.stderr
    wrong = _plan_cluster("--cluster", "holmes_ib_roce", "--gpus", "128")
    assert wrong.returncode == 2 and "has 64" in wrong.stderr
    without = _plan_cluster("--batch", "512")
    assert without.returncode == 2 and "--gpus is required" in without.stderr


def test_auto_partition_helps_most_where_groups_differ_most():
    # Three groups, the last on 25 Gb/s Ethernet: its reduction is slow, so it takes fewer
    # layers, and the gain over the even split is large.
    cluster = load_cluster("three_groups")
    layout = Layout(tensor=4, pipe=4, data=4, microbatches=128)
    auto = cluster_step_time(GPT_7_5B, cluster, layout, "auto")
    megatron = cluster_step_time(GPT_7_5B, cluster, layout, "megatron")
    assert auto.stage_groups == megatron.stage_groups == ("ib", "ib", "roce", "ethernet")
    assert auto.stage_layers[-1] < min(auto.stage_layers[:-1])
    assert megatron.stage_layers == (9, 9, 9, 9)
    assert auto.tflops_per_gpu > 1.2 * megatron.tflops_per_gpu
    fixed = dataclasses.replace(layout, stage_layers=auto.stage_layers)
    assert cluster_step_time(GPT_7_5B, cluster, fixed, "megatron").stage_layers == auto.stage_layers
