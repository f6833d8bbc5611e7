"""Schedules as data: Megatron's orders, a replayed tick table, buffer sizes, and the lockstep
efficiency against the asynchronous bubble. Pure numpy, no devices."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest

from jaxmeg.pipeline import ScheduleError, build, check_layers, lockstep_efficiency, validate

GRID = [(p, m) for p in (2, 4, 8) for m in range(p, 4 * p + 1)]


def megatron_interleaved(p: int, s: int, m: int, v: int) -> list:
    """A literal transcription of Megatron-LM core's interleaved loop (warm-up, 1F1B, cool-down)
    and its get_model_chunk_id; microbatch ids come from per-chunk FIFO queues, as there."""
    total = m * v
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)

    def chunk_id(k, forward):
        chunk = (k % (p * v)) // p
        return chunk if forward else v - chunk - 1

    next_mb = {"F": defaultdict(int), "B": defaultdict(int)}

    def action(kind, k):
        chunk = chunk_id(k, kind == "F")
        mb = next_mb[kind][chunk]
        next_mb[kind][chunk] += 1
        return (kind, mb, chunk)

    order = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(action("F", k + warmup))
        order.append(action("B", k))
    order += [action("B", k) for k in range(total - warmup, total)]
    return order


def megatron_1f1b(p: int, s: int, m: int) -> list:
    """Megatron-LM core's forward_backward_pipelining_without_interleaving."""
    warmup = min(p - s - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warmup, m)]


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
def test_interleaved_order_is_megatrons(p, m, v):
    schedule = build("interleaved_1f1b", p, m, num_chunks=v)
    for s in range(p):
        assert schedule.order(s) == megatron_interleaved(p, s, m, v)


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b_min_memory_order_is_megatrons(p, m):
    schedule = build("1f1b", p, m, warmup="min_memory")
    for s in range(p):
        assert schedule.order(s) == megatron_1f1b(p, s, m)


def _variants(p, m):
    yield build("gpipe", p, m)
    yield build("1f1b", p, m, warmup="min_memory")
    yield build("1f1b", p, m, warmup="min_bubble")
    if m % p == 0:
        for v in (2, 3, 4):
            yield build("interleaved_1f1b", p, m, num_chunks=v)


@pytest.mark.parametrize("p,m", GRID)
def test_every_table_replays_cleanly(p, m):
    for schedule in _variants(p, m):
        report = validate(schedule)
        assert report.num_ticks == schedule.tick_table.num_ticks
        assert max(report.input_slots) <= schedule.tick_table.num_input_slots


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m % p == 0])
def test_default_schedules_meet_the_asynchronous_bubble(p, m):
    """Lockstep (F slot + B slot per tick, backward = 2 forward) within 2 points of
    1 / (1 + (p - 1) / (v m))."""
    for schedule in [build("1f1b", p, m)] + [
        build("interleaved_1f1b", p, m, num_chunks=v) for v in (2, 3, 4)
    ]:
        report = validate(schedule)
        assert report.lockstep_efficiency >= report.async_bound - 0.02, (schedule.name, report)
        # Also with the recompute counted in the backward (3 x forward).
        assert lockstep_efficiency(schedule, 3.0) >= report.async_bound - 0.02
    for m_other in range(p, 4 * p + 1):  # 1f1b for every m, not only multiples of p
        report = validate(build("1f1b", p, m_other))
        assert report.lockstep_efficiency >= report.async_bound - 0.02


def test_min_memory_warmup_trades_bubble_for_memory():
    fast, lean = build("1f1b", 4, 16), build("1f1b", 4, 16, warmup="min_memory")
    fast_report, lean_report = validate(fast), validate(lean)
    assert lean_report.lockstep_efficiency < lean_report.async_bound - 0.2  # 0.53 vs 0.84
    assert fast_report.input_slots[0] == 2 * 4 - 1 and lean_report.input_slots[0] == 4


@pytest.mark.parametrize("p", [2, 4, 8])
def test_buffers_flat_in_microbatches_except_gpipe(p):
    def slots(name, m, v=1):
        table = build(name, p, m, num_chunks=v).tick_table
        return table.num_input_slots, table.num_cot_slots

    for name, v in [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]:
        assert len({slots(name, m, v) for m in (p, 2 * p, 3 * p, 4 * p)}) == 1, name
    assert slots("gpipe", 4 * p)[0] == 4 * slots("gpipe", p)[0]


def _corrupt(table, field, t, s, value):
    array = getattr(table, field).copy()
    array[t, s] = value
    return dataclasses.replace(table, **{field: array})


def test_validator_catches_a_corrupted_table():
    schedule = build("interleaved_1f1b", 4, 8, num_chunks=2)
    table = schedule.tick_table
    t, s = np.argwhere(table.recv_act_slot >= 0)[5]
    other = (table.recv_act_slot[t, s] + 1) % table.num_input_slots
    with pytest.raises(ScheduleError):
        validate(schedule, _corrupt(table, "recv_act_slot", t, s, other))
    t, s = np.argwhere(table.b_mb >= 0)[3]
    with pytest.raises(ScheduleError):
        validate(schedule, _corrupt(table, "b_mb", t, s, table.b_mb[t, s] + 1))
    t, s = np.argwhere(table.f_mb >= 0)[-1]
    with pytest.raises(ScheduleError):
        validate(schedule, _corrupt(table, "f_mb", t, s, -1))


BAD = [
    (("zb", 2, 4), {}, "unknown schedule 'zb'"),
    (("1f1b", 2, 0), {}, "num_microbatches must be >= 1, got 0"),
    (
        ("interleaved_1f1b", 4, 6),
        {"num_chunks": 2},
        r"num_microbatches \(6\) to be a multiple of num_stages \(4\)",
    ),
    (("interleaved_1f1b", 1, 4), {"num_chunks": 2}, "num_chunks = 2 needs num_stages > 1"),
    (("1f1b", 2, 4), {"num_chunks": 2}, "1f1b runs one chunk per stage"),
    (("1f1b", 2, 4), {"warmup": "eager"}, "warmup must be one of"),
]


@pytest.mark.parametrize("args,kwargs,message", BAD)
def test_bad_inputs_name_the_numbers(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(*args, **kwargs)


def test_layers_must_divide_into_chunks():
    assert check_layers(8, 2, 2) == 2
    with pytest.raises(
        ValueError, match=r"layers \(12\) must be divisible by stages \* chunks = 4 \* 2 = 8"
    ):
        check_layers(12, 4, 2)
