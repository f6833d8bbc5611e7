"""Held-out loss and perplexity of a run, and a run directory's newest params on a mesh of one's
choosing (what evaluation and generation start from).

The loss is the plain forward (`GPT.__call__`) on the params converted to canonical layout
inside one jitted function on the run's own mesh, microbatch by microbatch as training splits the
batch: no backward, so never more activation memory than a train step. Every layout takes this
path. With pipe > 1 it is the slower one: converting the stage layout [v, p, Lc, ...] to [L, ...]
gathers every layer onto every device of a data replica (their params, not the optimizer
state), and all pipe ranks compute the same forward. The loss equals the pipeline's (the same
model and `cross_entropy`); the executor is not reused because it always runs the backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmeg.config import RUN_CONFIG, Config
from jaxmeg.models import GPT, cross_entropy
from jaxmeg.parallel import activation_rules, make_constrain
from jaxmeg.training.batches import global_batch_arrays
from jaxmeg.training.compilation import check_hazards
from jaxmeg.training.state import Trainable, state_shardings, to_canonical_layout


def make_eval_loss(trainable: Trainable) -> Callable:
    """Jitted (params in the run's layout and shardings, tokens [G, S], targets [G, S]) -> mean
    token loss. Each data replica's rows are split into train.microbatches microbatches of
    train.microbatch_size, as the train step splits them; microbatch i takes rows i b..(i+1) b
    of every replica, so the split moves no data between devices."""
    cfg, mesh = trainable.cfg, trainable.mesh
    constrain = make_constrain(activation_rules(cfg.parallel))
    model = GPT(trainable.model_cfg, trainable.vocab, constrain, moe=trainable.moe_cfg)
    data, micro, b = mesh.shape["data"], cfg.train.microbatches, cfg.train.microbatch_size

    def microbatches(x_GxS):
        x_MxRxS = x_GxS.reshape(data, micro, b, -1).swapaxes(0, 1).reshape(micro, data * b, -1)
        return jax.lax.with_sharding_constraint(x_MxRxS, P(None, "data"))

    def mean_loss(params, tokens_GxS, targets_GxS):
        params = to_canonical_layout(params, trainable.layout)

        def add(total, microbatch):
            tokens_RxS, targets_RxS = microbatch
            logits = model.apply({"params": params}, tokens_RxS)
            return total + cross_entropy(logits, targets_RxS, cfg.model.vocab_size), None

        total, _ = jax.lax.scan(
            add,
            jnp.zeros((), jnp.float32),
            (microbatches(tokens_GxS), microbatches(targets_GxS)),
        )
        return total / micro

    batch = trainable.batch_sharding()
    return jax.jit(mean_loss, in_shardings=(state_shardings(trainable)["params"], batch, batch))


class Evaluator:
    """The held-out loss of params on `trainable`'s mesh over the first `num_batches` batches of
    `batches` (a `jaxmeg.data.loader.HeldOutBatches`), the same batches at every call."""

    def __init__(self, trainable: Trainable, batches, num_batches: int):
        if batches.num_batches < 1:
            raise ValueError(
                f"{batches.count} held-out samples of {batches.seq_len} + 1 tokens are fewer "
                f"than one batch of train.global_batch ({batches.global_batch}); hold out more "
                f"(data.eval_fraction) or evaluate on more data"
            )
        self.trainable, self.batches = trainable, batches
        self.num_batches = min(num_batches, batches.num_batches)
        self._loss = make_eval_loss(trainable)
        self._compiled = None

    def __call__(self, params) -> dict[str, Any]:
        """{"loss": mean token loss, "perplexity": exp(loss), "batches", "tokens"}."""
        sharding = self.trainable.batch_sharding()
        losses = []
        with jax.set_mesh(self.trainable.mesh):
            for k in range(self.num_batches):
                tokens, targets = global_batch_arrays(self.batches, k, sharding)
                if self._compiled is None:  # what could hang it is refused before it runs
                    self._compiled = self._loss.lower(params, tokens, targets).compile()
                    check_hazards(self._compiled, self.trainable, "evaluation step")
                losses.append(self._compiled(params, tokens, targets))
        loss = sum(float(x.addressable_data(0)) for x in losses) / self.num_batches
        tokens = self.num_batches * self.batches.global_batch * self.batches.seq_len
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "batches": self.num_batches,
            "tokens": tokens,
        }


# -- a run directory on an inference mesh ----------------------------------------------------------


def newest_meta(run_dir: str | Path) -> tuple[int, dict]:
    """(step, meta) of the newest checkpoint in RUN_DIR/checkpoints."""
    from jaxmeg.training.checkpoint import read_meta

    checkpoints = Path(run_dir).absolute() / "checkpoints"
    if not checkpoints.is_dir():
        raise FileNotFoundError(f"{run_dir} holds no checkpoints ({checkpoints} does not exist)")
    found = read_meta(checkpoints)
    if found is None:
        raise FileNotFoundError(f"{checkpoints} holds no checkpoint")
    return found


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> Config:
    """RUN_DIR/config.yaml if there is one, else the config its newest checkpoint was saved
    with, on one device (data = pipe = tensor = 1, no compression, microbatches re-derived;
    the checkpoint is canonical, so any mesh reads it), then `overrides` (`section.key=value`).
    Not validated. A vocabulary left at -1 is the checkpoint's."""
    from jaxmeg import config as C

    _, meta = newest_meta(run_dir)
    saved = C.from_dict(meta["config"])
    path = Path(run_dir) / RUN_CONFIG
    cfg = C.load(path) if path.is_file() else saved
    if cfg.model.vocab_size == -1:
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, vocab_size=saved.model.vocab_size)
        )
    single = dataclasses.replace(
        cfg,
        parallel=C.ParallelConfig(),
        compression=C.CompressionConfig(),
        train=dataclasses.replace(cfg.train, microbatches=-1, microbatch_size=-1),
    )
    return C.apply_overrides(single, list(overrides))


def inference_trainable(cfg: Config) -> Trainable:
    """`cfg` validated on the first data x pipe x context x tensor devices (all of them where an
    axis is -1), and its Trainable."""
    from jaxmeg import config as C
    from jaxmeg.config_validation import check_attention_runs_here
    from jaxmeg.parallel import make_mesh

    par = cfg.parallel
    sizes = (par.data, par.pipe, par.tensor)
    count = len(jax.devices()) if -1 in sizes else math.prod(sizes) * par.context * par.expert
    if count > len(jax.devices()):
        raise C.ConfigError(
            f"parallel.data * parallel.pipe * parallel.context * parallel.expert * "
            f"parallel.tensor = {count}, but there are {len(jax.devices())} devices "
            f"(--cpu-devices N simulates N on a CPU)"
        )
    cfg = C.validate(cfg, count)
    check_attention_runs_here(cfg, jax.devices()[0].platform)
    return Trainable.create(cfg, make_mesh(cfg.parallel, jax.devices()[:count]))


def restore_params(trainable: Trainable, run_dir: str | Path) -> tuple[int, Any]:
    """(step, params) of RUN_DIR's newest readable checkpoint, in `trainable`'s layout and
    shardings (`Checkpointer.restore_latest`, which refuses another model by field name)."""
    from jaxmeg.training.checkpoint import Checkpointer

    newest_meta(run_dir)  # a missing checkpoint directory is named, not created
    checkpoints = Path(run_dir) / "checkpoints"
    checkpointer = Checkpointer(checkpoints, trainable, trainable.cfg.checkpoint.keep)
    try:
        step, state, _ = checkpointer.restore_latest()
    finally:
        checkpointer.close()
    return step, state["params"]


def evaluate_run(
    run_dir: str | Path,
    dataset: str | None = None,
    batches: int | None = None,
    overrides: list[str] = (),
) -> dict[str, Any]:
    """Held-out loss and perplexity of RUN_DIR's newest checkpoint: on its own data's held-out
    split (`data.eval_fraction`), or on every sample of `dataset` (a token-file prefix other
    than the run's), over `batches` global batches (default `train.eval_batches`), on the mesh
    that `overrides` give (default one device). Returns {"loss", "perplexity", "batches",
    "tokens", "step"}."""
    from jaxmeg.data import BatchLoader
    from jaxmeg.data.loader import HeldOutBatches
    from jaxmeg.training.batches import open_dataset, with_vocab

    cfg = run_config(run_dir, overrides)
    own = cfg.data.dataset
    whole = dataset is not None and not (own and Path(dataset).resolve() == Path(own).resolve())
    if dataset is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=dataset))
    if not whole and cfg.data.eval_fraction == 0.0:
        raise ValueError(
            f"the run in {run_dir} holds nothing out (data.eval_fraction = 0): evaluate it on "
            f"data it did not train on with --dataset PREFIX"
        )
    if batches is not None and batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    token_file = open_dataset(cfg, show_progress=False)
    with_vocab(cfg, token_file.vocab_size)  # refuses ids past the model's vocabulary
    trainable = inference_trainable(cfg)
    cfg = trainable.cfg
    seq_len, global_batch = cfg.model.seq_len, cfg.train.global_batch
    if whole:
        held_out = HeldOutBatches.whole(token_file, seq_len, global_batch)
    else:
        loader = BatchLoader(token_file, seq_len, global_batch, cfg.train.seed,
                             cfg.data.eval_fraction)  # fmt: skip
        held_out = loader.held_out()
    evaluator = Evaluator(trainable, held_out, batches or cfg.train.eval_batches)
    step, params = restore_params(trainable, run_dir)
    return {**evaluator(params), "step": step}
