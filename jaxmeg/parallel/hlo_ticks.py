"""The executor's tick loop in a compiled step, as XLA's GPU compiler may have unrolled it: which
loop it is, and which of its body's instructions belong to which tick (`hlo_cost.StepCost`
walks it tick by tick for the schedule bound)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
DOUBLE_BUFFERED = ".double_buffer_clone"
"""How XLA's GPU compiler names the second copy of a loop body's instruction when it unrolls the
loop twice (`xla_gpu_enable_while_loop_double_buffering`); an odd trip count peels the first."""


@dataclasses.dataclass(frozen=True)
class TickLoop:
    """The executor's tick loop in the compiled step: its body, the table's ticks, how many
    ticks one trip runs (`unroll`), and how many ran before the loop (`peeled`)."""

    body: str
    ticks: int
    unroll: int
    peeled: int

    def weight(self, ins, tick: int, per_tick: bool) -> float:
        """How much of `ins` in the body counts for `tick`: a slot in that tick's copy of the
        body all, one in another copy nothing, the rest (the same every tick) 1/unroll. A
        peeled tick counts as the body's first copy."""
        if not per_tick:
            return 1.0 / self.unroll
        copy = int(DOUBLE_BUFFERED in ins.name)
        return float(copy == max(tick - self.peeled, 0) % self.unroll)


def find(comps: dict, ticks: int, per_tick: Callable[[str], bool]) -> TickLoop | None:
    """The loop whose body runs the slots (`per_tick(body)`) of as many trips as the table has
    `ticks`, or (double-buffered) half as many, the first tick peeled when they are odd."""
    for instructions in comps.values():
        for ins in instructions:
            trips = TRIP_RE.search(ins.attributes) if ins.op == "while" else None
            if not trips:
                continue
            body = re.search(r"\bbody=%?([\w.\-]+)", ins.attributes).group(1)
            unroll = 2 if any(DOUBLE_BUFFERED in i.name for i in comps[body]) else 1
            n = int(trips.group(1))
            if n * unroll in (ticks, ticks - 1) and per_tick(body):
                return TickLoop(body, ticks, unroll, ticks - n * unroll)
    return None
