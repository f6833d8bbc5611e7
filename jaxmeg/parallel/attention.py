"""Attention kernels that jax partitions itself, run where no partitioner is needed.

jax's cuDNN attention (`jax.nn.dot_product_attention(implementation="cudnn")`) is a custom call
with its own custom partitioner, which runs wherever a mesh axis is still automatic around it.
Inside the executor's map (manual over data, pipe and context) that is `tensor`, and the
partitioner fails to compile for every multi-GPU layout: it reads a legacy mesh context
(`GSPMDSharding` has no `spec`) or asserts in `get_num_ways_dim_sharded`. Attention needs no
partitioning: each tensor rank attends with its own heads (Megatron-LM's split). So the kernel
runs under a map manual over `tensor` too, on its local heads; heads are split over `tensor`
as the sharding rules split them, and the partitioner never runs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxmeg.parallel.mesh import automatic_axes_here

INSIDE_AXES = ("context", "expert", "tensor")
"""The mesh axes the executor's map leaves automatic (context where it is 1)."""


def heads_spec(axis_names) -> P:
    """q, k, v and o [B, S, N, H]: heads over `tensor`, rows over `expert` (a data-parallel
    axis for attention) where the mesh has one, the rest as the enclosing map holds it."""
    return P("expert" if "expert" in axis_names else None, None, "tensor", None)


def per_tensor_rank(implementation: str) -> Callable:
    """Causal `attend(q, k, v) -> o` that runs `implementation` on each tensor rank's heads.
    Needs the key/value heads split over tensor as the query heads are (t divides kv_heads)."""

    def kernel(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    def attend(q, k, v):
        # manual over the axes the executor's map leaves automatic (tensor, and context of
        # size 1): the partitioner runs wherever one axis is left. The same axes wherever the
        # step is traced, so residuals kept across ticks have one shape (a map stacks its
        # residuals over its manual axes).
        axes = automatic_axes_here(INSIDE_AXES)
        if not axes:  # inside a map over every axis (`gradients.map_axes`): one rank's heads
            return kernel(q, k, v)
        heads = heads_spec(jax.sharding.get_abstract_mesh().axis_names)
        mapped = jax.shard_map(
            kernel, in_specs=(heads, heads, heads), out_specs=heads, axis_names=axes
        )
        return mapped(q, k, v)

    return attend
