"""The (data, pipe, context, tensor) device mesh.

Device order: `tensor` varies fastest, so a tensor group is made of consecutive devices of one
host (NVLink), then `context` (a context group is c consecutive tensor groups); of `pipe` and
`data`, the config's `outer_axis` varies slowest and so is the one
that crosses hosts first (Megatron's default puts pipe outermost). All axes are Auto, so XLA
places tensor-parallel collectives from the sharding rules.

The mesh is a `jax.sharding.Mesh` over an explicit device grid rather than `jax.make_mesh`,
because `make_mesh` chooses its own device order (and makes axes Explicit by default); the
order above is what keeps a tensor group on one host's NVLink. With a cluster file the order
comes from `jaxmeg.parallel.placement` (NIC-aware, Holmes) instead.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxmeg.config import MESH_AXES, ParallelConfig, resolve_mesh_shape
from jaxmeg.parallel.placement import megatron_grid


def simulate_cpu_devices(count: int) -> None:
    """Makes the CPU backend expose `count` devices. Must run before jax initialises a backend."""
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        # jax read the variable when imported: without this, an installed CUDA plugin would
        # try to start on a machine without a GPU and log its failure as a traceback
        jax.config.update("jax_platforms", jax.config.jax_platforms or os.environ["JAX_PLATFORMS"])
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:  # backend already initialised
        if len(jax.devices()) != count:
            raise RuntimeError(
                f"cannot simulate {count} CPU devices: jax already started with "
                f"{len(jax.devices())}; call simulate_cpu_devices before any jax computation"
            ) from err


def mesh_words(mesh: Mesh) -> str:
    """`data=1 pipe=2 expert=4 tensor=1`: every axis of the mesh, `context` and `expert` where
    they split anything (what start-up lines print)."""
    return " ".join(
        f"{axis}={size}"
        for axis, size in mesh.shape.items()
        if axis not in ("context", "expert") or size > 1
    )


def make_mesh(par: ParallelConfig, devices: list | None = None, placement=None) -> Mesh:
    """Builds the mesh for `par` (with `-1` axes inferred) over `devices` (default: all), in
    Megatron's device order, or in `placement`'s (a `jaxmeg.parallel.placement.Placement`)."""
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    data, pipe, context, expert, tensor = resolve_mesh_shape(par, len(devices))
    inner = context * expert * tensor
    if placement is None:
        # a context or expert group is c (e) consecutive tensor groups: inside a node where it
        # fits
        ids = megatron_grid([d.id for d in devices], data, pipe, inner, par.outer_axis)
    else:
        ids = placement.grid
        if ids.shape != (data, pipe, inner):
            raise ValueError(f"placement grid {ids.shape} != mesh shape {(data, pipe, inner)}")
    ids = ids.reshape(data, pipe, context, expert, tensor)
    by_id = {d.id: d for d in devices}
    grid = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(ids)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def automatic_axes_here(names) -> set[str]:
    """Which of the mesh axes `names` the code being traced may still map over: those of the
    current mesh that an enclosing map has not made manual (the executor's map is manual over
    data and pipe; a map nested in it takes the rest, as `jaxmeg.parallel.attention` and
    `jaxmeg.parallel.experts` do)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = {a for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
              if kind == AxisType.Manual}  # fmt: skip
    return set(names) & set(mesh.axis_names) - manual
