"""Reading the YAML files a user writes (configs, hardware profiles, clusters): a syntax error
names the file, line and column; a key given twice in one mapping is refused (YAML would keep
the last silently); a file that must be a mapping and is not says so. Errors are ValueErrors of
the caller's kind (`error`), so every script reports them as one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep=False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (lines {seen[key]} and {line})",
                key_node.start_mark,
            )  # fmt: skip
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)


def read_yaml(path: str | Path, what: str, error: type[ValueError] = ValueError) -> Any:
    """The YAML document in `path` (described as `what`, e.g. 'config file'), or `error`."""
    try:
        with open(path) as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise error(f"{what} {str(path)!r}{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{what} {str(path)!r} cannot be read: {err}") from None


def read_mapping(path: str | Path, what: str, error: type[ValueError] = ValueError) -> dict:
    """`read_yaml` of a file that must hold a mapping (empty: {})."""
    raw = read_yaml(path, what, error)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{what} {str(path)!r} must be a mapping of keys, got {type(raw).__name__}")
    return raw
