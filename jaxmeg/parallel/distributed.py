"""Multi-process start-up: `jax.distributed.initialize` from flags, the environment or SLURM.

Sources, first match wins: explicit arguments (`--coordinator`, `--num-processes`,
`--process-id`); the variables JAXMEG_COORDINATOR / JAXMEG_NUM_PROCESSES / JAXMEG_PROCESS_ID (all
three, or an error naming the missing one); a SLURM job step of more than one task. Only a step
started by `srun` counts: the batch script itself also sees SLURM_NTASKS > 1 but is one process,
so the task count is read from SLURM_STEP_NUM_TASKS (falling back to SLURM_NTASKS) only when
SLURM_STEP_ID says this process is a task of a step. jax finds the coordinator from SLURM's node
list; with one task per node the process is given all of the node's GPUs (jax's default under
SLURM is one GPU per task). With none of them the run is single-process.

A peer that never arrives would make XLA abort the process with a bare DEADLINE_EXCEEDED; a
watchdog thread instead ends the run after `timeout_s` with a message that says which process
waited for how many peers at which address.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import jax


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    coordinator: str | None
    num_processes: int
    process_id: int
    source: str
    local_device_ids: tuple[int, ...] | None = None


ENV_VARIABLES = ("JAXMEG_COORDINATOR", "JAXMEG_NUM_PROCESSES", "JAXMEG_PROCESS_ID")


def _int_from(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None


def _from_flags(coordinator, num_processes, process_id) -> ClusterSpec:
    given = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}  # fmt: skip
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ValueError(f"multi-process runs need all three flags; missing {', '.join(missing)}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    return ClusterSpec(coordinator, num_processes, process_id, "flags")


def _from_environment(env) -> ClusterSpec:
    missing = [name for name in ENV_VARIABLES if name not in env]
    if missing:
        needed, absent = ", ".join(ENV_VARIABLES), ", ".join(missing)
        raise ValueError(f"multi-process runs need all of {needed}; missing {absent}")
    num_processes = _int_from(env, "JAXMEG_NUM_PROCESSES")
    process_id = _int_from(env, "JAXMEG_PROCESS_ID")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"JAXMEG_PROCESS_ID must be in [0, {num_processes}), got {process_id}")
    return ClusterSpec(env["JAXMEG_COORDINATOR"], num_processes, process_id, "environment")


def _slurm_step_tasks(env) -> int:
    """Tasks of the SLURM job step this process belongs to; 1 outside an srun step."""
    if "SLURM_STEP_ID" not in env:
        return 1
    name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    return _int_from(env, name) if name in env else 1


def cluster_spec(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: dict | None = None,
) -> ClusterSpec | None:
    """Where the process group comes from, or None for a single-process run. Raises ValueError
    (one line, naming the flag or variable) for an incomplete or inconsistent description."""
    env = os.environ if env is None else env
    if coordinator or num_processes or process_id is not None:
        return _from_flags(coordinator, num_processes, process_id)
    if any(name in env for name in ENV_VARIABLES):
        return _from_environment(env)
    tasks = _slurm_step_tasks(env)
    if tasks > 1:
        if "SLURM_PROCID" not in env:
            raise ValueError("a SLURM step of several tasks without SLURM_PROCID")
        process_id = _int_from(env, "SLURM_PROCID")
        return ClusterSpec(None, tasks, process_id, "slurm", _slurm_local_device_ids(env))
    return None


def _slurm_local_device_ids(env) -> tuple[int, ...] | None:
    """Left alone, jax gives each SLURM task only the GPU numbered by its local task id (one
    process per GPU). With one task per node (scripts/slurm/train.sbatch) the process must drive
    all of the node's visible GPUs instead; None keeps jax's choice."""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    if not per_node or any(part.split("(")[0] != "1" for part in per_node.split(",")):
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    count = len(visible.split(",")) if visible else int(env.get("SLURM_GPUS_ON_NODE", "0") or 0)
    return tuple(range(count)) if count else None


def initialize(spec: ClusterSpec | None, timeout_s: int = 300) -> None:
    """Joins the process group described by `spec` (no-op for None) within `timeout_s`."""
    if spec is None:
        return
    joined = threading.Event()
    where = spec.coordinator or "the SLURM coordinator"

    def watchdog():
        if not joined.wait(timeout_s):
            print(
                f"jaxmeg: process {spec.process_id} gave up after {timeout_s} s waiting for "
                f"{spec.num_processes} processes to join at {where} ({spec.source}); "
                f"check that every process was started with the same coordinator",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    if spec.source == "slurm":
        # The count and id of this step; jax finds the coordinator from SLURM's node list.
        jax.distributed.initialize(
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=spec.local_device_ids,
            initialization_timeout=timeout_s + 30,
        )
    else:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=timeout_s + 30,
        )
    joined.set()
