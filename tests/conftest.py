"""8 simulated CPU devices, set before jax is imported anywhere in the test session."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + [
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        # The older per-fusion LLVM emitters: the suite's steps compile about a quarter faster.
        "--xla_cpu_use_fusion_emitters=false",
    ]
)
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

assert len(jax.devices()) == 8, f"tests need 8 simulated CPU devices, got {len(jax.devices())}"

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from jaxmeg.pipeline.executor import carry  # noqa: E402


def _never_read(shape, dtype):
    """What the tests' rings hold before a slot is written: NaN (an integer's largest value, True)
    where the program fills zeros (`carry.RING_FILL`). A slot read before it is written turns
    the loss or a gradient NaN, which every equivalence test would catch."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.full(shape, jnp.nan, dtype)
    return jnp.full(shape, True if dtype == jnp.bool_ else jnp.iinfo(dtype).max, dtype)


carry.RING_FILL = _never_read


@pytest.fixture
def unordered_ticks(monkeypatch):
    """The executor without its CPU tick ordering (`slots.ordered_tick`): the program a GPU
    runs, or the code before the ordering. Only for steps traced inside the test (a step a
    cached helper compiled before keeps its ordering)."""
    import contextlib

    from jaxmeg.pipeline.executor import slots

    monkeypatch.setattr(slots, "ordered_tick", lambda on=True: contextlib.nullcontext())


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """scripts/train.py overrides that point the default corpus at a small, test-local cache."""
    cache = tmp_path_factory.mktemp("corpus-cache")
    return [
        "--set", f"data.cache_dir={cache}",
        "--set", "data.default_corpus_bytes=400000",
        "--set", "data.tokenizer_vocab=512",
    ]  # fmt: skip


LONGEST_FIRST = (
    "tests/test_readme.py::",
    "tests/test_slurm.py::",
    "test_gpt_tiny_trains_in_fp8",
    "test_a_delayed_fp8_run_stopped_by_sigterm",
    "tests/test_multiprocess.py::",
    "tests/test_cluster_run.py::",
    "test_train_py_at_context_4",
    "tests/test_operations.py::",
    "test_uneven_zbv_and_zero1",
    "test_main_job_loss_falls",
    "test_data_two_keeps_cudnn",
    "test_pipe_sends_beside_tensor_parallel",
    "by_ragged_all_to_alls_on_eight_h100",
    "test_moe_dualpipev_equals_one_device",
    "test_a_moe_report_gives_the_step_at_each_bound",
    "tests/test_notebook.py::",
)
"""Tests of 30 s to 5 min (measured with --durations), run first, longest first: a worker that
drew one of them late would finish alone while the other waits."""


def pytest_configure(config):
    """The controller (not an xdist worker, which inherits the variable) makes the run's XLA
    cache directory; the workers' own compiles and the scripts the tests run
    (`tests/test_train_cli._subprocess_env`) share it, so a step that another test or worker
    compiled already (each worker's one-device references, a script's step) loads instead."""
    from tests.helpers import XLA_CACHE_VARIABLE

    if not hasattr(config, "workerinput") and XLA_CACHE_VARIABLE not in os.environ:
        config.xla_cache = os.environ[XLA_CACHE_VARIABLE] = tempfile.mkdtemp(
            prefix="jaxmeg-tests-xla-cache-"
        )
    jax.config.update("jax_compilation_cache_dir", os.environ[XLA_CACHE_VARIABLE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config):
    """The run's XLA cache goes with the run (tens of MB each)."""
    if getattr(config, "xla_cache", None):
        shutil.rmtree(config.xla_cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, key in enumerate(LONGEST_FIRST) if key in item.nodeid), 99)

    items.sort(key=rank)
