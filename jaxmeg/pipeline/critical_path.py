"""Which backward transfers of a schedule can delay the step.

`compression.pipe_grad_phase: epilogue` compresses only the input cotangents whose transfer the
executor cannot hide: `exposed_backward_sends(table)`, the sends from the tick of the step's last
forward on (the lockstep executor has nothing left to overlap them with; for 1F1B p - s - 1 per
link). The rest of this module is the analysis of the asynchronous schedule, for comparison:
the longest paths through its DAG, found from the orders alone, the same way for every schedule.

The model is the asynchronous one of `timing.async_time`, as a DAG: one node per action
(kind, virtual stage, microbatch), lasting 1/v for a chunk's forward and `backward_cost`/v for
its backward; an edge from each action to the next on its stage, and one from the action it
waits for (`timing.dependency`: F on virtual stage u after F on u - 1; B on u after B on
u + 1, or on the last virtual stage after F on u, the loss being local). An edge between two
virtual stages is a transfer: it costs `transfer_cost` plus an infinitesimal epsilon > 0.
Times are pairs (time, transfers) compared lexicographically, i.e. time + transfers x epsilon:
exact (`Fraction`), with no epsilon constant to choose.

Earliest starts run forward through the DAG, latest starts backward from the makespan; the
slack of an edge is its head's latest start minus its tail's earliest end minus its cost. A
backward send is the edge from B on virtual stage u to B on u - 1, named by its sender
(stage, chunk, microbatch), which is the side that compresses; it is critical when its slack is
zero, i.e. it lies on a longest path, so that any latency added to it delays the step.

Ties: the critical set is the union of all longest paths, so no path is picked over another
and the result does not depend on any iteration order. Epsilon decides between paths of the
same compute time: the one with more transfers is longer, and only it is critical. Without it,
transfers would be critical that any positive latency takes off the longest path (Megatron's
1F1B and interleaved orders have many such ties).

What it gives (docs/schedules.md, "Critical backward transfers"): `1f1b` with `min_bubble` and
`interleaved_1f1b`: exactly the last microbatch's backward chain, one send per virtual stage
after the first; a stage's other cool-down backwards wait for their cotangents, but the wait is
set by the last stage's pace (one F + B per backward), so each has slack. `1f1b` with
`min_memory`: that chain plus steady-state sends, since Megatron's p - s - 1 warm-up leaves no
slack in the steady state (the cycle cotangent down, activation up, takes exactly one F + B).
`gpipe` and `breadth_first`: every send off the wrap-around link.

The tick table keeps each stage's order, so `b_send_critical(table)` reads the orders back from
it and marks the executor's B slots.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from jaxmeg.pipeline.schedules import Action, Schedule, prev_stage
from jaxmeg.pipeline.tick_table import TickTable
from jaxmeg.pipeline.timing import dependency

PHASES = ("all", "epilogue")
"""`compression.pipe_grad_phase`: compress every backward transfer, or only the critical ones."""

Node = tuple[str, int, int]
"""(kind, virtual stage, microbatch): the keys `timing.dependency` names."""
Time = tuple[Fraction, int]
"""(time, transfers): time plus an infinitesimal epsilon per transfer."""
Send = tuple[int, int, int]
"""(stage, chunk, microbatch) of a backward whose input cotangent goes to the previous virtual
stage."""

_LOCAL: Time = (Fraction(0), 0)


def _add(a: Time, b: Time) -> Time:
    return (a[0] + b[0], a[1] + b[1])


def _sub(a: Time, b: Time) -> Time:
    return (a[0] - b[0], a[1] - b[1])


def _graph(
    orders: Sequence[Sequence[Action]], p: int, v: int, backward: Fraction, transfer: Time
) -> tuple[dict[Node, Time], dict[Node, list[tuple[Node, Time]]]]:
    """Durations and in-edges {head: [(tail, edge cost)]} of the orders' DAG."""
    duration: dict[Node, Time] = {}
    edges: dict[Node, list[tuple[Node, Time]]] = {}
    for s, order in enumerate(orders):
        before = None
        for action in order:
            kind, mb, c = action
            node = (kind, c * p + s, mb)
            duration[node] = ((Fraction(1) if kind == "F" else backward) / v, 0)
            edges[node] = [] if before is None else [(before, _LOCAL)]
            waits_for = dependency(action, s, p, v)
            if waits_for is not None:
                edges[node].append((waits_for, _LOCAL if waits_for[1] == node[1] else transfer))
            before = node
    return duration, edges


def _topological(edges: dict[Node, list[tuple[Node, Time]]]) -> list[Node]:
    """Kahn's order of the DAG; ValueError naming actions that never get ready (a deadlock)."""
    waiting = {node: len(tails) for node, tails in edges.items()}
    heads: dict[Node, list[Node]] = {node: [] for node in edges}
    for node, tails in edges.items():
        for tail, _ in tails:
            heads[tail].append(node)
    ready = [node for node, count in waiting.items() if count == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for head in heads[node]:
            waiting[head] -= 1
            if waiting[head] == 0:
                ready.append(head)
    if len(order) != len(edges):
        stuck = sorted(node for node, count in waiting.items() if count)
        raise ValueError(f"the orders deadlock; (kind, virtual stage, mb) never ready: {stuck[:6]}")
    return order


def _send_slack(
    orders: Sequence[Sequence[Action]], p: int, v: int, backward: Fraction, transfer: Fraction
) -> dict[Send, Time]:
    """Slack of every backward send of the orders (module docstring)."""
    duration, edges = _graph(orders, p, v, backward, (transfer, 1))
    order = _topological(edges)
    end: dict[Node, Time] = {}  # earliest end
    for node in order:
        start = max((_add(end[tail], cost) for tail, cost in edges[node]), default=_LOCAL)
        end[node] = _add(start, duration[node])
    makespan = max(end.values())
    latest = {node: _sub(makespan, duration[node]) for node in order}  # latest start
    for node in reversed(order):
        for tail, cost in edges[node]:
            latest[tail] = min(latest[tail], _sub(_sub(latest[node], cost), duration[tail]))
    slack = {}
    for node in order:
        for tail, cost in edges[node]:
            if node[0] == tail[0] == "B" and tail[1] == node[1] + 1:
                u, mb = tail[1], tail[2]
                slack[(u % p, u // p, mb)] = _sub(latest[node], _add(end[tail], cost))
    return slack


@functools.lru_cache(maxsize=64)
def backward_send_slack(
    schedule: Schedule, backward_cost: float = 2.0, transfer_cost: float = 0.0
) -> dict[Send, Time]:
    """{(stage, chunk, microbatch): (slack, epsilons)} for every backward send: how much later
    its cotangent could arrive without delaying the step, in forwards of a whole stage plus a
    number of infinitesimal epsilons (the transfer epsilon is the module docstring's).
    `backward_cost` and `transfer_cost` are in forwards of a whole stage, taken exactly.
    Cached; do not mutate the result."""
    return _send_slack(
        schedule.orders,
        schedule.num_stages,
        schedule.num_chunks,
        Fraction(backward_cost),
        Fraction(transfer_cost),
    )


def critical_backward_sends(
    schedule: Schedule, backward_cost: float = 2.0, transfer_cost: float = 0.0
) -> frozenset[Send]:
    """(stage, chunk, microbatch) of every backward whose cotangent transfer to the previous
    virtual stage has zero slack: it lies on a longest path of the asynchronous schedule
    (module docstring). Empty for p v = 1 (nothing is sent)."""
    slack = backward_send_slack(schedule, backward_cost, transfer_cost)
    return frozenset(send for send, s in slack.items() if s == _LOCAL)


def link(stage: int, chunk: int, num_stages: int) -> tuple[int, int]:
    """(sender, receiver) stages of the cotangent that B on (stage, chunk) sends."""
    return (stage, prev_stage(stage, chunk, num_stages)[0])


def _per_link(sends, p: int, v: int) -> dict[tuple[int, int], int]:
    counts = {link(s, c, p): 0 for s in range(p) for c in range(v) if (s, c) != (0, 0)}
    for s, c, _ in sends:
        counts[link(s, c, p)] += 1
    return counts


def critical_per_link(schedule: Schedule, backward_cost: float = 2.0) -> dict[tuple[int, int], int]:
    """Critical backward transfers of the asynchronous schedule per link (sender, receiver)."""
    p, v = schedule.num_stages, schedule.num_chunks
    return _per_link(critical_backward_sends(schedule, backward_cost), p, v)


def exposed_backward_sends(table: TickTable) -> np.ndarray:
    """int32 [num_ticks, p]: 1 where the B slot sends a cotangent that no forward can hide, the
    column `compression.pipe_grad_phase: epilogue` compresses.

    The executor runs in lockstep: a B slot's send must arrive before the receiver's next B
    slot, and the F slot of the next tick runs in between on every stage that has a forward,
    so the tick lasts at least that long anyway and the send overlaps it. From the tick of the
    step's last forward on, no F slot is left: each send then adds its whole time to the step.
    These are the epilogue's transfers. For `1f1b` (the `min_bubble` warm-up) they are the
    sender's cool-down backwards and its last steady-state one, p - s - 1 per step on the link
    from stage s + 1 to s; for the other schedules the same rule gives docs/schedules.md's
    counts (every send for `gpipe` and `breadth_first`, whose backwards all follow the last
    forward)."""
    forwards = np.flatnonzero((table.f_mb >= 0).any(axis=1))
    last_forward = int(forwards[-1]) if forwards.size else 0
    p = table.num_stages
    v = int(table.f_chunk.max()) + 1
    stage = np.arange(p)[None, :]
    sends = (table.b_mb >= 0) & ~((stage == 0) & (table.b_chunk == 0)) & (p * v > 1)
    after = np.arange(table.num_ticks)[:, None] >= last_forward
    return (sends & after).astype(np.int32)


def compressed_per_link(schedule: Schedule, phase: str) -> dict[tuple[int, int], int]:
    """Backward transfers per step that `compression.pipe_grad_phase` = `phase` compresses, per
    link (sender, receiver) that carries any: `all` every one (m per link for v = 1; m v from
    stage s + 1 to s and m (v - 1) on the wrap-around link from 0 to p - 1), `epilogue` those of
    `exposed_backward_sends`."""
    if phase not in PHASES:
        raise ValueError(f"pipe_grad_phase must be one of {list(PHASES)}, got {phase!r}")
    from jaxmeg.pipeline.tick_table import build_tick_table

    p, v = schedule.num_stages, schedule.num_chunks
    if phase == "all":
        return _per_link(backward_send_slack(schedule), p, v)
    table = build_tick_table(schedule)
    column = exposed_backward_sends(table)
    sends = [(int(s), int(table.b_chunk[t, s]), int(table.b_mb[t, s]))
             for t, s in zip(*np.nonzero(column), strict=True)]  # fmt: skip
    return _per_link(sends, p, v)


def table_orders(table: TickTable) -> tuple[tuple[Action, ...], ...]:
    """Each stage's order read back from a tick table: per tick its F slot, then its B slot."""
    orders = []
    for s in range(table.num_stages):
        order = []
        for t in range(table.num_ticks):
            for kind, mb, c in (("F", table.f_mb, table.f_chunk), ("B", table.b_mb, table.b_chunk)):
                if mb[t, s] >= 0:
                    order.append((kind, int(mb[t, s]), int(c[t, s])))
        orders.append(tuple(order))
    return tuple(orders)


def b_send_critical(table: TickTable, backward_cost: float = 2.0) -> np.ndarray:
    """int32 [num_ticks, p]: 1 where the backward in the B slot sends its cotangent over a
    critical transfer (the sender compresses it under `pipe_grad_phase: epilogue`), else 0.
    The orders, and so the column, come from the table itself."""
    p = table.num_stages
    v = int(table.f_chunk.max()) + 1
    slack = _send_slack(table_orders(table), p, v, Fraction(backward_cost), Fraction(0))
    column = np.zeros(table.b_mb.shape, np.int32)
    for t, s in zip(*np.nonzero(table.b_mb >= 0), strict=True):
        send = (int(s), int(table.b_chunk[t, s]), int(table.b_mb[t, s]))
        column[t, s] = slack.get(send) == _LOCAL
    return column
