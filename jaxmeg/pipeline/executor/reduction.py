"""Where a chunk's gradients are reduced over `data` (x `context`) inside the tick loop: one
mode, chosen once (`choose`) and read by the columns, the carry, the slot bodies, the units
beside the slots and the step's final reduction."""

from __future__ import annotations

import dataclasses

NONE = "none"
"""No data axis: the step's final reduction only (over `pipe` where embeddings are tied)."""
AFTER = "after"
"""The mean (PowerSGD's where compressed) of the chunk whose last backward ran in the tick
before, from `pending`, beside this tick's slots, written back at the tick's end."""
BESIDE_B = "beside_b"
"""AFTER, but in one loop with that tick's B slot where one runs (a GPU overlaps the two)."""
SCATTER = "scatter"
"""A sharded optimizer: the chunk's reduce-scatter into the split accumulator `g_reduced`, in
the tick of its last backward, after the slots."""
WHERE = (NONE, AFTER, BESIDE_B, SCATTER)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The in-loop reduction's mode.

    where: one of WHERE
    layers: the chunk's last B (or, with split backwards, its last W) reduces each of its layers
        but the first itself as soon as that layer's gradient is final
        (`accumulator.add_reducing_layers`), beside the next layer's backward: a mean
        written back, or the reduce-scatter into `g_reduced`; `pending` (or the scatter after
        the slot) then takes the first layer only
    """

    where: str = NONE
    layers: bool = False

    def __post_init__(self) -> None:
        if self.where not in WHERE or (self.layers and self.where == NONE):
            raise ValueError(f"no such reduction: {self}")

    @property
    def in_loop(self) -> bool:
        """A chunk's gradients are reduced inside the loop."""
        return self.where != NONE

    @property
    def mean(self) -> bool:
        """The chunk's mean runs from `pending` in the tick after its last backward."""
        return self.where in (AFTER, BESIDE_B)

    @property
    def pending_layers(self) -> int | None:
        """How many of a chunk's leading layers `pending` (or the scatter) takes (None: all)."""
        return 1 if self.layers else None


NO_REDUCTION = Reduction()
"""No data axis."""


def choose(
    *, data_replicas: int, sharded: bool, overlap_sends: bool, powersgd: bool, paired: bool,
    last_reduces: bool, layers_per_chunk: int,
) -> Reduction:  # fmt: skip
    """The mode for `data_replicas` = data x context replicas, a sharded optimizer, the
    GPU's overlapped sends, PowerSGD, a table of F&B pairs, and whether a chunk's last backward
    action is known (`last_reduces`: whole backwards with per-layer chunks, or split ones
    only): the mean beside the B slot and the layer-by-layer reduction come with overlapped
    sends, neither with PowerSGD, the first not with a sharded optimizer or F&B pairs, the
    second with chunks of two or more layers."""
    if data_replicas == 1:
        return NO_REDUCTION
    layers = overlap_sends and not powersgd and last_reduces and layers_per_chunk > 1
    if sharded:
        return Reduction(SCATTER, layers)
    beside = overlap_sends and not powersgd and not paired
    return Reduction(BESIDE_B if beside else AFTER, layers)
