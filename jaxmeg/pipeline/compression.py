"""Low-rank compression of the activation gradients a pipeline stage sends backward (Optimus-CC,
Song et al., ASPLOS 2023), with lazy error propagation. Pure `jnp`, fp32, shape-generic.

A cotangent [b, s, h] is viewed as M [n = b s, h]. One power iteration with the link's
warm-started Q [h, r]: Q <- orth(Q); P = orth(M Q) [n, r]; Q' = M^T P [h, r]; the receiver
rebuilds P Q'^T = P P^T M, the projection of M onto r directions. Q' is the next warm start.
With r >= min(n, h) nothing is gained, and the executor sends M whole (`worth_compressing`).

Lazy error propagation: the sender adds what the previous transfer on the same link lost,
x_i = g_i + e_(i-1), sends C(x_i) and keeps e_i = x_i - C(x_i). Over a step the receiver gets
sum_i C(x_i) = sum_i g_i + e_0 - e_m: the error is delayed, never dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PipeCompression:
    """What the executor needs of `compression.pipe_grad_*`.

    rank: r (> 0). lazy: lazy error propagation. compress: bool [num_ticks, p], where the B
    slot's send is compressed (every sending backward for `all`, the critical ones for
    `epilogue`).
    """

    rank: int
    lazy: bool
    compress: np.ndarray


def worth_compressing(rank: int, rows: int, cols: int) -> bool:
    """Whether rank-`rank` factors of a [rows, cols] matrix are smaller than the matrix."""
    return 0 < rank < min(rows, cols)


def orthonormal_columns(a):
    """Q of the reduced QR decomposition: orthonormal columns spanning those of `a` [n, r]."""
    q, _ = jnp.linalg.qr(a)
    return q


def power_step(m, q):
    """One power iteration on m [n, h] from the warm start q [h, r]: (p [n, r], q' [h, r]) with
    p orthonormal and p q'^T = p p^T m."""
    p = orthonormal_columns(m @ orthonormal_columns(q))
    return p, m.T @ p


def rebuild(p, q):
    return p @ q.T


def compress_with_feedback(g, error, q, lazy: bool = True):
    """(p, q', new error) for gradient g [n, h] on a link holding `error` and warm start `q`."""
    x = g + error if lazy else g
    p, q_new = power_step(x, q)
    new_error = x - rebuild(p, q_new) if lazy else jnp.zeros_like(error)
    return p, q_new, new_error


def encode_link(pc: PipeCompression, links: dict, chunk, g, here, sending):
    """What one B slot sends on its link from chunk `chunk`: ((p, q) factors, the whole
    gradient), each zero where the other goes, and the link state after it. `g` [n, h] is the
    cotangent; `here` whether this send is compressed, `sending` whether the slot sends at all
    (only then does the lazy error change). `links` {"q": [v, h, r], "error": [v, n, h]}."""
    x = g + links["error"][chunk] if pc.lazy else g
    q_old = links["q"][chunk]
    p, q = jax.lax.cond(
        here,
        lambda: power_step(x, q_old),
        lambda: (jnp.zeros((x.shape[0], pc.rank), x.dtype), q_old),
    )
    new = {**links, "q": links["q"].at[chunk].set(q)}
    if pc.lazy:
        lost = jnp.where(here, x - rebuild(p, q), 0.0)
        error = jnp.where(sending, lost, links["error"][chunk])
        new["error"] = links["error"].at[chunk].set(error)
    factors = (jnp.where(here, p, 0.0), jnp.where(here, q, 0.0))
    return factors, jnp.where(here, 0.0, x), new
