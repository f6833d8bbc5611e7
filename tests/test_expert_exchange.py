"""The dropless exchange over an expert axis at a bound chosen per step
(`experts_ffn.experts_ffn_exchanged`): the same outputs and gradients as the experts on one
device (`experts_ffn.experts_ffn`) whatever the bound the routing needs, the bound the busiest
block fits taken on every device, the switch whose branches share one set of residual buffers
(`residual_switch`), and what the compiled step exchanges and computes at each bound."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxmeg import config as C
from jaxmeg.config_moe import exchange_bounds, kept_bound
from jaxmeg.models import experts_ffn, grouped_gemm, residual_switch
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import init_state
from jaxmeg.training.step import make_train_step
from tests.helpers import put_batch, random_batch, step_hazards, trainable_for
from tests.test_moe_step import LLAMA, TOP2, config

E, RANKS, TENSOR, T, K, H, F = 8, 4, 2, 8, 2, 16, 8
"""8 experts over 4 expert ranks (2 each) x 2 tensor ranks; T tokens and k choices per device."""


def routes() -> dict[str, np.ndarray]:
    """[RANKS x T, K] expert ids: an even load (each device sends T k / RANKS = 4 choices to
    every device), one device sending 6 to its next, and every choice to expert 0."""
    even = np.arange(RANKS * T * K).reshape(RANKS * T, K) % E
    skewed = even.copy()
    to_device_2 = np.argwhere(even[:T] // 2 == 2)[:2]  # two of device 0's 4 choices for device 2
    skewed[to_device_2[:, 0], to_device_2[:, 1]] = 2  # go to expert 2 (device 1): 6 for it
    return {"even": even, "skewed": skewed, "one-expert": np.zeros_like(even)}


def params(seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), 6)
    return {
        "x": jax.random.normal(keys[0], (RANKS * T, H)),
        "weights": jax.nn.softmax(jax.random.normal(keys[1], (RANKS * T, K)), axis=-1),
        "w_in": jax.random.normal(keys[2], (E, H, F)) * 0.3,
        "w_out": jax.random.normal(keys[3], (E, F, H)) * 0.3,
        "w_gate": jax.random.normal(keys[4], (E, H, F)) * 0.3,
        "target": jax.random.normal(keys[5], (RANKS * T, H)),
    }


def loss_of(ffn, ids):
    def loss(p):
        routing = experts_ffn.Routing(ids, p["weights"], None, None)
        y = ffn(p["x"], routing, p["w_in"], p["w_out"], p["w_gate"])
        return jnp.sum(y.astype(jnp.float32) * p["target"])

    return loss


def exchanged(mesh, gemm, factors, form="blocks"):
    expert_in, expert_out = P("expert", None, "tensor"), P("expert", "tensor", None)

    def local(x, ids, weights, w_in, w_out, w_gate):
        routing = experts_ffn.Routing(ids, weights, None, None)
        y, _, _ = experts_ffn.experts_ffn_exchanged(
            x, routing, w_in, w_out, w_gate, "expert", "tensor", gemm=gemm, factors=factors,
            form=form,
        )  # fmt: skip
        return y

    mapped = jax.shard_map(
        local, mesh=mesh, out_specs=P("expert"),
        in_specs=(P("expert"), P("expert"), P("expert"), expert_in, expert_out, expert_in),
    )  # fmt: skip
    return lambda x, routing, *w: mapped(x, routing.experts, routing.weights, *w)


@pytest.mark.parametrize(
    ("route", "gemm", "factors", "form"),
    [
        ("even", "ragged", None, "blocks"), ("skewed", "ragged", None, "blocks"),
        ("one-expert", "ragged", None, "blocks"), ("skewed", "blocked", None, "blocks"),
        ("skewed", "ragged", (2.0,), "blocks"),
        ("even", "ragged", None, "ragged"), ("skewed", "ragged", None, "ragged"),
        ("one-expert", "ragged", None, "ragged"),
    ],
)  # fmt: skip
def test_every_bound_gives_one_devices_outputs_and_gradients(
    route, gemm, factors, form, monkeypatch
):  # fmt: skip
    """The busiest block of the even route holds T k / RANKS = 4 rows: the exchange runs its
    first bound, which moves exactly the routed tokens (E_ranks blocks of 4 rows hold the
    device's T k = 16 choices); the skewed one 6 rows (the third bound, 1.5x), every choice to
    one expert all T k (the last). Every device takes that bound, and the loss and every
    gradient equal the experts run on one device, with either grouped GEMM
    (`moe.grouped_gemm`) in the exchange's forward and backward. The bounds up to 2x the even
    load (8 rows) keep their residuals (`moe.exchange_kept_bound`); the one-expert route's
    (16 rows) keeps only its inputs and reruns its forward in the backward. With
    `moe.exchange_bounds` [2] the bounds are 8 rows and all 16, and the skewed route takes the
    first.

    `moe.exchange: ragged` (`jax.lax.ragged_all_to_all`; here its reference, the same result)
    bounds the rows a device receives in all: the even route's 16 fit the first bound (4 x 4),
    the skewed route's busiest device receives 18 (the second, 4 x 5), every choice to one
    expert 64 on its device (the last, 4 x 16)."""
    moe_cfg = C.MoeConfig(experts=E, grouped_gemm=gemm)
    if factors is not None:
        moe_cfg = dataclasses.replace(moe_cfg, exchange_bounds=factors)
    bounds = exchange_bounds(T * K, RANKS, moe_cfg.exchange_bounds)
    assert bounds == ((4, 5, 6, 8, 12, 16) if factors is None else (8, 16))
    skewed = 1 if form == "ragged" else 2
    expected = {"even": 0, "skewed": skewed, "one-expert": len(bounds) - 1}[route]
    if factors is not None:
        expected = 0
    taken, switch = [], residual_switch.switch

    def spying(index, branches, const, diff, name=None):
        jax.debug.callback(lambda i: taken.append(int(i)), index)
        return switch(index, branches, const, diff, name)

    monkeypatch.setattr(residual_switch, "switch", spying)
    mesh = jax.make_mesh((RANKS, TENSOR), ("expert", "tensor"), (jax.sharding.AxisType.Auto,) * 2)
    ids = jnp.asarray(routes()[route], jnp.int32)
    p = params()
    pair = grouped_gemm.grouped_gemm(moe_cfg)
    loss, grads = jax.jit(
        jax.value_and_grad(loss_of(exchanged(mesh, pair, moe_cfg.exchange_bounds, form), ids))
    )(p)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_of(experts_ffn.experts_ffn, ids)))(p)
    jax.effects_barrier()
    assert taken and set(taken) == {expected}, taken
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in ("x", "weights", "w_in", "w_out", "w_gate"):
        scale = float(np.abs(ref_grads[key]).max())
        np.testing.assert_allclose(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=key)  # fmt: skip


def test_the_ragged_all_to_all_reference_gives_jaxs_documented_example():
    """`moe_exchange.ragged_all_to_all` off a GPU (`_ragged_reference`) on the example of
    `jax.lax.ragged_all_to_all`'s docstring, over an axis of 2: device 0 gets [1, 3, 0, 0],
    device 1 [2, 2, 4, 0], the output's other rows kept."""
    from jaxmeg.models.moe_exchange import ragged_all_to_all

    mesh = jax.make_mesh((2,), ("expert",), (jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])  # fmt: skip
    args = [
        [[1, 2, 2], [3, 4, 0]],
        [[0, 0, 0, 9], [0, 0, 0, 0]],
        [[0, 1], [0, 1]],
        [[1, 2], [1, 1]],
        [[0, 0], [1, 2]],
        [[1, 1], [2, 1]],
    ]
    args = [jnp.asarray(a, jnp.int32).reshape(-1) for a in args]
    # device 0's output keeps the 9 it held in a row nothing is written to
    run = jax.jit(jax.shard_map(
        lambda *a: ragged_all_to_all(*a, "expert"), mesh=mesh, in_specs=(P("expert"),) * 6,
        out_specs=P("expert"),
    ))  # fmt: skip
    got = np.asarray(run(*args)).reshape(2, 4)
    np.testing.assert_array_equal(got, [[1, 3, 0, 9], [2, 2, 4, 0]])


def test_a_switchs_branches_share_one_set_of_residual_buffers():
    """Three branches keeping 2, 5 and 8 rows: the forward keeps one float buffer as large as
    the largest branch's residuals other than the switch's inputs (jax's own switch keeps all
    three branches'), and each branch's gradient is its own."""

    def branch(n):
        def run(scale, d):
            x, w = d
            y = jnp.tanh(x[:n] @ w) * scale[:n, None]
            return jnp.pad(y, ((0, 8 - n), (0, 0)))

        return run

    branches = (branch(2), branch(5), branch(8))
    keys = jax.random.split(jax.random.key(1), 2)
    d = (jax.random.normal(keys[0], (8, 4)), jax.random.normal(keys[1], (4, 3)))
    scale = jnp.arange(8, dtype=jnp.float32)
    _, kept = jax.eval_shape(
        lambda i, c, d_: residual_switch._switch_fwd(branches, None, i, c, d_), 0, scale, d
    )
    _, (_, _, _, buffers, _) = kept, kept
    largest = jax.eval_shape(lambda c, d_: jax.vjp(lambda e: branches[2](c, e), d_)[1], scale, d)
    floats = sum(b.size for b in buffers.values())
    inputs = d[0].size + d[1].size  # the pullback keeps x and w: referenced, not copied
    assert floats == sum(r.size for r in jax.tree.leaves(largest)) - inputs
    for j, run in enumerate(branches):
        switched = lambda d_, j=j: residual_switch.switch(j, branches, scale, d_)  # noqa: E731
        got = jax.grad(lambda d_, f=switched: jnp.sum(f(d_) ** 2))(d)
        want = jax.grad(lambda d_, f=run: jnp.sum(f(scale, d_) ** 2))(d)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_compiled_exchange_moves_and_computes_each_bounds_rows():
    """(expert 4, one expert per device): per MoE layer and microbatch, the compiled step
    exchanges tokens by all-to-all over `expert` only, at each bound of the exchange (a branch
    each; a step runs one): dispatch and combine and their transposes (4 of each bound's [4, B,
    h] row buffer; up to `moe.exchange_kept_bound` the forward keeps its residuals, so the
    backward reruns neither; past it the backward dispatches the ids and rows again) and one
    of the choices' expert ids. The first bound's row buffer holds exactly the routed tokens, T k
    h, of which (E - 1) / E leave the device, and counted at that branch the step's matmul
    FLOPs are the model's active FLOPs (its vocabulary padding aside): no expert GEMM row
    beyond the routed ones, no rerun. At the next bound, 1.25x the even load, the experts do
    1.25x their work, what the performance model prices, and its all-to-all bytes are the
    compiled ones. The routing runs on each device's own rows: the only all-gathers over
    `expert` are the embedding's backward, none in the MoE layers (one microbatch in bf16: the
    executor's map leaves `expert` automatic, `pipeline_step.splits_experts`). With bf16
    compute the rows travel as 16 bits (XLA would widen a bf16 all-to-all to float32)."""
    from jaxmeg.models.moe_exchange import EXCHANGE_KEPT
    from jaxmeg.parallel import hlo
    from jaxmeg.parallel.hlo_cost import StepCost
    from jaxmeg.perf.experts import exchange_branch
    from jaxmeg.perf.layout import config_layout
    from jaxmeg.perf.shape import shape_of
    from jaxmeg.perf.traffic import bytes_per_step
    from jaxmeg.training.flops import model_flops_per_step

    bf16 = dataclasses.replace(LLAMA, compute_dtype="bfloat16")
    cfg = config((1, 1, 1), TOP2, bf16, expert=4, microbatches=1)
    trainable = trainable_for(cfg)
    cfg = trainable.cfg
    loss_and_grads = make_loss_and_grads(trainable)
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        tokens = put_batch(trainable, random_batch(cfg))
        text = jax.jit(loss_and_grads).lower(params, *tokens).compile().as_text()
    found = hlo.collectives(text, trainable.mesh)
    rows = cfg.train.microbatch_size // 4 * LLAMA.seq_len  # T on each device
    choices = rows * TOP2.top_k
    bounds = exchange_bounds(choices, 4)
    buffers = {b: 4 * b * LLAMA.hidden * 2 for b in bounds}  # bf16 rows
    assert buffers[bounds[0]] == choices * LLAMA.hidden * 2  # the routed tokens
    exchanges = [c.bytes for c in found if c.kind == "all-to-all"]
    assert all(c.axes == {"expert"} for c in found if c.kind == "all-to-all")
    kept = kept_bound(bounds, choices, 4, TOP2.exchange_kept_bound)
    rerun = [b for b in bounds if b > kept]  # their backward: the ids' and rows' dispatch again
    assert bounds[0] <= kept < bounds[-1] and rerun
    rows_moved = [buffers[b] for b in bounds] * 4 + [buffers[b] for b in rerun]
    ids_moved = [4 * b * 4 for b in bounds] + [4 * b * 4 for b in rerun]
    assert sorted(exchanges) == sorted((rows_moved + ids_moved) * LLAMA.layers)
    gathers = [c for c in found if c.kind == "all-gather"]
    assert gathers and all("embed" in c.op_name and "/moe/" not in c.op_name for c in gathers)
    # the branch is the data's: every collective inside the exchange's conditionals stays in
    # the expert x tensor group that the bound's all-reduce made its index the same over
    branched = [c for c in found if EXCHANGE_KEPT in c.op_name]
    assert [c.bytes for c in branched if c.kind == "all-to-all"] == exchanges
    assert all(c.axes <= {"expert", "tensor"} for c in branched), branched

    def matmul_flops(branch):
        counter = StepCost(text, trainable.mesh, loss_and_grads.program.branch_columns,
                           chosen_branches={EXCHANGE_KEPT: branch})  # fmt: skip
        return counter.total().matmul_flops

    active = model_flops_per_step(cfg.model, cfg.train.global_batch, moe=cfg.moe)
    routed = cfg.train.global_batch * LLAMA.seq_len * TOP2.top_k
    tokens_ = cfg.train.global_batch * LLAMA.seq_len
    padding = 6 * tokens_ * LLAMA.hidden * (trainable.vocab - LLAMA.vocab_size)  # 500 -> 512
    assert matmul_flops(0) == pytest.approx(active + padding, rel=1e-9)
    # the performance model's bound: the next one, 10 rows per block against the even 8
    shape, layout = shape_of(cfg.model, cfg.moe), config_layout(cfg)
    balanced = exchange_branch(shape, layout)
    assert bounds[balanced] == 10
    experts = 3 * 3 * 2 * routed * LLAMA.hidden * TOP2.ffn_hidden * LLAMA.layers  # fwd + bwd
    assert matmul_flops(balanced) == pytest.approx(active + padding + 0.25 * experts, rel=1e-9)
    traffic = bytes_per_step(shape, layout, compute_bytes=2)
    assert traffic["expert"] == pytest.approx(4 * LLAMA.layers * buffers[10] * 3 / 4)


def _per_slot(text: str, pattern: str) -> dict[str, int]:
    """How many of the compiled step's ops inside the exchange's scope match `pattern` (a
    regex on the line), per slot body (f_first, b_middle, i_first, w_last, ...)."""
    import re

    from jaxmeg.models.moe_exchange import EXCHANGE_KEPT

    counts: dict[str, int] = {}
    for line in text.splitlines():
        name = re.search(r'op_name="([^"]*)"', line)
        slot = name and re.search(r"closed_call/([fbiw]_[a-z]+)/", name.group(1))
        if slot and EXCHANGE_KEPT in name.group(1) and re.search(pattern, line):
            counts[slot.group(1)] = counts.get(slot.group(1), 0) + 1
    return counts


@pytest.mark.parametrize("schedule,overlap", [("1f1b", False), ("1f1b", True), ("zb_h1", False)])
def test_a_pipeline_slot_exchanges_each_microbatch_four_times_and_reruns_no_forward(
    schedule, overlap
):
    """expert 4 x pipe 2, dropless, one bound (`moe.exchange_bounds: []`), one MoE layer per
    stage: per MoE layer and microbatch 4 all-to-alls of rows, as with the whole model in one
    computation: the F slot's dispatch and combine, and their transposes in the B slot (I with
    a split backward). The F slot keeps the exchange's residuals (named outside the layer's
    map), so the backward reruns neither them nor the experts' forward GEMMs: B and I run as
    many row GEMMs as F (the rows' gradient, dY against each transposed weight: a rerun would
    double them), and W exchanges nothing. The one all-to-all of expert ids is F's. With
    `overlap_sends` (GPUs) 1f1b's last stage runs F and B at once (`B_LAST`): its B slot holds
    all four, F's ids and both's GEMMs."""
    cfg = config((1, 2, 1), dataclasses.replace(TOP2, exchange_bounds=()), LLAMA, schedule,
                 expert=4, overlap_sends=overlap)  # fmt: skip
    trainable = trainable_for(cfg)
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        tokens = put_batch(trainable, random_batch(trainable.cfg))
        text = jax.jit(make_loss_and_grads(trainable)).lower(params, *tokens).compile().as_text()
    back = "i_" if schedule == "zb_h1" else "b_"
    rows = _per_slot(text, r"= \(f32\[.*all-to-all\(")
    ids = _per_slot(text, r"= \(s32\[.*all-to-all\(")
    gemms = _per_slot(text, r"= \S+ (dot|ragged-dot)\(")
    # with `overlap_sends` 1f1b's last stage runs each microbatch's F and B in its B slot
    at_once = {k for k in rows if k.startswith("b_last")}
    assert bool(at_once) == overlap, rows
    apart = {k: n for k, n in rows.items() if k not in at_once}
    assert {k[:2] for k in apart} == {"f_", back} and set(apart.values()) == {2}, rows
    assert {k[:2] for k in ids} - {"b_"} == {"f_"} and set(ids.values()) == {1}, ids
    assert {k for k in ids if k.startswith("b_")} == at_once, ids
    forward = {n for k, n in gemms.items() if k.startswith("f_")}
    backward = {n for k, n in gemms.items() if k.startswith(back) and k not in at_once}
    assert len(forward) == 1 and backward == forward, gemms
    assert all(rows[k] == 4 and gemms[k] == 2 * min(forward) for k in at_once), (rows, gemms)


def test_a_pipeline_keeps_the_exchange_residuals_of_the_kept_bound_only():
    """expert 4 x pipe 2, dropless top-2: a device's T k = 32 choices, blocks of 8 rows at an
    even load, bounds 8, 10, 12, 16, 24 and 32 rows. What a stage keeps per microbatch for its
    MoE layer (`trace_info["slot_bytes"]`) grows with `moe.exchange_kept_bound` by the received
    rows and the first GEMMs' outputs (h + 2 f floats) and the row order of each kept row, on
    each device (the step's map is manual over `expert`): 1x keeps E_ranks x 8 rows, 2x (the
    default) 16 each, 64x all
    32 (what every bound kept before); bounds past it rerun their forward in the backward
    (`test_every_bound_gives_one_devices_outputs_and_gradients`, the one-expert route)."""
    stored = {}
    for factor in (1.0, 2.0, 64.0):
        moe_cfg = dataclasses.replace(TOP2, exchange_kept_bound=factor)
        trainable = trainable_for(config((1, 2, 1), moe_cfg, LLAMA, "1f1b", expert=4))
        loss_and_grads = make_loss_and_grads(trainable)
        with jax.set_mesh(trainable.mesh):
            params = init_state(trainable, seed=0)["params"]
            tokens = put_batch(trainable, random_batch(trainable.cfg))
            jax.jit(loss_and_grads).lower(params, *tokens)
        stored[factor] = loss_and_grads.program.trace_info["slot_bytes"]
    ranks, f = 4, TOP2.ffn_hidden
    per_row = (LLAMA.hidden + 2 * f) * 4 + 4
    assert stored[2.0] - stored[1.0] == ranks * (16 - 8) * per_row
    assert stored[64.0] - stored[2.0] == ranks * (32 - 16) * per_row


def test_the_step_reports_the_largest_exchange_bound_each_layer_took():
    """`moe_exchange_bound` (dropless, expert 2 x pipe 2): each layer's largest bound over the
    step's microbatches, as a multiple of an even load. The initial router's near-even route
    takes a small one (measured: 1.25 and 1.5); a bias that sends every choice to experts 0
    and 1, both on expert rank 0, takes all T k choices per block, E_ranks = 2 x an even load.
    The counting slot never trains: param and AdamW moments stay zero."""
    trainable = trainable_for(config((1, 2, 1), TOP2, expert=2))
    tokens = put_batch(trainable, random_batch(trainable.cfg))
    step = make_train_step(trainable)
    bounds = {}
    with jax.set_mesh(trainable.mesh):
        for route in ("initial", "to_rank_0"):
            state = init_state(trainable, seed=0)
            if route == "to_rank_0":
                moe = state["params"]["blocks"]["layers"]["moe"]
                moe["router_bias"] = moe["router_bias"].at[..., :2].set(100.0)
            state, metrics = step(state, *tokens)
            bounds[route] = np.asarray(metrics["moe_exchange_bound"].addressable_data(0))
    assert bounds["initial"].shape == (LLAMA.layers,)
    assert np.all(bounds["initial"] >= 1) and np.all(bounds["initial"] < 2), bounds
    np.testing.assert_array_equal(bounds["to_rank_0"], 2.0)
    leaves = [
        np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
        if "exchange_taken" in jax.tree_util.keystr(path)
    ]
    assert len(leaves) == 3 and all(np.all(leaf == 0) for leaf in leaves)  # param, mu, nu


def test_a_layers_backward_runs_no_bound_all_reduce_beside_its_exchange(monkeypatch):
    """(expert 2 x pipe 2 x tensor 2) dropless top-1, the layer's checkpoint keeping the
    exchange's pullback: the routing's statistics are kept with it (`experts.kept_statistics`).
    Recomputed instead (as before), each B slot's layer backward ran the bound's all-reduce
    over expert x tensor again beside the transposed exchange (a conditional over `expert`) in
    no order that data fixed; `deadlock_hazards` reads every computation and names that pair
    (the step as it is passes the check in `test_moe_step_equals_one_device`'s e2p2t2 cases)."""
    from jaxmeg.parallel import experts

    trainable = trainable_for(config((1, 2, 2), dataclasses.replace(TOP2, top_k=1), expert=2))
    monkeypatch.setattr(experts, "kept_statistics", lambda aux, shares: (aux, shares))
    found = step_hazards(trainable)
    assert found and all("no data orders" in line for line in found), found
    assert all("moe_exchange" in line and "pmax" in line for line in found), found


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_pipeline_sums_its_dense_gradients_over_expert_once_per_step(schedule):
    """expert 4 x pipe 2 (tensor 1: the executor's map is manual over `expert`,
    `pipeline_step.splits_experts`): each expert rank holds its share of every microbatch's rows and
    keeps its dense gradients its own through the step; they are summed over `expert` with the data
    mean once per chunk, in the reduction beside the tick after the chunk's last backward
    (`reduce_chunk`, one tick per stage), all of a stage's dense leaves in one all-reduce. No slot
    all-reduces anything over `expert` but the exchange bound's scalar max (in F, or B_LAST: the
    last stage's F and B at once); with `expert` automatic XLA all-reduced a stage's dense gradients
    in every B slot (m per step) and the head's in every last F. After the loop the embedding's and
    head's gradients and the loss go in one all-reduce over pipe x expert."""
    import re

    from jaxmeg.parallel import hlo

    cfg = config((1, 2, 1), TOP2, LLAMA, schedule, expert=4)
    trainable = trainable_for(cfg)
    loss_and_grads = make_loss_and_grads(trainable)
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        tokens = put_batch(trainable, random_batch(trainable.cfg))
        text = jax.jit(loss_and_grads).lower(params, *tokens).compile().as_text()
    reduces = [
        c for c in hlo.collectives(text, trainable.mesh)
        if c.kind == "all-reduce" and "expert" in c.axes
    ]  # fmt: skip
    in_slots = [c for c in reduces if re.search(r"/closed_call/[fbiw]_[a-z_]+/", c.op_name)]
    forwards = ("/f_", "/b_last")  # 1f1b's last stage runs F and B at once (`B_LAST`)
    assert in_slots and all(c.bytes == 4 for c in in_slots), in_slots
    assert all(any(f in c.op_name for f in forwards) for c in in_slots), in_slots
    stage = params["blocks"]["layers"]
    dense = sum(
        a.size // 2 * 4  # a stage's half of each [v = 1, p = 2, Lc, ...] leaf, fp32
        for path, a in jax.tree_util.tree_leaves_with_path(stage)
        if not re.search(r"\['moe'\]\['w_(in|out|gate)'\]", jax.tree_util.keystr(path))
    )
    chunk = [c for c in reduces if "/reduce_chunk/" in c.op_name]
    assert [c.bytes for c in chunk] == [dense], (chunk, dense)
    assert (loss_and_grads.program.branch_columns["reduce_chunk"].sum(axis=0) == 1).all()
    after = [c for c in reduces if c not in in_slots and c not in chunk]
    assert len(after) == 1 and after[0].axes == {"expert", "pipe"}, after
