"""Multi-process start-up: `jax.distributed.initialize` from flags, the environment or SLURM.

Sources, first match wins: explicit arguments (`--coordinator`, `--num-processes`,
`--process-id`); the variables JAXMEG_COORDINATOR / JAXMEG_NUM_PROCESSES / JAXMEG_PROCESS_ID (all
three, or an error naming the missing one); a SLURM job step of more than one task. Only a step
started by `srun` counts: the batch script itself also sees SLURM_NTASKS > 1 but is one process,
so the task count is read from SLURM_STEP_NUM_TASKS (falling back to SLURM_NTASKS) only when
SLURM_STEP_ID says this process is a task of a step. jax finds the coordinator from SLURM's node
list; which GPUs a task drives is `_slurm_local_device_ids`'s: all it sees with one task per
node, its own with GPUs bound per task, else jax's default (the GPU numbered by SLURM_LOCALID).
With none of them the run is single-process.

A peer that never arrives would make XLA abort the process with a bare DEADLINE_EXCEEDED; a
watchdog thread instead ends the run after `timeout_s` with a message that says which process
waited for how many peers at which address. A peer that dies mid-run makes the next collective
fail at once (Gloo on CPU, NCCL on GPU) and, seconds later, the coordination service abort the
survivors with a C++ stack; `exit_on_peer_loss` gets there first: one line naming the lost
process, exit code 4, and `PeerWatch` does the same for a survivor whose collective does not
fail (a peer silent for 30 s). Not when process 0 dies: it hosts the coordination service, and the
survivors' service clients abort them the moment its socket closes, from a C++ thread that
Python cannot pre-empt (jaxlib's `missed_heartbeat_callback` cannot take a Python function).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

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
    """The GPUs this SLURM task drives, as indices among those it sees (CUDA_VISIBLE_DEVICES).
    Left alone, jax gives each task the GPU numbered by its local task id (SLURM_LOCALID), right
    when every task of a node sees all of its GPUs (`--ntasks-per-node=8 --gpus-per-node=8`).
    With one task per node (scripts/slurm/train.sbatch's default) the process drives all the
    GPUs it sees; with GPUs bound per task (`--gpus-per-task=1`: SLURM sets each task's
    CUDA_VISIBLE_DEVICES to its own), it drives those, numbered from 0 (jax's local id would
    name a GPU the task cannot see). None keeps jax's choice."""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    if not per_node:
        return None
    tasks_here = max(int(part.split("(")[0]) for part in per_node.split(","))
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if tasks_here == 1:
        count = len(visible) if visible else int(env.get("SLURM_GPUS_ON_NODE", "0") or 0)
        return tuple(range(count)) if count else None
    if visible and len(visible) < tasks_here:  # bound per task: its own GPUs only
        return tuple(range(len(visible)))
    return None


def initialize(spec: ClusterSpec | None, timeout_s: int = 300) -> None:
    """Joins the process group described by `spec` (no-op for None) within `timeout_s`."""
    if spec is None:
        return
    from jaxmeg.parallel.native_output import drop_gloo_lines

    drop_gloo_lines()  # CPU collectives connect through Gloo, which prints a line per group
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


PEER_LOSS_MARKERS = ("Gloo", "NCCL", "Connection reset", "Socket closed", "UNAVAILABLE")
"""Words in a runtime error that mean a collective lost a peer process."""
PEER_LOSS_EXIT = 4


def is_peer_loss(err: BaseException) -> bool:
    """Whether `err` is a collective's failure because a peer process is gone (multi-process
    runs only)."""
    if jax.process_count() == 1 or "RuntimeError" not in type(err).__name__:
        return False
    return any(marker in str(err) for marker in PEER_LOSS_MARKERS)


def lost_peers(wait_s: float = 2.0) -> list[int] | None:
    """Process ids the coordination service no longer counts as live; None when it does not
    answer within `wait_s` (the coordinator, process 0, may be the one gone)."""
    from jax._src import distributed as jax_distributed

    everyone = list(range(jax.process_count()))
    answer: dict = {}

    def ask() -> None:
        try:
            answer["live"] = jax_distributed.global_state.client.get_live_nodes(everyone)
        except Exception as err:  # noqa: BLE001 - no answer is an answer here
            answer["error"] = err

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(wait_s)
    if "live" not in answer:
        return None
    return sorted(set(everyone) - set(answer["live"]))


def peer_loss_message(err: BaseException) -> str:
    me, count = jax.process_index(), jax.process_count()
    gone = lost_peers()
    if gone:
        who = "process " + ", ".join(map(str, gone))
    elif count == 2:
        who = f"process {1 - me}"
    elif gone is None:
        who = "the coordinator (process 0) or another peer"
    else:
        who = "a peer process"
    first = " ".join(str(err).split())[:160]
    return (
        f"jaxmeg: process {me} of {count} lost {who}: a collective failed ({first}). "
        f"Stopping; restart all processes to resume from the last checkpoint"
    )


def exit_on_peer_loss(err: BaseException) -> None:
    """Prints `peer_loss_message` and ends the process with PEER_LOSS_EXIT at once, before the
    coordination service aborts it (no traceback, no C++ stack, no SIGABRT)."""
    print(peer_loss_message(err), file=sys.stderr, flush=True)
    os._exit(PEER_LOSS_EXIT)


PEER_SILENCE_S = 30.0
"""A peer whose sign of life has not changed for this long is taken as gone (`PeerWatch`)."""


class PeerWatch:
    """Multi-process runs: a thread bumps this process's counter in the coordination
    service's key-value store every `every_s` and reads the peers'; a peer whose counter has not
    moved for `silence_s` (killed, crashed, its host down) ends this process with one line
    naming it and PEER_LOSS_EXIT. A collective normally fails at once when a peer dies
    (`exit_on_peer_loss`), but on CPU under load a survivor was seen blocked for the coordination
    service's whole heartbeat timeout (100 s), then aborted by it with a C++ stack. A peer
    that leaves normally says so first (`stop`), and is then not watched."""

    def __init__(self, silence_s: float = PEER_SILENCE_S, every_s: float = 1.0):
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        self.me, self.count = jax.process_index(), jax.process_count()
        self.silence_s, self.every_s = silence_s, every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _key(self, kind: str, process: int) -> str:
        return f"jaxmeg/{kind}/{process}"

    def _run(self) -> None:
        seen: dict[int, tuple[str, float]] = {}
        beat = 0
        while not self.stopped.wait(self.every_s):
            beat += 1
            try:
                self.client.key_value_set(self._key("alive", self.me), str(beat), True)
                for peer in range(self.count):
                    if peer == self.me or self._left(peer):
                        continue
                    value = self._get(self._key("alive", peer))
                    now = time.monotonic()
                    if value is None or seen.get(peer, (None,))[0] != value:
                        seen[peer] = (value, now)
                    elif now - seen[peer][1] > self.silence_s:
                        self._exit(peer)
            except Exception:  # noqa: BLE001 - the service itself is gone: jax aborts us
                return

    def _get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - not written yet
            return None

    def _left(self, peer: int) -> bool:
        return self._get(self._key("left", peer)) is not None

    def _exit(self, peer: int) -> None:
        print(
            f"jaxmeg: process {self.me} of {self.count} lost process {peer}: no sign of life "
            f"from it for {self.silence_s:.0f} s while a collective waits for it. Stopping; "
            f"restart all processes to resume from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(PEER_LOSS_EXIT)

    def stop(self) -> None:
        """This process leaves normally: peers stop watching it, and it stops watching."""
        self.stopped.set()
        try:
            self.client.key_value_set(self._key("left", self.me), "1", True)
        except Exception:  # noqa: BLE001 - the service is gone already
            pass


def watch_peers() -> PeerWatch | None:
    """A `PeerWatch` in a multi-process run, None in a single-process one."""
    return PeerWatch() if jax.process_count() > 1 else None
