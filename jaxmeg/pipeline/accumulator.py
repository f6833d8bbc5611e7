"""A stage's gradient accumulator in the tick loop's carry, in one of two forms:

  stacked    a tree of fp32 [v, Lc, ...] leaves (chunk, layer slot, the parameter's dims);
  per layer  with one chunk per stage whose layers run one after another
             (`StageFunctions.per_layer`), a list of Lc trees of fp32 leaves, one per layer.

Per layer, each weight's accumulator is an array of its own, and XLA's GPU compiler runs a
microbatch's `acc + dW` as the weight-gradient GEMM itself: cuBLAS with beta = 1, its output
aliased to the accumulator, the bf16 -> fp32 cast folded into the GEMM. Stacked, the GEMMs write
bf16 dW and one elementwise pass per microbatch reads them and the whole stack and writes it back
(gpt_1.3b on one H100: 12 bytes per parameter and microbatch, 29 ms of a 762 ms step), and
writing a layer's slot of the stack in place is no better (a dynamic-update-slice the GEMM does
not fuse with). Every function here takes either form; `stacked` gives the [v, Lc, ...] one.

Per layer, XLA folds the add into the GEMM only where the accumulator has the shape of the
GEMM's output matrix. A weight whose leaf joins the weights of GEMMs run per part (`w_qkv`
[D, 3, N, H] where q, k and v are three GEMMs), or whose GEMM's output flattens some of its
dims (the attention's `w_out` [N, H, D]: [N H, D]), keeps its accumulator as those matrices
(`Parts`, the leaves `StageFunctions.weight_gemms` names): the joined [D, 3, N, H] took one
more elementwise pass (2.2 ms of an 8-layer gpt_1.3b step on one H100), the [N, H, D] one an
add of the GEMM's transposed output (0.8 ms).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import rings
from jaxmeg.pipeline.gradients import accumulate, reduce_over_data, zeros_f32


@jax.tree_util.register_pytree_node_class
class Parts:
    """One weight's accumulator as its GEMMs' output matrices: its parts along `axis` (None:
    one part, the whole weight), each [its dims before `split` flattened, the rest flattened].
    `shape`: a part's own shape (the weight's without `axis`)."""

    def __init__(self, arrays, axis: int | None, split: int, shape: tuple):
        self.arrays, self.axis, self.split = tuple(arrays), axis, split
        self.shape = tuple(shape)

    def tree_flatten(self):
        return self.arrays, (self.axis, self.split, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, arrays):
        return cls(arrays, *aux)

    @classmethod
    def of(cls, x: jax.Array, axis: int | None, split: int) -> Parts:
        if axis is None:
            parts = [x]
        else:
            parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
        rows = math.prod(parts[0].shape[:split])
        return cls([p.reshape(rows, -1) for p in parts], axis, split, parts[0].shape)

    def joined(self) -> jax.Array:
        """The weight's shape again."""
        parts = [a.reshape(self.shape) for a in self.arrays]
        return parts[0] if self.axis is None else jnp.stack(parts, self.axis)

    def plus(self, delta: jax.Array) -> Parts:
        """Each part + its slice of `delta` (the joined weight's shape), cast to fp32."""
        slices = Parts.of(delta, self.axis, self.split).arrays
        summed = [a + d.astype(a.dtype) for a, d in zip(self.arrays, slices, strict=True)]
        return Parts(summed, self.axis, self.split, self.shape)


def _is_parts(x) -> bool:
    return isinstance(x, Parts)


def _joined(tree):
    """A per-layer tree with its `Parts` joined."""
    return jax.tree.map(lambda a: a.joined() if _is_parts(a) else a, tree, is_leaf=_is_parts)


def _like(tree, acc_layer):
    """A plain per-layer tree cast to the accumulator's dtypes, split where it keeps `Parts`."""

    def one(x, a):
        if _is_parts(a):
            return Parts.of(x.astype(a.arrays[0].dtype), a.axis, a.split)
        return x.astype(a.dtype)

    return jax.tree.map(one, tree, acc_layer)


def _plus(acc_layer, delta):
    """acc_layer + delta, a plain per-layer tree."""
    return jax.tree.map(
        lambda d, a: a.plus(d) if _is_parts(a) else a + d.astype(a.dtype), delta, acc_layer
    )


def zeros(like, per_layer: bool, weight_gemms=None):
    """fp32 zeros shaped like `like` ([v, Lc, ...] leaves), per layer (v must be 1) or stacked;
    per layer, a leaf named in `weight_gemms` ({name: (parts axis or None, split)} in a
    layer's leaf) as `Parts`."""
    acc = zeros_f32(like)
    if not per_layer:
        return acc
    assert jax.tree.leaves(acc)[0].shape[0] == 1, "per-layer accumulators take one chunk"
    gemms = weight_gemms or {}

    def shaped(path, a):
        name = getattr(path[-1], "key", None) if path else None
        return Parts.of(a, *gemms[name]) if name in gemms else a

    return [
        jax.tree_util.tree_map_with_path(shaped, layer)
        for layer in unstack_layers(jax.tree.map(lambda a: a[0], acc))
    ]


def per_layer(acc) -> bool:
    return isinstance(acc, list)


def unstack_layers(tree) -> list:
    """A tree of [Lc, ...] leaves as a list of Lc per-layer trees."""
    count = jax.tree.leaves(tree)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(count)]


def stack_layers(delta):
    """A list of per-layer trees as one tree of [Lc, ...] leaves (any other tree as it is)."""
    if not isinstance(delta, list):
        return delta
    return jax.tree.map(lambda *layers: jnp.stack(layers), *delta)


def stacked(acc):
    """The accumulator as [v, Lc, ...] leaves."""
    if not per_layer(acc):
        return acc
    return jax.tree.map(lambda a: a[None], stack_layers([_joined(layer) for layer in acc]))


def add_at(acc, index, delta):
    """acc[index] += delta along the chunk dim, in place in the loop carry; `delta` a tree of
    [Lc, ...] leaves or a list of per-layer trees."""
    if per_layer(acc):
        layers = delta if isinstance(delta, list) else unstack_layers(delta)
        return [_plus(a, d) for a, d in zip(acc, layers, strict=True)]
    delta = stack_layers(delta)
    return jax.tree.map(lambda a, d: rings.add(a, index, d), acc, delta)


def layer(acc, index, i):
    """Layer i of chunk `index`, a tree of the parameter's dims."""
    return _joined(acc[i]) if per_layer(acc) else jax.tree.map(lambda a: a[index, i], acc)


def layers_at(acc, index, pick):
    """acc[index, pick]: the layers a slice picks, [n, ...] leaves; `pick` a slice or a tree
    of them per leaf (the layer tree's structure)."""
    if per_layer(acc):
        layers = [_joined(tree) for tree in acc]
        picks = jax.tree.map(lambda _: pick, layers[0]) if isinstance(pick, slice) else pick
        return jax.tree.map(lambda p, *ls: jnp.stack(ls[p]), picks, *layers)
    picks = jax.tree.map(lambda _: pick, acc) if isinstance(pick, slice) else pick
    return jax.tree.map(lambda a, p: a[index, p], acc, picks)


def write_layers(acc, index, layers: list, start: int = 0):
    """acc[index, start + l] = layers[l] for each per-layer tree, in place."""
    if not per_layer(acc):
        write = lambda g, *ls: rings.write_layers(g, index, list(ls), start)  # noqa: E731
        return jax.tree.map(write, acc, *layers)
    out = list(acc)
    for l, tree in enumerate(layers):
        out[start + l] = _like(tree, acc[start + l])
    return out


def write_leading(acc, index, tree):
    """acc[index, :n] = tree, a tree of [n, ...] leaves (`layers_at`'s leading layers)."""
    if per_layer(acc):
        return write_layers(acc, index, unstack_layers(tree))
    return jax.tree.map(lambda a, r: rings.write(a, index, r), acc, tree)


def split(acc, split_fn) -> tuple:
    """`split_fn(tree) -> (a, b)` of an accumulator: two accumulators of its form."""
    if not per_layer(acc):
        return split_fn(acc)
    halves = [split_fn(tree) for tree in acc]
    return [a for a, _ in halves], [b for _, b in halves]


def merge(a, b, merge_fn):
    """`merge_fn(a, b) -> tree` of two accumulators of one form (`split`'s inverse)."""
    if not per_layer(a):
        return merge_fn(a, b)
    return [merge_fn(x, y) for x, y in zip(a, b, strict=True)]


def add_reducing_layers(acc, index, layers: list, reduce=None):
    """A chunk's last backward: acc[index, l] + layers[l] for each layer, and `reduce` (the
    mean over the replicas, `reduce_over_data`, by default) of each layer l >= 1, last layer
    first, each started as soon as that layer's gradient is final (its backward has ended) so
    that it runs beside the backwards of the layers before it. Each reduction waits for the one
    after it (an optimization barrier): XLA would otherwise combine them into one collective,
    which waits for every layer. Layer 0, whose backward ends the slot, is left unreduced
    (`pending` or the sharded optimizer's scatter takes it after the slot). Returns each
    layer's sum (unreduced) and layers 1 .. Lc - 1 reduced, as lists of per-layer trees."""
    reduce = reduce or reduce_over_data
    done, sums, reduced = None, [None] * len(layers), []
    for i in reversed(range(len(layers))):
        one = accumulate(layer(acc, index, i), layers[i])
        sums[i] = one
        if i == 0:
            break
        if done is not None:
            one, _ = jax.lax.optimization_barrier((one, done))
        done = reduce(one)
        reduced.insert(0, done)
    return sums, reduced
