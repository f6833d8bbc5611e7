"""DualPipeV: its orders against PyTorch's `ScheduleDualPipeV` (a fixture written offline by
tests/fixtures/torch_dualpipev.py), its paired tick table (every listed F&B pair in one tick,
replayed clean, rings flat in m), and the executor running it with the F&B slot: loss and
every gradient equal one device's, dense and mixture-of-experts with an expert axis."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import pytest
import test_moe_step as moe_step
import test_pipeline as tp

import jaxmeg.config as C
from jaxmeg.pipeline import analysis, schedules
from jaxmeg.pipeline.executor.columns import FB_KINDS
from jaxmeg.pipeline.tick_table import PAIRS, build_tick_table
from jaxmeg.training.pipeline_step import make_loss_and_grads
from jaxmeg.training.state import init_state
from tests.helpers import put_batch, random_batch, run_checked_text, trainable_for

TORCH = json.loads((Path(__file__).parent / "fixtures" / "torch_dualpipev.json").read_text())
GRID = sorted((int(p), int(m)) for p, m in (re.match(r"p(\d+)-m(\d+)", k).groups()
                                             for k in TORCH if k.startswith("p")))  # fmt: skip


def _text(schedule: schedules.Schedule, stage: int) -> str:
    """A stage's order as the fixture writes it: pairs joined by "&"."""
    order, paired = schedule.order(stage), set(schedule.paired[stage])
    words, i = [], 0
    while i < len(order):
        took = order[i : i + 2] if i in paired else order[i : i + 1]
        words.append("&".join(f"{kind}{mb}.{chunk}" for kind, mb, chunk in took))
        i += len(took)
    return " ".join(words)


def test_orders_and_pairs_are_pytorchs():
    """Every (p, m) of the fixture (p 2..8, m from 2p to 4p + 3): each stage's actions, and
    which of them run overlapped, as torch's per-rank order."""
    assert len(GRID) == 28
    for p, m in GRID:
        schedule = schedules.build("dualpipev", p, m, num_chunks=2)
        assert [_text(schedule, s) for s in range(p)] == TORCH[f"p{p}-m{m}"], (p, m)


@pytest.mark.parametrize("p,m", [(4, 7), (2, 3), (8, 15)])
def test_too_few_microbatches_is_one_named_error(p, m):
    with pytest.raises(ValueError, match=rf"dualpipev needs num_microbatches >= 2 x num_stages "
                                         rf"= {2 * p} .*got {m}"):  # fmt: skip
        schedules.build("dualpipev", p, m, num_chunks=2)
    cfg = C.apply_overrides(C.Config(), [
        "model.vocab_size=512", f"parallel.pipe={p}", "parallel.schedule=dualpipev",
        "parallel.chunks=2", f"train.global_batch={m}", f"train.microbatches={m}",
    ])  # fmt: skip
    expected = rf"microbatches >= 2 x parallel.pipe = {2 * p} .*got {m}"
    with pytest.raises(C.ConfigError, match=expected):
        C.validate(cfg, p)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_lockstep_table_runs_every_pair_in_one_tick(p):
    """The table replays clean; every F&B pair the orders list shares a tick (and only those:
    `analysis.validate` refuses an F and B together that the order does not pair); the
    stage-input ring does not grow with m; the stored stage inputs peak at p + 1 stage
    microbatches (2p + 2 chunk inputs), DeepSeek's PP + 1 with PP = 2p virtual stages counts
    2p + 1."""
    rings = set()
    for m in (2 * p, 3 * p, 4 * p + 1):
        schedule = schedules.build("dualpipev", p, m, num_chunks=2)
        table = build_tick_table(schedule)
        report = analysis.validate(schedule)
        assert table.ticks == PAIRS and table.split and table.whole_backwards
        assert int(table.paired.sum()) == sum(map(len, schedule.paired)), (p, m)
        rings.add(table.num_input_slots)
        assert report.lockstep_efficiency < report.async_bound
    assert rings == {2 * p + 2}


def test_pairs_split_by_the_order_are_refused():
    """A table whose F and B share a tick where the order does not pair them fails the replay:
    the same schedule with its pairs dropped packs one action per tick."""
    schedule = schedules.build("dualpipev", 2, 4, num_chunks=2)
    unpaired = dataclasses.replace(schedule, paired=((), ()))
    with pytest.raises(analysis.ScheduleError, match="does not pair them"):
        analysis.validate(unpaired, build_tick_table(schedule))
    assert not build_tick_table(unpaired).paired.any()


# -- the executor ---------------------------------------------------------------------------

DENSE = {
    "p4": ((1, 4, 1), tp.MODEL, {}),
    "d2p2t2": ((2, 2, 2), tp.MODEL, {}),
    # full recompute in the F&B slot; ZeRO-3 gathers both slots' chunks
    "d2p2-full-zero3": ((2, 2, 1), dataclasses.replace(tp.MODEL, remat="full"),
                        {"zero_stage": 3}),
    # sequence parallelism: the pipe messages split over tensor 4 as the sequence is
    "p2t4-sequence-parallel": ((1, 2, 4), tp.MODEL, {"sequence_parallel": True}),
    # every-tick sends and late cotangents (they arrive before the F&B slot), ZeRO-1
    "d2p2t2-overlap-zero1": ((2, 2, 2), tp.MODEL,
                             {"overlap_sends": True, "layers": 8, "zero_stage": 1}),
}  # fmt: skip


@pytest.mark.parametrize("case", DENSE)
def test_dense_dualpipev_equals_one_device(case):
    mesh, model, parallel = DENSE[case]
    tp.check_against_single_device(mesh, "dualpipev", 2, 2, model=model, **parallel)


TOP1 = dataclasses.replace(moe_step.TOP2, top_k=1)
MOE = {
    # the rows by ragged all-to-all, a GPU's exchange (off a GPU, its reference)
    "e2p2-top1-ragged": ((1, 2, 1), dataclasses.replace(TOP1, exchange="ragged"), moe_step.LLAMA),
    "e2p2-top2-capacity": ((1, 2, 1), moe_step.CAPACITY, moe_step.GPT),
    "e2p2t2-top2": ((1, 2, 2), moe_step.TOP2, moe_step.LLAMA),
    "e2p2t2-top1-capacity-full": (
        (1, 2, 2), dataclasses.replace(TOP1, capacity_factor=1.0),
        dataclasses.replace(moe_step.LLAMA, remat="full"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", MOE)
def test_moe_dualpipev_equals_one_device(case):
    """expert 2 x pipe 2 (x tensor 2): the exchange's all-to-alls run inside the F&B slot; the
    step passes the deadlock check (`run_checked`) and equals one device."""
    mesh, moe, model = MOE[case]
    cfg = moe_step.config(mesh, moe, model, "dualpipev", 2, microbatches=4, expert=2)
    moe_step.check(cfg)


def test_the_f_and_b_slot_is_in_the_step_and_nothing_in_it_can_hang():
    """The F&B slot's loops are in the compiled step, one per (F kind, B kind) the table
    pairs, and the step has no collective that only some stages reach
    (`hlo_module.deadlock_hazards`, which `run_checked_text` asserts): every pipe send is
    outside the stage-dependent loops."""
    cfg = tp.config(1, 2, 1, "dualpipev", 2, 4)
    trainable = trainable_for(cfg)
    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
    batch = put_batch(trainable, random_batch(cfg))
    _, text = run_checked_text(trainable, make_loss_and_grads(trainable), params, *batch)
    scopes = {kind.scope for kind in FB_KINDS.values() if f"/{kind.scope}/" in text}
    assert scopes == {"f_first_with_b_middle", "f_last_with_b_first", "f_middle_with_b_middle"}


def test_schedules_doc_holds_the_current_dualpipev_table():
    doc = (Path(__file__).parent.parent / "docs" / "schedules.md").read_text()
    assert analysis.dualpipev_table() in doc, (
        "regenerate with: python scripts/plot_schedule.py --table"
    )


def test_the_performance_model_prices_the_lockstep_pairs():
    """The planner's bubble for dualpipev is its lockstep table's (a tick lasts its slowest
    pair), zbv's its orders'; the expert all-to-all is hidden in the share of actions that run
    in pairs, so with the same bubble an MoE layer's time falls by that share of its
    exchange."""
    from jaxmeg.config_io import load
    from jaxmeg.perf import experts, model
    from jaxmeg.perf.hardware import load_hardware
    from jaxmeg.perf.layout import Layout
    from jaxmeg.perf.shape import shape_of

    assert model.pipeline_bubble("dualpipev", 4, 8, 2) == pytest.approx(0.25)  # 6 / 24
    assert model.pipeline_bubble("zbv", 4, 8, 2) == pytest.approx(0.0625)  # 1.5 / 24
    share = model.paired_share("dualpipev", 4, 32, 2)
    assert 0.8 < share < 0.9 and model.paired_share("zbv", 4, 32, 2) == 0.0
    cfg = load(Path(__file__).parent.parent / "configs" / "mixtral_8x7b.yaml")
    shape = shape_of(cfg.model, cfg.moe)
    hw = load_hardware("h100_dgx")
    layout = Layout(tensor=1, data=1, pipe=2, expert=8, chunks=2, microbatches=8, schedule="zbv")
    exposed = experts.moe_seconds(shape, layout, hw)
    hidden = experts.moe_seconds(shape, layout, hw, share)
    assert hidden[0] < exposed[0] and hidden[1] < exposed[1]


def test_the_planner_picks_dualpipev_where_the_pairs_hide_the_exchange():
    """`plan.py --schedule any` prices every schedule that runs a layout: a Mixtral-8x7B
    stack on 32 H100s with expert 8 at batch 512 (m = 64 on pipe 4) runs fastest as
    dualpipev, the all-to-all hidden in its pairs, the exchange rerun in the backward (kept,
    its residuals do not fit pipe 4: `moe.exchange_kept_bound` 1); a dense gpt_1.3b never
    picks it."""
    from jaxmeg.config_io import load
    from jaxmeg.perf import planner
    from jaxmeg.perf.hardware import load_hardware
    from jaxmeg.perf.shape import shape_of

    configs = Path(__file__).parent.parent / "configs"
    hw = load_hardware("h100_dgx")
    mixtral = load(configs / "mixtral_8x7b.yaml")
    plans = planner.plan(shape_of(mixtral.model, mixtral.moe), 32, 512, hw,
                         schedule=planner.ANY, expert=8, recompute=("selective",))  # fmt: skip
    assert plans[0].layout.schedule == "dualpipev", plans[0].layout
    assert (plans[0].layout.pipe, plans[0].layout.exchange_kept_bound) == (4, 1.0)
    names = {p.layout.schedule for p in plans}
    assert {"zbv", "interleaved_zb", "1f1b"} <= names
    dense = load(configs / "gpt_1.3b.yaml", ["model.vocab_size=51200"])
    plans = planner.plan(shape_of(dense.model), 32, 512, hw, schedule=planner.ANY,
                         recompute=("selective",))  # fmt: skip
    assert plans[0].layout.schedule != "dualpipev"
