"""What the executor is given: the model as three functions (`StageFunctions`, with
`SplitFunctions` for a split backward), how a data group splits the params (`ZeroSharding`),
and the options of one build (`ExecutorOptions`). It knows nothing else about the model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxmeg.pipeline import compression, powersgd


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """The head and loss in the pieces that let the last virtual stage of a split backward
    leave the output projection's weight gradient to its W slot; `head_loss(shared, x, t)` is
    `loss(logits(shared, inputs(shared, x), weight(shared)), t)`.

    inputs(shared, x_BxSxD) -> z_BxSxD        what the output projection reads
    weight(shared) -> w                        the projection's weight, a leaf of `shared`
    logits(shared, z_BxSxD, w) -> logits_BxSxV the projection (reads no other leaf's value)
    loss(logits_BxSxV, targets_BxS) -> scalar  microbatch mean
    """

    inputs: Callable
    weight: Callable
    logits: Callable
    loss: Callable


@dataclasses.dataclass(frozen=True)
class SplitFunctions:
    """A chunk whose backward splits into I and W (zero-bubble schedules;
    `jaxmeg.models.split_backward`).

    chunk(chunk_params, x, real_layers, taps) -> (x, matmul inputs [Lc, ...]): the chunk with
        zero taps on its weight matmuls' outputs; chunk_recompute likewise for `model.remat`
        full (the I slot reruns it), or None
    taps(chunk_params, x) -> zero taps [Lc, ...]
    split_weights(tree, taps) -> (matmul weights, rest); merge_weights(weights, rest) -> tree
    weight_grads(matmul inputs, tap cotangents, lead=1) -> the weights' gradients (W), of a
        chunk's layers ([Lc, ...] leaves) or with lead 0 of one layer
    head: the head's pieces (`HeadSplit`), or None: the last virtual stage's F then runs the
        head's whole backward
    """

    chunk: Callable
    chunk_recompute: Callable | None
    taps: Callable
    split_weights: Callable
    merge_weights: Callable
    weight_grads: Callable
    head: HeadSplit | None = None


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model as the executor sees it; it knows nothing else about the model.

    embed(shared, tokens_BxS) -> x_BxSxD                  first virtual stage
    chunk(chunk_params, x_BxSxD, real_layers) -> x_BxSxD  every virtual stage; `real_layers`
        (int32 scalar) of the chunk's layer slots are real, the rest are padding (identity)
    head_loss(shared, x_BxSxD, targets_BxS) -> scalar     last virtual stage (microbatch mean)
    chunk_recompute: same signature as `chunk`, or None: with None the F slot keeps the
        chunk's residuals for the B slot (`model.remat` none / selective); with a function the
        F slot keeps only the stage input and the B slot reruns it (`model.remat` full)
    split: how to split the chunk's backward into I and W, for tables that do (else None)
    per_layer: `chunk` and `chunk_recompute` take the chunk's params as a list of Lc per-layer
        trees (a chunk that runs its layers one after another): each layer's gradient is then
        an array of its own, final when that layer's backward ends, which a reduction over
        `data` can start from while the layers before it run theirs
    weight_gemms: {leaf name: (axis, split)} of the weights whose gradient comes out of their
        GEMMs in other shapes than the leaf's: the leaf joins, along `axis` of a layer's leaf
        (None: no parts), the weights of GEMMs run per part, and each GEMM's output is the
        part's dims before `split` by the rest; per-layer accumulators keep those matrices
        (`jaxmeg.pipeline.accumulator.Parts`)
    """

    embed: Callable
    chunk: Callable
    head_loss: Callable
    chunk_recompute: Callable | None = None
    split: SplitFunctions | None = None
    per_layer: bool = False
    weight_gemms: Mapping[str, tuple] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ZeroSharding:
    """How a data group splits the params (a sharded optimizer; `jaxmeg.parallel.zero`).

    stage: 0 none; 1 gradients reduce-scattered, params arrive whole; 3 params also arrive
        split, and each slot all-gathers a chunk when its order moves to it and keeps it until
        the next (`columns.gather_columns`).
    stage_dims: tree like stage_params, the global dim split over `data` (-1 none).
    shared_dims: tree like shared, the dim split over `shared_axes` (-1 none).
    stage_specs / shared_specs: the params' own specs (trees like stage_params and shared,
        None: no leaf split over an automatic axis): each reduce-scatter and all-gather over
        the data group runs on a device's blocks of the automatic axes they name
        (`gradients.on_blocks`).
    """

    stage: int = 0
    stage_dims: Any = None
    shared_dims: Any = None
    shared_axes: tuple[str, ...] = ("pipe", "data")
    stage_specs: Any = None
    shared_specs: Any = None


@dataclasses.dataclass(frozen=True)
class ExecutorOptions:
    """One build's options besides the model, the table, the layout and the mesh.

    microbatches: m, each replica's rows split into m microbatches.
    zero: the sharded optimizer, if any.
    pipe_compression / data_compression: compressed backward links (Optimus-CC) and PowerSGD
        over `data`; either makes the step stateful (`jaxmeg.training.links`).
    fused_embedding_sync: the shared gradients are reduced by `gradients.fused_sync`.
    scatter_gather (with an automatic `tensor` axis > 1): Megatron-LM's scatter/gather; each
        tensor rank sends 1/t of an activation or cotangent [b, s, h] (its slice of the
        sequence) and the receiver all-gathers it over `tensor`.
    expert_dims: with an `expert` mesh axis > 1, to make the map manual over it too (each
        expert rank then holds its share of every microbatch's rows, and its dense gradients
        are summed over `expert` once per step: `gradients.summed_axes`), a tree like
        stage_params of each leaf's dim split over `expert` (-1 none): a MoE layer's experts.
        None leaves `expert` automatic.
    overlap_sends: every pipe send is one `ppermute` per tick on all the pairs its direction
        ever uses, outside any conditional (what arrives where nothing was sent is not read), and
        a B slot's cotangent leaves at the start of the next tick (without pipe compression):
        XLA's GPU scheduler then runs F's send beside the B slot and B's beside the next F. A
        send over the pairs of the tick only, under a `lax.switch`, can overlap nothing; with
        synchronous collectives (CPU) the every-tick send only adds the idle pairs' bytes.
    pooled_slots: in a zero-bubble table with stored residuals, a microbatch's residuals and
        then its dY share the slot it holds from F to W (`Plan.pooled`). A GPU compile writes
        the dY in place once the residuals are read; XLA:CPU, which drops the optimization
        barriers that would order them, copies the pool twice per I slot instead.
    """

    microbatches: int
    zero: ZeroSharding = ZeroSharding()
    pipe_compression: compression.PipeCompression | None = None
    data_compression: powersgd.DataCompression | None = None
    fused_embedding_sync: bool = False
    scatter_gather: bool = False
    overlap_sends: bool = False
    expert_dims: Any = None
    pooled_slots: bool = False

    @property
    def splits_experts(self) -> bool:
        """The map is manual over `expert` (where the mesh has one > 1)."""
        return self.expert_dims is not None

    @property
    def stateful(self) -> bool:
        return self.pipe_compression is not None or self.data_compression is not None
