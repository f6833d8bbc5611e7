"""The train step's side of the MoE layers' routing (`jaxmeg.training.expert_balance`): loss-free
balancing moves each bias toward an even load outside the optimizer, the loads leave the
gradients, and the per-layer metrics (load spread, dropped share) report every MoE layer in
model order; the plot that reads them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from jaxmeg.training import expert_balance
from jaxmeg.training.state import init_state
from jaxmeg.training.step import make_train_step
from tests.helpers import put_batch, random_batch, trainable_for
from tests.test_moe_step import LLAMA, TOP2, config


def test_bias_update_evens_a_skewed_load_and_the_step_reports_it():
    """Loss-free balancing in the train step: a bias that starts with expert 0 taking most of
    the choices moves toward an even load step by step (max/mean falls), the bias never enters
    the optimizer (its AdamW moments stay 0), and `moe_load_spread` is each layer's max/mean."""
    moe = dataclasses.replace(TOP2, top_k=1, aux_loss=0.0, bias_update_rate=0.004)
    trainable = trainable_for(config((1, 2, 1), moe))  # the spread whole on both stages
    tokens = put_batch(trainable, random_batch(trainable.cfg))
    with jax.set_mesh(trainable.mesh):
        state = init_state(trainable, seed=0)
        bias = state["params"]["blocks"]["layers"]["moe"]["router_bias"]
        state["params"]["blocks"]["layers"]["moe"]["router_bias"] = bias.at[..., 0].set(0.06)
        step = make_train_step(trainable)
        spreads = []
        for _ in range(16):
            state, metrics = step(state, *tokens)
            spreads.append(np.asarray(metrics["moe_load_spread"].addressable_data(0)))
    assert spreads[0].shape == (LLAMA.layers,)
    # measured: 3.25 at the first step (expert 0 takes most tokens), 1.4 over the last three
    first, last = spreads[0].mean(), np.mean(spreads[-3:])
    assert first > 2.5 and last < 0.6 * first, (first, last)
    moments = [
        np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state["opt_state"])
        if "router_bias" in jax.tree_util.keystr(path)
    ]
    assert moments and all(np.all(m == 0) for m in moments)


def test_the_step_reports_the_share_of_choices_its_capacity_dropped():
    """`moe_dropped`, each layer's share of the step's routing choices past an expert's slots:
    with C = ceil(cf s k / E) slots per expert and sequence, at least 1 - E C / (s k) of them
    (a factor of 0.5: 4 x 2 slots for 16 choices, at least half dropped); none with a factor
    that gives every expert a slot for every token; the kept-share slot never enters the
    optimizer."""
    dropped = {}
    for factor in (0.5, 2.0):  # 2.0: C = s = 8
        moe = dataclasses.replace(TOP2, capacity_factor=factor)
        trainable = trainable_for(config((1, 2, 1), moe))
        with jax.set_mesh(trainable.mesh):
            state = init_state(trainable, seed=0)
            state, metrics = make_train_step(trainable)(
                state, *put_batch(trainable, random_batch(trainable.cfg))
            )
        dropped[factor] = np.asarray(metrics["moe_dropped"].addressable_data(0))
        moments = [
            np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state["opt_state"])
            if "router_kept" in jax.tree_util.keystr(path)
        ]
        assert moments and all(np.all(m == 0) for m in moments)
    assert dropped[0.5].shape == (LLAMA.layers,)
    assert np.all(dropped[0.5] >= 0.5 - 1e-6) and np.all(dropped[0.5] < 1), dropped
    np.testing.assert_allclose(dropped[2.0], 0, atol=1e-6)


def test_loads_leave_the_gradients_and_move_each_bias_toward_the_mean():
    grads = {"moe": {"router_bias": np.array([[0.5, 0.25, 0.25, 0.0]], np.float32),
                     "w_in": np.ones(2, np.float32)}}  # fmt: skip
    cleaned, loads, kept, _ = expert_balance.take_loads(grads)
    assert kept == []  # no capacity factor
    np.testing.assert_array_equal(cleaned["moe"]["router_bias"], 0)
    np.testing.assert_array_equal(cleaned["moe"]["w_in"], 1)
    params = {"moe": {"router_bias": np.zeros((1, 4), np.float32), "w_in": np.ones(2)}}
    moved = expert_balance.move_biases(params, loads, 0.1)
    np.testing.assert_allclose(moved["moe"]["router_bias"], [[-0.1, 0.0, 0.0, 0.1]])


def test_the_expert_load_plot_reads_metrics_and_names_a_file_without_them(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plot_expert_load", Path(__file__).resolve().parent.parent / "scripts/plot_expert_load.py"
    )
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(
        json.dumps({"step": i, "loss": 1.0, "moe_load_spread": [4.0 / i, 2.0]}) + "\n"
        for i in range(1, 4)
    ))  # fmt: skip
    assert plot.main([str(metrics), "--out", str(tmp_path / "load.png")]) == 0
    assert (tmp_path / "load.png").stat().st_size > 0
    dense = tmp_path / "dense.jsonl"
    dense.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert plot.main([str(dense), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no moe_load_spread records" in capsys.readouterr().err


def test_a_units_moe_blocks_report_in_model_order():
    """With several MoE blocks in a stack entry (`moe.pattern`), the loads, moved biases and
    per-layer metrics follow the layers' order: `layer_2` before `layer_10` (a tree sorts the
    names the other way), the entries' blocks interleaved."""
    from jaxmeg.pipeline.layout import StageLayout

    def unit(first, second):  # a stack of 2 entries, [v, p, Lc, E], on one stage
        return {"layer_10": {"moe": {"router_bias": second}},
                "layer_2": {"moe": {"router_bias": first}}}  # fmt: skip

    first = np.array([[[[2.0, 0, 0, 0], [1.0, 1, 1, 1]]]], np.float32)  # layers 2 and 2 + 11
    second = np.array([[[[3.0, 1, 0, 0], [0.0, 0, 0, 4]]]], np.float32)  # layers 10 and 21
    _, loads, _, _ = expert_balance.take_loads(unit(first, second))
    assert [x is first for x in loads] == [True, False]
    layout = StageLayout.create(2, 1, 1)
    spread = np.asarray(expert_balance.load_spread(loads, layout))
    np.testing.assert_allclose(spread, [4.0, 3.0, 1.0, 4.0])  # model order: entry by entry
    zeros = np.zeros_like(first)
    moved = expert_balance.move_biases(unit(zeros, zeros), loads, 0.5)
    np.testing.assert_allclose(
        moved["layer_2"]["moe"]["router_bias"][0, 0, 0], [-0.5, 0.5, 0.5, 0.5]
    )
    np.testing.assert_allclose(
        moved["layer_10"]["moe"]["router_bias"][0, 0, 1], [0.5, 0.5, 0.5, -0.5]
    )
