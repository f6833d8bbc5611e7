"""Performance model (parameters, FLOPs, memory, communication, time) and the planner."""

from jaxmeg.perf.hardware import Hardware, load_hardware
from jaxmeg.perf.layout import Layout
from jaxmeg.perf.memory import memory_per_gpu
from jaxmeg.perf.model import (
    Shape,
    flops_per_iteration,
    parameter_count,
    shape_of,
    step_time,
    tflops_per_gpu,
)
from jaxmeg.perf.planner import Plan, plan
from jaxmeg.perf.traffic import bytes_per_step

__all__ = [
    "Hardware",
    "Layout",
    "Plan",
    "Shape",
    "bytes_per_step",
    "flops_per_iteration",
    "load_hardware",
    "memory_per_gpu",
    "parameter_count",
    "plan",
    "shape_of",
    "step_time",
    "tflops_per_gpu",
]
