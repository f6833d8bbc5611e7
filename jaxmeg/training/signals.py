"""SIGTERM and SIGINT during a run: the first asks it to stop after the current step (with a
checkpoint when the run has a directory), the second ends the process at once."""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np

from jaxmeg.training.run_log import say

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_DEFAULT_HANDLERS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


class StopSignals:
    """SIGTERM / SIGINT ask the run to stop: it finishes the current step, checkpoints and
    returns (exit 0); a signal during start-up stops it before the first step.

    The first signal puts the default handlers back, so a second one ends a hung run at once.
    Python runs signal handlers only between bytecodes, so a main thread stuck in XLA would
    never run them; a watcher thread on the signal wake-up fd counts signals as they arrive
    and ends the process on the second one in that case too.

    The watcher also announces the first signal. Leaving the block closes the pipe's write end
    and waits (boundedly) for the watcher to read it to the end, so a signal that stopped the
    run is always announced, even when the run ends before the watcher was first scheduled."""

    JOIN_SECONDS = 10.0  # how long leaving the block waits for the watcher's announcement

    def __init__(self, checkpointing: bool = True):
        self.checkpointing = checkpointing
        self.received: int | None = None
        self._previous: dict = {}
        self._wakeup: tuple[int, int, int] | None = None  # read fd, write fd, previous fd
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # handlers can only be installed from the main thread
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._start_watcher()
        return self

    def _handle(self, signum, _frame) -> None:
        # No printing here: the handler may interrupt the main thread inside a stderr write,
        # and a reentrant write raises. The watcher thread announces the signal instead.
        self.received = signum
        for sig in _STOP_SIGNALS:
            signal.signal(sig, _DEFAULT_HANDLERS[sig])

    def _start_watcher(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wakeup = (read_fd, write_fd, previous)
        self._watcher = threading.Thread(
            target=_exit_on_second_signal,
            args=(read_fd, self.checkpointing),
            daemon=True,  # a watcher that cannot finish never keeps the process alive
            name="jaxmeg-signals",
        )
        self._watcher.start()

    def stop_agreed(self) -> bool:
        """Whether to stop now. Every process gets the same answer: a signal can reach the
        processes of a job at different steps, and all must save the same step."""
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(local))))

    def name(self) -> str:
        if self.received is None:
            return "a signal to another process"
        return signal.Signals(self.received).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            _, write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            self._wakeup = None
            os.close(write_fd)  # the watcher reads every byte written so far, then end-of-file
            # Without this wait the process could exit before the daemon watcher ran, and the
            # announcement of a signal that stopped the run would be lost.
            self._watcher.join(timeout=self.JOIN_SECONDS)


def _exit_on_second_signal(read_fd: int, checkpointing: bool) -> None:
    seen = 0
    while byte := os.read(read_fd, 1):
        if byte[0] not in _STOP_SIGNALS:
            continue
        seen += 1
        if seen == 1:
            then = "checkpointing and exiting" if checkpointing else "exiting (no --out)"
            say(
                f"{signal.Signals(byte[0]).name}: finishing the steps already started (the "
                f"running one and the one queued behind it), then {then}; send it again to "
                f"stop at once"
            )
        if seen >= 2:
            name = signal.Signals(byte[0]).name
            print(f"jaxmeg: second {name}: exiting now, without a checkpoint", file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + byte[0])
    os.close(read_fd)
