"""Low-rank compression of the activation gradients a pipeline stage sends backward (Optimus-CC,
Song et al., ASPLOS 2023), with lazy error propagation. Pure `jnp`, fp32, shape-generic.

A cotangent [b, s, h] is viewed as M [n = b s, h]. One power iteration with the link's
warm-started Q [h, r]: Q <- orth(Q); P = orth(M Q) [n, r]; Q' = M^T P [h, r]; the receiver
rebuilds P Q'^T = P P^T M, the projection of M onto r directions. Q' is the next warm start.
With r >= min(n, h) nothing is gained, and the executor sends M whole (`worth_compressing`).

Lazy error propagation: a compressed send adds what the previous compressed transfer on the
same link lost, x_i = g_i + e_(i-1), sends C(x_i) and keeps e_i = x_i - C(x_i). Over a step of
compressed sends the receiver gets sum_i C(x_i) = sum_i g_i + e_0 - e_m: the error is delayed,
never dropped. An uncompressed send carries g_i alone and leaves the error where it is (the
authors' code); with `flush` it carries g_i + e and clears it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PipeCompression:
    """What the executor needs of `compression.pipe_grad_*`.

    rank: r (> 0). lazy: lazy error propagation (a compressed send adds the link's error and
    keeps what it loses); flush: an uncompressed send also adds the error and clears it
    (`lazy_flush`; the authors' code leaves it for the next compressed send). compress: bool
    [num_ticks, p], where the B slot's send is compressed (every sending backward for `all`,
    the critical ones for `epilogue`).
    """

    rank: int
    lazy: bool
    compress: np.ndarray
    flush: bool = False


def worth_compressing(rank: int, rows: int, cols: int) -> bool:
    """Whether rank-`rank` factors of a [rows, cols] matrix are smaller than the matrix."""
    return 0 < rank < min(rows, cols)


RANK_TOLERANCE = 1e-6
"""What is left of a column after Gram-Schmidt, relative to the largest column, below which it
is rounding and is dropped. Measured on [32, 32] products M Q, projection error of P P^T M
relative to max |M|: with M of rank 8-31, 0 (normalise whatever is left) gives up to 1.4e-5,
1e-6 at most 6.4e-7 (LAPACK QR: 5.2e-7); with singular values down to 1e-7, 1e-6 gives 7.8e-7,
1e-5 drops signal (3.0e-5)."""


def orthonormal_columns(a):
    """Orthonormal columns spanning those of `a` [..., n, r], by modified Gram-Schmidt (as
    PowerSGD's reference implementation, two passes): matmuls in a loop over the columns.
    Not `jnp.linalg.qr`: on CPU its LAPACK call spreads a batch over the thread pool and waits
    for it inside the step, while the devices of other stages hold those threads waiting in a
    collective: the step hung (2 x 2 x 2 mesh, PowerSGD rank 32 on stage 0). A column with
    nothing left of it beyond rounding (`a` of rank below r, a zero gradient) is zero, not
    rounding noise scaled up: the span is the same."""
    r = a.shape[-1]
    later = jnp.arange(r)
    # scaled so that the largest column has norm 1: one threshold for rounding in both passes
    largest = jnp.sqrt(jnp.max(jnp.sum(a * a, axis=-2, keepdims=True), axis=-1, keepdims=True))
    a = a / jnp.where(largest > 0, largest, 1)

    def column(i, q):
        col = jax.lax.dynamic_index_in_dim(q, i, axis=-1, keepdims=False)  # [..., n]
        norm = jnp.sqrt(jnp.sum(col * col, axis=-1, keepdims=True))
        kept = norm > RANK_TOLERANCE
        col = jnp.where(kept, col / jnp.where(kept, norm, 1), 0)
        overlap = jnp.einsum("...n,...nr->...r", col, q) * (later > i)
        q = q - col[..., :, None] * overlap[..., None, :]
        return jax.lax.dynamic_update_index_in_dim(q, col, i, axis=-1)

    # twice: one pass leaves nearly dependent columns (a low-rank gradient's) far from
    # orthogonal; two restore orthogonality to rounding ("twice is enough")
    return jax.lax.fori_loop(0, 2 * r, lambda i, q: column(i % r, q), a)


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
    error = links["error"][chunk] if pc.lazy else None
    if pc.lazy:
        x = g + (error if pc.flush else jnp.where(here, error, 0.0))
    else:
        x = g
    q_old = links["q"][chunk]
    p, q = jax.lax.cond(
        here,
        lambda: power_step(x, q_old),
        lambda: (jnp.zeros((x.shape[0], pc.rank), x.dtype), q_old),
    )
    new = {**links, "q": links["q"].at[chunk].set(q)}
    if pc.lazy:
        # an uncompressed send: the error went out with it (flush) or waits for the next
        # compressed one
        lost = jnp.where(here, x - rebuild(p, q), 0.0 if pc.flush else error)
        new["error"] = links["error"].at[chunk].set(jnp.where(sending, lost, error))
    factors = (jnp.where(here, p, 0.0), jnp.where(here, q, 0.0))
    return factors, jnp.where(here, 0.0, x), new
