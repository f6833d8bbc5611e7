"""Where each layer lives: the one object that knows the pipeline layout.

Checkpoints, the model and the single-device reference keep layer stacks in canonical order,
[L, ...]. A run stores them as [v, p, Lc, ...]: chunk c of stage s (virtual stage c p + s) holds
Lc layer slots, `p` sharded over `pipe`. Two placements:
  even     (any schedule) virtual stage u holds layers u Lc .. u Lc + Lc - 1, Lc = L / (p v):
           Megatron's interleaved placement, and for v = 1 contiguous blocks. A reshape.
  uneven   (`stage_layers`, v = 1) stage s holds stage_layers[s] consecutive layers; Lc =
           max(stage_layers) and a shorter stage's trailing slots are padding: identity layers
           whose parameters are zero, receive zero gradients, and are counted nowhere.
State init, the executor, checkpoint conversion, the performance model and validation all ask
this object; nothing else computes a layer's place.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import numpy as np

PADDING = -1
PLACEMENTS = ("interleaved", "v")
PADDING_SLOT = "padding_slot_"
"""The name scope of a layer slot's conditional where some stage pads the slot
(`StageLayout.padding_slots`), followed by the slot's index: branch 1 runs the slot's layer (its
forward, backward or weight gradients) on the stages that hold more layers than the index,
branch 0 passes x (or the accumulator) through. The cost report weighs it per stage
(`StageLayout.padding_branches`)."""


class LayoutError(ValueError):
    """A layer split that cannot be built; the message names the field and the numbers."""


def _as_int(field: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"{field} must be an integer, got {value!r}") from None


UNROLLED_LAYERS = 4
"""A chunk of up to this many layer slots runs its layers one after another rather than in a
scan (an uneven stage's padding slots each under a conditional): each layer's residuals are
then arrays of their own, written straight into the pipeline's rings, where a scan first stacks
them in its outputs; its first layer's input is the stage input itself."""


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Layer l -> (stage, chunk, position); built with `StageLayout.create`."""

    num_layers: int
    num_stages: int
    num_chunks: int
    stage_layers: tuple[int, ...]
    """Real layers per stage (all chunks together)."""
    uneven: bool
    placement: str = "interleaved"
    """`interleaved` (virtual stage c p + s) or `v` (see the module docstring)."""

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_stages: int = 1,
        num_chunks: int = 1,
        stage_layers: tuple[int, ...] | list[int] = (),
        placement: str = "interleaved",
        field: str = "model.layers",
    ) -> StageLayout:
        """The even split of `num_layers` over p stages and v chunks, or the uneven split
        `stage_layers` (one count per stage, v = 1); `placement` `v` puts two chunks in a V.
        Raises LayoutError naming the numbers, the layers as `field` (the config's name)."""
        L = _as_int(field, num_layers)
        p = _as_int("parallel.pipe", num_stages)
        v = _as_int("parallel.chunks", num_chunks)
        for name, value in ((field, L), ("parallel.pipe", p), ("parallel.chunks", v)):
            if value < 1:
                raise LayoutError(f"{name} must be >= 1, got {value}")
        if placement not in PLACEMENTS:
            raise LayoutError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
        if placement == "v" and (v != 2 or stage_layers):
            raise LayoutError(
                f"the V placement (zbv) needs parallel.chunks = 2 and an even split, got "
                f"parallel.chunks = {v}, parallel.stage_layers = {list(stage_layers)}"
            )
        if not stage_layers:
            if L % (p * v):
                raise LayoutError(
                    f"{field} ({L}) must be divisible by parallel.pipe * parallel.chunks = "
                    f"{p} * {v} = {p * v} (or give parallel.stage_layers, one count per stage)"
                )
            return cls(L, p, v, (L // p,) * p, uneven=False, placement=placement)
        counts = tuple(_as_int("parallel.stage_layers entry", n) for n in stage_layers)
        if len(counts) != p:
            raise LayoutError(
                f"parallel.stage_layers has {len(counts)} entries {list(counts)}, but "
                f"parallel.pipe is {p}: give one layer count per pipeline stage"
            )
        if min(counts) < 1:
            raise LayoutError(
                f"parallel.stage_layers entries must be >= 1, got {list(counts)} "
                f"(stage {counts.index(min(counts))} has {min(counts)})"
            )
        if sum(counts) != L:
            raise LayoutError(
                f"parallel.stage_layers {list(counts)} sums to {sum(counts)}, but {field} is {L}"
            )
        if v > 1:
            raise LayoutError(
                f"parallel.stage_layers needs one chunk per stage (gpipe or 1f1b), got "
                f"parallel.chunks = {v}"
            )
        return cls(L, p, v, counts, uneven=len(set(counts)) > 1)

    @property
    def unrolled(self) -> bool:
        """Whether a chunk runs its layers one after another (`UNROLLED_LAYERS`; a padding slot
        of a shorter stage under a conditional that skips it)."""
        return self.layers_per_chunk <= UNROLLED_LAYERS

    @property
    def padding_slots(self) -> tuple[int, ...]:
        """The layer slots some stage pads: from the shortest stage's count on (none if even)."""
        if not self.uneven:
            return ()
        return tuple(range(min(self.stage_layers), max(self.stage_layers)))

    def padding_branches(self) -> dict[str, tuple[int, ...]]:
        """Per padding slot's scope (`PADDING_SLOT`), the branch each stage runs (the cost
        report's chosen branches)."""
        return {
            f"{PADDING_SLOT}{i}": tuple(int(i < n) for n in self.stage_layers)
            for i in self.padding_slots
        }

    @property
    def reshaped(self) -> bool:
        """Whether [L, ...] <-> [v, p, Lc, ...] is a reshape (even and interleaved)."""
        return not self.uneven and self.placement == "interleaved"

    @property
    def layers_per_chunk(self) -> int:
        """Lc: layer slots per chunk, padding included."""
        return max(self.stage_layers) // self.num_chunks

    @property
    def shape(self) -> tuple[int, int, int]:
        """(v, p, Lc): the leading dims of a layer stack in the run's layout."""
        return self.num_chunks, self.num_stages, self.layers_per_chunk

    @functools.cached_property
    def layer_index(self) -> np.ndarray:
        """int [v, p, Lc]: the canonical layer in each slot, PADDING (-1) where none."""
        v, p, lc = self.shape
        if self.placement == "v":
            virtual = np.array([[s, 2 * p - 1 - s] for s in range(p)]).T  # [v, p]
            return virtual[..., None] * lc + np.arange(lc)
        if not self.uneven:
            return np.arange(self.num_layers).reshape(v, p, lc)
        index = np.full((v, p, lc), PADDING)
        start = 0
        for s, count in enumerate(self.stage_layers):
            index[0, s, :count] = np.arange(start, start + count)
            start += count
        return index

    @functools.cached_property
    def chunk_layers(self) -> np.ndarray:
        """int [v, p]: real layers in each chunk (they come first; padding trails)."""
        return (self.layer_index != PADDING).sum(axis=-1)

    def place(self, layer: int) -> tuple[int, int, int]:
        """(stage, chunk, position) of canonical layer `layer`."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        c, s, pos = np.argwhere(self.layer_index == layer)[0]
        return int(s), int(c), int(pos)

    @functools.cached_property
    def _canonical_slots(self) -> np.ndarray:
        """int [L]: flat slot (in v p Lc order) of each canonical layer."""
        flat = self.layer_index.reshape(-1)
        return np.argsort(np.where(flat == PADDING, flat.size, flat), kind="stable")[
            : self.num_layers
        ]

    def to_stages(self, stack):
        """[L, ...] -> [v, p, Lc, ...]; padding slots are zeros. numpy or jax arrays."""
        if self.reshaped:
            return stack.reshape(*self.shape, *stack.shape[1:])
        index = self.layer_index.reshape(-1)
        gathered = stack[np.maximum(index, 0)]
        real = (index != PADDING).reshape(-1, *([1] * (stack.ndim - 1)))
        return (gathered * real.astype(gathered.dtype)).reshape(*self.shape, *stack.shape[1:])

    def to_canonical(self, stack):
        """[v, p, Lc, ...] -> [L, ...] (padding dropped). numpy or jax arrays."""
        flat = stack.reshape(-1, *stack.shape[3:])
        if self.reshaped:
            return flat
        return flat[self._canonical_slots]

    def describe(self) -> str:
        """e.g. 'stages hold [5, 3] layers (padded to 5)' for progress output."""
        if self.placement == "v":
            return f"{self.num_stages} stages x 2 chunks in a V x {self.layers_per_chunk}"
        if not self.uneven:
            return f"{self.num_stages} stages x {self.num_chunks} chunks x {self.layers_per_chunk}"
        return f"stages hold {list(self.stage_layers)} layers (padded to {self.layers_per_chunk})"
