"""Critical backward transfers (`compression.pipe_grad_phase: epilogue`): the longest-path
analysis of the asynchronous schedule, checked against a brute-force simulation, the counts per
link it gives for every schedule, and the tick-table column. Pure Python, no devices."""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import pytest

from jaxmeg.pipeline.critical_path import (
    b_send_critical,
    backward_send_slack,
    compressed_per_link,
    critical_backward_sends,
    critical_per_link,
    exposed_backward_sends,
    table_orders,
)
from jaxmeg.pipeline.schedules import Schedule, build
from jaxmeg.pipeline.tick_table import build_tick_table
from jaxmeg.pipeline.timing import dependency as action_dependency


def schedule(name, p, m, v=1, warmup="min_memory"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # breadth_first with m < p warns
        return build(name, p, m, v, warmup)


def last_microbatch_chain(p, m, v):
    """The backward sends of the last microbatch, one per virtual stage after the first."""
    return {(u % p, u // p, m - 1) for u in range(1, p * v)}


CASES = [
    ("1f1b", 2, 3, 1, "min_memory"),
    ("1f1b", 3, 5, 1, "min_memory"),
    ("1f1b", 4, 8, 1, "min_memory"),
    ("1f1b", 3, 5, 1, "min_bubble"),
    ("1f1b", 4, 8, 1, "min_bubble"),
    ("gpipe", 3, 4, 1, "min_memory"),
    ("interleaved_1f1b", 2, 4, 2, "min_memory"),
    ("interleaved_1f1b", 3, 6, 2, "min_memory"),
    ("breadth_first", 2, 1, 3, "min_memory"),
    ("breadth_first", 3, 4, 2, "min_memory"),
    ("interleaved_1f1b", 4, 8, 2, "min_memory"),
    ("interleaved_1f1b", 2, 4, 4, "min_memory"),
    ("breadth_first", 4, 8, 2, "min_memory"),
    ("gpipe", 4, 8, 1, "min_memory"),
    ("1f1b", 1, 3, 1, "min_memory"),
]


def simulated_makespan(sch: Schedule, epsilon: Fraction, delayed=None, delay=Fraction(0)):
    """Event-driven run of the orders in exact arithmetic: every transfer costs `epsilon`, the
    transfer into `delayed` ((tail, head) nodes) `delay` more."""
    p, v = sch.num_stages, sch.num_chunks
    end, free, position = {}, [Fraction(0)] * p, [0] * p
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while position[s] < len(sch.orders[s]):
                action = sch.orders[s][position[s]]
                kind, mb, c = action
                node, dependency = (kind, c * p + s, mb), action_dependency(action, s, p, v)
                if dependency is not None and dependency not in end:
                    break
                ready = Fraction(0)
                if dependency is not None:
                    ready = end[dependency]
                    if dependency[1] != node[1]:
                        ready += epsilon + (delay if (dependency, node) == delayed else 0)
                cost = Fraction(1 if kind == "F" else 2, v)
                free[s] = end[node] = max(free[s], ready) + cost
                position[s] += 1
                progressed = True
    assert all(pos == len(order) for pos, order in zip(position, sch.orders, strict=True))
    return max(free)


@pytest.mark.parametrize("args", CASES)
def test_a_send_is_critical_iff_delaying_it_delays_the_step(args):
    """Zero slack <=> a small extra latency on that one transfer lengthens the simulated step
    (transfers cost a small finite epsilon, the extra delay much less)."""
    sch = schedule(*args)
    p = sch.num_stages
    epsilon, delay = Fraction(1, 10_000), Fraction(1, 10_000_000)
    base = simulated_makespan(sch, epsilon)
    critical = critical_backward_sends(sch)
    for s, c, mb in backward_send_slack(sch):
        u = c * p + s
        edge = (("B", u, mb), ("B", u - 1, mb))
        longer = simulated_makespan(sch, epsilon, edge, delay) - base
        assert longer == (delay if (s, c, mb) in critical else 0), (s, c, mb, longer)


@pytest.mark.parametrize("warmup", ["min_memory", "min_bubble"])
def test_all_compresses_m_per_link(warmup):
    counts = compressed_per_link(schedule("1f1b", 4, 8, warmup=warmup), "all")
    assert counts == {(s + 1, s): 8 for s in range(3)}


def test_chunked_all_counts_m_v_per_link_and_m_v_minus_one_on_the_wrap():
    for name in ("interleaved_1f1b", "breadth_first"):
        counts = compressed_per_link(schedule(name, 4, 8, 2), "all")
        assert counts == {(1, 0): 16, (2, 1): 16, (3, 2): 16, (0, 3): 8}, name


def test_1f1b_min_bubble_p4_m8_one_critical_send_per_link_the_last_microbatch():
    """The trainer's warm-up: only B(m - 1)'s chain is critical, 1 per link (not p - s - 1:
    stage s's other cool-down backwards wait for their cotangents, but the last stage's pace
    sets the wait: B(m - 2) and B(m - 3) have slack 1 and 2 forwards on every link)."""
    sch = schedule("1f1b", 4, 8, warmup="min_bubble")
    assert critical_per_link(sch) == {(1, 0): 1, (2, 1): 1, (3, 2): 1}
    assert critical_backward_sends(sch) == last_microbatch_chain(4, 8, 1)
    slack = backward_send_slack(sch)
    assert [slack[(1, 0, mb)] for mb in range(8)] == [(n, 0) for n in (6, 6, 5, 4, 3, 2, 1, 0)]
    assert all(slack[(s, 0, 6)] == (1, 0) and slack[(s, 0, 5)] == (2, 0) for s in (1, 2, 3))


def test_1f1b_min_memory_p4_m8_steady_state_sends_are_critical_too():
    """Megatron's p - s - 1 warm-up has zero slack in the steady state (cotangent down, then
    activation up, takes exactly one F + B), so with any latency the longest path also runs
    through steady-state sends; of the cool-down only the last microbatch's are critical."""
    sch = schedule("1f1b", 4, 8)
    assert critical_per_link(sch) == {(1, 0): 3, (2, 1): 4, (3, 2): 4}
    assert critical_backward_sends(sch) == {(1, 0, mb) for mb in (0, 3, 7)} | {
        (s, 0, mb) for s in (2, 3) for mb in (0, 3, 4, 7)
    }
    slack = backward_send_slack(sch)
    # sender 1's cool-down B(5), B(6): slack 2 and 1 forwards (and some epsilons)
    assert slack[(1, 0, 5)][0] == 2 and slack[(1, 0, 6)][0] == 1


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("backward_cost", [2.0, 3.0])
def test_min_bubble_and_interleaved_critical_sends_are_the_last_microbatchs_chain(p, backward_cost):
    for m in (p, 2 * p, 3 * p + 1, 4 * p):
        sch = schedule("1f1b", p, m, warmup="min_bubble")
        assert critical_backward_sends(sch, backward_cost) == last_microbatch_chain(p, m, 1)
    for v in (2, 4):
        for m in (p, 2 * p, 4 * p):
            sch = schedule("interleaved_1f1b", p, m, v)
            assert critical_backward_sends(sch, backward_cost) == last_microbatch_chain(p, m, v)


def test_interleaved_p4_v2_m8_counts():
    counts = critical_per_link(schedule("interleaved_1f1b", 4, 8, 2))
    assert counts == {(1, 0): 2, (2, 1): 2, (3, 2): 2, (0, 3): 1}


@pytest.mark.parametrize("p", [2, 4])
def test_breadth_first_every_send_is_critical_but_the_wrap_when_m_exceeds_p(p):
    """All stages run backwards back to back; the cotangent that wraps from stage 0 to p - 1
    arrives while p - 1 still runs the later chunk's backwards, unless m <= p."""
    for m in (p // 2 or 1, p, 2 * p):
        for v in (2, 3):
            sch = schedule("breadth_first", p, m, v)
            critical = critical_per_link(sch)
            every = compressed_per_link(sch, "all")
            wrap = (0, p - 1)
            assert critical == {**every, wrap: every[wrap] if m <= p else 0}, (m, v)


def test_gpipe_every_send_is_critical():
    for p, m in ((2, 1), (4, 8), (4, 3)):
        sch = schedule("gpipe", p, m)
        assert critical_per_link(sch) == compressed_per_link(sch, "all")


@pytest.mark.parametrize("args", CASES)
def test_a_small_finite_latency_gives_the_same_sends(args):
    """Up to a fifth of a chunk's forward; from a chunk's forward on, new ties appear."""
    sch = schedule(*args)
    for transfer_cost in (0.01, 0.2 / sch.num_chunks):
        assert critical_backward_sends(sch, 2.0, transfer_cost) == critical_backward_sends(sch)


@pytest.mark.parametrize("args", CASES)
def test_the_column_marks_exactly_the_critical_sends(args):
    sch = schedule(*args)
    table = build_tick_table(sch)
    assert table_orders(table) == sch.orders
    column = b_send_critical(table)
    assert column.dtype == np.int32 and column.shape == table.b_mb.shape
    assert set(np.unique(column)) <= {0, 1}
    assert not column[table.b_mb < 0].any()
    marked = {
        (int(s), int(table.b_chunk[t, s]), int(table.b_mb[t, s]))
        for t, s in zip(*np.nonzero(column), strict=True)
    }
    assert marked == critical_backward_sends(sch)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_1f1b_min_bubble_marks_each_senders_last_b_slot(p, m):
    """The critical sends lie at the end of the step: each stage's last backward."""
    table = build_tick_table(schedule("1f1b", p, m, warmup="min_bubble"))
    column = b_send_critical(table)
    assert not column[:, 0].any()
    for s in range(1, p):
        last_b = int(np.nonzero(table.b_mb[:, s] >= 0)[0][-1])
        assert np.nonzero(column[:, s])[0].tolist() == [last_b]


def test_bad_phase_and_deadlocking_orders_are_named():
    with pytest.raises(ValueError, match="pipe_grad_phase"):
        compressed_per_link(schedule("1f1b", 2, 2), "steady")
    # stage 1 wants F1 first, which stage 0 runs only after B0, which needs stage 1's B0
    stuck = Schedule(
        "custom", 2, 2, 1, "min_memory",
        (
            (("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)),
            (("F", 1, 0), ("F", 0, 0), ("B", 0, 0), ("B", 1, 0)),
        ),
    )  # fmt: skip
    with pytest.raises(ValueError, match="deadlock"):
        critical_backward_sends(stuck)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_epilogue_1f1b_compresses_p_minus_s_minus_1_per_link(p, m):
    counts = compressed_per_link(schedule("1f1b", p, m, warmup="min_bubble"), "epilogue")
    assert counts == {(s + 1, s): p - s - 1 for s in range(p - 1)}
    assert compressed_per_link(schedule("1f1b", p, m, warmup="min_bubble"), "all") == {
        (s + 1, s): m for s in range(p - 1)
    }


def test_epilogue_counts_of_the_other_schedules():
    """The same rule (sends from the tick of the last forward on), not a 1F1B one."""
    interleaved = compressed_per_link(
        schedule("interleaved_1f1b", 4, 8, 2, "min_bubble"), "epilogue"
    )
    assert interleaved == {(1, 0): 7, (2, 1): 6, (3, 2): 5, (0, 3): 4}
    for name, v in (("gpipe", 1), ("breadth_first", 2)):  # every backward follows every forward
        sch = schedule(name, 4, 8, v, "min_bubble")
        assert compressed_per_link(sch, "epilogue") == compressed_per_link(sch, "all")
    megatron = compressed_per_link(schedule("1f1b", 4, 8, warmup="min_memory"), "epilogue")
    assert megatron == {(1, 0): 2, (2, 1): 1, (3, 2): 1}


def test_exposed_sends_follow_the_last_forward_and_never_come_from_the_first_stage():
    table = build_tick_table(schedule("1f1b", 4, 8, warmup="min_bubble"))
    column = exposed_backward_sends(table)
    last_forward = np.flatnonzero((table.f_mb >= 0).any(axis=1))[-1]
    assert not column[:last_forward].any()
    assert not column[:, 0].any()
    assert np.array_equal(column[last_forward:, 1:] > 0, table.b_mb[last_forward:, 1:] >= 0)
