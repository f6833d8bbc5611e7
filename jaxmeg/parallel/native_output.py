"""Gloo's connection lines off standard output.

On CPU, each multi-process collective group connects through Gloo, whose C++ code writes
"[Gloo] Rank r is connected to n peer ranks. Expected number of connected peer ranks is : n" to
file descriptor 1, a piece per write, so the lines of concurrent groups interleave (dozens per
run, nothing a user needs). `drop_gloo_lines` points descriptor 1 at a pipe read by a thread that
passes on every line except those made only of these pieces; Python's own `sys.stdout` writes to
the terminal directly, unchanged.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading

GLOO_PIECES = re.compile(
    r"(?:\[Gloo\] Rank | is connected to | peer ranks\. Expected number of connected peer ranks"
    r" is : |\d+|\s)*"
)
"""A line that these pieces make up whole is Gloo's (or several of its, interleaved)."""


def is_gloo_noise(line: str) -> bool:
    return "[Gloo]" in line or (line.strip() != "" and GLOO_PIECES.fullmatch(line) is not None)


def _pass_on(read_fd: int, out_fd: int) -> None:
    pending = b""
    while chunk := os.read(read_fd, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = [line for line in lines if not is_gloo_noise(line.decode(errors="replace"))]
        if kept:
            os.write(out_fd, b"\n".join(kept) + b"\n")
    if pending and not is_gloo_noise(pending.decode(errors="replace")):
        os.write(out_fd, pending)


def drop_gloo_lines() -> None:
    """From now on, lines that native code writes to descriptor 1 reach it without Gloo's."""
    try:
        sys.stdout.flush()
        terminal = os.dup(1)
    except (OSError, ValueError, AttributeError):
        return  # no descriptor 1 to filter (an embedded or captured interpreter)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.close(write_fd)
    sys.stdout = io.TextIOWrapper(
        os.fdopen(terminal, "wb", buffering=0), encoding=sys.stdout.encoding,
        errors=sys.stdout.errors, line_buffering=True, write_through=True,
    )  # fmt: skip
    threading.Thread(target=_pass_on, args=(read_fd, terminal), daemon=True).start()
