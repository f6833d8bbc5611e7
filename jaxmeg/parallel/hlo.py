"""Reads the collectives of a compiled XLA module and names the mesh axes each one spans.

`compiled.as_text()` prints a collective's `replica_groups` in three forms, sometimes in one
module, and in no stable group order:
  literal   `{{0,1},{2,3}}`
  iota      `[4,2]<=[8]` or `[2,4]<=[4,2]T(1,0)` (iota over the devices, reshaped, transposed,
            then read as [groups, group_size])
  mesh      `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (devices laid out row-major on that
            mesh; a group varies over the listed axes)
Each group is turned into device positions on the jaxmeg mesh, and the collective's axes are the
mesh axes along which members of a group differ. `collective-permute` uses its source-target
pairs the same way.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import numpy as np
from jax.sharding import Mesh

KINDS = (
    "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
    "ragged-all-to-all",
)  # fmt: skip
_KIND_RE = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = (?P<shape>.*?) (?P<kind>" + "|".join(KINDS) + r")(?:-start)?\("
)
_ARRAY_RE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|c64)\[([\d,]*)\]")
_BYTES = {
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
}
_COMPUTATION_RE = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    """One of `KINDS`."""
    axes: frozenset
    """The jaxmeg mesh axes that a group spans (empty for a collective within one device)."""
    bytes: int
    """Bytes of the result (summed over a tuple result), per device; of a ragged all-to-all,
    what can move (`moved_bytes`)."""
    computation: str
    """The HLO computation that holds it (a while body for loop-carried collectives)."""
    op_name: str
    """The JAX op name from the metadata, e.g. `jit(step)/.../transpose(jvp(GPT))/blocks/...`."""
    op_axes: frozenset = frozenset()
    """The mesh axes that the op's devices span taken together: a collective-permute meets
    every device its pairs name (one rendezvous on CPU, one clique on GPU), even where each
    pair stays inside one stage; a grouped collective meets each group on its own (`axes`)."""


def _result_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY_RE.findall(shape_text):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _BYTES[dtype]
    return total


def moved_bytes(kind: str, shape_text: str) -> int:
    """A collective's bytes per device: its result's, but of a ragged all-to-all (whose GPU
    start's result is ((operand, output, offsets and sizes), output)) the smaller of its
    operand and output: a device sends at most its operand's rows and receives at most its
    output's, so at a balanced route the routed rows."""
    if kind != "ragged-all-to-all":
        return _result_bytes(shape_text)
    arrays = _ARRAY_RE.findall(shape_text)
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES[t] for t, dims in arrays]
    return min(sizes[0], sizes[-1]) if sizes else 0


def _iota_groups(text: str) -> list[list[int]]:
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    group_shape = [int(x) for x in m.group(1).split(",")]
    reshape = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(reshape))).reshape(reshape)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(group_shape[0], -1).tolist()


def _device_order(text: str, count: int) -> np.ndarray:
    """The `device_ids=(...)` of a mesh form: an iota spec `[dims](<=[dims])?(T(perm))?` or a
    literal id list; the identity order when absent."""
    if not text:
        return np.arange(count)
    m = re.match(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?$", text)
    if not m:
        return np.array([int(x) for x in re.findall(r"\d+", text)])
    dims = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(count).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(-1)


def _mesh_groups(text: str) -> list[list[int]]:
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", text)
    if not m:
        raise ValueError(f"unknown mesh replica_groups form: {text[:100]!r}")
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
    ids = _device_order(m.group(2) or "", int(np.prod(sizes))).reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in grouped]
    ids = ids.transpose(rest + grouped)
    group_size = int(np.prod([sizes[i] for i in grouped])) if grouped else 1
    return ids.reshape(-1, group_size).tolist()


def _literal_groups(text: str) -> list[list[int]]:
    inner = text[1 : _matching_brace(text)]
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^{}]*)\}", inner)]


def _matching_brace(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced braces in {text[:80]!r}")


def replica_groups(line: str) -> list[list[int]]:
    """Device groups of one HLO collective line, from any of the three printed forms."""
    if "source_target_pairs=" in line:
        return _literal_groups(line.split("source_target_pairs=", 1)[1])
    if "replica_groups=" not in line:
        return []
    text = line.split("replica_groups=", 1)[1]
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("{"):
        return _literal_groups(text)
    raise ValueError(f"unknown replica_groups form: {text[:80]!r}")


def _group_axes(groups: list[list[int]], mesh: Mesh) -> frozenset:
    shape = mesh.devices.shape
    axes = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group, dtype=int), shape))
        for i, name in enumerate(mesh.axis_names):
            if len(set(coords[i].tolist())) > 1:
                axes.add(name)
    return frozenset(axes)


def collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """All collectives of a compiled module (`compiled.as_text()`), with their mesh axes."""
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        m = _KIND_RE.match(line)
        if not m:
            continue
        op_name = _OP_NAME_RE.search(line)
        groups = replica_groups(line)
        axes = _group_axes(groups, mesh)
        if m.group("kind") == "collective-permute" and groups:
            op_axes = _group_axes([sorted({d for pair in groups for d in pair})], mesh)
        else:
            op_axes = axes
        found.append(
            Collective(
                kind=m.group("kind"),
                axes=axes,
                bytes=moved_bytes(m.group("kind"), m.group("shape")),
                computation=computation,
                op_name=op_name.group(1) if op_name else "",
                op_axes=op_axes,
            )
        )
    return found


def count(found: list[Collective], kind: str, axes: set | frozenset, where: str = "") -> int:
    """How many collectives of `kind` span exactly `axes` and have `where` in their op name."""
    return sum(
        1 for c in found if c.kind == kind and c.axes == frozenset(axes) and where in c.op_name
    )


def summary(found: list[Collective]) -> Counter:
    """(kind, sorted axes) -> count, for reports."""
    return Counter((c.kind, tuple(sorted(c.axes))) for c in found)
