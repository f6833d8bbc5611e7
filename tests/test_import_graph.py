"""No import cycle in `jaxmeg/`: the graph of which module imports which, read from the sources
(lazy imports inside functions and `TYPE_CHECKING` blocks count too), has no cycle. A module
importing `jaxmeg.a.b` is an edge to `jaxmeg.a.b` only (not to the package `jaxmeg.a`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in (ROOT / "jaxmeg").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from jaxmeg.a import b` imports the module jaxmeg.a.b where there is one
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in modules
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_jaxmeg_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
