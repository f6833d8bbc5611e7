"""What the last virtual stage keeps close, decided from the tick table in NumPy: where its F
and B run at once (`at_once_cells`, B_LAST), where its F leaves the head's weight gradient to a
W (`head_in_w_columns`), and whether what its F keeps for its I fits one buffer
(`kept_one_at_a_time`, I_LAST). Its F is the costliest slot of the step (the chunk, the head
and the loss), and on a GPU every ring write, and every GEMM or cuDNN operand read out of a
ring slot, is a copy kernel of its own; a one-slot buffer is neither (the producing kernel
writes it, the GEMM reads it)."""

from __future__ import annotations

import numpy as np

from jaxmeg.pipeline.tick_table import ONE_ACTION, TWO_SLOTS, TickTable


def at_once_cells(table: TickTable, num_chunks: int) -> np.ndarray:
    """bool [num_ticks, p]: where a tick's F and B are one microbatch's on the last virtual
    stage (an F then a B per tick: 1F1B's last stage in every tick it works), which the B slot
    runs at once (`B_LAST`): the chunk, head and loss under one `jax.vjp`, so that what the
    backward reads never goes through a ring (on a GPU each ring write and each GEMM or cuDNN
    operand read from a ring slot is a copy). Only where the forward keeps its residuals
    (`model.remat` none or selective): with full recompute one `jax.vjp` would hold every
    layer's activations at once. The executor asks for them with `overlap_sends` only (on for
    GPUs): where the activation's send is a synchronous step between the F and the B slot (CPU
    devices, or sends inside conditionals), the last stage's forward would wait for the first
    stage's instead of running beside it (gpt_tiny, pipe 2 on 2 CPU devices: 0.46-0.52 ->
    0.51-0.59 s per step)."""
    if table.ticks != TWO_SLOTS or table.num_stages * num_chunks == 1:
        return np.zeros(table.f_mb.shape, bool)
    last = table.virtual_stages(table.f_chunk) == table.num_stages * num_chunks - 1
    same = (table.f_mb == table.b_mb) & (table.f_chunk == table.b_chunk)
    return (table.f_mb >= 0) & last & same


def head_in_w_columns(table: TickTable) -> tuple[np.ndarray, np.ndarray]:
    """bool [num_ticks, p] each: the last stage's F slots that leave the head's weight gradient
    to a later tick's W slot, and those ticks (`Plan.head_in_w`, one chunk per stage, one
    action per tick). An F leaves it to the stage's first W after it if that comes before its
    next F, else to its first backward (its I) before its next F; one F's at a time, so what
    it keeps takes one buffer, not a ring (a GEMM operand read from a ring slot is copied
    first). ZB-H1's last stage runs F I W per microbatch from the first W on, and F I before:
    the GEMM goes beside the other stages' I in a W tick, in the warm-up beside their F in the
    tick of its own I (where the F's tick holds chunk, head and loss beside their I)."""
    defers = np.zeros(table.f_mb.shape, bool)
    runs = np.zeros(table.w_mb.shape, bool)
    s = table.num_stages - 1
    forwards, weights = table.f_mb[:, s] >= 0, table.w_mb[:, s] >= 0
    backwards = table.b_mb[:, s] >= 0
    for t in np.flatnonzero(forwards):
        after = np.arange(table.num_ticks) > t
        nxt = np.flatnonzero(after & forwards)
        before_next = after & (np.arange(table.num_ticks) < (nxt[0] if nxt.size else np.inf))
        for slots in (weights, backwards):
            where = np.flatnonzero(before_next & slots)
            if where.size:
                defers[t, s] = runs[where[0], s] = True
                break
    return defers, runs


def kept_one_at_a_time(table: TickTable, num_chunks: int) -> bool:
    """Whether, in a table of split backwards and one action per tick, every F of the last
    virtual stage is followed by its own I before that stage's next such F (ZB-H1's last
    stage: F and I alternate from its first F on; ZB-V's chunk 1 on stage 0), so that the
    residuals an F keeps for its I take one buffer (`Carry.last_kept`) instead of a ring slot:
    the executor then runs that stage's I as I_LAST. False where a last-stage backward runs
    whole (its W at once, from the slot its F wrote)."""
    p, v = table.num_stages, num_chunks
    if not table.split or table.ticks != ONE_ACTION or p * v == 1:
        return False
    last = p * v - 1
    f_last = (table.f_mb >= 0) & (table.virtual_stages(table.f_chunk) == last)
    b_last = (table.b_mb >= 0) & (table.virtual_stages(table.b_chunk) == last)
    if (b_last & (table.b_split == 0)).any():
        return False
    for s in range(p):
        pending = None
        for t in range(table.num_ticks):
            if f_last[t, s]:
                if pending is not None:
                    return False
                pending = int(table.f_mb[t, s])
            if b_last[t, s]:
                if pending != int(table.b_mb[t, s]):
                    return False
                pending = None
    return bool(f_last.any())
