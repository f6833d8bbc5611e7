"""notebooks/small_mesh_debugging.ipynb runs top to bottom (nbclient), so it never goes stale:
its own asserts check that the pipelined step equals one device and that the loss falls."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "small_mesh_debugging.ipynb"


@pytest.mark.timeout(600)
def test_small_mesh_debugging_notebook_runs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel starts as a user's would: conftest's 8-device and fast-compile XLA_FLAGS (and
    # JAX_PLATFORMS) stay in this process, so the notebook's own simulate_cpu_devices is tested.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.execute(cwd=str(ROOT), env=env)  # raises CellExecutionError naming the failing cell
