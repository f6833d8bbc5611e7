"""Schedules as data: Megatron's orders, a replayed tick table, buffer sizes, and the lockstep
efficiency against the asynchronous bubble. Pure numpy, no devices."""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import pytest

from jaxmeg.pipeline import ScheduleError, build, lockstep_efficiency, validate
from jaxmeg.pipeline.schedules import Schedule
from jaxmeg.pipeline.tick_table import build_tick_table
from jaxmeg.pipeline.timing import async_efficiency, bubble_fraction

GRID = [(p, m) for p in (2, 4, 8) for m in range(p, 4 * p + 1)]
INTERLEAVED_GRID = [(p, m) for p, m in GRID if m % p == 0]


def megatron_get_schedule_table(num_microbatches, num_model_chunks, group_size):
    """megatron/core/pipeline_parallel/schedules.py: get_schedule_table."""
    schedule_table = []
    for min_microbatch_id_in_group in range(0, num_microbatches, group_size):
        if min_microbatch_id_in_group + group_size >= num_microbatches:
            schedule_table.extend(
                [
                    (microbatch_id, model_chunk_id)
                    for model_chunk_id in range(num_model_chunks)
                    for microbatch_id in range(min_microbatch_id_in_group, num_microbatches)
                ]
            )
        else:
            schedule_table.extend(
                [
                    (microbatch_id, model_chunk_id)
                    for model_chunk_id in range(num_model_chunks)
                    for microbatch_id in range(
                        min_microbatch_id_in_group, min_microbatch_id_in_group + group_size
                    )
                ]
            )
    return schedule_table


def megatron_interleaved(pipeline_parallel_size, pipeline_parallel_rank, num_microbatches, v):
    """A transcription of Megatron-LM core's forward_backward_pipelining_with_interleaving:
    get_pp_rank_microbatches, get_model_chunk_id, and its warm-up / steady / cool-down loops.
    A backward pops its chunk's oldest input tensor (input_tensors[chunk].pop(0)), so the
    backward microbatch of a chunk is first-in first-out."""
    num_model_chunks = v
    group_size = pipeline_parallel_size  # microbatch_group_size_per_vp_stage default
    total_num_microbatches = num_microbatches * num_model_chunks
    num_warmup_microbatches = (pipeline_parallel_size - pipeline_parallel_rank - 1) * 2
    num_warmup_microbatches += (num_model_chunks - 1) * group_size
    if num_warmup_microbatches >= total_num_microbatches:
        num_warmup_microbatches = total_num_microbatches
    num_microbatches_remaining = total_num_microbatches - num_warmup_microbatches
    table = megatron_get_schedule_table(num_microbatches, num_model_chunks, group_size)
    microbatch_id_table, model_chunk_id_table = zip(*table, strict=True)

    def get_model_chunk_id(virtual_microbatch_id, forward):
        model_chunk_id = model_chunk_id_table[virtual_microbatch_id % total_num_microbatches]
        if not forward:
            model_chunk_id = num_model_chunks - model_chunk_id - 1
        return model_chunk_id

    input_tensors = [deque() for _ in range(num_model_chunks)]
    order = []

    def forward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=True)
        input_tensors[chunk].append(microbatch_id_table[k])
        order.append(("F", microbatch_id_table[k], chunk))

    def backward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=False)
        order.append(("B", input_tensors[chunk].popleft(), chunk))

    for k in range(num_warmup_microbatches):
        forward_step_helper(k)
    for k in range(num_microbatches_remaining):
        forward_step_helper(k + num_warmup_microbatches)
        backward_step_helper(k)
    for k in range(num_microbatches_remaining, total_num_microbatches):
        backward_step_helper(k)
    return order


def megatron_1f1b(pipeline_parallel_size, rank, num_microbatches):
    """Megatron-LM core's forward_backward_pipelining_without_interleaving."""
    return one_f_one_b(num_microbatches, min(pipeline_parallel_size - rank - 1, num_microbatches))


def one_f_one_b(num_microbatches, num_warmup):
    """`num_warmup` forwards, then F(num_warmup + i), B(i) alternately, then the rest of B."""
    remaining = num_microbatches - num_warmup
    order = [("F", i, 0) for i in range(num_warmup)]
    for i in range(remaining):
        order += [("F", num_warmup + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(remaining, num_microbatches)]


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", INTERLEAVED_GRID)
def test_interleaved_order_is_megatrons(p, m, v):
    schedule = build("interleaved_1f1b", p, m, num_chunks=v)
    for s in range(p):
        assert schedule.order(s) == megatron_interleaved(p, s, m, v)


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b_min_memory_order_is_megatrons(p, m):
    schedule = build("1f1b", p, m, warmup="min_memory")
    for s in range(p):
        assert schedule.order(s) == megatron_1f1b(p, s, m)


def test_orders_of_gpipe_and_min_bubble():
    assert build("gpipe", 2, 2).order(1) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    order = build("1f1b", 4, 8, warmup="min_bubble").order(0)  # 2 (p - 1) = 6 warm-ups
    assert [kind for kind, _, _ in order[:8]] == ["F"] * 7 + ["B"]
    default = build("1f1b", 4, 8).order(0)  # Megatron's p - 1 = 3 warm-ups
    assert [kind for kind, _, _ in default[:5]] == ["F"] * 4 + ["B"]


def _variants(p, m):
    yield build("gpipe", p, m)
    yield build("1f1b", p, m, warmup="min_memory")
    yield build("1f1b", p, m, warmup="min_bubble")
    if p > 1 and m % p == 0:
        for v in (2, 3, 4):
            yield build("interleaved_1f1b", p, m, num_chunks=v)


@pytest.mark.parametrize("p,m", GRID + [(1, 1), (1, 3), (3, 3), (3, 7)])
def test_every_table_replays_cleanly(p, m):
    for schedule in _variants(p, m):
        report = validate(schedule)
        table = build_tick_table(schedule)
        assert report.num_ticks == table.num_ticks
        assert max(report.input_slots) <= table.num_input_slots
        assert max(report.cot_slots) <= table.num_cot_slots
        for field in dataclasses.fields(table):
            array = getattr(table, field.name)
            if isinstance(array, np.ndarray):
                assert array.dtype == np.int32 and array.shape == (table.num_ticks, p)


@pytest.mark.parametrize("p,m", INTERLEAVED_GRID)
def test_default_schedules_meet_the_asynchronous_bubble(p, m):
    """Lockstep (F slot + B slot per tick, backward = 2 forward) within 2 points of
    1 / (1 + (p - 1) / (v m))."""
    for schedule in [build("1f1b", p, m, warmup="min_bubble")] + [
        build("interleaved_1f1b", p, m, num_chunks=v) for v in (2, 3, 4)
    ]:
        report = validate(schedule)
        assert report.lockstep_efficiency >= report.async_bound - 0.02, (schedule.name, report)
        # Also with the recompute counted in the backward (3 x forward).
        assert report.lockstep_efficiency_recompute >= report.async_bound - 0.02
    for m_other in range(p, 4 * p + 1):  # 1f1b for every m, not only multiples of p
        report = validate(build("1f1b", p, m_other, warmup="min_bubble"))
        assert report.lockstep_efficiency >= report.async_bound - 0.02


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 16), (8, 24)])
def test_asynchronous_time_meets_megatrons_formula(p, m):
    """Event-driven, zero latency: every 1F1B-type order meets 1 / (1 + bubble) exactly, even
    Megatron's min_memory warm-up (its lockstep shortfall is the one tick per hop)."""
    for schedule in [
        build("1f1b", p, m, warmup="min_memory"),
        build("1f1b", p, m, warmup="min_bubble"),
        build("gpipe", p, m),
        build("interleaved_1f1b", p, m, num_chunks=2),
    ]:
        assert async_efficiency(schedule) == pytest.approx(1 / (1 + bubble_fraction(schedule)))


def test_min_memory_warmup_trades_bubble_for_memory():
    fast, lean = build("1f1b", 4, 16, warmup="min_bubble"), build("1f1b", 4, 16)
    fast_report, lean_report = validate(fast), validate(lean)
    assert lean_report.lockstep_efficiency == pytest.approx(8 / 15)  # bound 16 / 19 = 0.842
    assert fast_report.lockstep_efficiency == pytest.approx(16 / 19)
    assert fast_report.input_slots[0] == 2 * 4 - 1 and lean_report.input_slots[0] == 4


def test_min_bubble_warmup_is_the_smallest_that_meets_the_bound():
    """One warm-up forward fewer on any stage s < p - 1 loses the bound (a round trip from stage
    s to the last stage and back takes 2 (p - s - 1) ticks)."""
    p, m = 4, 16
    base = build("1f1b", p, m, warmup="min_bubble")
    for s in range(p - 1):
        orders = list(base.orders)
        w = 2 * (p - s - 1) - 1
        orders[s] = tuple(one_f_one_b(m, w))
        shorter = dataclasses.replace(base, orders=tuple(orders))
        assert lockstep_efficiency(shorter) < lockstep_efficiency(base) - 0.15


@pytest.mark.parametrize("p", [2, 4, 8])
def test_buffers_flat_in_microbatches_except_gpipe(p):
    def slots(name, m, v=1):
        table = build_tick_table(build(name, p, m, num_chunks=v))
        return table.num_input_slots, table.num_cot_slots

    for name, v in [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]:
        assert len({slots(name, m, v) for m in (p, 2 * p, 3 * p, 4 * p, 8 * p)}) == 1, name
    assert slots("gpipe", 4 * p)[0] == 4 * slots("gpipe", p)[0]


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
def test_stored_inputs_saturate_at_two_p(name, v):
    """The rings are sized from m = 2p; the measured peaks do not grow past it."""
    for p in (2, 4, 8):
        at_2p = validate(build(name, p, 2 * p, v))
        at_6p = validate(build(name, p, 6 * p, v))
        assert at_2p.input_slots == at_6p.input_slots and at_2p.cot_slots == at_6p.cot_slots


def _corrupt(table, field, t, s, value):
    array = getattr(table, field).copy()
    array[t, s] = value
    return dataclasses.replace(table, **{field: array})


def test_validator_catches_a_corrupted_table():
    schedule = build("interleaved_1f1b", 4, 8, num_chunks=2)
    table = build_tick_table(schedule)
    validate(schedule, table)

    def rejects(field, where, change):
        t, s = where
        with pytest.raises(ScheduleError):
            validate(schedule, _corrupt(table, field, t, s, change(getattr(table, field)[t, s])))

    def other_slot(slot):
        return (slot + 1) % table.num_input_slots

    rejects("recv_act_slot", np.argwhere(table.recv_act_slot >= 0)[5], other_slot)
    rejects("f_slot", np.argwhere((table.f_slot >= 0) & (table.f_chunk > 0))[2], other_slot)
    rejects("b_slot", np.argwhere(table.b_slot >= 0)[4], other_slot)
    rejects("b_cot_slot", np.argwhere(table.b_cot_slot >= 0)[0], lambda slot: slot + 1)
    rejects("recv_cot_slot", np.argwhere(table.recv_cot_slot >= 0)[1], lambda slot: -1)
    rejects("b_mb", np.argwhere(table.b_mb >= 0)[3], lambda mb: mb + 1)
    rejects("f_mb", np.argwhere(table.f_mb >= 0)[-1], lambda mb: -1)


def test_validator_catches_a_dependency_broken_by_one_tick():
    """Move a backward one tick earlier, into the tick its cotangent arrives in."""
    schedule = build("1f1b", 2, 2)
    table = build_tick_table(schedule)
    t = int(np.argwhere(table.b_mb[:, 0] >= 0)[0][0])
    earlier = table
    for field in ("b_mb", "b_chunk", "b_slot", "b_cot_slot"):
        column = getattr(earlier, field)
        earlier = _corrupt(earlier, field, t - 1, 0, column[t, 0])
        earlier = _corrupt(earlier, field, t, 0, -1)
    with pytest.raises(ScheduleError):
        validate(schedule, earlier)


def test_a_deadlocking_order_is_refused():
    """Stage 1 wants microbatch 1 first; stage 0 sends it only after B of microbatch 0."""
    orders = (
        (("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)),
        (("F", 1, 0), ("F", 0, 0), ("B", 0, 0), ("B", 1, 0)),
    )
    schedule = Schedule("custom", 2, 2, 1, "min_memory", orders)
    with pytest.raises(ValueError, match="deadlocks at tick 1"):
        build_tick_table(schedule)


def test_an_order_missing_an_action_is_refused():
    with pytest.raises(ValueError, match="stage 1 order must run F then B"):
        Schedule("custom", 2, 1, 1, "min_memory", ((("F", 0, 0), ("B", 0, 0)), (("F", 0, 0),)))
    with pytest.raises(ValueError, match="runs B"):
        Schedule("custom", 1, 1, 1, "min_memory", ((("B", 0, 0), ("F", 0, 0)),))


def test_bubble_fraction():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction(build("interleaved_1f1b", 4, 8, num_chunks=2)) == pytest.approx(3 / 16)


BAD = [
    (("zb", 2, 4), {}, r"unknown schedule 'zb'; choose one of \['gpipe', '1f1b'"),
    (("1f1b", 2, 0), {}, "num_microbatches must be >= 1, got 0"),
    (("1f1b", 0, 4), {}, "num_stages must be >= 1, got 0"),
    (("interleaved_1f1b", 2, 4), {"num_chunks": 0}, "num_chunks must be >= 1, got 0"),
    (("1f1b", 2, 2.5), {}, "num_microbatches must be an integer, got 2.5"),
    (
        ("interleaved_1f1b", 4, 6),
        {"num_chunks": 2},
        r"num_microbatches \(6\) to be a multiple of num_stages \(4\)",
    ),
    (("interleaved_1f1b", 1, 4), {"num_chunks": 2}, "num_chunks = 2 needs num_stages > 1"),
    (("1f1b", 2, 4), {"num_chunks": 2}, "1f1b runs one chunk per stage"),
    (("gpipe", 2, 4), {"num_chunks": 2}, "gpipe runs one chunk per stage"),
    (("1f1b", 2, 4), {"warmup": "eager"}, "warmup must be one of"),
]


@pytest.mark.parametrize("args,kwargs,message", BAD)
def test_bad_inputs_name_the_numbers(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(*args, **kwargs)


def test_benchmarks_doc_holds_the_current_efficiency_tables():
    from pathlib import Path

    from jaxmeg.pipeline.analysis import efficiency_tables

    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert efficiency_tables() in doc, "regenerate with: python scripts/plot_schedule.py --table"


def test_the_pipeline_package_imports_in_one_direction():
    """zero_bubble, dual_pipe <- schedules <- timing, tick_table <- analysis; layout stands
    alone. Read
    from the sources, so a lazy import inside a function counts too."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "jaxmeg" / "pipeline"
    allowed = {
        "layout": set(),
        "zero_bubble": set(),
        "dual_pipe": set(),
        "schedules": {"zero_bubble", "dual_pipe"},
        "timing": {"schedules"},
        "tick_table": {"schedules"},
        "analysis": {"schedules", "tick_table", "timing"},
    }
    for module, may_import in allowed.items():
        tree = ast.parse((package / f"{module}.py").read_text())
        imported = {
            node.module.removeprefix("jaxmeg.pipeline.")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxmeg")
        } | {
            alias.name.removeprefix("jaxmeg.pipeline.")
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("jaxmeg")
        }
        assert imported <= may_import, (module, imported - may_import)


@pytest.mark.parametrize("p,m,v", [(2, 2, 4), (4, 4, 2), (4, 8, 2), (2, 4, 1)])
def test_breadth_first_order_stores_and_bubble(p, m, v):
    schedule = build("breadth_first", p, m, num_chunks=v)
    forwards = [("F", mb, c) for c in range(v) for mb in range(m)]
    backwards = [("B", mb, c) for c in reversed(range(v)) for mb in range(m)]
    for stage in range(p):
        assert schedule.order(stage) == forwards + backwards
    report = validate(schedule)
    assert report.input_slots == (m * v,) * p
    assert report.bubble == pytest.approx((p - 1) / (v * m))
    # m >= p: the lockstep table meets the asynchronous bound, like interleaved 1F1B.
    assert report.lockstep_efficiency == pytest.approx(report.async_bound)


def test_breadth_first_with_fewer_microbatches_than_stages_warns_of_the_stall():
    with pytest.warns(
        UserWarning, match=r"num_microbatches \(2\) < num_stages \(4\): every stage stalls 2 ticks"
    ):
        schedule = build("breadth_first", 4, 2, num_chunks=2)
    report = validate(schedule)
    assert report.lockstep_efficiency < report.async_bound
