"""Multi-process start-up: `jax.distributed.initialize` from flags, the environment or SLURM.

Sources, first match wins: explicit arguments (`--coordinator`, `--num-processes`,
`--process-id`); the variables JAXMEG_COORDINATOR / JAXMEG_NUM_PROCESSES / JAXMEG_PROCESS_ID;
SLURM (`SLURM_NTASKS` > 1: jax reads the coordinator and ids from SLURM itself). With none of
them the run is single-process.

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
    process_id: int | None
    source: str


def cluster_spec(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: dict | None = None,
) -> ClusterSpec | None:
    """Where the process group comes from, or None for a single-process run."""
    env = os.environ if env is None else env
    if coordinator or num_processes or process_id is not None:
        missing = [
            name
            for name, value in (
                ("--coordinator", coordinator),
                ("--num-processes", num_processes),
                ("--process-id", process_id),
            )
            if value is None
        ]
        if missing:
            raise ValueError(f"multi-process runs need all three flags; missing {missing}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
        return ClusterSpec(coordinator, num_processes, process_id, "flags")
    if "JAXMEG_COORDINATOR" in env:
        return ClusterSpec(
            env["JAXMEG_COORDINATOR"],
            int(env["JAXMEG_NUM_PROCESSES"]),
            int(env["JAXMEG_PROCESS_ID"]),
            "environment",
        )
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        return ClusterSpec(None, int(env["SLURM_NTASKS"]), None, "slurm")
    return None


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
        jax.distributed.initialize(initialization_timeout=timeout_s + 30)
    else:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=timeout_s + 30,
        )
    joined.set()
