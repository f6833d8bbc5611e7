"""notebooks/small_mesh_debugging.ipynb runs top to bottom (nbclient), so it never goes stale:
its own asserts check that the pipelined step equals one device and that the loss falls."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.test_train_cli import CLEAN_ENV

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "small_mesh_debugging.ipynb"


@pytest.mark.timeout(600)
def test_small_mesh_debugging_notebook_runs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel starts without conftest's device count and JAX_PLATFORMS, so the notebook's own
    # simulate_cpu_devices gives it its 8 CPU devices; it keeps the suite's fast-compile XLA
    # flags (the notebook compiles three steps and runs 20 small ones: compiling dominates).
    env = {k: v for k, v in CLEAN_ENV.items() if k != "JAX_PLATFORMS"}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.execute(cwd=str(ROOT), env=env)  # raises CellExecutionError naming the failing cell
