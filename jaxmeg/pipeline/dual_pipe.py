"""DualPipeV (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", section 3.2.1, in its V form):
two chunks per stage in a V (chunk 0 of stage s is virtual stage s, chunk 1 is 2p - 1 - s, as
`zbv`), and in the steady state a forward of one chunk runs overlapped with a whole backward of
the other chunk, so that each one's communication (the expert all-to-alls, the pipe sends) has
the other's compute to hide under.

`v_order` is stage s's order, the per-rank order of PyTorch's `ScheduleDualPipeV`
(`torch.distributed.pipelining`) with its overlapped F&B pairs written as the forward and then
the backward, next to each other. Kinds: F, B (a whole backward), I and W (a split one: the
first and last backwards of the step are split so that W fills the cool-down's bubbles). The
phases, for p stages (ranks) and m >= 2p microbatches:
  1  2 (p - s - 1) forwards of chunk 0
  2  s + 1 times: F of chunk 0, F of chunk 1
  3  p - s - 1 times: I of chunk 1, the oldest pending W, F of chunk 1
  4  m - 2p + s + 1 times: F0 & B1, then F1 & B0 (the last stage runs its first F0 and B1
     apart: PyTorch does not overlap them, to shorten the bubble)
  5  p - s - 1 times: B of chunk 1, then F1 & B0
  6  s + 1 times: a backward of chunk 1, then one of chunk 0; from the middle of this phase
     on (its (s + 1) // 2-th step: before chunk 1's backward on odd stages, after it on even
     ones) the backwards are split (I, with its W queued)
  7  p - s - 1 times: the oldest pending W, then a backward of chunk 0
  8  the W still pending (s + 1 of them at most).
`pairs(p, s, m)` gives the positions in that order of the overlapped F&B pairs (the forward's).
"""

from __future__ import annotations

import collections

Action = tuple[str, int, int]


def check_microbatches(num_stages: int, num_microbatches: int) -> None:
    """ValueError unless m >= 2p: each of the 2p virtual stages needs a microbatch in flight
    before the steady state's pairs start (PyTorch refuses the same)."""
    if num_microbatches < 2 * num_stages:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 x num_stages = {2 * num_stages} (one "
            f"microbatch per virtual stage of its V), got {num_microbatches}"
        )


class _Order:
    """One stage's order as it is written: microbatch counters per (kind, chunk), a backward's
    counter shared by B and I, and the queue of W that the I's left pending."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.paired: list[int] = []  # the positions of the forwards that run with a B
        self.count: collections.Counter = collections.Counter()
        self.pending_w: collections.deque = collections.deque()

    def forward(self, chunk: int) -> None:
        self.actions.append(("F", self.count["F", chunk], chunk))
        self.count["F", chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        mb = self.count["B", chunk]
        self.count["B", chunk] += 1
        self.actions.append(("I" if split else "B", mb, chunk))
        if split:
            self.pending_w.append((mb, chunk))

    def weight(self) -> None:
        if self.pending_w:
            mb, chunk = self.pending_w.popleft()
            self.actions.append(("W", mb, chunk))

    def pair(self, forward_chunk: int) -> None:
        """F of `forward_chunk` overlapped with B of the other chunk."""
        self.paired.append(len(self.actions))
        self.forward(forward_chunk)
        self.backward(1 - forward_chunk)


def _write(p: int, s: int, m: int) -> _Order:
    check_microbatches(p, m)
    o = _Order()
    for _ in range(2 * (p - s - 1)):
        o.forward(0)
    for _ in range(s + 1):
        o.forward(0)
        o.forward(1)
    for _ in range(p - s - 1):
        o.backward(1, split=True)
        o.weight()
        o.forward(1)
    for i in range(m - 2 * p + s + 1):
        if i == 0 and s == p - 1:
            o.forward(0)
            o.backward(1)
        else:
            o.pair(0)
        o.pair(1)
    for _ in range(p - s - 1):
        o.backward(1)
        o.pair(1)
    split = False
    for i in range(s + 1):
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        o.backward(1, split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        o.backward(0, split)
    for _ in range(p - s - 1):
        o.weight()
        o.backward(0, split)
    for _ in range(s + 1):
        o.weight()
    return o


def v_order(p: int, s: int, m: int) -> tuple[Action, ...]:
    """Stage s's order under `dualpipev` (see the module docstring)."""
    return tuple(_write(p, s, m).actions)


def pairs(p: int, s: int, m: int) -> tuple[int, ...]:
    """The positions in `v_order(p, s, m)` of the forwards that run overlapped with the
    backward right after them."""
    return tuple(_write(p, s, m).paired)
