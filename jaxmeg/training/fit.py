"""Will it fit: the compiled step's per-device memory against a GPU's, with the planner's
prediction for the same layout beside it (`scripts/train.py --compile-only --target h100`).

Per device the step holds its arguments (params, optimizer state, the batch), its temporaries
and the outputs that do not reuse a donated argument: `argument + temp + output - alias` of
`memory_analysis()`. It fits when that is at most the GPU's memory (XLA's target spec) times
`gpu_target.GPU_MEMORY_FRACTION`, what the run may allocate; the CUDA context, NCCL's buffers
and allocator fragmentation are in the rest and not in XLA's figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmeg.perf.jaxmeg_memory import jaxmeg_step_memory
from jaxmeg.perf.layout import config_layout
from jaxmeg.perf.model import shape_of
from jaxmeg.training.compilation import memory_report
from jaxmeg.training.state import Trainable

NOT_FIT_EXIT = 3
"""scripts/train.py --compile-only --target: the exit code when the step does not fit."""


def step_bytes(memory: dict[str, int]) -> int:
    """Per-device bytes of a step from `memory_report`: arguments, temporaries and the outputs
    that are not aliased to donated arguments."""
    return (
        memory["argument_bytes"]
        + memory["temp_bytes"]
        + memory["output_bytes"]
        - memory["alias_bytes"]
    )


def predicted_step_bytes(trainable: Trainable, loss_and_grads=None) -> float | None:
    """The planner's per-device figure for jaxmeg's step (`jaxmeg.perf.jaxmeg_memory`), with
    flash attention's kept statistics when the step runs cuDNN attention; None where it does
    not price the layout: context parallelism, and MoE layers (it counts a dense MLP's
    parameters and residuals; `jaxmeg.perf.memory.memory_per_gpu`, the planner's, prices the
    experts but not jaxmeg's step buffer by buffer)."""
    from jaxmeg.training.pipeline_step import make_loss_and_grads

    cfg = trainable.cfg
    if cfg.parallel.context > 1 or cfg.moe.experts:
        return None
    table = (loss_and_grads or make_loss_and_grads(trainable)).program.table
    predicted = jaxmeg_step_memory(
        shape_of(cfg.model), config_layout(cfg), trainable.vocab,
        compute_bytes=np.dtype(cfg.model.compute_dtype).itemsize,
        input_slots=table.num_input_slots, cot_slots=table.num_cot_slots,
        flash_attention=trainable.model_cfg.attention == "cudnn",
    )  # fmt: skip
    return predicted.total


def fit_report(trainable: Trainable, compiled, target) -> dict[str, Any]:
    """`target` (a `gpu_target.GpuTarget`), the step's per-device bytes against what the GPU
    gives a run, `fits`, and the planner's prediction with its ratio to the compiled figure."""
    compiled_bytes = step_bytes(memory_report(compiled))
    usable = target.usable_memory_bytes
    predicted = predicted_step_bytes(trainable)
    return {
        "target": target.describe(),
        "device_bytes": compiled_bytes,
        "usable_device_bytes": usable,
        "fits": compiled_bytes <= usable,
        "planner_device_bytes": predicted,
        "planner_over_compiled": predicted / compiled_bytes if predicted else None,
    }


def describe_fit(report: dict[str, Any]) -> str:
    """One line for people: fits or not, by how much, and the planner's figure."""
    used, usable = report["device_bytes"], report["usable_device_bytes"]
    verdict = "fits" if report["fits"] else "does not fit"
    line = (
        f"{report['target']}: {used / 1e9:.2f} GB per device of {usable / 1e9:.2f} GB usable "
        f"({used / usable:.0%}): {verdict}"
    )
    if report["planner_device_bytes"]:
        line += (
            f"; planner {report['planner_device_bytes'] / 1e9:.2f} GB "
            f"(x{report['planner_over_compiled']:.2f})"
        )
    return line
