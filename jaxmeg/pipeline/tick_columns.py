"""Static per-(tick, stage) columns the executor reads besides the tick table's own: which
branch each slot runs, the chunk whose gradients become final, and where ZeRO-3 gathers a
chunk's weights. All are derived from the table in NumPy, before anything is traced.
"""

from __future__ import annotations

import numpy as np

from jaxmeg.pipeline.tick_table import TickTable

IDLE = 0
F_FIRST, F_MIDDLE, F_LAST, F_EMBED = 1, 2, 3, 4
B_CHUNK, B_FIRST, B_WHOLE = 1, 2, 3


def kind_columns(table: TickTable, num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 [num_ticks, p] F and B branch kinds of every (tick, stage) (static)."""
    p, v = table.num_stages, num_chunks
    stage = np.arange(p)[None, :]
    if p * v == 1:
        f_kind = np.where(table.f_mb >= 0, F_EMBED, IDLE)
        b_kind = np.where(table.b_mb >= 0, B_WHOLE, IDLE)
        return f_kind.astype(np.int32), b_kind.astype(np.int32)
    f_first = (stage == 0) & (table.f_chunk == 0)
    f_last = (stage == p - 1) & (table.f_chunk == v - 1)
    f_kind = np.where(f_first, F_FIRST, np.where(f_last, F_LAST, F_MIDDLE))
    b_kind = np.where((stage == 0) & (table.b_chunk == 0), B_FIRST, B_CHUNK)
    f_kind = np.where(table.f_mb >= 0, f_kind, IDLE)
    b_kind = np.where(table.b_mb >= 0, b_kind, IDLE)
    return f_kind.astype(np.int32), b_kind.astype(np.int32)


def final_backward_chunks(table: TickTable) -> np.ndarray:
    """int32 [num_ticks, p]: the chunk whose last backward on that stage runs in that tick (its
    gradients are final from then on), -1 elsewhere."""
    final = np.full(table.b_mb.shape, -1, np.int32)
    for s in range(table.num_stages):
        seen: set[int] = set()
        for t in reversed(range(table.num_ticks)):
            chunk = int(table.b_chunk[t, s])
            if table.b_mb[t, s] >= 0 and chunk not in seen:
                seen.add(chunk)
                final[t, s] = chunk
    return final


def gather_columns(table: TickTable) -> tuple[np.ndarray, np.ndarray]:
    """bool [num_ticks, p]: where the F (B) slot all-gathers its chunk's weights under ZeRO-3:
    when the chunk differs from the one that slot last used on that stage (each slot keeps its
    gathered chunk until then). `breadth_first`: 2 v gathers per stage and step whatever m;
    `1f1b`: 2; `interleaved_1f1b`: about 2 v m / p (its order switches chunk every p
    microbatches). With p v = 1 the F slot only embeds and gathers nothing."""
    gathers = []
    for kind, (mb, chunk) in enumerate(((table.f_mb, table.f_chunk), (table.b_mb, table.b_chunk))):
        active = mb >= 0
        gather = np.zeros_like(active)
        if kind == 0 and table.num_stages == 1:  # p v = 1
            gathers.append(gather)
            continue
        for s in range(table.num_stages):
            previous = -1
            for t in np.flatnonzero(active[:, s]):
                gather[t, s] = chunk[t, s] != previous
                previous = chunk[t, s]
        gathers.append(gather)
    return gathers[0], gathers[1]


def forward_senders(table: TickTable, num_chunks: int) -> np.ndarray:
    """bool [num_ticks, p]: the stages whose F slot sends an activation on (all but the last
    virtual stage's forwards)."""
    p, v = table.num_stages, num_chunks
    virtual = table.f_chunk * p + np.arange(p)[None, :]
    return (table.f_mb >= 0) & (virtual != p * v - 1)


def backward_senders(table: TickTable, num_chunks: int) -> np.ndarray:
    """bool [num_ticks, p]: the stages whose B slot sends a cotangent on (all but the first
    virtual stage's backwards)."""
    virtual = table.b_chunk * table.num_stages + np.arange(table.num_stages)[None, :]
    return (table.b_mb >= 0) & (virtual != 0)


def send_patterns(
    senders: np.ndarray, step: int
) -> tuple[np.ndarray, list[tuple[tuple[int, int], ...]]]:
    """The ppermutes a direction needs: every distinct set of (source, source + step mod p)
    pairs that some tick sends on, and int32 [num_ticks, p] the index of a tick's set in that
    list plus one (0: nothing is sent in that tick). The index depends on the tick only, so
    every stage takes the same branch: a `ppermute` under it cannot deadlock."""
    p = senders.shape[1]
    patterns: list[tuple[tuple[int, int], ...]] = []
    index = np.zeros(senders.shape, np.int32)
    for t, row in enumerate(senders):
        pairs = tuple((s, (s + step) % p) for s in np.flatnonzero(row).tolist())
        if not pairs:
            continue
        if pairs not in patterns:
            patterns.append(pairs)
        index[t, :] = patterns.index(pairs) + 1
    return index, patterns
