"""Which link each mesh axis's collectives use: the device order of the mesh
(`jaxmeg.parallel.mesh.make_mesh`) laid over nodes of `gpus_per_node` GPUs, NVLink inside a node,
the network across nodes."""

from __future__ import annotations

import numpy as np

from jaxmeg.config import MESH_AXES
from jaxmeg.perf.hardware import Hardware
from jaxmeg.perf.layout import Layout


def hardware_link(hw: Hardware, inside_node: bool) -> tuple[float, float]:
    """(achievable GB/s, latency us): datasheet bandwidth x the collectives' efficiency."""
    if inside_node:
        return hw.intra_node_gb_per_s * hw.collective_efficiency, hw.intra_node_latency_us
    return hw.inter_node_gb_per_s * hw.collective_efficiency, hw.inter_node_latency_us


def device_grid(layout: Layout) -> np.ndarray:
    """int [d, p, c, e, t] (`config.MESH_AXES`): each GPU's rank in the device order, laid out
    as `jaxmeg.parallel.mesh.make_mesh` lays out the mesh: tensor fastest, then expert, then
    context (a context group is c consecutive expert x tensor groups), `outer_axis` slowest.
    Nodes are runs of `gpus_per_node` consecutive ranks."""
    d, p, c, e, t = layout.data, layout.pipe, layout.context, layout.expert, layout.tensor
    ranks = np.arange(layout.gpus)
    if layout.outer_axis == "pipe":
        return ranks.reshape(p, d, c, e, t).transpose(1, 0, 2, 3, 4)
    return ranks.reshape(d, p, c, e, t)


def inside_node(layout: Layout, hw: Hardware, axis: str | tuple[str, ...]) -> bool:
    """Whether every group along mesh `axis` (or the axes together) sits in one node (its
    collectives use NVLink)."""
    node = device_grid(layout) // hw.gpus_per_node
    axes = (axis,) if isinstance(axis, str) else axis
    dims = tuple(MESH_AXES.index(a) for a in axes)
    return bool((node.min(axis=dims) == node.max(axis=dims)).all())


def tensor_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """A tensor group is consecutive GPUs: NVLink while it fits in a node."""
    return hardware_link(hw, inside_node(layout, hw, "tensor"))


def pipe_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """Pipeline neighbours are c t GPUs apart (outer_axis data) or c t d (outer_axis pipe); the
    pipeline moves at the pace of its slowest hop, so one hop across nodes makes it inter-node."""
    return hardware_link(hw, inside_node(layout, hw, "pipe"))


def data_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """The gradient group, data x context x expert: data neighbours are c e t GPUs apart
    (outer_axis pipe) or c e t p (outer_axis data), with the c e t GPUs of a context group
    between them."""
    return hardware_link(hw, inside_node(layout, hw, ("data", "context", "expert")))


def expert_data_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """The experts' gradient group, data x context (`Layout.expert_gradient_group`)."""
    return hardware_link(hw, inside_node(layout, hw, ("data", "context")))


def expert_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """An expert group is e consecutive tensor groups: NVLink while e t fits in a node."""
    return hardware_link(hw, inside_node(layout, hw, "expert"))


def context_link(layout: Layout, hw: Hardware) -> tuple[float, float]:
    """Ring neighbours are t GPUs apart: a context group of c t consecutive GPUs uses NVLink
    while c t fits in a node (and starts on a node boundary), the network otherwise."""
    return hardware_link(hw, inside_node(layout, hw, "context"))
