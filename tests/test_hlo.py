"""The HLO collective reader maps each of the three printed `replica_groups` forms (and a
permute's source-target pairs) back to the mesh axes they span, on a (2, 2, 2) mesh where
device position = 4 data + 2 pipe + tensor."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxmeg.parallel.hlo import collectives, count, replica_groups

MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "pipe", "tensor"))


def line(kind: str, groups: str, shape: str = "f32[4,16]{1,0}") -> str:
    key = "source_target_pairs" if kind == "collective-permute" else "replica_groups"
    return (
        f"  %{kind}.7 = {shape} {kind}({shape} %x), channel_id=3, {key}={groups}, "
        f'use_global_device_ids=true, metadata={{op_name="jit(step)/blocks/attn/dot_general"}}'
    )


FORMS = [
    ("literal", "all-reduce", "{{0,1},{2,3},{4,5},{6,7}}", {"tensor"}),
    ("literal, shuffled groups", "all-reduce", "{{6,7},{0,1},{4,5},{2,3}}", {"tensor"}),
    ("literal", "all-gather", "{{0,4},{1,5},{2,6},{3,7}}", {"data"}),
    ("iota", "reduce-scatter", "[4,2]<=[8]", {"tensor"}),
    ("iota transposed", "all-reduce", "[4,2]<=[2,2,2]T(1,2,0)", {"data"}),
    ("iota transposed, two axes", "all-reduce", "[2,4]<=[2,4]T(1,0)", {"data", "tensor"}),
    ("mesh", "all-reduce", "mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}", {"pipe"}),
    ("mesh, two axes", "all-gather", "mesh['a'=2,'b'=2,'c'=2] {'a','c'}", {"data", "tensor"}),
    ("permute pairs", "collective-permute", "{{0,2},{2,0},{1,3},{3,1},{4,6},{6,4}}", {"pipe"}),
]


@pytest.mark.parametrize("form,kind,groups,axes", FORMS, ids=[f[0] + " " + f[1] for f in FORMS])
def test_every_printed_form_maps_to_its_mesh_axes(form, kind, groups, axes):
    (found,) = collectives(line(kind, groups), MESH)
    assert found.kind == kind and found.axes == frozenset(axes)
    assert found.bytes == 4 * 16 * 4 and "attn" in found.op_name
    assert count([found], kind, axes, where="attn") == 1


def test_iota_groups_are_the_transposed_device_grid():
    assert replica_groups(line("all-reduce", "[4,2]<=[2,2,2]T(1,2,0)")) == [
        [0, 4], [1, 5], [2, 6], [3, 7]
    ]  # fmt: skip


def test_tuple_results_add_their_bytes_and_async_starts_count():
    text = line("all-reduce", "{{0,1},{2,3},{4,5},{6,7}}", "(f32[8]{0}, bf16[4,4]{1,0})")
    text = text.replace("all-reduce(", "all-reduce-start(")
    (found,) = collectives(text, MESH)
    assert found.bytes == 8 * 4 + 16 * 2


def test_compiled_psum_over_each_axis_is_named():
    """The same reader on what XLA really prints for a psum over each mesh axis."""
    from jax.sharding import PartitionSpec as P

    for axis in MESH.axis_names:

        def f(x, axis=axis):
            return jax.lax.psum(x, axis)

        fn = jax.shard_map(f, mesh=MESH, in_specs=P(MESH.axis_names), out_specs=P(MESH.axis_names))
        text = jax.jit(fn).lower(np.ones((8, 4), np.float32)).compile().as_text()
        found = [c for c in collectives(text, MESH) if c.kind == "all-reduce"]
        assert [c.axes for c in found] == [frozenset({axis})], (axis, found)


def test_an_async_all_to_all_counts_the_bytes_that_move():
    """A GPU `all-to-all-start` returns ((operands...), results...): what moves is the results,
    once (the operand tuple is the same bytes again)."""
    from jaxmeg.parallel.hlo import _result_bytes
    from jaxmeg.parallel.hlo_gpu import after_operand_tuple

    one = "((u16[8,1,1024,4096]{3,2,1,0}), u16[8,1,1024,4096]{3,2,1,0})"
    assert _result_bytes(after_operand_tuple(one)) == 8 * 1024 * 4096 * 2
    two = "((bf16[4,2]{1,0}, s32[4]{0}), bf16[4,2]{1,0}, s32[4]{0})"
    assert _result_bytes(after_operand_tuple(two)) == 4 * 2 * 2 + 4 * 4
    assert after_operand_tuple("f32[4]{0}") == "f32[4]{0}"
