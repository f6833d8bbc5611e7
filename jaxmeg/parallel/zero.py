"""Sharded optimizer (`parallel.zero_stage`): which dim of each parameter a data group splits.

ZeRO (Rajbhandari et al., 2020) as Megatron's distributed optimizer does it:
  stage 1  the master weights (`model.param_dtype`, fp32 by default) and both Adam moments are
           split over `data`: each replica
           updates 1/d of them, from gradients reduce-scattered over `data` (half the bytes of
           an all-reduce's reduce phase); the updated weights are all-gathered for the next
           step's forward.
  stage 3  the same, and the weights stay split while the tick loop runs: each of the F and B
           slots all-gathers a chunk's weights when its order moves to that chunk and keeps them
           until it moves on (2 v gathers per stage and step with `breadth_first`, 2 with
           `1f1b`, about 2 v m / p with `interleaved_1f1b`).
The fp32 gradient accumulators are not split (whole-stage, plus the split ones the in-loop
reduce-scatters fill).
The embedding and head, replicated over `pipe`, are split over `pipe` x `data` instead.

Each parameter (in the run's layout) is split on one dim: the first of its candidates that no
other mesh axis (> 1) splits and whose size the shard count divides; a parameter without one (too
small) stays replicated and is all-reduced as before. `zero_dims` gives that dim per leaf, -1
for none. For layer stacks [v, p, Lc, ...] the candidates are the parameter's first own dim,
then Lc, then its other dims: a GPU reduce-scatters and gathers along the major dim of what it
moves, and a split along a later dim made XLA lay the whole gradient accumulator out with that
dim major and transpose it into and out of every B slot's loop (gpt_1.3b (2,2,2) ZeRO-1 on 8
H100s: 103 GB of copy kernels per step, 23 GB with Lc; docs/benchmarks.md). A split along Lc
is reduced per chunk after its last backward, not layer by layer beside it
(`accumulator.add_reducing_layers` takes only the parameter's own dims).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

NO_DIM = -1
STAGE_AXES = ("data",)
SHARED_AXES = ("pipe", "data")
"""Mesh axes that split a layer-stack leaf / an embedding or head leaf (pipe major)."""


def _entry_axes(entry) -> tuple:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def zero_dim(
    shape: tuple[int, ...], spec: P, shards: int, candidates: list[int], mesh_shape=None
) -> int:
    """The first dim in `candidates` that `spec` leaves unsplit (it names no axis, or only axes
    of size 1 in `mesh_shape`) and `shards` divides."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    sizes = mesh_shape or {}
    for dim in candidates:
        unsplit = all(sizes.get(axis, 2) == 1 for axis in _entry_axes(entries[dim]))
        if unsplit and shape[dim] % shards == 0:
            return dim
    return NO_DIM


def zero_dims(shapes, specs, mesh_shape, is_layer_stack) -> object:
    """Per leaf of `shapes` (ShapeDtypeStructs in the run's layout) the dim split over the
    data group (`is_layer_stack(path)`: layer stacks, split over `data`; others over
    `pipe` x `data`), NO_DIM where none fits."""

    def pick(path, shape_struct, spec):
        shape = tuple(shape_struct.shape)
        if is_layer_stack(path):
            shards = mesh_shape["data"]
            candidates = [3, 2, *range(4, len(shape))]  # own first dim, Lc, the rest
        else:
            shards = mesh_shape["data"] * mesh_shape["pipe"]
            candidates = list(range(len(shape)))
        return zero_dim(shape, spec, shards, candidates, mesh_shape)

    return jax.tree_util.tree_map_with_path(pick, shapes, specs)


def with_zero_axes(spec: P, dim: int, axes: tuple[str, ...], ndim: int) -> P:
    """`spec` with `axes` added on `dim` (unchanged for NO_DIM)."""
    if dim == NO_DIM:
        return spec
    entries = list(spec) + [None] * (ndim - len(spec))
    entries[dim] = axes if len(axes) > 1 else axes[0]
    return P(*entries)


def without_zero_axes(spec: P) -> P:
    """`spec` with the data group's split removed (what `with_zero_axes` added): checkpoints
    store the canonical arrays the same way whatever the zero stage."""
    kept = []
    for entry in spec:
        axes = _entry_axes(entry)
        if axes in (STAGE_AXES, SHARED_AXES):
            axes = ()
        kept.append(None if not axes else axes if len(axes) > 1 else axes[0])
    return P(*kept)
