"""Zero-bubble stage orders (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism"): the
backward of a chunk is split into I (the cotangent of its input, which the previous virtual
stage waits for) and W (its weight gradients, which nothing waits for), and W fills bubbles.

Each function returns one stage's order as actions (kind, microbatch, chunk), kind in F, I, W
(and B, a whole backward, where ZB-V keeps one). The orders are the per-rank orders of PyTorch's
`torch.distributed.pipelining` schedules with the idle steps dropped, so that a run here and
there executes the same actions in the same sequence on every stage:
  zb_h1           `ScheduleInterleavedZeroBubble` with one stage per rank (ZB-H1): p - s - 1
                  warm-up forwards, then F and I alternately; W starts after s such pairs and
                  then follows every I, the oldest pending W first; the rest of W at the end.
  interleaved_zb  the same with v chunks per rank (chunk c of stage s is virtual stage c p + s):
                  microbatches go through the chunks in rounds of m / max(1, m // p), and the
                  warm-up is (v - 1) x that + p - s - 1 forwards.
  zbv             `ScheduleZBVZeroBubble` (ZB-V): two chunks per stage in a V, chunk 0 of stage
                  s is virtual stage s and chunk 1 is 2p - 1 - s, so stage 0 runs the first and
                  the last virtual stage (embedding and loss on one device) and the turn at the
                  bottom stays on stage p - 1.
"""

from __future__ import annotations

import collections

Action = tuple[str, int, int]


def rounds(num_stages: int, num_microbatches: int) -> tuple[int, int]:
    """(rounds, microbatches per round) of the interleaved orders: max(1, m // p) rounds; m
    must be a multiple of the number of rounds (ValueError otherwise)."""
    p, m = num_stages, num_microbatches
    count = max(1, m // p)
    if m % count:
        raise ValueError(
            f"interleaved_zb and zb_h1 need num_microbatches ({m}) to be a multiple of its "
            f"rounds, max(1, m // num_stages) = {count}"
        )
    return count, m // count


def interleaved_order(p: int, s: int, m: int, v: int) -> tuple[Action, ...]:
    """Stage s's order under `interleaved_zb` (v >= 2) or `zb_h1` (v = 1)."""
    _, per_round = rounds(p, m)
    total = m * v
    warmup = min((v - 1) * per_round + (p - 1 - s), total)

    def forward_chunk(k: int) -> int:
        return (k // per_round) % v

    def backward_chunk(k: int) -> int:
        return v - 1 - ((k - warmup) // per_round) % v

    count = {kind: collections.Counter() for kind in "FIW"}
    order: list[Action] = []

    def add(kind: str, chunk: int) -> None:
        order.append((kind, count[kind][chunk], chunk))
        count[kind][chunk] += 1

    backward_steps: list[int] = []
    for k in range(total + warmup):  # warm-up: F; steady: F, I (, W); cool-down: I (, W)
        if k < total:
            add("F", forward_chunk(k))
        if k >= warmup:
            add("I", backward_chunk(k))
            backward_steps.append(k)
            if k - warmup >= s:  # W starts once s I's are pending, the oldest first
                add("W", backward_chunk(backward_steps[count["W"].total()]))
    while count["W"].total() < len(backward_steps):
        add("W", backward_chunk(backward_steps[count["W"].total()]))
    return tuple(order)


def v_order(p: int, s: int, m: int) -> tuple[Action, ...]:
    """Stage s's order under `zbv` (chunk 0 = virtual stage s, chunk 1 = 2p - 1 - s). The
    order is written for max(m, 2p - 1) microbatches; actions of microbatches >= m drop out."""
    n = max(2 * p - 1, m)
    count = {(kind, c): 0 for kind in "FIW" for c in (0, 1)}
    order: list[Action] = []

    def add(kind: str, chunk: int) -> None:
        order.append((kind, count[kind, chunk], chunk))
        count[kind, chunk] += 1

    for _ in range(2 * (p - s) - 1):  # warm-up: chunk 0 forwards
        add("F", 0)
    for _ in range(s):  # then both chunks
        add("F", 1)
        add("F", 0)
    for _ in range(p - s):  # the bottom of the V: chunk 1's F, I, W
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < n:  # steady state
        if count["F", 0] < n:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(s):  # cool-down: I of both chunks, then chunk 0's I and W, then the rest
        add("I", 0)
        add("I", 1)
    for _ in range(p - s):
        add("I", 0)
        add("W", 0)
    for chunk in (1, 0):
        while count["W", chunk] < count["I", chunk]:
            add("W", chunk)
    return tuple(action for action in order if action[1] < m)
