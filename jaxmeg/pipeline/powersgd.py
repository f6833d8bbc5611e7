"""PowerSGD (Vogels et al., NeurIPS 2019) on the data-parallel reduction of a stage's layer
gradients, with error feedback; on selected pipeline stages and after a warm-up (Optimus-CC,
Song et al., ASPLOS 2023). Runs inside the executor's `shard_map`, manual over `data`.

Per weight matrix M_i [n, m] on data replica i (a chunk's leaf [Lc, ...] is Lc matrices: n its
hidden dim, m the others; `hidden_dim`), with error e_i and warm start Q [m, r]:
  X_i = M_i + e_i
  P = orth(mean_i X_i Q)        one all-reduce of every matrix's P [n, r] at once
  Q' = mean_i X_i^T P           one all-reduce of every matrix's Q [m, r] at once
  X_hat = P Q'^T                the same on every replica, used as the reduced gradient
  e_i <- X_i - X_hat            Q' is the next step's warm start (equal on every replica)
X_hat = P P^T mean_i X_i, the projection of the mean onto r directions: with r at or above the
rank of the mean it is the mean itself. A matrix with r >= min(n, m) is not worth compressing
and goes whole, with the vectors (biases, norm scales), in one all-reduce.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxmeg.pipeline import compression


@dataclasses.dataclass(frozen=True)
class DataCompression:
    """What the executor needs of `compression.data_grad_*`.

    rank: r (> 0). stages: compress on pipeline stages < stages. warmup_steps: optimizer steps
    (the step counter the executor is given) that reduce uncompressed.
    matrices: {leaf key (`leaf_key`) of a chunk's layer params: the dim of one layer's leaf
        that is the hidden (n) side}; only leaves worth compressing at `rank`.
    """

    rank: int
    stages: int
    warmup_steps: int
    matrices: dict[str, int]


def leaf_key(path) -> str:
    """A param leaf's name from its tree path, e.g. `attn/w_qkv`."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def hidden_dim(name: str, shape: tuple[int, ...], hidden: int) -> int | None:
    """Which dim of one layer's weight leaf `name` of `shape` (no layer dim) is the hidden
    side: its first or its last; None for a vector (no `w_` name, one dim, or no hidden dim).
    The matrix is [hidden, the other dims]: the hidden dim is never split over `tensor`, so
    P [hidden, r] needs no tensor collective beyond the contraction's all-reduce, and Q keeps
    the leaf's other dims (and their tensor split) as they are."""
    if not name.split("/")[-1].startswith("w_") or len(shape) < 2:
        return None
    if shape[0] == hidden:
        return 0
    return len(shape) - 1 if shape[-1] == hidden else None


def matrix_shape(shape: tuple[int, ...], dim: int) -> tuple[int, int]:
    """(n, m): the hidden side and the product of the other dims."""
    return shape[dim], math.prod(shape) // shape[dim]


def compressed_matrices(layer_shapes: dict[str, tuple[int, ...]], hidden: int, rank: int):
    """{key: hidden dim} of the leaves PowerSGD at `rank` compresses (`DataCompression`)."""
    dims = {key: hidden_dim(key, shape, hidden) for key, shape in layer_shapes.items()}
    return {
        key: dim
        for key, dim in dims.items()
        if dim is not None
        and compression.worth_compressing(rank, *matrix_shape(layer_shapes[key], dim))
    }


def state_shapes(dc: DataCompression, layer_shapes: dict[str, tuple[int, ...]], layers: int):
    """Per chunk: {"q": {key: [Lc, *other dims, r]}, "error": {key: [Lc, ...]}} (fp32)."""

    def q_shape(key):
        shape = list(layer_shapes[key])
        del shape[dc.matrices[key]]
        return (layers, *shape, dc.rank)

    return {
        "q": {k: q_shape(k) for k in dc.matrices},
        "error": {k: (layers, *layer_shapes[k]) for k in dc.matrices},
    }


def _mean(tree):
    return jax.tree.map(lambda a: a / jax.lax.axis_size("data"), jax.lax.psum(tree, "data"))


def _hidden_first(a, dim: int):
    """[Lc, ...] with the layer's hidden dim (`dim` of a layer) moved right after Lc."""
    return jnp.moveaxis(a, 1 + dim, 1)


def reduce(grads, state, dc: DataCompression):
    """(mean over `data` of `grads`, new state): one chunk's layer gradients [Lc, ...] and its
    state {"q": {key: [Lc, *other dims, r]}, "error": {key: [Lc, ...]}} (module docstring).
    Written with einsum over the leaf's own dims, never a reshape, so that a leaf split over
    `tensor` stays split (a reshape would reshard it by collective-permutes, which would
    deadlock here: the executor runs this under a stage-dependent branch)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    keys = [leaf_key(path) for path, _ in leaves]
    whole = {k: g for k, (_, g) in zip(keys, leaves, strict=True) if k not in dc.matrices}
    x = {
        k: _hidden_first(g.astype(jnp.float32) + state["error"][k], dc.matrices[k])
        for k, (_, g) in zip(keys, leaves, strict=True)
        if k in dc.matrices
    }  # [Lc, n, *other dims]
    p = _mean({k: jnp.einsum("ln...,l...r->lnr", x[k], state["q"][k]) for k in x})
    p = {k: compression.orthonormal_columns(a) for k, a in p.items()}
    q = _mean({k: jnp.einsum("ln...,lnr->l...r", x[k], p[k]) for k in x})
    approx = {k: jnp.einsum("lnr,l...r->ln...", p[k], q[k]) for k in x}
    reduced = {
        **_mean(whole),
        **{k: jnp.moveaxis(a, 1, 1 + dc.matrices[k]) for k, a in approx.items()},
    }
    out = [reduced[k].astype(g.dtype) for k, (_, g) in zip(keys, leaves, strict=True)]
    error = {k: jnp.moveaxis(x[k] - approx[k], 1, 1 + dc.matrices[k]) for k in x}
    return jax.tree_util.tree_unflatten(treedef, out), {"q": q, "error": error}
