"""Mixture-of-experts layers in the step: the executor's loss and every gradient equal one
device's (`jaxmeg.training.reference`, which adds the auxiliary losses to the loss it
differentiates, while the step injects their gradient in the backward), router and routing-bias
slot included, for pipelines, tensor and data parallelism, the zero-bubble split backward, a
sharded optimizer, both routers, top-1 and top-2, shared experts, and a router that sends every
token to one expert; the config checks. The routing bias, the loads and the per-layer metrics:
tests/test_expert_balance.py."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.reference import make_plain_loss_and_grads
from jaxmeg.training.state import (
    init_state,
    state_shardings,
    to_canonical_layout,
    to_stage_layout,
)
from tests.helpers import (
    put_batch,
    random_batch,
    run_checked,
    step_hazards,
    trainable_for,
    without_bound_counts,
)

pytestmark = pytest.mark.timeout(300)

# Two layers: one per stage on two stages (compile time grows with the layers a chunk unrolls);
# `config` gives an interleaved pipeline one per chunk.
LLAMA = C.ModelConfig(
    block="llama", vocab_size=500, hidden=32, layers=2, heads=4, seq_len=8,
    compute_dtype="float32", tie_embeddings=False,
)  # fmt: skip
GPT = dataclasses.replace(LLAMA, block="gpt", tie_embeddings=True)
TOP2 = C.MoeConfig(experts=4, top_k=2, ffn_hidden=16, aux_loss=0.1, z_loss=0.01)
SHARED = dataclasses.replace(TOP2, shared_experts=1, shared_gate=True)
SIGMOID_TOP1 = dataclasses.replace(TOP2, top_k=1, router="sigmoid", normalize=False)
CAPACITY = dataclasses.replace(TOP2, capacity_factor=1.0)  # 4 slots per expert and sequence
FIRST_DENSE = dataclasses.replace(TOP2, first_dense=1)  # a dense layer, then the MoE ones
EVERY2 = dataclasses.replace(TOP2, every=2)  # dense, MoE, dense, MoE: groups of 2 per stage
# DeepSeek-V3's router: sigmoid scores, 4 experts in 2 groups, each token's top 2 within its
# best group, the weights scaled by 2.5
GROUPED = dataclasses.replace(
    SIGMOID_TOP1, top_k=2, router_groups=2, router_group_topk=1, routed_scaling=2.5
)
TOL = 2e-5


def config(mesh, moe, model=LLAMA, schedule="1f1b", chunks=1, microbatches=2, **parallel):
    data, pipe, tensor = mesh
    return C.Config(
        model=dataclasses.replace(
            model,
            layers=len(moe.pattern)
            or max(model.layers, pipe * chunks * moe.layers_per_unit + moe.dense_layers),
        ),
        moe=moe,
        parallel=C.ParallelConfig(
            data=data, pipe=pipe, tensor=tensor, schedule=schedule, chunks=chunks, **parallel
        ),
        train=C.TrainConfig(
            global_batch=2 * data * parallel.get("expert", 1) * microbatches,
            microbatches=microbatches,
        ),
        optimizer=C.OptimizerConfig(lr=1e-2, warmup_steps=1),
    )


@functools.cache
def reference(global_batch: int, moe: C.MoeConfig, model: C.ModelConfig, bias=None):
    """Tokens, canonical params, loss and canonical gradients on one device (one microbatch);
    `bias` [E] set in every layer's routing bias before the run."""
    cfg = dataclasses.replace(
        config((1, 1, 1), moe, model), train=C.TrainConfig(global_batch=global_batch)
    )
    trainable = trainable_for(cfg)
    tokens = random_batch(trainable.cfg)
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        if bias is not None:
            experts = params["blocks"]["layers"]["moe"]
            experts["router_bias"] = experts["router_bias"] + np.asarray(bias, np.float32)
        loss, grads = jax.jit(make_plain_loss_and_grads(trainable))(
            params, *put_batch(trainable, tokens)
        )
    canonical = functools.partial(to_canonical_layout, layout=trainable.layout)
    to_host = functools.partial(jax.tree.map, np.asarray)
    return tokens, canonical(to_host(params)), float(loss), canonical(to_host(grads))


def check(cfg: C.Config, bias=None) -> dict:
    """Asserts the step's loss and gradients equal one device's; returns the canonical grads."""
    trainable = trainable_for(cfg)
    ragged = dataclasses.replace(cfg.moe, grouped_gemm="ragged")  # every form computes the same
    tokens, params, ref_loss, ref_grads = reference(cfg.train.global_batch, ragged, cfg.model, bias)
    params = jax.device_put(
        to_stage_layout(params, trainable.layout), state_shardings(trainable)["params"]
    )
    loss, grads = run_checked(
        trainable, make_loss_and_grads(trainable), params, *put_batch(trainable, tokens)
    )
    grads = to_canonical_layout(jax.tree.map(np.asarray, grads), trainable.layout)
    grads = without_bound_counts(grads)  # the exchange's statistic: test_expert_exchange.py
    np.testing.assert_allclose(float(loss), ref_loss, rtol=TOL)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    assert len(jax.tree.leaves(grads)) == len(flat_ref)
    for (path, ref), got in zip(flat_ref, jax.tree.leaves(grads), strict=True):
        name = jax.tree_util.keystr(path)
        assert np.abs(ref).max() > 0 or "router_bias" not in name, name
        np.testing.assert_allclose(
            got, ref, rtol=TOL, atol=TOL * float(np.abs(ref).max()), err_msg=name
        )
    return grads


CASES = {
    # mesh (data, pipe, tensor), moe, model, schedule, chunks, parallel overrides
    "p2t2-zb_h1-sigmoid-top1": ((1, 2, 2), SIGMOID_TOP1, LLAMA, "zb_h1", 1, {}),
    # expert parallelism: the experts split over `expert`, tokens exchanged by all-to-all
    "d2e2p2-zb_h1-zero3-shared": (
        (2, 2, 1), SHARED, LLAMA, "zb_h1", 1, {"expert": 2, "zero_stage": 3}
    ),
    # dropless with expert parallelism keeps the exchange's residuals; full recompute reruns
    # the forward's exchange inside the checkpointed layer
    "e2p2t2-top2-full": (
        (1, 2, 2), TOP2, dataclasses.replace(LLAMA, remat="full"), "1f1b", 1, {"expert": 2}
    ),
    # four expert ranks in each of two stages: each holds its share of every microbatch; the
    # rows by ragged all-to-all (`moe.exchange`; off a GPU its reference); sends beside the
    # slots as on GPUs, so the last stage runs each microbatch's F and B at once (`B_LAST`)
    "e4p2-top2-ragged": (
        (1, 2, 1), dataclasses.replace(TOP2, exchange="ragged"), LLAMA, "1f1b", 1,
        {"expert": 4, "overlap_sends": True},
    ),
    "e4t2-sequence_parallel": (
        (1, 1, 2), SIGMOID_TOP1, LLAMA, "1f1b", 1, {"expert": 4, "sequence_parallel": True}
    ),
    "d2e2p2-interleaved-zero1-gpt": (
        (2, 2, 1), TOP2, GPT, "interleaved_1f1b", 2, {"expert": 2, "zero_stage": 1}
    ),
    # capacity limits: choices past an expert's slots in a sequence dropped, as on one device
    # (in a pipeline the backward reruns the exchange; in one computation it keeps it)
    "e4-capacity": ((1, 1, 1), CAPACITY, LLAMA, "1f1b", 1, {"expert": 4}),
    "e2p2t2-capacity-shared": (
        (1, 2, 2), dataclasses.replace(SHARED, capacity_factor=1.0), LLAMA, "1f1b", 1,
        {"expert": 2},
    ),
    # uneven stages: the second stage's padding slot skips an MoE layer (zero aux and loads)
    "e2p2-uneven-2-1": (
        (1, 2, 1), TOP2, dataclasses.replace(LLAMA, layers=3), "1f1b", 1,
        {"expert": 2, "stage_layers": (2, 1)},
    ),
    # on one device the experts' grouped GEMMs are tapped: their weight gradients come in W
    "d2p2-zb_h1-capacity": ((2, 2, 1), CAPACITY, LLAMA, "zb_h1", 1, {}),
    "d2p2-capacity-half-gpt": (
        (2, 2, 1), dataclasses.replace(TOP2, capacity_factor=0.5), GPT, "1f1b", 1, {}
    ),
    # a dense leading layer runs with the embedding, on the first stage, recomputed in its B
    "d2e2p2-zb_h1-zero3-first_dense": (
        (2, 2, 1), FIRST_DENSE, LLAMA, "zb_h1", 1, {"expert": 2, "zero_stage": 3}
    ),
    # MoE every other layer: each stack entry a group of a dense layer and an MoE one; its
    # grouped GEMMs as dense GEMMs over blocks of rows (`moe.grouped_gemm`), their weight
    # gradients in W
    "d2p2-zb_h1-every2-blocked": (
        (2, 2, 1), dataclasses.replace(EVERY2, grouped_gemm="blocked"), LLAMA, "zb_h1", 1, {}
    ),
    # ... and exchanged: blocked GEMMs in the exchange's written-out backward and in W
    "e2p2t2-zb_h1-every2-first_dense-blocked": (
        (1, 2, 2), dataclasses.replace(EVERY2, first_dense=1, grouped_gemm="blocked"), LLAMA,
        "zb_h1", 1, {"expert": 2},
    ),
    # ... and as kernels of our own (off a GPU inside the map: ragged_dot; the wiring, with W)
    "e2p2-zb_h1-pallas": (
        (1, 2, 1), dataclasses.replace(TOP2, grouped_gemm="pallas"), LLAMA, "zb_h1", 1,
        {"expert": 2},
    ),
    "e2t2-first_dense-sequence_parallel-gpt": (
        (1, 1, 2), FIRST_DENSE, GPT, "1f1b", 1, {"expert": 2, "sequence_parallel": True}
    ),
    # the embedding's lookup under sequence parallelism in a pipeline: XLA partitioned it with
    # a collective-permute across the expert axis in the first stage's slot (the step hung)
    "e2p2t2-sequence_parallel-shared-gpt": (
        (1, 2, 2), SHARED, GPT, "1f1b", 1, {"expert": 2, "sequence_parallel": True}
    ),
    # dropless top-1: a B slot's bound all-reduce and F's send, which no data ordered, met in
    # different orders on different devices (the step hung; `slots.ordered_tick`)
    "e4p2-top1": ((1, 2, 1), dataclasses.replace(TOP2, top_k=1), LLAMA, "1f1b", 1, {"expert": 4}),
    # group-limited routing with a routed scaling factor, dropless and with a capacity factor
    "e2p2t2-zb_h1-groups-ragged": (
        (1, 2, 2), dataclasses.replace(GROUPED, exchange="ragged"), LLAMA, "zb_h1", 1,
        {"expert": 2},
    ),
    "e4p2-groups-capacity": (
        (1, 2, 1), dataclasses.replace(GROUPED, capacity_factor=1.0), GPT, "1f1b", 1,
        {"expert": 4},
    ),
    # any layer pattern (`moe.pattern`): stack entries of MoE, dense, MoE (two MoE blocks an
    # entry; on the executor's manual expert map the first one's output is kept, `UNIT_KEPT`,
    # else the backward reran its exchange beside the second's and the step could hang), and
    # of MoE then dense, with a capacity factor
    "e4p2-pattern": (
        (1, 2, 1), dataclasses.replace(TOP2, pattern=("moe", "dense", "moe") * 2), LLAMA,
        "1f1b", 1, {"expert": 4},
    ),
    "e2p2t2-zb_h1-pattern-capacity": (
        (1, 2, 2), dataclasses.replace(CAPACITY, pattern=("moe", "dense") * 2), GPT, "zb_h1", 1,
        {"expert": 2},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_moe_step_equals_one_device(name, monkeypatch):
    """With zero-bubble schedules the experts' weight gradients come in W: dropless with an
    expert axis from the rows the exchange recorded (`experts.weight_gradient`, traced here)."""
    from jaxmeg.parallel import experts

    mesh, moe, model, schedule, chunks, parallel = CASES[name]
    traced, original = [], experts.weight_gradient

    def tracing(dy, recorded, weight, *how):
        traced.append(weight)
        return original(dy, recorded, weight, *how)

    monkeypatch.setattr(experts, "weight_gradient", tracing)
    check(config(mesh, moe, model, schedule, chunks, **parallel))
    dropless = not moe.capacity_factor  # a capacity factor's experts run as batched GEMMs
    exchanged_in_w = schedule == "zb_h1" and parallel.get("expert", 1) > 1 and dropless
    assert sorted(set(traced)) == (["w_gate", "w_in", "w_out"] if exchanged_in_w else [])


def test_the_layouts_docs_name_are_the_ones_tested():
    """docs/architecture.md lists the equivalence cases by name: each is in `CASES` (it named
    a (2,2,2) case with a shared expert that none was), and every case is listed."""
    import re

    text = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    start = text.index("`tests/test_moe_step.py` checks loss and every gradient")
    paragraph = text[start : text.index("\n\n", start)]
    named = set(re.findall(r"`([a-z0-9_\-]+)`", paragraph))
    assert named == set(CASES), (named - set(CASES), set(CASES) - named)


@pytest.mark.parametrize(
    "mesh,schedule,expert",
    [((1, 1, 1), "1f1b", 2), ((1, 2, 1), "zb_h1", 4)],
    ids=["e2", "e4p2-zb_h1"],
)
def test_every_token_to_one_expert_leaves_the_others_at_zero(mesh, schedule, expert):
    """A routing bias that makes expert 0 every token's only choice, with the experts split
    over 2 devices: the device of experts 2 and 3 receives no token, the other experts get no
    rows (groups of size 0) and no gradient, and the bias slot says expert 0 took them all.
    Over 4 devices in a split-backward pipeline the step takes the largest bound (4x the even
    load), past the kept one: I reruns the exchange's forward, and W computes the expert
    weights' gradients from the rows the forward recorded (at the largest bound's size)."""
    cfg = config(mesh, dataclasses.replace(TOP2, top_k=1), schedule=schedule, expert=expert)
    grads = check(cfg, bias=(100.0, 0.0, 0.0, 0.0))
    experts = grads["blocks"]["layers"]["moe"]
    np.testing.assert_array_equal(
        experts["router_bias"], np.tile([1.0, 0, 0, 0], (LLAMA.layers, 1))
    )
    for name in ("w_in", "w_gate", "w_out"):
        assert np.abs(experts[name][:, 0]).max() > 0, name
        np.testing.assert_array_equal(experts[name][:, 1:], 0)


def test_a_microbatch_split_across_expert_ranks_is_a_named_hazard(monkeypatch):
    """(expert 4, pipe 2) with `expert` automatic in the executor's map (as it is with tensor
    > 1; here it would be manual, `pipeline_step.splits_experts`, and every rank would take its
    own rows): the executor takes microbatch mb as every m-th row (`carry.Stage`), so each
    expert rank holds its share of every microbatch and no slot moves rows. Taken as a block of
    rows instead (as before), its rows sit on half of a stage's expert ranks and GSPMD moves
    them inside the F slots of the first and last stages by a collective-permute whose pairs
    stay inside each stage but which meets all 8 devices: the step hung (the CPU rendezvous
    aborted after 40 s). `deadlock_hazards` names such a permute before any run (the e2p2t2
    cases of `test_moe_step_equals_one_device` run such steps as they are, checked)."""
    from jaxmeg.pipeline.executor import carry
    from jaxmeg.training import pipeline_step

    monkeypatch.setattr(pipeline_step, "splits_experts", lambda trainable: False)
    trainable = trainable_for(config((1, 2, 1), TOP2, LLAMA, expert=4))

    def block_of_rows(self, mb):
        take = lambda a: a.reshape(self.plan.m, -1, a.shape[-1])[mb]  # noqa: E731
        rows = lambda a: take(a.reshape(-1, a.shape[-1]))  # noqa: E731
        return rows(self.tokens), rows(self.targets)

    monkeypatch.setattr(carry.Stage, "batch", block_of_rows)
    found = step_hazards(trainable)
    assert found and all(line.startswith("collective-permute over ['expert']") for line in found)


def test_a_tick_whose_collectives_no_data_orders_is_a_named_hazard(unordered_ticks):
    """(expert 4, pipe 2) dropless top-1: F's send (a conditional over `pipe`) and the B slot
    (a loop whose exchange all-reduces the bound over `expert`) had no data between them, and
    XLA:CPU may start the loop's collectives while the send waits: 4 of 8 devices waited in the
    send and 4 in the bound's all-reduce (the rendezvous aborted). The executor orders a CPU
    tick's loops and sends (`slots.ordered_tick`); without that `deadlock_hazards` names the
    pair, and `compile_step` refuses the step."""
    from jaxmeg.parallel import hlo_module
    from jaxmeg.training import compilation

    trainable = trainable_for(
        config((1, 2, 1), dataclasses.replace(TOP2, top_k=1), LLAMA, expert=4)
    )
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        tokens = put_batch(trainable, random_batch(trainable.cfg))
        step = jax.jit(make_loss_and_grads(trainable)).lower(params, *tokens).compile()
    found = hlo_module.deadlock_hazards(step.as_text(), trainable.mesh)
    assert found and all("no data orders" in line for line in found), found
    assert any("send_x" in line for line in found), found
    with pytest.raises(compilation.DeadlockHazard, match=r"expert 4 x pipe 2, 1f1b\): "):
        compilation.check_hazards(step, trainable)


@pytest.mark.parametrize("every", [1, 2])
def test_capacity_exchange_moves_its_buffers_and_the_experts_run_the_routed_flops(
    monkeypatch, every
):
    """(expert 4), capacity factor 1: per MoE layer and microbatch the all-to-alls move the
    fixed [E, sequences x C] buffers (C = s k / E), 4 of them over `expert` and nothing else
    (dispatch, combine and their transposes: with the whole model in one computation the
    forward keeps its residuals): the routed tokens' bytes, not the dropless exchange's padded
    blocks, as the planner prices them, also with MoE every other layer. The compiled step's
    matmul FLOPs are the model's active FLOPs: the experts compute E C rows per sequence, the
    k s routed choices, not every expert on every token, and nothing twice."""
    from jaxmeg.parallel import hlo
    from jaxmeg.perf.layout import config_layout
    from jaxmeg.perf.shape import shape_of
    from jaxmeg.perf.traffic import bytes_per_step
    from jaxmeg.training import cost_report as cost_report_module
    from jaxmeg.training.compilation import compile_step

    cfg = config((1, 1, 1), dataclasses.replace(CAPACITY, every=every), expert=4, microbatches=1)
    trainable = trainable_for(cfg)
    moe_layers = LLAMA.layers // every
    compiled = []  # the train step the cost report compiles: its exchanges are the step's

    def compile_and_keep(*args):
        compiled.append(compile_step(*args))
        return compiled[-1]

    monkeypatch.setattr(cost_report_module, "compile_step", compile_and_keep)
    report = cost_report_module.cost_report(trainable)
    (compiled,) = [c for c, _ in compiled]
    found = hlo.collectives(compiled.as_text(), trainable.mesh)
    sequences = trainable.cfg.train.microbatch_size // 4  # on each device
    slots = LLAMA.seq_len * CAPACITY.top_k // CAPACITY.experts  # C
    buffer = CAPACITY.experts * sequences * slots * LLAMA.hidden * 4  # fp32 rows
    exchanges = [c for c in found if c.kind == "all-to-all"]
    assert all(c.axes == {"expert"} and c.bytes == buffer for c in exchanges), exchanges
    assert len(exchanges) == 4 * moe_layers
    shape = shape_of(trainable.cfg.model, trainable.cfg.moe)
    traffic = bytes_per_step(shape, config_layout(trainable.cfg), compute_bytes=4)
    assert traffic["expert"] == pytest.approx(4 * moe_layers * buffer * 3 / 4)
    if every > 1:  # the dense layer's SwiGLU is not the model FLOPs' 4h GeLU MLP
        return
    tokens = cfg.train.global_batch * LLAMA.seq_len
    padding = 6 * tokens * LLAMA.hidden * (trainable.vocab - LLAMA.vocab_size)  # 500 -> 512
    assert report["matmul_flops"] == pytest.approx(report["model_flops"] + padding, rel=1e-6)


def test_the_fit_check_does_not_price_moe_steps_as_dense_ones():
    """`train.py --compile-only --target` shows no planner figure for a MoE step: the step
    estimate (`jaxmeg.perf.jaxmeg_memory`) counts dense MLPs."""
    from jaxmeg.training.fit import predicted_step_bytes

    assert predicted_step_bytes(trainable_for(config((1, 1, 1), TOP2))) is None


def test_train_py_refuses_a_step_that_could_hang_before_its_first_step(
    unordered_ticks, tmp_path, small_corpus
):
    """train.py compiles, checks the step (`compilation.check_hazards`) and, where it could
    hang, exits 2 with one line naming the layout and the settings to change, having run and
    written no step. Shown with the tick's ordering switched off (the code before it), which
    otherwise hangs or aborts this layout (`test_a_tick_whose_collectives_no_data_orders_...`)."""
    from tests.helpers import run_script_main

    ran = run_script_main(
        "train", "--config", "configs/moe_tiny.yaml", "--out", str(tmp_path / "run"),
        "--steps", "1", "--no-progress", *small_corpus,
        "--set", "parallel.expert=4", "--set", "parallel.pipe=2", "--set", "moe.top_k=1",
        "--set", "model.layers=2", "--set", "model.seq_len=32", "--set", "model.hidden=32",
        "--set", "moe.shared_experts=0", "--set", "train.global_batch=8",
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr[-2000:]
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could hang on this layout (expert 4 x pipe 2" in errors[0]
    assert "change parallel." in errors[0]
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or not (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    )


def test_the_fused_embedding_sync_sums_the_expert_ranks_first():
    """expert 4 x pipe 2 with `compression.fused_embedding_sync` (the shared gradients and the
    loss in one all-reduce over {first, last stage} x data, `gradients.fused_sync`): with the
    executor's map manual over `expert` each rank holds its share of them, summed over `expert`
    before the fused all-reduce; the step equals one device."""
    from jaxmeg.training.pipeline_step import splits_experts

    cfg = config((1, 2, 1), TOP2, LLAMA, expert=4)
    cfg = dataclasses.replace(cfg, compression=C.CompressionConfig(fused_embedding_sync=True))
    assert splits_experts(trainable_for(cfg))
    check(cfg)
