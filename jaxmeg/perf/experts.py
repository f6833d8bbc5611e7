"""Mixture-of-experts layers in the performance model (the `moe` section, `jaxmeg.models.moe`,
`jaxmeg.parallel.experts`): parameters, active FLOPs, what expert parallelism sends and keeps,
and an MoE feed-forward block's time, as jaxmeg runs them.

Words: as `jaxmeg.perf.model`, and E experts, k of them per token, f one expert's width, f_s the
shared experts' width together, M matrices per expert (3 SwiGLU, 2 GeLU), e expert ranks, T the
tokens of one microbatch on one GPU (s b, with s / c under context parallelism).

How jaxmeg runs an MoE block with e > 1: each GPU routes its T tokens, sends each of its T k choices
to the GPU that holds the expert and gets the output back, by two all-to-alls over the expert axis.
Dropless at a bound chosen per step (`Layout.expert_exchange = "bounded"`, what jaxmeg runs): each
(sender, receiver) block holds B rows, the smallest of `config_moe.exchange_bounds` that the step's
busiest block fits; priced here at a busiest block of `EXCHANGE_LOAD` times the even load T k / e,
so B = 1.25 T k / e: a GPU sends (e - 1) B rows each way and its grouped GEMMs take the e B rows it
receives. `"padded"` prices the largest bound, B = T k (a router that sends every choice to one
GPU); `"routed"` the routed rows only, (e - 1) / e T k rows each way (a ragged all-to-all,
Megatron-Core's dispatcher; jaxmeg's on a GPU, `moe.exchange: ragged`). The dropless exchange keeps
its residuals (the received rows and the experts' hidden activations) in buffers for the largest
bound up to `moe.exchange_kept_bound` (2x the even load) and its backward runs the two transposed
all-to-alls: 2 forward, 2 backward; priced at a bound past that, its backward reruns the forward's
exchange and expert GEMMs (2 forward, 4 backward). With a capacity factor in a pipeline's slots (p v
> 1) the backward reruns its forward too; with p v = 1 it keeps it. With a capacity factor cf
(`moe.capacity_factor`) the exchange moves fixed buffers of E C rows per sequence, C = ceil(cf s k /
E), whatever `expert_exchange` says: (e - 1) / e of them per all-to-all, the experts running on E C
rows per sequence, about cf times the routed work. With e = 1 the experts run on the GPU with no
exchange.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmeg.config_moe import exchange_bounds, kept_bound
from jaxmeg.perf.context import local_seq_len, send_seconds
from jaxmeg.perf.hardware import Hardware, gemm_seconds
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.links import expert_link
from jaxmeg.perf.shape import Shape

EXCHANGE_LOAD = 1.25
"""The busiest (sender, receiver) block of a bounded exchange as a multiple of the even load,
as priced: balanced routing (max / mean expert load below 1.3, docs/moe.md)."""
BUFFER_PASSES = 6
"""Memory passes over the exchange's e B x h buffers per forward (zero fill, scatter into the
send blocks, sort by expert, unsort, gather back, combine), priced at HBM bandwidth."""


def expert_parameters(shape: Shape) -> float:
    """One layer's routed experts, all E of them: E M h f (no biases)."""
    x = shape.experts
    return 0.0 if x is None else x.count * x.matrices * shape.hidden * x.width


def moe_layer_parameters(shape: Shape) -> float:
    """One MoE layer: attention and layer norms as eq. 2 counts them (4 h^2 + 8 h), the router
    (h E, and E routing biases), the shared experts (M h f_s; GeLU ones with biases) and the
    routed experts."""
    h, x = shape.hidden, shape.experts
    shared = x.matrices * h * x.shared_width
    if x.shared_width and not x.gated:
        shared += x.shared_width + h
    return 4 * h * h + 8 * h + (h + 1) * x.count + shared + expert_parameters(shape)


def mlp_flops_per_token(shape: Shape) -> float:
    """Forward FLOPs per token of one layer's feed-forward block: eq. 3's dense MLP, 4 h f for
    f = mlp_ratio h (16 h^2); an MoE block's router (2 h E), its k routed experts and the shared
    ones (2 M h per unit of width): the FLOPs a token runs, not those of every expert."""
    h, x = shape.hidden, shape.experts
    if x is None:
        return 4 * h * shape.mlp_ratio * h
    return 2 * h * x.count + 2 * x.matrices * h * (x.top_k * x.width + x.shared_width)


def tokens(shape: Shape, layout: Layout) -> float:
    """T: one microbatch's tokens on one GPU."""
    return local_seq_len(shape, layout) * layout.microbatch


def capacity_rows(shape: Shape, layout: Layout) -> float:
    """With a capacity factor, the E C slots of each of a GPU's b sequences (0 without)."""
    x = shape.experts
    if not x.capacity_factor:
        return 0.0
    slots = math.ceil(x.capacity_factor * local_seq_len(shape, layout) * x.top_k / x.count)
    return x.count * slots * layout.microbatch


def exchange_block(shape: Shape, layout: Layout) -> float:
    """B, the rows of one (sender, receiver) block of a dropless exchange: T k padded, the
    first bound at or above `EXCHANGE_LOAD` T k / e bounded, T k / e routed."""
    choices, e = tokens(shape, layout) * shape.experts.top_k, layout.expert
    if layout.expert_exchange == "padded":
        return choices
    if layout.expert_exchange == "routed":
        return choices / e
    busiest = EXCHANGE_LOAD * choices / e
    bounds = exchange_bounds(max(1, round(choices)), e, shape.experts.exchange_bounds)
    return next(b for b in bounds if b >= busiest or b == bounds[-1])


def exchange_branch(shape: Shape, layout: Layout) -> int | None:
    """Which of `exchange_bounds` a bounded exchange runs at as priced (`exchange_block`): the
    branch of the compiled exchange the cost report counts; None without a dropless exchange."""
    x = shape.experts
    if x is None or x.capacity_factor or layout.expert == 1:
        return None
    choices = max(1, round(tokens(shape, layout) * x.top_k))
    bounds = exchange_bounds(choices, layout.expert, x.exchange_bounds)
    bounded = dataclasses.replace(layout, expert_exchange="bounded")
    return bounds.index(exchange_block(shape, bounded))


def expert_rows(shape: Shape, layout: Layout) -> float:
    """Rows one GPU's expert GEMMs take per layer and microbatch: T k with e = 1, e B with an
    exchange (`exchange_block`), E C per sequence with a capacity factor."""
    if shape.experts.capacity_factor:
        return capacity_rows(shape, layout)
    if layout.expert == 1:
        return tokens(shape, layout) * shape.experts.top_k
    return layout.expert * exchange_block(shape, layout)


def all_to_all_bytes(shape: Shape, layout: Layout, compute_bytes: int = 2) -> float:
    """Bytes one GPU sends in one all-to-all (dispatch or combine): (e - 1) / e of the rows its
    experts take (`expert_rows`: the e B rows of a dropless exchange, (e - 1) B h; its E C slots
    per sequence with a capacity factor); 0 with e = 1."""
    e = layout.expert
    return (e - 1) / e * expert_rows(shape, layout) * shape.hidden * compute_bytes


def kept_block(shape: Shape, layout: Layout) -> float:
    """The rows of one (sender, receiver) block whose residuals a dropless exchange keeps: the
    largest bound up to the kept multiple of the even load (`config_moe.kept_bound`): the
    layout's, else the model's."""
    x, e = shape.experts, layout.expert
    choices = max(1, round(tokens(shape, layout) * x.top_k))
    factor = layout.exchange_kept_bound or x.exchange_kept_bound
    return kept_bound(exchange_bounds(choices, e, x.exchange_bounds), choices, e, factor)


def reruns_exchange(shape: Shape, layout: Layout) -> bool:
    """Whether the backward reruns the exchange's forward (e > 1): dropless, where the priced
    block (`exchange_block`) is past the kept one (`kept_block`); with a capacity factor, in a
    pipeline's slots (p v > 1)."""
    if layout.expert == 1:
        return False
    if shape.experts.capacity_factor:
        return layout.pipe * layout.chunks > 1
    return exchange_block(shape, layout) > kept_block(shape, layout)


def all_to_alls(shape: Shape, layout: Layout) -> tuple[int, int]:
    """(forward, backward) all-to-alls per MoE layer and microbatch: none with e = 1; else the
    dispatch and combine, and in the backward their transposes (and the forward's again where
    `reruns_exchange`). Full recompute runs the forward once more (`LayerSeconds.recompute`)."""
    if layout.expert == 1:
        return (0, 0)
    return (2, 4) if reruns_exchange(shape, layout) else (2, 2)


def moe_seconds(
    shape: Shape, layout: Layout, hw: Hardware, hidden: float = 0.0
) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block for one microbatch on one GPU, its tensor
    all-reduce aside (counted with the layer, as the dense MLP's): the router, the E / e local
    experts' GEMMs (their width / t; rows shared evenly), the shared experts, the exchange's
    buffer passes and its all-to-alls over `links.expert_link`, a `hidden` share of them under
    compute (the schedule's F&B pairs, `jaxmeg.pipeline.analysis.paired_share`), the rest
    exposed. The backward: twice the forward's GEMMs, and where `reruns_exchange` the forward's
    exchange and expert GEMMs once more. With `layout.fp8` the shared and the routed experts'
    GEMMs run at the FP8 peak (their scaling passes are not priced: the linears'
    `model.fp8_scaling_seconds` are)."""
    x, h, t, e = shape.experts, shape.hidden, layout.tensor, layout.expert
    rows, local = expert_rows(shape, layout), x.count / e
    per_expert, f = rows / local, x.width / t
    fp8 = layout.fp8 != "none"
    experts = local * (
        (x.matrices - 1) * gemm_seconds(per_expert, f, h, hw, fp8)
        + gemm_seconds(per_expert, h, f, hw, fp8)
    )
    shared = 0.0
    if x.shared_width:
        fs = x.shared_width / t
        n = tokens(shape, layout)
        shared = (x.matrices - 1) * gemm_seconds(n, fs, h, hw, fp8) + gemm_seconds(
            n, h, fs, hw, fp8
        )
    router = gemm_seconds(tokens(shape, layout), x.count, h, hw)
    buffers = 0.0
    if e > 1:
        buffers = BUFFER_PASSES * 2 * rows * h / (hw.hbm_tb_per_s * 1e12)
    exchange = (1.0 - hidden) * send_seconds(
        all_to_all_bytes(shape, layout), expert_link(layout, hw)
    )
    fwd, bwd = all_to_alls(shape, layout)
    compute = router + experts + shared
    forward = compute + buffers + fwd * exchange
    rerun = experts + buffers if reruns_exchange(shape, layout) else 0.0
    return forward, 2 * compute + rerun + bwd * exchange


def kept_bytes_per_layer(shape: Shape, layout: Layout) -> float:
    """What an MoE block keeps for its backward per microbatch, in place of the dense MLP's
    (Korthikanti's (3 + 16 / t) s b h of a 4h MLP): its input (2 T h) and fp32 router logits
    (4 T E); with e = 1 also the sorted rows and the experts' hidden activations, 2 T k (h + M
    f / t), and the per-choice outputs in fp32 (4 T k h). With e > 1, where the exchange is not
    rerun (`reruns_exchange`), the exchange's (`jaxmeg.models.moe_exchange`): the rows the
    experts received and their first GEMMs' outputs (M - 1 of them), over the kept bound's
    e B_kept rows (`kept_block`: those bounds keep the same buffers), and the per-choice
    outputs (2 T k h);
    with a capacity factor its buffers and hidden activations over its E C rows per sequence;
    where it is rerun nothing."""
    x, h, n = shape.experts, shape.hidden, tokens(shape, layout)
    kept = 2 * n * h + 4 * n * x.count
    if layout.expert == 1:
        kept += 2 * n * x.top_k * (h + x.matrices * x.width / layout.tensor) + 4 * n * x.top_k * h
    elif x.capacity_factor and not reruns_exchange(shape, layout):
        # jax's pullback of the capacity exchange: its buffers and every hidden activation
        rows = capacity_rows(shape, layout)
        kept += 2 * rows * (h + x.matrices * x.width / layout.tensor)
    elif not reruns_exchange(shape, layout):
        rows = layout.expert * kept_block(shape, layout)
        kept += 2 * rows * (h + (x.matrices - 1) * x.width / layout.tensor) + 2 * n * x.top_k * h
    return kept


def dense_mlp_kept_bytes(shape: Shape, layout: Layout) -> float:
    """The dense MLP's share of `model.layer_activation_bytes` (none and selective): its input
    and dropout mask, 3 s b h (/ t with sequence parallelism), and the two 4h activations,
    16 s b h / t."""
    sbh = tokens(shape, layout) * shape.hidden
    t = layout.tensor
    return sbh * ((3 + 16) / t if layout.sequence_parallel else 3 + 16 / t)


def working_bytes(shape: Shape, layout: Layout) -> float:
    """The exchange's buffers while one MoE block runs (e > 1): the send, received, sorted,
    output and returned blocks, e B h each (`expert_rows`), and the experts' hidden
    activations, M e B f / t, all 16-bit; where the backward reruns the dropless exchange
    (`reruns_exchange`), also the rerun's residuals over its e B rows until the layer's
    backward is done."""
    if layout.expert == 1:
        return 0.0
    x, rows = shape.experts, expert_rows(shape, layout)
    working = 2 * rows * (5 * shape.hidden + x.matrices * x.width / layout.tensor)
    if reruns_exchange(shape, layout) and not x.capacity_factor:
        working += 2 * rows * (shape.hidden + (x.matrices - 1) * x.width / layout.tensor)
    return working
