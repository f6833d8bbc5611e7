"""The `moe` config section: a mixture-of-experts feed-forward block in place of the dense MLP
(`jaxmeg.models.moe`). Part of `jaxmeg.config_sections` (which imports it); checked by
`jaxmeg.config_validation.validate`."""

from __future__ import annotations

import dataclasses
import functools
import math

MOE_ROUTERS = ("softmax", "sigmoid")
"""The `moe.router` choices (`jaxmeg.models.moe.route`)."""
GROUPED_GEMMS = ("auto", "ragged", "blocked", "pallas")
"""The `moe.grouped_gemm` choices (`jaxmeg.models.grouped_gemm`)."""
EXCHANGES = ("auto", "blocks", "ragged")
"""The `moe.exchange` choices (`jaxmeg.models.moe_exchange.PLANS`)."""
EXCHANGE_BOUNDS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)
"""The bounds a dropless exchange over an expert axis runs at (`exchange_bounds`): rows per
(sender, receiver) block as multiples of an even load, T k / E_ranks."""


LAYER_KINDS = ("dense", "moe")
"""The `moe.pattern` entries: a layer's MLP is the dense one or the mixture of experts."""


@functools.cache
def stack_split(kinds: tuple[bool, ...]) -> tuple[int, tuple[bool, ...]]:
    """(dense leading layers, one entry of the layer stack: True where a layer is MoE) of the
    per-layer pattern `kinds`: of its splits into a dense prefix (at most its leading dense
    layers) and the shortest unit whose repeats make the rest, the one with the most stack
    entries, then the shortest prefix. A rest that repeats no shorter unit is one entry."""
    lead = kinds.index(True) if True in kinds else 0
    best = (0, 0, kinds)
    for prefix in range(lead + 1):
        rest = kinds[prefix:]
        n = next(n for n in range(1, len(rest) + 1)
                 if len(rest) % n == 0 and rest == rest[:n] * (len(rest) // n))  # fmt: skip
        if len(rest) // n > best[0]:
            best = (len(rest) // n, prefix, rest[:n])
    return best[1], best[2]


EXCHANGE_KEPT_BOUND = 2.0
"""`moe.exchange_kept_bound`'s default: the bounds up to twice the even load keep their
residuals."""


def kept_bound(bounds: tuple[int, ...], choices: int, ranks: int, factor: float) -> int:
    """The largest of `bounds` (block rows) at most `factor` times the even share T k / E_ranks,
    and at least the first: the block rows whose residuals the dropless exchange's forward
    keeps (`jaxmeg.models.moe_exchange`)."""
    limit = factor * choices / ranks
    return max([bounds[0], *(b for b in bounds if b <= limit)])


BOUND_SLOTS = 16
"""The slots of a dropless layer's exchange-bound counts (`moe.record_exchange_bounds`): one
per factor of `moe.exchange_bounds` (at most 15), the last for all T k choices; a fixed size,
so the bounds may change between runs of one checkpoint."""


def bound_slots(
    choices: int, ranks: int, factors: tuple[float, ...] = EXCHANGE_BOUNDS
) -> tuple[int, ...]:
    """For each of `exchange_bounds`' block sizes, its slot (`BOUND_SLOTS`): the first factor
    that rounds to it, or the last slot for all T k choices."""
    slots = []
    for size in exchange_bounds(choices, ranks, factors):
        at = [i for i, f in enumerate(factors) if math.ceil(f * choices / ranks) == size]
        slots.append(at[0] if at and size < choices else BOUND_SLOTS - 1)
    return tuple(slots)


def slot_factors(factors: tuple[float, ...], ranks: int) -> tuple[float, ...]:
    """Each slot's bound as a multiple of an even load: the factors, 0 for unused slots, and
    `ranks` (E_ranks x an even load is all T k choices) in the last."""
    return (*factors, *[0.0] * (BOUND_SLOTS - 1 - len(factors)), float(ranks))


def exchange_bounds(
    choices: int, ranks: int, factors: tuple[float, ...] = EXCHANGE_BOUNDS
) -> tuple[int, ...]:
    """The dropless exchange's block sizes for a device's `choices` (T k) over `ranks` expert
    ranks: each of `factors` (`moe.exchange_bounds`) times the even share T k / E_ranks,
    rounded up, below T k; then T k, which any routing fits
    (`jaxmeg.models.experts_ffn.experts_ffn_exchanged` runs the smallest that fits the step's
    busiest block)."""
    sizes = {math.ceil(f * choices / ranks) for f in factors}
    return (*sorted(b for b in sizes if b < choices), choices)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    experts: int = 0
    """Routed experts E per MoE layer; 0 = a dense model (the other fields are not read)."""
    top_k: int = 2
    """Experts each token is sent to, k (1 <= k <= experts)."""
    ffn_hidden: int = -1
    """Each expert's FFN width; -1 = the dense MLP's (model.ffn_hidden or mlp_ratio x hidden).
    A SwiGLU expert (llama block) or a GeLU one without biases (gpt block). Split over `tensor`
    like the dense MLP's width, so it must be divisible by parallel.tensor."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek, Qwen-MoE), run as
    one dense MLP of shared_experts x shared_ffn_hidden."""
    shared_ffn_hidden: int = -1
    """Width of one shared expert; -1 = `ffn_hidden`."""
    shared_gate: bool = False
    """Scale the shared experts' output by a per-token sigmoid gate (Qwen2-MoE's
    `shared_expert_gate`)."""
    first_dense: int = 0
    """Leading layers that keep the dense MLP (DeepSeek-V3: 3, of model.layers). They run with
    the embedding, on the first pipeline stage, and its backward recomputes them; the other
    model.layers - first_dense layers are the ones split over stages."""
    every: int = 1
    """MoE in every n-th layer only (Switch Transformer, Llama 4 Maverick: 2; Qwen-MoE's
    `decoder_sparse_step`): after the `first_dense` layers the layers come in groups of n, n - 1
    with the dense MLP and then an MoE one, so model.layers - first_dense must be divisible by
    n. A group is one entry of the layer stack: pipeline stages and `parallel.stage_layers`
    count groups."""
    pattern: tuple[str, ...] = ()
    """Each layer's MLP in model order, `dense` or `moe` (model.layers of them), in place of
    `first_dense` and `every` (leave those at 0 and 1): e.g. [moe, dense] repeated, or
    Qwen2-MoE's `mlp_only_layers` anywhere. The model runs it as dense leading layers (with the
    embedding, as `first_dense`) and a layer stack of equal entries, each a repeat of the
    shortest unit the rest is made of (`stack_split`: the split with the most entries); a rest
    that repeats no shorter unit is one entry, which a pipeline cannot split. [] = the layers
    `first_dense` and `every` say."""
    router: str = "softmax"
    """`softmax` (Mixtral, Qwen-MoE: probabilities over all experts) or `sigmoid` (DeepSeek-V3:
    independent scores, the chosen ones normalised). The router runs in float32."""
    normalize: bool = True
    """Renormalise a softmax router's top-k weights to sum to 1 (Mixtral; Qwen1.5-MoE keeps
    them as they are). A sigmoid router's are always normalised."""
    router_groups: int = 1
    """Group-limited routing (DeepSeek-V3's node-limited routing): the experts in this many
    groups of moe.experts / router_groups consecutive ones, each token choosing its top k among
    its `router_group_topk` best groups (a group scores the sum of its two highest scores).
    Laid over expert ranks, a token's choices reach at most that many groups of ranks. 1 = off
    (DeepSeek-V3: 8)."""
    router_group_topk: int = 1
    """The groups each token chooses its experts from, M (1 <= M <= router_groups, and M x
    experts / router_groups >= top_k; DeepSeek-V3: 4). Read only with router_groups > 1."""
    routed_scaling: float = 1.0
    """A factor on the routed experts' combine weights, after their normalisation (DeepSeek-V3's
    routed_scaling_factor: 2.5)."""
    capacity_factor: float = 0.0
    """Choices an expert takes from each sequence, as a multiple of its even share: C =
    ceil(cf s k / E) slots, first come in token order, the rest dropped (Switch Transformer's
    capacity). The experts then run on fixed [E, C] buffers per sequence and expert
    parallelism moves only those (cf times the routed tokens' bytes). 0 = dropless (every
    choice computed, however uneven the load; the exchange then pads each device pair's block
    to a bound chosen per step, `exchange_bounds`)."""
    aux_loss: float = 0.01
    """Coefficient of the load-balancing loss (Switch Transformer's E sum_e f_e P_e), taken per
    sequence and averaged, so its gradient is the same however the batch is split over
    microbatches, replicas and stages. 0 = off."""
    z_loss: float = 0.0
    """Coefficient of the router z-loss (ST-MoE: the mean squared log-sum-exp of the logits)."""
    exchange_bounds: tuple[float, ...] = EXCHANGE_BOUNDS
    """The bounds a dropless exchange (parallel.expert > 1) runs at, as multiples (>= 1,
    increasing) of an even load, T k / E_ranks rows per (sender, receiver) block: each step
    takes the smallest its busiest block fits, and all of a device's T k choices (the largest
    bound, always there) when none does. Each bound is a branch of the step compiled at its
    shapes: fewer bounds compile faster and move more padding; [] = always the largest."""
    record_exchange_bounds: bool = True
    """Dropless: each MoE layer keeps `exchange_taken` [BOUND_SLOTS], never
    trained, whose "gradient" counts the bounds its exchange took in the step, and the step
    reports the largest as `moe_exchange_bound` (a skewed router made it pay that multiple of
    an even load). false for checkpoints written before the leaf existed."""
    exchange_kept_bound: float = EXCHANGE_KEPT_BOUND
    """The dropless exchange's forward keeps its residuals (the received rows and the first
    GEMMs' outputs) for the bounds up to this multiple of the even load, in buffers that size;
    a step that takes a larger bound reruns the exchange's forward in its backward. Larger keeps
    more memory per layer and microbatch in flight (at most E_ranks times the routed rows, all
    bounds); smaller reruns more skewed steps. >= 1."""
    grouped_gemm: str = "auto"
    """How a dropless layer runs its experts' grouped GEMMs, on one device and under the
    exchange (parallel.expert > 1): `auto` (`pallas` on a GPU where a device holds several
    experts, in 16 bits; `ragged` elsewhere: `grouped_gemm.settled`), `ragged`
    (`jax.lax.ragged_dot`, which XLA's GPU compiler makes one dense GEMM over every expert a
    device holds), `blocked` (a loop of dense GEMMs
    over blocks of each expert's rows: about the routed FLOPs, more memory traffic;
    docs/benchmarks.md) or `pallas` (Triton kernels of our own that run only each group's
    rows, `jaxmeg.models.grouped_kernels`; interpreted, slowly, off a GPU). All give the same
    outputs and gradients; only `ragged` has an FP8 form."""
    exchange: str = "auto"
    """How a dropless exchange (parallel.expert > 1) moves the rows: `blocks` (one all-to-all
    of E_ranks blocks of B rows each, B the bound for the step's busiest (sender, receiver)
    pair: about 1.25x the routed rows' bytes when balanced, all T k choices per block at
    worst), `ragged` (`jax.lax.ragged_all_to_all`: only the routed rows travel, into a buffer
    whose bound is on the rows a device receives in all; off a GPU, where XLA has no ragged
    all-to-all, the same result by a dense all-to-all of every slice at its largest size, for
    tests) or `auto` (`ragged` on a GPU, `blocks` elsewhere: `moe_exchange.settled`)."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3's loss-free balancing: after each step every expert's routing bias moves by
    this much toward an even load (up if the expert got fewer tokens than the mean, down if
    more). The bias changes which experts are chosen, never the weights they are combined
    with; it is kept in the params (`router_bias`) and the checkpoint, outside the optimizer.
    0 = the bias stays 0 (DeepSeek-V3: 0.001)."""

    def kinds(self, layers: int) -> tuple[bool, ...]:
        """Each of the model's `layers` layers: True where its MLP is the mixture of experts."""
        if not self.experts:
            return (False,) * layers
        if self.pattern:
            return tuple(kind == "moe" for kind in self.pattern)
        return (False,) * self.first_dense + self.unit * ((layers - self.first_dense) // self.every)

    @property
    def dense_layers(self) -> int:
        """The leading layers that run with the embedding (dense MLPs): `first_dense`, or the
        prefix of `pattern`'s split; 0 for a dense model."""
        if not self.experts:
            return 0
        return stack_split(self.kinds(len(self.pattern)))[0] if self.pattern else self.first_dense

    @property
    def unit(self) -> tuple[bool, ...]:
        """One entry of the layer stack, a layer each: True where its MLP is the mixture of
        experts (`every` - 1 dense layers then an MoE one, or `pattern`'s unit; one dense layer
        for a dense model)."""
        if not self.experts:
            return (False,)
        if self.pattern:
            return stack_split(self.kinds(len(self.pattern)))[1]
        return (False,) * (self.every - 1) + (True,)

    @property
    def layers_per_unit(self) -> int:
        """Layers per entry of the layer stack (`unit`'s length: `every`, 1 for a dense
        model)."""
        return len(self.unit)

    def expert_width(self, dense_width: int) -> int:
        """One routed expert's FFN width, given the dense MLP's."""
        return dense_width if self.ffn_hidden == -1 else self.ffn_hidden

    def shared_width(self, dense_width: int) -> int:
        """The shared experts' FFN width together (0 without shared experts)."""
        one = (
            self.expert_width(dense_width)
            if self.shared_ffn_hidden == -1
            else (self.shared_ffn_hidden)
        )
        return self.shared_experts * one
