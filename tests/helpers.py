"""Small configs, meshes and batches shared by the parallelism tests."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import jax
import numpy as np

from jaxmeg import config as C
from jaxmeg.parallel import hlo_module, make_mesh
from jaxmeg.training.expert_balance import without_bound_counts  # noqa: F401  (the tests import it here)
from jaxmeg.training.state import Trainable

XLA_CACHE_VARIABLE = "JAXMEG_TEST_XLA_CACHE"
"""The test run's one XLA cache directory for the scripts it runs (`conftest.py` makes it and
removes it at the end)."""

TINY_MODEL = C.ModelConfig(
    vocab_size=500, hidden=64, layers=2, heads=4, seq_len=16, compute_dtype="float32"
)


def tiny_config(data=1, pipe=1, tensor=1, **parallel) -> C.Config:
    cfg = C.Config(
        model=TINY_MODEL,
        parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor, **parallel),
        train=C.TrainConfig(global_batch=8, microbatches=2, steps=2),
        optimizer=C.OptimizerConfig(lr=1e-3, warmup_steps=1),
    )
    return cfg


def trainable_for(cfg: C.Config) -> Trainable:
    par = cfg.parallel
    n = par.data * par.pipe * par.context * par.expert * par.tensor
    cfg = C.validate(cfg, n)
    return Trainable.create(cfg, make_mesh(cfg.parallel, jax.devices()[:n]))


def random_batch(cfg: C.Config, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    return rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32)


def put_batch(trainable: Trainable, tokens: np.ndarray):
    sharding = trainable.batch_sharding()
    return jax.device_put(tokens[:, :-1], sharding), jax.device_put(tokens[:, 1:], sharding)


def replace_model(cfg: C.Config, **changes) -> C.Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def run_checked(trainable: Trainable, fn, *args):
    """jit(fn)(*args) under the trainable's mesh, after checking the compiled step for what
    could hang it (`hlo_module.deadlock_hazards`): every equivalence run passes this check."""
    return run_checked_text(trainable, fn, *args)[0]


def run_checked_text(trainable: Trainable, fn, *args):
    """`run_checked`'s result and the compiled step's HLO text."""
    with jax.set_mesh(trainable.mesh):
        compiled = jax.jit(fn).lower(*args).compile()
        text = compiled.as_text()
        hazards = hlo_module.deadlock_hazards(text, trainable.mesh)
        assert not hazards, "\n".join(hazards)
        return compiled(*args), text


def step_hazards(trainable: Trainable) -> list[str]:
    """`hlo_module.deadlock_hazards` of the loss-and-gradients step traced and compiled now for
    `trainable` (so a test's monkeypatches apply), on its initial parameters and a random batch."""
    from jaxmeg.training.pipeline_step import make_loss_and_grads
    from jaxmeg.training.state import init_state

    with jax.set_mesh(trainable.mesh):
        params = init_state(trainable, seed=0)["params"]
        tokens = put_batch(trainable, random_batch(trainable.cfg))
        step = jax.jit(make_loss_and_grads(trainable)).lower(params, *tokens).compile()
    return hlo_module.deadlock_hazards(step.as_text(), trainable.mesh)


@contextlib.contextmanager
def factors_at_any_rank(on: bool = True):
    """With `on`, compressed links take the factor path at any rank > 0, where a rank at the
    matrix's smaller side is exact in exact arithmetic (that rank normally sends the matrix
    whole)."""
    from jaxmeg.pipeline import compression

    with contextlib.ExitStack() as stack:
        if on:
            stack.enter_context(mock.patch.object(
                compression, "worth_compressing", lambda rank, rows, cols: rank > 0
            ))  # fmt: skip
        yield


def run_script_main(name: str, *argv: str):
    """scripts/NAME.py's `main(argv)` in this process, its stdout, stderr and exit status as a
    subprocess's would be (argparse's `SystemExit` included): for tests of what a script decides
    and prints, where the process itself is not the point."""
    import importlib.util
    import io
    import subprocess
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(list(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess([name, *argv], code or 0, out.getvalue(), err.getvalue())
