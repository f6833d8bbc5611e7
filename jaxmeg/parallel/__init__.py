"""Mesh construction and the logical->mesh rules. The only place mesh axes are named."""

from jaxmeg.parallel.mesh import make_mesh, simulate_cpu_devices
from jaxmeg.parallel.rules import (
    activation_rules,
    logical_to_spec,
    make_constrain,
    named,
    param_rules,
    param_specs,
)

__all__ = [
    "activation_rules",
    "logical_to_spec",
    "make_constrain",
    "make_mesh",
    "named",
    "param_rules",
    "param_specs",
    "simulate_cpu_devices",
]
