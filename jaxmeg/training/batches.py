"""The training data as the step sees it: the token file (or the default corpus), the vocabulary
it fixes, and each step's global batch arrays, of which every process reads only its own rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from jaxmeg.config import Config


def dataset_prefix(cfg: Config, show_progress: bool = True) -> str:
    """The configured dataset's prefix, or the default corpus's (built and cached on first
    use)."""
    from jaxmeg.data import prepare_default_dataset

    if cfg.data.dataset:
        return cfg.data.dataset
    return prepare_default_dataset(
        Path(cfg.data.cache_dir).expanduser(),
        vocab_size=cfg.data.tokenizer_vocab,
        max_bytes=cfg.data.default_corpus_bytes,
        show_progress=show_progress,
    )


def open_dataset(cfg: Config, show_progress: bool = True):
    """The configured token file, or the default corpus (built and cached on first use)."""
    from jaxmeg.data import TokenFile

    return TokenFile.open(dataset_prefix(cfg, show_progress))


def with_vocab(cfg: Config, vocab_size: int) -> Config:
    """Sets model.vocab_size from the data when the config leaves it at -1."""
    if cfg.model.vocab_size != -1:
        if cfg.model.vocab_size < vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the dataset's "
                f"vocabulary ({vocab_size})"
            )
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def expected_vocab(cfg: Config) -> Config:
    """The config with the vocabulary it will train with when no dataset says otherwise: its
    own, else the default corpus's BPE size."""
    if cfg.model.vocab_size == -1:
        return with_vocab(cfg, cfg.data.tokenizer_vocab)
    return cfg


def global_batch_arrays(loader, step: int, sharding) -> tuple[jax.Array, jax.Array]:
    """Builds the global (inputs, targets) arrays; each process reads only its own rows."""
    shape = (loader.global_batch, loader.seq_len)
    cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def rows(index, which: int) -> np.ndarray:
        start, stop, _ = index[0].indices(shape[0])
        if (start, stop) not in cache:
            cache[(start, stop)] = loader.rows(step, start, stop)
        return cache[(start, stop)][which][:, index[1]]

    inputs = jax.make_array_from_callback(shape, sharding, lambda i: rows(i, 0))
    targets = jax.make_array_from_callback(shape, sharding, lambda i: rows(i, 1))
    return inputs, targets
