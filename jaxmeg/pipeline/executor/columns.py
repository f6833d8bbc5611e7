"""Static per-(tick, stage) columns the executor reads besides the tick table's own: which
slot kind runs, the chunk whose gradients become final, where ZeRO-3 gathers a chunk's weights,
which pairs each direction sends on (`send_patterns`); `slot_columns` gathers them all. All are
derived from the table in NumPy, before anything is traced.

`SLOT_KINDS` is the one table of what the tick runs under a name scope of its own (a slot body,
a send, a receive, a unit beside the slots): the columns key their branch columns by its
scopes, the executor names its loops and switches from its rows, and
`jaxmeg.parallel.hlo_cost` weights the compiled loops by them and refuses a scope it lacks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmeg.pipeline.executor.last_stage import at_once_cells, head_in_w_columns, kept_one_at_a_time
from jaxmeg.pipeline.executor.reduction import BESIDE_B, NO_REDUCTION, SCATTER, Reduction
from jaxmeg.pipeline.tick_table import FIELDS, PAIRS, TickTable

IDLE = 0


@dataclasses.dataclass(frozen=True)
class SlotKind:
    """One thing the tick runs under its own name scope, as a loop of 0 or 1 trips or a switch.

    scope: the name scope of its loop or switch in the compiled step, and the key of its
        branch column (`SlotColumns.branch_columns`)
    column, code: a slot body runs where `column` (f_kind or b_kind) holds `code`
    """

    scope: str
    what: str
    column: str = ""
    code: int = 0


F_FIRST = SlotKind("f_first", "F of the first virtual stage: embed + chunk", "f_kind", 1)
F_MIDDLE = SlotKind("f_middle", "F of a middle virtual stage: the chunk", "f_kind", 2)
F_LAST = SlotKind("f_last", "F of the last virtual stage: chunk + head + loss", "f_kind", 3)
F_EMBED = SlotKind("f_embed", "F with p v = 1: the embedding only", "f_kind", 4)
F_LAST_HEAD_IN_W = SlotKind(
    "f_last_head_in_w", "F_LAST, the head's weight gradient left to the stage's next W", "f_kind", 5
)
B_CHUNK = SlotKind("b_middle", "B of a chunk", "b_kind", 1)
B_FIRST = SlotKind("b_first", "B of the first virtual stage: chunk + embedding", "b_kind", 2)
B_WHOLE = SlotKind("b_whole", "B with p v = 1: chunk + head + loss, embedding", "b_kind", 3)
I_CHUNK = SlotKind("i_middle", "I (split backward) of a chunk", "b_kind", 4)
I_FIRST = SlotKind("i_first", "I of the first virtual stage, and the embedding", "b_kind", 5)
B_CHUNK_REDUCING = SlotKind("b_middle_reducing", "a chunk's last B, its means in it", "b_kind", 6)
B_FIRST_REDUCING = SlotKind("b_first_reducing", "B_FIRST, the chunk's last, + means", "b_kind", 7)
B_WHOLE_REDUCING = SlotKind("b_whole_reducing", "B_WHOLE, the last one, + means", "b_kind", 8)
B_LAST = SlotKind(
    "b_last", "F and B at once on the last virtual stage: chunk + head + loss, one jax.vjp",
    "b_kind", 9,
)  # fmt: skip
B_LAST_REDUCING = SlotKind("b_last_reducing", "B_LAST, the chunk's last B, + means", "b_kind", 10)
I_LAST = SlotKind(
    "i_last", "I of the last virtual stage, its residuals from one buffer", "b_kind", 11
)  # fmt: skip
REDUCING_OF = {
    B_CHUNK: B_CHUNK_REDUCING, B_FIRST: B_FIRST_REDUCING, B_WHOLE: B_WHOLE_REDUCING,
    B_LAST: B_LAST_REDUCING,
}  # fmt: skip
"""A chunk's last B where its layers' means run in the slot (`Reduction.layers`)."""
COTANGENT_SENDERS = (B_CHUNK, I_CHUNK, I_LAST, B_LAST, B_CHUNK_REDUCING, B_LAST_REDUCING)
"""The B slot kinds whose input cotangent goes to another virtual stage (all but the first's)."""
W_CHUNK = SlotKind("w_chunk", "W: the weight gradients of a split backward")
W_CHUNK_REDUCING = SlotKind("w_chunk_reducing", "a chunk's last W, its layers' means in it")
W_HEAD = SlotKind("w_head", "the W slot after F_LAST_HEAD_IN_W: the head's weight gradient")
SEND_X = SlotKind("send_x", "the activation to stage s + 1")
SEND_COT = SlotKind("send_cot", "the cotangent to stage s - 1")
SEND_X_BACK = SlotKind("send_x_back", "a V's activation the other way")
SEND_COT_BACK = SlotKind("send_cot_back", "a V's cotangent the other way")
SEND_WHOLE = SlotKind("send_whole", "compressed links: the cotangents sent whole")
SEND_FACTORS = SlotKind("send_factors", "compressed links: the rank-r factors")
SENDS = (SEND_X, SEND_COT, SEND_X_BACK, SEND_COT_BACK, SEND_WHOLE, SEND_FACTORS)
"""The sends (`slots.send`); their columns hold the index of the tick's pattern."""
RECEIVE = {
    (what, way): SlotKind(f"recv_{what}{way}", f"{what} arriving {way or '_usual'}")
    for what in ("x", "cot")
    for way in ("", "_back", "_local")
}
"""The ring writes of what arrived (`slots.receive`), by (x or cot, way)."""
LATE_COLUMNS = (SEND_COT.scope, SEND_COT_BACK.scope, "recv_cot_slot", "recv_cot_back_slot",
                "recv_cot_local_slot")  # fmt: skip
"""What a late cotangent reads of the tick it was made in (`Plan.late_cotangents`)."""
GATHER = {slot: SlotKind(f"{slot}_gather", f"ZeRO-3: the {slot} slot takes its next chunk")
          for slot in ("f", "b")}  # fmt: skip
FETCH = {slot: SlotKind(f"{slot}_fetch", f"ZeRO-3: the {slot} slot gathers the chunk after")
         for slot in ("f", "b")}  # fmt: skip
COMPRESS_LINK = SlotKind("compress_link", "compressed links: encode the cotangent")
REDUCE_CHUNK = SlotKind("reduce_chunk", "a chunk's data mean (or reduce-scatter)")
REDUCE_POWERSGD = SlotKind("reduce_powersgd", "a chunk's PowerSGD reduction")
REDUCE_TAKE = SlotKind("reduce_take", "a final chunk's gradients to `pending`")
REDUCE_WRITE = SlotKind("reduce_write", "the mean written back into the stage gradients")
REDUCE_BESIDE_B = SlotKind("reduce_beside_b", "a chunk's data mean in one loop with the B slot")
B_ALONE = SlotKind("b_alone", "the B slot where no mean runs beside it")
F_KINDS = (F_FIRST, F_MIDDLE, F_LAST, F_EMBED, F_LAST_HEAD_IN_W)
B_KINDS = (B_CHUNK, B_FIRST, B_WHOLE, B_LAST, I_CHUNK, I_FIRST, I_LAST, *REDUCING_OF.values())
PAIR_CODE = 16
"""An F&B slot's code: its F kind's code x PAIR_CODE + its B kind's."""
FB_KINDS: dict[tuple[SlotKind, SlotKind], SlotKind] = {
    (f, b): SlotKind(
        f"{f.scope}_with_{b.scope}", f"F&B: {f.what}, beside {b.what}", "fb_kind",
        f.code * PAIR_CODE + b.code,
    )
    for f in (F_FIRST, F_MIDDLE, F_LAST)
    for b in (B_CHUNK, B_FIRST)
}  # fmt: skip
"""The F&B slots (DualPipeV): one microbatch's forward and another's whole backward in one
loop, where the tick table pairs them (`TickTable.paired`)."""
SLOT_KINDS: dict[str, SlotKind] = {
    kind.scope: kind
    for kind in (
        *F_KINDS, *B_KINDS, *FB_KINDS.values(), W_CHUNK, W_CHUNK_REDUCING, W_HEAD, *SENDS,
        *RECEIVE.values(), *GATHER.values(), *FETCH.values(), COMPRESS_LINK, REDUCE_CHUNK,
        REDUCE_POWERSGD, REDUCE_TAKE, REDUCE_WRITE, REDUCE_BESIDE_B, B_ALONE,
    )
}  # fmt: skip
"""The one table: every scope the executor's tick runs something under."""


def kind_columns(
    table: TickTable,
    num_chunks: int,
    reducing_at: np.ndarray | None = None,
    at_once: bool = False,
    last_kept: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """int32 [num_ticks, p] F and B branch kinds of every (tick, stage) (static); where
    `reducing_at` (bool [num_ticks, p]: a chunk's last backward) a B is of the kind that
    reduces its layers (`REDUCING_OF`); with `at_once`, B_LAST where `at_once_cells` says;
    with `last_kept`, the last virtual stage's I is I_LAST where `kept_one_at_a_time` holds."""
    f_kind, b_kind = _kinds(table, num_chunks)
    if last_kept and kept_one_at_a_time(table, num_chunks):
        last = table.virtual_stages(table.b_chunk) == table.num_stages * num_chunks - 1
        b_kind = np.where(last & (b_kind == I_CHUNK.code), I_LAST.code, b_kind)
    if at_once:
        cells = at_once_cells(table, num_chunks)
        f_kind = np.where(cells, IDLE, f_kind).astype(np.int32)
        b_kind = np.where(cells, B_LAST.code, b_kind)
    if reducing_at is not None:
        for kind, reducing in REDUCING_OF.items():
            b_kind = np.where(reducing_at & (b_kind == kind.code), reducing.code, b_kind)
    return f_kind, b_kind.astype(np.int32)


def _kinds(table: TickTable, num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    p, v = table.num_stages, num_chunks
    if p * v == 1:
        f_kind = np.where(table.f_mb >= 0, F_EMBED.code, IDLE)
        b_kind = np.where(table.b_mb >= 0, B_WHOLE.code, IDLE)
        return f_kind.astype(np.int32), b_kind.astype(np.int32)
    f_virtual, b_virtual = table.virtual_stages(table.f_chunk), table.virtual_stages(table.b_chunk)
    last = f_virtual == p * v - 1
    f_kind = np.where(f_virtual == 0, F_FIRST.code, np.where(last, F_LAST.code, F_MIDDLE.code))
    first = b_virtual == 0
    b_kind = np.where(first, B_FIRST.code, B_CHUNK.code)
    b_kind = np.where(table.b_split > 0, np.where(first, I_FIRST.code, I_CHUNK.code), b_kind)
    f_kind = np.where(table.f_mb >= 0, f_kind, IDLE)
    b_kind = np.where(table.b_mb >= 0, b_kind, IDLE)
    return f_kind.astype(np.int32), b_kind.astype(np.int32)


def final_backward_chunks(table: TickTable) -> np.ndarray:
    """int32 [num_ticks, p]: the chunk whose last gradient-making action on that stage (a whole
    B, or a split backward's W) runs in that tick (its gradients are final from then on), -1
    elsewhere."""
    whole = (table.b_mb >= 0) & (table.b_split == 0)
    final = np.full(table.b_mb.shape, -1, np.int32)
    for s in range(table.num_stages):
        seen: set[int] = set()
        for t in reversed(range(table.num_ticks)):
            for ran, chunk in ((table.w_mb[t, s] >= 0, table.w_chunk[t, s]),
                               (whole[t, s], table.b_chunk[t, s])):  # fmt: skip
                if ran and int(chunk) not in seen:
                    seen.add(int(chunk))
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


def senders(table: TickTable, num_chunks: int, forward: bool) -> dict[str, np.ndarray]:
    """bool [num_ticks, p] per direction: the stages whose F slot sends an activation (all but
    the last virtual stage's forwards; `forward`) or whose B slot sends a cotangent (all but the
    first virtual stage's backwards), split by where it goes: "usual" (to s + 1 for activations,
    s - 1 for cotangents, around the ring), "back" (the other way: a V's chunk 1) and "local"
    (to the stage itself: the V's turn on stage p - 1)."""
    p, v = table.num_stages, num_chunks
    mb, chunk = (table.f_mb, table.f_chunk) if forward else (table.b_mb, table.b_chunk)
    virtual = table.virtual_stages(chunk)
    sending = (mb >= 0) & (virtual != (p * v - 1 if forward else 0))
    target = virtual + (1 if forward else -1)
    if table.placement != "v":
        return {"usual": sending, "back": np.zeros_like(sending), "local": np.zeros_like(sending)}
    target_chunk = (target >= p).astype(int)  # in a V, virtual stages >= p are chunk 1
    stage = np.arange(p)[None, :]
    target_stage = np.where(target_chunk == 1, 2 * p - 1 - target, target)
    local = sending & (target_stage == stage)
    back = sending & ~local & (target_chunk == 1)
    return {"usual": sending & ~local & ~back, "back": back, "local": local}


def forward_senders(table: TickTable, num_chunks: int) -> np.ndarray:
    """bool [num_ticks, p]: the stages whose F slot sends an activation on (all but the last
    virtual stage's forwards), any direction."""
    return np.logical_or.reduce(list(senders(table, num_chunks, True).values()))


def backward_senders(table: TickTable, num_chunks: int) -> np.ndarray:
    """bool [num_ticks, p]: the stages whose B slot sends a cotangent on (all but the first
    virtual stage's backwards), any direction."""
    return np.logical_or.reduce(list(senders(table, num_chunks, False).values()))


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


@dataclasses.dataclass(frozen=True)
class SlotColumns:
    """What the executor's tick reads, all static.

    columns: int [num_ticks, p] by name: the tick table's, the slot kinds, the chunk whose
        reduction starts (the tick after its last backward; `final_chunk`: the tick of it),
        ZeRO-3's gathers (`f_gather`: the slot takes the chunk gathered ahead, and its second
        buffer gathers `f_fetch_chunk`, the chunk of the slot's next gather), the
        send indices (`send_patterns`), where a cotangent is compressed, where something
        arrives. num_ticks is the table's plus one idle tick before it where ZeRO-3 gathers
        (the first gather's tick) and one after it where the loop reduces chunks (the last
        reduction's).
    patterns: send name -> its sets of pairs (`send_patterns`).
    branch_columns: name scope -> int [num_ticks, p]: the branch each (tick, stage) takes in
        every conditional of the tick, and the trips of every 0-or-1-trip slot loop; what
        `jaxmeg.parallel.hlo_cost` weights the compiled branches and loops by.
    """

    columns: dict[str, np.ndarray]
    patterns: dict[str, list[tuple[tuple[int, int], ...]]]
    branch_columns: dict[str, np.ndarray]

    @property
    def num_ticks(self) -> int:
        return len(self.columns["f_mb"])


def _pad(
    columns: dict[str, np.ndarray], before: int, after: int, branches: bool = False
) -> dict[str, np.ndarray]:
    """Idle ticks around the table: nothing runs, sends or arrives in them. `branches`: the
    branch columns, whose idle value is 0 (no trip, the first branch) whatever their name (the
    W slot's scope is also a table field's, `w_chunk`, whose idle value is -1)."""
    negative = () if branches else (*FIELDS, REDUCE_CHUNK.scope)
    idle = {name: -1 if name in negative and name != "b_split" else 0 for name in columns}
    pad = ((before, after), (0, 0))
    return {
        name: np.pad(np.asarray(col, np.int32), pad, constant_values=idle[name])
        for name, col in columns.items()
    }


def _next_gathered(gather: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """int32 [num_ticks, p]: at each tick that gathers, the chunk of the stage's next gather
    after it (-1: none), which that tick fetches ahead."""
    out = np.full_like(chunk, -1)
    for s in range(gather.shape[1]):
        ticks = np.flatnonzero(gather[:, s])
        for here, then in zip(ticks[:-1], ticks[1:], strict=True):
            out[here, s] = chunk[then, s]
    return out


def _shift(column: np.ndarray, ticks: int, fill: int) -> np.ndarray:
    """column moved `ticks` later (earlier where negative), `fill` where nothing moved in."""
    out = np.full_like(column, fill)
    if ticks >= 0:
        out[ticks:] = column[: len(column) - ticks]
    else:
        out[:ticks] = column[-ticks:]
    return out


def slot_columns(
    table: TickTable,
    num_chunks: int,
    reduction: Reduction = NO_REDUCTION,
    *,
    gathering: bool = False,
    compress: np.ndarray | None = None,
    powersgd_stages: int | None = None,
    head_in_w: bool = False,
    at_once: bool = False,
    last_kept: bool = False,
) -> SlotColumns:
    """The executor's columns for `table`: ZeRO-3 gathers where `gathering`, the in-loop data
    reductions of `reduction` (PowerSGD's on stages < `powersgd_stages`), compressed
    cotangents where `compress` (bool [num_ticks, p]) says, the head's weight gradient in the
    last stage's W slots where `head_in_w` (one chunk per stage), B_LAST where `at_once`
    (`at_once_cells`), I_LAST where `last_kept` (the forward keeps its residuals) and
    `kept_one_at_a_time`. Each direction sends only on the
    pairs that carry something in that tick (one ppermute per distinct set of pairs, chosen by
    an index equal on every stage).

    No slot waits for a collective that could have run earlier: a ZeRO-3 chunk is gathered
    ahead, in the tick where its slot takes the chunk before it (a second buffer per slot),
    and a chunk's data mean runs in the tick after its last backward, beside that tick's
    slots, and is written back at its end (beside the tick's B slot where it is BESIDE_B).
    SCATTER (a sharded optimizer): the reduce-scatter runs in the tick of the last backward,
    after its B slot, into the split accumulator that only the optimizer reads. With
    `reduction.layers` a chunk's last B slot (last W with a split backward) reduces its layers
    but the first itself, and the mean after it only that one."""
    p, v = table.num_stages, num_chunks
    columns = {name: getattr(table, name) for name in FIELDS}
    final = final_backward_chunks(table)
    reducing_at = final >= 0 if reduction.layers else None
    columns["f_kind"], columns["b_kind"] = kind_columns(table, v, reducing_at, at_once, last_kept)
    if table.ticks == PAIRS:  # a paired cell runs its F and B in the F&B slot only
        paired = table.paired
        pair = columns["f_kind"] * PAIR_CODE + columns["b_kind"]
        columns["fb_kind"] = np.where(paired, pair, IDLE).astype(np.int32)
        columns["f_kind"] = np.where(paired, IDLE, columns["f_kind"]).astype(np.int32)
        columns["b_kind"] = np.where(paired, IDLE, columns["b_kind"]).astype(np.int32)
    columns[REDUCE_CHUNK.scope] = final
    if gathering:
        columns[GATHER["f"].scope], columns[GATHER["b"].scope] = gather_columns(table)
    patterns = _send_columns(table, v, compress, columns)
    kinds = (*F_KINDS, *B_KINDS, *(FB_KINDS.values() if "fb_kind" in columns else ()))
    branches = {kind.scope: columns[kind.column] == kind.code for kind in kinds}
    branches[W_CHUNK.scope] = table.w_mb >= 0
    if reduction.layers and table.split:  # the chunk's last W reduces its layers
        columns[W_CHUNK_REDUCING.scope] = reducing_at
        branches[W_CHUNK_REDUCING.scope] = columns[W_CHUNK_REDUCING.scope]
        branches[W_CHUNK.scope] = branches[W_CHUNK.scope] & ~branches[W_CHUNK_REDUCING.scope]
    if head_in_w:
        defers, columns[W_HEAD.scope] = head_in_w_columns(table)
        columns["f_kind"] = np.where(defers, F_LAST_HEAD_IN_W.code, columns["f_kind"])
        branches[F_LAST_HEAD_IN_W.scope] = columns["f_kind"] == F_LAST_HEAD_IN_W.code
        branches[F_LAST.scope] = columns["f_kind"] == F_LAST.code
        branches[W_HEAD.scope] = columns[W_HEAD.scope]
    named = (*SENDS, *RECEIVE.values(), *GATHER.values())
    branches.update({k.scope: columns[k.scope] for k in named if k.scope in columns})
    if compress is not None:
        branches[COMPRESS_LINK.scope] = columns["pipe_compress"]
    before, after = int(gathering), int(reduction.mean)
    columns, branches = _pad(columns, before, after), _pad(branches, before, after, True)
    if gathering:
        _gather_ahead(columns, branches)
    if reduction.in_loop:
        _reduce_columns(columns, branches, p, reduction.where == SCATTER, powersgd_stages)
    if reduction.where == BESIDE_B:
        _beside_b_columns(columns, branches)
    return SlotColumns(
        columns={k: np.asarray(c, np.int32) for k, c in columns.items()},
        patterns=patterns,
        branch_columns={k: np.asarray(c, np.int32) for k, c in branches.items()},
    )


def _send_columns(table: TickTable, v: int, compress, columns: dict) -> dict:
    """Adds each send's pattern index, where a cotangent is compressed, and where something
    arrives, to `columns`; returns each send's patterns."""
    patterns = {}

    def sends(kind: SlotKind, senders: np.ndarray, step: int) -> None:
        columns[kind.scope], patterns[kind.scope] = send_patterns(senders, step)

    f_senders, b_by_way = senders(table, v, True), senders(table, v, False)
    b_senders = b_by_way["usual"]
    sends(SEND_X, f_senders["usual"], 1)
    if table.placement == "v":
        if compress is not None:
            raise ValueError("compressed cotangents need the interleaved placement, not a V")
        sends(SEND_X_BACK, f_senders["back"], -1)
        sends(SEND_COT_BACK, b_by_way["back"], 1)
    if compress is None:
        sends(SEND_COT, b_senders, -1)
    else:
        compress = np.asarray(compress, bool) & b_senders
        columns["pipe_compress"] = compress
        sends(SEND_WHOLE, b_senders & ~compress, -1)
        sends(SEND_FACTORS, compress, -1)
    ways = ("", "_back", "_local") if table.placement == "v" else ("",)
    for way in ways:
        for what, field in (("x", "act"), ("cot", "cot")):
            columns[RECEIVE[what, way].scope] = getattr(table, f"recv_{field}{way}_slot") >= 0
    return patterns


def _gather_ahead(columns: dict, branches: dict) -> None:
    """ZeRO-3 (padded columns): the idle tick before the table gathers each slot's first chunk,
    and every gather fetches the slot's next chunk into its second buffer."""
    for slot in ("f", "b"):
        gather = columns[GATHER[slot].scope]
        gather[0] = gather[1:].any(axis=0)  # the first chunk's, ahead
        fetch = _next_gathered(gather, columns[f"{slot}_chunk"])
        columns[f"{slot}_fetch_chunk"] = fetch
        branches[GATHER[slot].scope], branches[FETCH[slot].scope] = gather, fetch >= 0


def _beside_b_columns(columns: dict, branches: dict) -> None:
    """BESIDE_B: a mean due in a tick whose B slot runs goes in one loop with it (the
    `reduce_beside_b` column, which the tick reads), the B slot of every other tick in a loop of
    its own (`b_alone`), and the mean alone only where no B runs."""
    due, busy = columns[REDUCE_CHUNK.scope] >= 0, columns["b_kind"] != IDLE
    columns[REDUCE_BESIDE_B.scope] = (due & busy).astype(np.int32)
    branches[REDUCE_BESIDE_B.scope] = columns[REDUCE_BESIDE_B.scope]
    branches[B_ALONE.scope] = (~(due & busy)).astype(np.int32)
    branches[REDUCE_CHUNK.scope] = (due & ~busy).astype(np.int32)


def _reduce_columns(columns: dict, branches: dict, p: int, sharded: bool,
                    powersgd_stages: int | None) -> None:  # fmt: skip
    """The in-loop reduction (padded columns): a sharded optimizer reduce-scatters in the tick
    of a chunk's last backward; otherwise the mean (PowerSGD's on stages < `powersgd_stages`)
    starts in the tick after it (`final_chunk`: the tick it is taken in)."""
    reduce = REDUCE_CHUNK.scope  # also the column of the chunk it reduces
    if sharded:
        branches[reduce] = (columns[reduce] >= 0).astype(np.int32)
        return
    columns["final_chunk"] = columns[reduce]
    columns[reduce] = _shift(columns[reduce], 1, -1)
    reducing = (columns[reduce] >= 0).astype(np.int32)
    powersgd = np.arange(p) < (powersgd_stages or 0)  # after the warm-up: stages < k
    branches[REDUCE_TAKE.scope] = (columns["final_chunk"] >= 0).astype(np.int32)
    branches[reduce] = reducing * ~powersgd
    branches[REDUCE_POWERSGD.scope] = reducing * powersgd
    branches[REDUCE_WRITE.scope] = reducing
