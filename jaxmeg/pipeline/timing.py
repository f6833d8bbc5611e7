"""The asynchronous timing model of a schedule's orders: every stage runs its next action as
soon as its input is there (no ticks, no communication time). `bubble_fraction` is Megatron's
(p - 1) / (v m) for the whole-backward schedules and read from the orders for the split ones;
`critical_path.py` builds the same model as a DAG (`dependency` names its edges);
`analysis.py` compares the lockstep tick table against it.
"""

from __future__ import annotations

import functools

from jaxmeg.pipeline.schedules import Action, Schedule, build, spec, virtual_stage


def bubble_fraction(
    schedule_or_name: Schedule | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    num_chunks: int = 1,
) -> float:
    """Idle over compute time of the asynchronous schedule: Megatron's (p - 1) / (v m), v = 1
    for gpipe and 1f1b; for the split-backward schedules, read from their orders with F = I = W
    (`async_time`; ZB-H1's is a third of 1F1B's). Takes a Schedule, or (name, p, m, v)."""
    if isinstance(schedule_or_name, Schedule):
        sch = schedule_or_name
        name, p, m, v = sch.name, sch.num_stages, sch.num_microbatches, sch.num_chunks
    elif num_stages is None or num_microbatches is None:
        raise ValueError("bubble_fraction needs a Schedule or name, num_stages, num_microbatches")
    else:
        name, p, m, v = schedule_or_name, num_stages, num_microbatches, num_chunks
    if spec(name).split_backward and p > 1:
        return _split_bubble(name, p, m, v)
    return (p - 1) / (v * m)


@functools.lru_cache(maxsize=256)
def _split_bubble(name: str, p: int, m: int, v: int) -> float:
    schedule = build(name, p, m, v)
    return async_time(schedule) / ideal_time(schedule) - 1.0


def ideal_time(
    schedule: Schedule, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """One stage's compute with no bubble: m (1 + backward), a stage's forward = 1 (backward
    = I + W with `split`)."""
    backward = sum(split) if split else backward_cost
    return schedule.num_microbatches * (1.0 + backward)


def action_cost(
    kind: str, num_chunks: int, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """A chunk's action in forwards of a whole stage: F 1/v, B backward_cost/v, and I and W half
    of B each (each is one pass of the chunk's matmuls, as is F), or (I, W) = `split` (measured
    ratios; B is then their sum)."""
    i_cost, w_cost = split or (backward_cost / 2, backward_cost / 2)
    unit = {"F": 1.0, "B": i_cost + w_cost, "I": i_cost, "W": w_cost}
    return unit[kind] / num_chunks


def dependency(
    action: Action, stage: int, p: int, v: int, placement: str = "interleaved"
) -> tuple[str, int, int] | None:
    """(kind, virtual stage, microbatch) that `action` on `stage` waits for, None if none.
    F on virtual stage u needs F on u - 1; B or I on u needs B or I on u + 1 (both named "B":
    the input cotangent it sends), or F on u if u is last; W on u needs I on u."""
    kind, mb, c = action
    u = virtual_stage(stage, c, p, placement)
    if kind == "F":
        return None if u == 0 else ("F", u - 1, mb)
    if kind == "W":
        return ("B", u, mb)
    return ("F", u, mb) if u == p * v - 1 else ("B", u + 1, mb)


def _done_key(action: Action, stage: int, p: int, placement: str) -> tuple[str, int, int]:
    """The key `dependency` names for a finished action (I is filed under "B")."""
    kind, mb, c = action
    return ("B" if kind == "I" else kind, virtual_stage(stage, c, p, placement), mb)


def async_time(
    schedule: Schedule, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """Makespan when every stage runs its order as soon as its input is there (no ticks, no
    communication time): start = max(stage free, dependency finished); costs `action_cost`.
    Raises ValueError if the orders deadlock."""
    p, v, placement = schedule.num_stages, schedule.num_chunks, schedule.placement
    orders = [schedule.order(s) for s in range(p)]
    finished: dict[tuple[str, int, int], float] = {}
    free, position = [0.0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                waits_for = dependency(action, s, p, v, placement)
                if waits_for is not None and waits_for not in finished:
                    break
                cost = action_cost(action[0], v, backward_cost, split)
                free[s] = max(free[s], finished.get(waits_for, 0.0)) + cost
                finished[_done_key(action, s, p, placement)] = free[s]
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][position[s]] for s in range(p) if position[s] < len(orders[s])}
            raise ValueError(f"schedule {schedule.name} deadlocks; next actions by stage: {stuck}")
    return max(free)


def async_efficiency(
    schedule: Schedule, backward_cost: float = 2.0, split: tuple[float, float] | None = None
) -> float:
    """ideal_time / async_time; Megatron's analysis says 1 / (1 + bubble_fraction)."""
    return ideal_time(schedule, backward_cost, split) / async_time(schedule, backward_cost, split)
