"""The paths a script reads and writes, checked in one place before anything compiles, and the
one helper that writes a file: an OS error on a path (a full disk, a read-only file system, a
directory that is gone) becomes one line that names the path and says what to do, and nothing a
user made is replaced unless `--overwrite` asks for it. Imports no jax.

`JAXMEG_DEBUG=1` in the environment keeps the tracebacks and library logs that are otherwise
summed up in that one line (see `debugging`)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEBUG_ENV = "JAXMEG_DEBUG"
OVERWRITE = "--overwrite"

_ADVICE = {
    errno.ENOSPC: "the disk is full: free space there or pass another path",
    errno.EDQUOT: "the disk quota is used up: free space there or pass another path",
    errno.EROFS: "the file system is read-only: pass a path on a writable one",
    errno.EACCES: "permission denied: pass a path you may write",
    errno.EPERM: "permission denied: pass a path you may write",
    errno.ENOENT: "a directory on the way is gone: create it or pass another path",
    errno.ENOTDIR: "a file stands where a directory is needed: move it or pass another path",
    errno.EISDIR: "it is a directory: give a file path",
}
# The text of these errors, as the C++ writers under orbax (TensorStore) quote them.
_STRERRORS = {os.strerror(code): code for code in _ADVICE}


class PathError(ValueError):
    """A path the run cannot use: said in one line naming the path and what to do. A ValueError,
    so every script reports it as `error: ...` with exit code 2."""


def debugging() -> bool:
    """Whether `JAXMEG_DEBUG` asks for the full tracebacks and library logs."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def os_error_code(err: BaseException) -> int | None:
    """The errno of an OS error, also one that a library wrapped into another exception's text
    (TensorStore's `... No space left on device [os_error_code='28']`); None for other errors."""
    if isinstance(err, OSError) and err.errno in _ADVICE:
        return err.errno
    text = str(err)
    return next((code for words, code in _STRERRORS.items() if words in text), None)


def os_error(err: BaseException, path: str | Path, what: str = "") -> PathError | None:
    """A PathError that names `path` (and `what` it was, e.g. '--metrics-file') for an OS error,
    or None when `err` is not one."""
    code = os_error_code(err)
    if code is None:
        return None
    name = f"{what} {path}" if what else str(path)
    return PathError(f"{name}: {os.strerror(code)}; {_ADVICE[code]}")


def size_text(num_bytes: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "bytes" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError


def nearest_existing(path: str | Path) -> Path:
    path = Path(path).absolute()
    return next(p for p in [path, *path.parents] if p.exists())


def free_bytes(path: str | Path) -> int:
    """Free space on the file system that holds `path` (or would, once created)."""
    return shutil.disk_usage(nearest_existing(path)).free


def _writable_problem(path: Path, what: str) -> str | None:
    existing = nearest_existing(path)
    if not existing.is_dir():
        return f"{what} {path}: {existing} is a file, where a directory is needed"
    if not os.access(existing, os.W_OK | os.X_OK):  # also says EROFS when run as root
        return f"{what} {path}: {existing} is not writable"
    return None


def directory_problem(path: str, what: str) -> str | None:
    """What keeps `path` from being a directory to write in (made if missing), or None."""
    if not path.strip():
        return f"{what} is empty; give a directory"
    if Path(path).exists() and not Path(path).is_dir():
        return f"{what} {path} is a file; it must be a directory (new or existing)"
    return _writable_problem(Path(path), what)


def is_metrics_file(path: str | Path) -> bool:
    """Whether `path` is a metrics file jaxmeg wrote (JSON lines with a step and a loss), or
    empty: nothing in it is lost when a run writes it again."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return False
    if not first.strip():
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "step" in record and "loss" in record


def file_problem(
    path: str, what: str, overwrite: bool = False, ours: Callable[[Path], bool] | None = None
) -> str | None:
    """What keeps `path` from being a file to write, or None: an existing file is replaced only
    with `overwrite` or when `ours(path)` says jaxmeg wrote it for the same purpose."""
    if not path.strip():
        return f"{what} is empty; give a file path"
    target = Path(path)
    if target.is_dir():
        return f"{what} {path} is a directory; give a file path"
    if target.exists() and not target.is_file() and path != os.devnull:
        return f"{what} {path} is not a regular file; give a file path"
    if not target.parent.exists():
        return f"{what} {path}: directory {target.parent} does not exist"
    problem = _writable_problem(target.parent, what)
    if problem:
        return problem
    if target.is_file() and target.stat().st_size and not overwrite:
        if ours is None or not ours(target):
            return (
                f"{what} {path} already exists and jaxmeg did not write it; pass "
                f"{OVERWRITE} to replace it, or give another path"
            )
    return None


RUN_PARTS = {
    "checkpoints": "dir",
    "tensorboard": "dir",
    "metrics.jsonl": "file",
    "config.yaml": "file",
}


def run_directory_problem(out: str, overwrite: bool = False) -> str | None:
    """What keeps `out` from being a run directory to train in (new or a run's), or None: a
    directory, writable, whose checkpoints/ and tensorboard/ are directories, and whose
    metrics.jsonl is a metrics file (a directory that is not yet a run and holds one of another
    kind keeps it unless `overwrite`)."""
    problem = directory_problem(out, "--out")
    if problem or not Path(out).is_dir():
        return problem
    for name, kind in RUN_PARTS.items():
        part = Path(out) / name
        if part.exists() and (part.is_dir() != (kind == "dir")):
            need = "a directory" if kind == "dir" else "a file"
            return (
                f"--out {out}: {part} is not {need}, as a run directory's {name} must be; "
                f"move it away or pass another --out"
            )
    metrics = Path(out) / "metrics.jsonl"
    if metrics.is_file() and not overwrite and not is_metrics_file(metrics):
        return (
            f"--out {out}: {metrics} is not a jaxmeg metrics file and a run would replace it; "
            f"pass {OVERWRITE} to replace it, or give another --out"
        )
    return None


def write_file(path: str | Path, write: Callable, what: str = "", binary: bool = True) -> None:
    """The one way jaxmeg writes a file: `write(f)` fills a temporary file beside `path`, which
    then replaces `path` at once. On an OS error the temporary file is removed and a PathError
    names `path`; `path` itself is as it was."""
    path, tmp = Path(path), None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        problem = os_error(err, path, what)
        if problem is None:
            raise
        raise problem from err
