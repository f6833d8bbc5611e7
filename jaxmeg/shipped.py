"""The YAML files shipped in configs/ (hardware profiles, cluster descriptions), found by name or
by path: the one lookup `jaxmeg.perf.hardware` and `jaxmeg.parallel.cluster` share."""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def shipped_dir(kind: str) -> Path:
    """configs/KIND (`hardware`, `clusters`)."""
    return CONFIGS / kind


def shipped_names(kind: str) -> list[str]:
    """The names of configs/KIND/*.yaml, sorted."""
    return sorted(p.stem for p in shipped_dir(kind).glob("*.yaml"))


def find_shipped(kind: str, name_or_path: str | Path) -> Path | None:
    """`name_or_path` if it is a file, else configs/KIND/NAME.yaml if shipped, else None."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    path = shipped_dir(kind) / f"{name_or_path}.yaml"
    return path if path.is_file() else None
