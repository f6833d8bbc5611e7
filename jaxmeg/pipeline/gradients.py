"""Microbatch gradient accumulation and the step's gradient reductions over `data` and `pipe`
(the stage accumulator's two forms: `accumulator`).

The one home of both for every layout (pipe = 1 is the degenerate pipeline): the executor calls
these inside its `shard_map`, manual over `data` and `pipe`. Gradients accumulate in fp32 in the
tick loop's carry; a step then makes
  stage gradients:   one pmean over `data` (each stage reduces its own layers);
  shared gradients:  one all-reduce over `pipe` x `data`: the sum over stages (embedding grads of
                     the first stage plus head grads of the last; with tied embeddings, the two
                     copies' sum) and the mean over replicas at once;
  loss:              the same (only the last stage has it).
With `data` > 1 each chunk's layer gradients are reduced inside the tick loop, in the tick
after the chunk's last backward on its stage, beside that tick's slots (where the executor says
so, its last B slot reduces each layer but the first itself, as the layer's backward ends:
`accumulator.add_reducing_layers`); after the loop only the shared gradients and the loss are
reduced (and the stage gradients' sums divided into their mean where the loop summed them:
`reduce_over_data(mean=False)`, `mean_of_sum`). With a sharded optimizer every reduction is a
reduce-scatter (`reduce_scatter`) into split accumulators. With PowerSGD
(`compression.data_grad_rank`) a chunk's reduction on the stages that compress is
`powersgd.reduce` (`reduce_chunk_compressed`); with the fused embedding sync
(`compression.fused_embedding_sync`) the shared gradients and the loss are reduced over
{first, last stage} x data only (`fused_sync`).
With context parallelism (a `context` axis > 1, manual too) each context rank's gradients and
loss are those of its part of every sequence, so they are averaged over `context` exactly as
over `data`, in the same collectives: `replica_axes` is (data, context) then. With expert
parallelism, where the caller makes the map manual over `expert` too, each expert rank holds
its share of every microbatch's rows and weighs its loss by that share (`loss_scale`), so the
dense gradients and the loss are summed over `expert` in the same collectives
(`summed_axes`): once per chunk and step, not in every backward, where an automatic `expert`
has XLA reduce them; a rank's own experts' gradients already hold every rank's rows (the
exchange's backward brought them) and are reduced over the replicas only (`reduce_over_data`).
When every manual axis has size 1 the reductions are skipped: they are the identity, and
XLA refuses a cross-device reduction in a manual partition whose manual axes all have size 1
(the mesh (1, 1, t) with t > 1; the executor then runs its shard_map without type checks).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmeg.pipeline import powersgd, rings


def zeros_f32(tree):
    """fp32 accumulators shaped like `tree` (and varying over the same manual axes)."""
    return jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), tree)


def accumulate(acc, delta):
    """acc + delta, delta cast to the accumulator's dtype."""
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, delta)


MANUAL_AXES = ("data", "pipe")
"""The executor's manual axes, with `context` where it is > 1 and `expert` where the caller
splits rows over it (`manual_axes`)."""
EXPERT = "expert"


def manual_axes(mesh_shape, expert: bool = False) -> tuple[str, ...]:
    """The axes the executor's map is manual over on a mesh of `mesh_shape`: `context` where
    > 1, and `expert` where > 1 and `expert` (the caller's choice: `ExecutorOptions`)."""
    axes = [*MANUAL_AXES]
    if mesh_shape.get("context", 1) > 1:
        axes.append("context")
    if expert and mesh_shape.get(EXPERT, 1) > 1:
        axes.append(EXPERT)
    return tuple(axes)


def map_axes(mesh_shape, expert: bool = False) -> tuple[str, ...]:
    """The axes the executor's map is over: its `manual_axes`, and every other axis of the
    mesh when those all have size 1. In a map manual over only some axes jax constrains the
    sharding of every value it lowers (an open constraint per op: on (2, 4, 1) `1f1b` 40% of
    the step's StableHLO) and Shardy propagates through each; with nothing left to partition,
    a map over every axis has none of them and XLA compiles the step about a third faster.
    Nothing varies over the extra axes (no spec names them), so the step is the same."""
    axes = manual_axes(mesh_shape, expert)
    rest = tuple(a for a in mesh_shape if a not in axes)
    return (*axes, *rest) if all(mesh_shape[a] == 1 for a in rest) else axes


def trivial(mesh_shape, expert: bool = False) -> bool:
    """Whether every manual axis has size 1, so no reduction is needed (or allowed)."""
    return all(mesh_shape[axis] == 1 for axis in manual_axes(mesh_shape, expert))


def inside_manual_axes() -> tuple[str, ...]:
    """Inside the executor's map: its manual axes (`manual_axes` of its mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = mesh.manual_axes
    # a context or expert of size 1 is manual only in a map over every axis (`map_axes`)
    return tuple(
        a for a in (*MANUAL_AXES, "context", EXPERT)
        if a in manual and (a in MANUAL_AXES or mesh.shape[a] > 1)
    )  # fmt: skip


def _inside_sizes() -> dict[str, int]:
    return {a: jax.lax.axis_size(a) for a in inside_manual_axes()}


def replica_axes(manual: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The axes over which gradients are averaged among the executor's manual axes (default:
    inside its map, the current ones): `data` and, with context parallelism, `context`."""
    manual = inside_manual_axes() if manual is None else manual
    return ("data", "context") if "context" in manual else ("data",)


def summed_axes(manual: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The manual axes over which the dense gradients are summed: `expert` where the map is
    manual over it (each expert rank's loss is its rows' share of its replica's:
    `loss_scale`), else none."""
    manual = inside_manual_axes() if manual is None else manual
    return (EXPERT,) if EXPERT in manual else ()


def loss_scale(m: int) -> float:
    """Inside the map: the weight of one microbatch's mean loss on a device: 1 / m, and 1 /
    expert where the map is manual over `expert` (each rank holds 1/expert of every
    microbatch's rows), so that the sum over `expert` is the replica's loss and every
    cotangent is what it is with the rows together."""
    return 1.0 / (m * math.prod(jax.lax.axis_size(a) for a in summed_axes()))


def replicas() -> int:
    sizes = _inside_sizes()
    return sizes["data"] * sizes.get("context", 1)


def _psum(tree, axis: str | tuple[str, ...]):
    return tree if trivial(_inside_sizes(), expert=True) else jax.lax.psum(tree, axis)


def _by_kind(tree, experts, dense_fn, expert_fn):
    """`dense_fn` of the dense leaves and `expert_fn` of the expert leaves of `tree` (each
    called once, on a tree with the other kind's leaves left out); `experts`: a tree like
    `tree` of bools (True: a leaf split over the manual `expert` axis), or None (all dense)."""
    if not summed_axes():
        return dense_fn(tree)
    if experts is None:
        experts = jax.tree.map(lambda _: False, tree)
    leaves, treedef = jax.tree.flatten(tree)
    flags = treedef.flatten_up_to(experts)
    dense = iter(dense_fn([a for a, f in zip(leaves, flags, strict=True) if not f]))
    split = iter(expert_fn([a for a, f in zip(leaves, flags, strict=True) if f]))
    return jax.tree.unflatten(treedef, [next(split) if f else next(dense) for f in flags])


def reduce_over_data(tree, experts=None, mean: bool = True):
    """The data-parallel gradient reduction: the mean over the replicas (`replica_axes`), and
    for the dense leaves the sum over `summed_axes`. A rank's own experts (the leaves
    `experts` marks, as in `_by_kind`) already hold every expert rank's rows' gradient: the
    exchange's backward brought them. `mean=False`: the sum over the replicas, which
    `mean_of_sum` makes the mean (a collective's result is a buffer of its own, so a divide
    right after it is one more pass over every gradient, where after the tick loop it fuses
    into the optimizer's update)."""
    axes = replica_axes()

    def dense(t):
        return _mean_of(_psum(t, (*axes, *summed_axes())), mean)

    return _by_kind(tree, experts, dense, lambda t: _mean_of(_psum(t, axes), mean))


def mean_of_sum(tree):
    """`reduce_over_data(..., mean=False)`'s sum over the replicas as their mean."""
    return _mean_of(tree, True)


def _mean_of(summed, mean: bool):
    count = replicas()
    return jax.tree.map(lambda a: a / count, summed) if mean and count > 1 else summed


def _sum_stages_mean_replicas(tree):
    return mean_of_sum(_psum(tree, (*MANUAL_AXES, *replica_axes()[1:], *summed_axes())))


def drop_leading_dims(dims, count: int):
    """Split dims (-1 = none) of arrays seen without their first `count` dims."""
    return jax.tree.map(lambda dim: dim - count if dim >= 0 else dim, dims)


def drop_leading_specs(specs, count: int):
    """Specs of arrays seen without their first `count` dims (None stays None)."""
    return jax.tree.map(lambda s: P(*tuple(s)[count:]), specs, is_leaf=_is_spec)


def reduce_chunk_compressed(part, chunk, state, dc):
    """(reduced part, new state): one chunk's gradients `part` reduced over `data` by PowerSGD
    (`powersgd.reduce`) with the chunk's slice of `state` (leaves [v, ...]), updated in place."""
    reduced, new = powersgd.reduce(part, jax.tree.map(lambda a: a[chunk], state), dc)
    return reduced, jax.tree.map(lambda a, n: rings.write(a, chunk, n), state, new)


def broadcast_rounds(p: int) -> list[list[tuple[int, int]]]:
    """ppermute rounds that copy a value held by stages 0 and p - 1 to the stages between: each
    round every holder sends to one stage still without it (sources and targets distinct)."""
    holders, missing, rounds = [0, p - 1], list(range(1, p - 1)), []
    while missing:
        pairs = []
        for source in list(holders):
            if not missing:
                break
            # stage 0's side fills upwards, stage p - 1's downwards: neighbours first
            target = missing.pop(0) if source < p // 2 else missing.pop()
            pairs.append((source, target))
            holders.append(target)
        rounds.append(pairs)
    return rounds


def _select(flag, new, old):
    return jnp.where(flag, new, old)


def fused_sync(tree):
    """The sum over {first, last stage} and mean over `data` of `tree` (the shared gradients
    and the loss: only the first and last stage hold them), in ONE all-reduce over
    {first, last stage} x data (within each tensor rank); the middle stages take no part in it
    (singleton groups) and then receive the result by ppermute rounds, as every stage keeps a
    replica of the shared params (`broadcast_rounds`)."""
    p, d = jax.lax.axis_size("pipe"), jax.lax.axis_size("data")
    if summed := summed_axes():  # expert ranks: each holds its share of every microbatch
        tree = jax.lax.psum(tree, summed)
    first_last = [r * p + s for r in range(d) for s in sorted({0, p - 1})]
    middle = [[r * p + s] for s in range(1, p - 1) for r in range(d)]
    summed = jax.lax.psum(tree, ("data", "pipe"), axis_index_groups=[first_last, *middle])
    summed = jax.tree.map(lambda a: a / d, summed) if d > 1 else summed
    stage = jax.lax.axis_index("pipe")
    for pairs in broadcast_rounds(p):
        got = jax.lax.ppermute(summed, "pipe", pairs)
        here = jnp.isin(stage, jnp.asarray([t for _, t in pairs]))
        summed = jax.tree.map(functools.partial(_select, here), got, summed)
    return summed


def reduce_scatter(tree, dims, axes: tuple[str, ...], experts=None, specs=None):
    """Sharded optimizer: each leaf summed over `axes`, divided by the replica count, and split
    (tiled) over `axes` along its dim in `dims`; leaves with dim -1 are all-reduced whole. With
    context parallelism the context ranks' sum comes first (the optimizer is split over `data`
    only), and over `summed_axes` too but for the leaves `experts` marks (`reduce_over_data`).
    `specs`: the leaves' own specs, whose automatic axes the split runs on blocks of
    (`on_blocks`)."""
    count = replicas()
    split = replica_axes()[1:]
    flags = jax.tree.map(lambda _: False, tree) if experts is None else experts
    specs = jax.tree.map(lambda _: P(), tree) if specs is None else specs

    def one(a, dim, expert, spec):
        first = (*split, *(() if expert else summed_axes()))
        if first:
            a = jax.lax.psum(a, first)
        if dim < 0:
            summed = jax.lax.psum(a, axes)
        else:
            scatter = functools.partial(
                jax.lax.psum_scatter, axis_name=axes, scatter_dimension=dim, tiled=True
            )
            summed = on_blocks(scatter, a, spec)
        return summed / count

    return jax.tree.map(one, tree, dims, flags, specs, is_leaf=_is_spec)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def on_blocks(fn, a: jax.Array, spec: P, out_spec: P | None = None) -> jax.Array:
    """fn(a), a collective over manual axes, run on each device's block of the automatic mesh
    axes (> 1) that split `a` by its own `spec` (`out_spec` for the result, default `spec`),
    in a map manual over them: XLA's partitioner would otherwise all-gather `a` over those
    axes, reduce-scatter or gather the whole array and slice the block back out (three
    collectives where one does, and copies of the whole array)."""
    mesh = jax.sharding.get_abstract_mesh()

    def kept(s: P) -> P:
        def entry(e):
            names = tuple(n for n in ((e,) if isinstance(e, str) else e or ())
                          if n not in mesh.manual_axes and mesh.shape[n] > 1)  # fmt: skip
            return names[0] if len(names) == 1 else names or None

        return P(*(entry(e) for e in s))

    spec_in = kept(spec)
    spec_out = spec_in if out_spec is None else kept(out_spec)
    axes = {n for e in (*spec_in, *spec_out) for n in ((e,) if isinstance(e, str) else e or ())}
    if not axes:
        return fn(a)
    mapped = jax.shard_map(fn, in_specs=spec_in, out_specs=spec_out, axis_names=axes,
                           check_vma=False)  # fmt: skip
    return mapped(a)


def reduce_step(
    stage_grads,
    shared_grads,
    loss,
    *,
    stage_grads_reduced: bool = False,
    stage_dims=None,
    shared_dims=None,
    shared_axes: tuple[str, ...] = (),
    fused: bool = False,
    experts=None,
    specs=(None, None),
):
    """(loss, stage_grads, shared_grads) of the whole step (see the module docstring for the
    collectives). With `stage_dims` / `shared_dims` (a sharded optimizer: per leaf the local dim
    to split, -1 for none) the gradients are reduce-scattered instead: stage gradients over
    `data`, shared gradients over `shared_axes` (the order their split takes). `fused`: the
    shared gradients and the loss go through `fused_sync` (pipe > 1, no sharded optimizer).
    `experts`: which stage leaves a manual `expert` axis splits (`reduce_over_data`); `specs`:
    the stage and shared leaves' own specs (`reduce_scatter`)."""
    if fused:
        loss, shared_grads = fused_sync((loss, shared_grads))
    elif shared_dims is None:
        loss, shared_grads = _sum_stages_mean_replicas((loss, shared_grads))
    else:
        (loss,) = _sum_stages_mean_replicas((loss,))
        shared_grads = reduce_scatter(shared_grads, shared_dims, shared_axes, specs=specs[1])
    if stage_dims is not None:
        stage_grads = reduce_scatter(stage_grads, stage_dims, ("data",), experts, specs[0])
    elif not stage_grads_reduced:
        stage_grads = reduce_over_data(stage_grads, experts)
    return loss, stage_grads, shared_grads
