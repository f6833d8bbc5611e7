"""The experts' grouped GEMMs as kernels of our own (`moe.grouped_gemm: pallas`), written in
Pallas for Triton: each runs only the rows of each expert's group, where XLA's GPU compiler
makes a `jax.lax.ragged_dot` one dense GEMM over every expert (E_local times the rows' FLOPs).

  grouped_matmul          y = rows @ w[e] for each expert e's group of rows (rows sorted by
                          expert, `sizes` [E] rows each, the rows past the groups zero), or
                          rows @ w[e]^T (`transpose_w`, the rows' cotangent in the backward)
  grouped_weight_gradient dw[e] = rows_e^T dy_e, each expert's weight gradient

`grouped_matmul`'s programs walk a table of row tiles (`tile_table`): ceil(n_e / BM) tiles of
expert e's group, then tiles that zero the rows past the groups, then idle ones (at most
ceil(N / BM) + E + 1 in all, a static grid), each a [BM, K] x [K, BN] product per column
block, its rows masked to its group. `grouped_weight_gradient`'s programs are (expert, in
block, out block), each looping over its group's rows. Both launch their blocks in grouped
order (`SWIZZLE`), as Triton's matmuls do, so that a wave of programs shares what it reads.
A tile's rows start anywhere: a block that would run past the array reads from N - BM on, its
mask keeping the tile's own rows.

On a GPU the kernels are Triton's; elsewhere (CPU) Pallas interprets them
(`jax.lax.platform_dependent`), slowly, so the tests check the same kernels against
`jax.lax.ragged_dot`. The cost report prices each call as a GEMM over every row of its buffer
(`hlo_gpu.grouped_kernel_flops`), an upper bound: the idle tiles and the rows past the groups
compute nothing at run time. Block shapes are powers of two from 16 (`block`); a shape without
one (a dim not a multiple of 16, fewer than 16 rows) runs `jax.lax.ragged_dot` instead.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax.experimental import pallas as pl

MATMUL, WEIGHTS = "grouped_gemm", "grouped_gemm_weights"
"""The kernels' names in the compiled program (a Triton custom call's `name`), which the cost
report prices (`jaxmeg.parallel.hlo_gpu`)."""
ROWS, COLUMNS, INNER = 128, 128, 64
"""The largest block of rows, output columns and contracted dim."""
_PARAMS = plt.CompilerParams(num_warps=8, num_stages=3)


def block(dim: int, largest: int) -> int:
    """The largest power of two <= `largest` that divides `dim`, 0 below 16 (no Triton dot)."""
    size = largest
    while size >= 16 and dim % size:
        size //= 2
    return size if size >= 16 else 0


def runs(rows: int, inner: int, out: int) -> bool:
    """Whether the kernels take these shapes (else `jax.lax.ragged_dot` runs)."""
    return rows >= 16 and block(inner, INNER) > 0 and block(out, COLUMNS) > 0


SWIZZLE = 8
"""Programs launched one after another take blocks in groups of this many rows (of blocks) per
column: a wave of them re-reads a few row blocks and weight panels from L2 rather than every
row block once per column block from memory (Triton's grouped ordering)."""


def _swizzled(pid, rows: int, columns: int):
    """(row block, column block) of program `pid` of a rows x columns grid in grouped order."""
    per_group = SWIZZLE * columns
    first = (pid // per_group) * SWIZZLE
    height = jnp.minimum(rows - first, SWIZZLE)
    within = pid % per_group
    return first + within % height, within // height


def _row_block(rows: int) -> int:
    size = ROWS
    while size > rows:
        size //= 2
    return size


def tile_table(sizes: jax.Array, n: int, bm: int):
    """(expert, first row, end) per tile of `grouped_matmul`'s grid: each group's tiles (its
    rows [first, min(first + bm, end))), then tiles over the rows past the groups (expert E:
    they write zeros), then idle ones (first = end = 0)."""
    e = sizes.shape[0]
    count = -(-n // bm) + e + 1
    per = (sizes + bm - 1) // bm
    ends = jnp.cumsum(per)
    group_starts = jnp.cumsum(sizes) - sizes
    i = jnp.arange(count)
    expert = jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1), e - 1)
    real = i < ends[-1]
    first = jnp.where(real, group_starts[expert] + (i - (ends - per)[expert]) * bm, 0)
    end = jnp.where(real, group_starts[expert] + sizes[expert], 0)
    tail_first = jnp.sum(sizes) + (i - ends[-1]) * bm
    tail = ~real & (tail_first < n)
    first = jnp.where(tail, tail_first, first)
    end = jnp.where(tail, n, end)
    expert = jnp.where(real, expert, e)
    return tuple(a.astype(jnp.int32) for a in (expert, first, end))


def _rows(first, end, bm: int, n: int):
    """(the block's first row, inside the array; which of its rows are the tile's)."""
    at = jnp.minimum(first, n - bm)
    rows = at + jnp.arange(bm)
    return at, (rows >= first) & (rows < end)


def _matmul_kernel(expert_ref, first_ref, end_ref, x_ref, w_ref, o_ref, *, bm, bn, bk, n, k, e,
                   transpose_w, tiles, columns):  # fmt: skip
    t, j = _swizzled(pl.program_id(0), tiles, columns)
    g, first, end = expert_ref[t], first_ref[t], end_ref[t]
    at, mine = _rows(first, end, bm, n)
    out = o_ref.at[pl.ds(at, bm), pl.ds(j * bn, bn)]

    @pl.when((end > first) & (g < e))
    def _():
        def step(kk, acc):
            a = plt.load(x_ref.at[pl.ds(at, bm), pl.ds(kk * bk, bk)], mask=mine[:, None], other=0)
            if transpose_w:
                b = plt.load(w_ref.at[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)])
                return acc + plt.dot(a, b, trans_b=True).astype(jnp.float32)
            b = plt.load(w_ref.at[g, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)])
            return acc + plt.dot(a, b).astype(jnp.float32)

        acc = jax.lax.fori_loop(0, k // bk, step, jnp.zeros((bm, bn), jnp.float32))
        plt.store(out, acc.astype(o_ref.dtype), mask=mine[:, None])

    @pl.when((end > first) & (g >= e))
    def _():
        plt.store(out, jnp.zeros((bm, bn), o_ref.dtype), mask=mine[:, None])


def _varying_alike(args) -> tuple[tuple, object]:
    """`args` all varying over the manual axes any of them varies over (inside a map), and that
    type, which the kernel's output takes (None outside a map)."""
    axes = set()
    for a in args:
        axes |= set(jax.typeof(a).manual_axis_type.varying)
    if not axes:
        return args, None
    missing = lambda a: tuple(sorted(axes - set(jax.typeof(a).manual_axis_type.varying)))  # noqa: E731
    args = tuple(jax.lax.pcast(a, missing(a), to="varying") if missing(a) else a for a in args)
    return args, jax.typeof(args[0]).manual_axis_type


def _call(kernel, shape, dtype, grid, name, elsewhere, *args):
    """The kernel as Triton's on a GPU; elsewhere interpreted, but inside a map, where Pallas's
    interpreter fails jax's varying-axes check (jax 0.10.2: its grid loop slices varying blocks
    at invariant indices), `elsewhere()` (`jax.lax.ragged_dot`'s forms) runs instead."""
    args, manual = _varying_alike(args)
    out_shape = jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)

    def run(*a, interpret):
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret,
                              name=name, compiler_params=_PARAMS)(*a)  # fmt: skip

    interpreted = functools.partial(run, interpret=True)
    return jax.lax.platform_dependent(
        *args, cuda=functools.partial(run, interpret=False),
        default=interpreted if manual is None else lambda *_: elsewhere(),
    )  # fmt: skip


def grouped_matmul(
    rows: jax.Array, w: jax.Array, sizes: jax.Array, transpose_w: bool = False,
    elsewhere=None,
) -> jax.Array:  # fmt: skip
    """rows [N, K] (sorted by expert, `sizes` [E] rows each) times their expert's w [E, K, O]
    -> [N, O], the rows past the groups zero; with `transpose_w` times w[e]^T (w [E, O, K]).
    `elsewhere`: what runs instead off a GPU inside a map (`_call`)."""
    n, k = rows.shape
    e, out = w.shape[0], (w.shape[1] if transpose_w else w.shape[2])
    bm, bn, bk = _row_block(n), block(out, COLUMNS), block(k, INNER)
    table = tile_table(sizes, n, bm)
    tiles, columns = table[0].shape[0], out // bn
    kernel = functools.partial(_matmul_kernel, bm=bm, bn=bn, bk=bk, n=n, k=k, e=e,
                               transpose_w=transpose_w, tiles=tiles, columns=columns)  # fmt: skip
    return _call(kernel, (n, out), rows.dtype, (tiles * columns,), MATMUL, elsewhere, *table,
                 rows, w.astype(rows.dtype))  # fmt: skip


def _weights_kernel(starts_ref, sizes_ref, x_ref, dy_ref, o_ref, *, bm, bi, bo, n, ins, outs):
    pid = pl.program_id(0)
    g = pid // (ins * outs)
    i, j = _swizzled(pid % (ins * outs), ins, outs)
    start, size = starts_ref[g], sizes_ref[g]

    def step(c, acc):
        at, mine = _rows(start + c * bm, start + size, bm, n)
        a = plt.load(x_ref.at[pl.ds(at, bm), pl.ds(i * bi, bi)], mask=mine[:, None], other=0)
        b = plt.load(dy_ref.at[pl.ds(at, bm), pl.ds(j * bo, bo)], mask=mine[:, None], other=0)
        return acc + plt.dot(a, b, trans_a=True).astype(jnp.float32)

    acc = jax.lax.fori_loop(0, (size + bm - 1) // bm, step, jnp.zeros((bi, bo), jnp.float32))
    plt.store(o_ref.at[g, pl.ds(i * bi, bi), pl.ds(j * bo, bo)], acc.astype(o_ref.dtype))


def grouped_weight_gradient(
    rows: jax.Array, sizes: jax.Array, dy: jax.Array, elsewhere=None
) -> jax.Array:  # fmt: skip
    """Each expert's rows_e^T dy_e [E, K, O] (rows [N, K], dy [N, O] sorted by expert).
    `elsewhere`: what runs instead off a GPU inside a map (`_call`)."""
    n, k = rows.shape
    e, out = sizes.shape[0], dy.shape[-1]
    bm, bi, bo = _row_block(n), block(k, COLUMNS), block(out, COLUMNS)
    starts = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
    ins, outs = k // bi, out // bo
    kernel = functools.partial(_weights_kernel, bm=bm, bi=bi, bo=bo, n=n, ins=ins, outs=outs)
    return _call(kernel, (e, k, out), rows.dtype, (e * ins * outs,), WEIGHTS, elsewhere,
                 starts, sizes.astype(jnp.int32), rows, dy.astype(rows.dtype))  # fmt: skip
