"""The one table that maps logical axes to mesh axes, and the shardings derived from it.

Megatron layout (Shoeybi et al., 2019): for the MLP, Y = GeLU(X A) with A = [A_1 .. A_t] split
along its second dim (column-parallel, logical `mlp` -> `tensor`), then Z = Y B with B split along
its first dim (row-parallel, same logical axis) and one all-reduce of Z. Attention does the same
over `heads`. The embedding table is split on `vocab`. Activations: `act_batch` on `data`; with
sequence parallelism the residual stream (`act_rows`, `act_seq`) goes on `tensor`, so each
all-reduce becomes a reduce-scatter plus an all-gather. Megatron-LM splits its sequence dim,
which its [s, b, h] activations hold major; ours are [b, s, h], so the residual stream is split
on its rows (the batch dim, major) where t divides a microbatch's rows, and a GPU's all-gathers
and reduce-scatters move contiguous blocks; split on the sequence (b < t), XLA transposes the
operand of each one, and of the GEMM beside it, to make the sequence major (gpt_1.3b (2,2,2)
on H100s, 8 layers: 68 GB of copy kernels a step, 8.2% of the kernel bytes; on the rows, 2 GB).
The tokens each rank holds, and so every layer norm, residual add and their memory, are the
same either way. With context parallelism the sequence dim is split over `context` everywhere
(`act_seq` and, inside attention and the MLP, `act_tokens`), and sequence parallelism splits it
over `tensor` too.

Grouped-query attention (`model.kv_heads` < `model.heads`): the query heads stay on `tensor`; the
key/value heads (`kv_heads`, `act_kv_heads`) go on `tensor` too when t divides kv_heads, so each
rank holds the kv heads of its own query heads, and are replicated on every tensor rank otherwise
(Megatron does the same when t > kv_heads): `jaxmeg.config_validation.kv_head_rules`, which
`config.validate` writes into `parallel.param_rules` / `activation_rules` unless they name those
axes already.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmeg.config import ParallelConfig

Rules = tuple[tuple[str, str | None], ...]

PARAM_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert_mlp": "tensor",
    "experts": "expert",
    "embed": None,
    "head_dim": None,
    "qkv": None,
    "positions": None,
    "layers": None,
}

ACTIVATION_RULES: dict[str, str | None] = {
    "act_batch": ("data", "expert"),
    "act_rows": ("data", "expert"),
    "act_seq": None,
    "act_tokens": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def param_rules(par: ParallelConfig) -> Rules:
    return tuple({**PARAM_RULES, **par.param_rules}.items())


def activation_rules(par: ParallelConfig, rows: int | None = None) -> Rules:
    """The activation rules of `par`. `rows`: a microbatch's rows on each (data, expert) rank;
    with sequence parallelism they are split over `tensor` where it divides them (the module
    docstring), else (or unknown) the sequence is."""
    rules = dict(ACTIVATION_RULES)
    if par.sequence_parallel and par.context == 1 and rows and rows % par.tensor == 0:
        rules["act_rows"] = ("data", "expert", "tensor")
    elif par.sequence_parallel:
        rules["act_seq"] = "tensor"
    if par.context > 1:  # the sequence split over context everywhere, and over tensor with SP
        rules["act_tokens"] = "context"
        rules["act_seq"] = ("context", "tensor") if par.sequence_parallel else "context"
    rules.update(par.activation_rules)
    return tuple(rules.items())


def logical_to_spec(logical_axes: tuple, rules: Rules, drop: frozenset = frozenset()) -> P:
    """Maps a tuple of logical names to a PartitionSpec; mesh axes in `drop` become None."""
    table = dict(rules)
    axes = []
    for name in logical_axes:
        mesh_axis = table.get(name) if name is not None else None
        if isinstance(mesh_axis, tuple):  # several mesh axes: keep those not dropped
            mesh_axis = tuple(a for a in mesh_axis if a not in drop) or None
            mesh_axis = mesh_axis[0] if mesh_axis and len(mesh_axis) == 1 else mesh_axis
        axes.append(None if mesh_axis in drop else mesh_axis)
    return P(*axes)


def make_constrain(rules: Rules, manual_axes: frozenset = frozenset()) -> Callable:
    """The model's activation hook: a sharding constraint with a bare PartitionSpec.

    Inside a shard_map, axes that are manual there (`manual_axes`) cannot be named and are left
    out; the bare spec binds to the mesh in context (`jax.set_mesh` or the shard_map's own).
    Where nothing is left (a map over every axis) there is nothing to constrain.
    """

    def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
        if jax.sharding.get_abstract_mesh().are_all_axes_manual:
            return x
        return jax.lax.with_sharding_constraint(
            x, logical_to_spec(logical_axes, rules, manual_axes)
        )

    return constrain


def param_specs(boxed_params, rules: Rules):
    """PartitionSpecs for a tree of flax LogicallyPartitioned params (or their abstract shapes)."""
    logical = nn.get_partition_spec(boxed_params)
    return jax.tree.map(
        lambda spec: logical_to_spec(tuple(spec), rules),
        logical,
        is_leaf=lambda x: isinstance(x, P),
    )


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
