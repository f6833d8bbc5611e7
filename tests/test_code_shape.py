"""The engine stays in small rooms: no function in `jaxmeg/pipeline/` over 80 lines (the tick,
the slot bodies and the units beside the slots each read in one screen), and the executor's
rooms import one way (contract and columns -> plan -> carry -> bodies and beside -> run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 80
ROOMS = ("contract", "columns", "plan", "carry", "bodies", "beside", "run")


def test_no_function_in_the_pipeline_package_is_over_80_lines():
    long = []
    for path in sorted((ROOT / "jaxmeg" / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def test_the_executor_rooms_import_one_way():
    package = ROOT / "jaxmeg" / "pipeline" / "executor"
    for i, room in enumerate(ROOMS):
        tree = ast.parse((package / f"{room}.py").read_text())
        imported = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("jaxmeg.pipeline.executor.")
        }
        imported |= {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "jaxmeg.pipeline.executor"
            for alias in node.names
        }
        later = imported & set(ROOMS[i + 1 :])
        assert not later, f"{room} imports {later}, which come after it"
