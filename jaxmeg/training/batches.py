"""The training data as the step sees it: the token file (or the default corpus), the vocabulary
it fixes, and each step's global batch arrays, of which every process reads only its own rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from jaxmeg.config import Config

DEFAULT_CORPUS = ("", "default")
"""The values of data.dataset that name the default corpus."""


def run_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer.json that `data.tokenizer` names; None when it is unset or `none`."""
    if cfg.data.tokenizer in ("", "none"):
        return None
    path = Path(cfg.data.tokenizer).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer {str(path)!r} does not exist")
    return path


def dataset_prefix(cfg: Config, show_progress: bool = True) -> str:
    """The configured dataset's prefix, or the default corpus's (built and cached on first
    use), tokenized with the run's own tokenizer when it has one (`data.tokenizer`)."""
    from jaxmeg.data import prepare_default_dataset

    if cfg.data.dataset not in DEFAULT_CORPUS:
        return cfg.data.dataset
    if cfg.data.tokenizer == "none":
        raise ValueError(
            "the run has no tokenizer (data.tokenizer: none) to tokenize the default corpus "
            "with; set data.dataset to a token file in the model's own ids"
        )
    return prepare_default_dataset(
        Path(cfg.data.cache_dir).expanduser(),
        vocab_size=cfg.data.tokenizer_vocab,
        max_bytes=cfg.data.default_corpus_bytes,
        show_progress=show_progress,
        tokenizer_json=run_tokenizer(cfg),
    )


def open_dataset(cfg: Config, show_progress: bool = True):
    """The configured token file, or the default corpus (built and cached on first use); a
    token file made by another tokenizer than the run's (`data.tokenizer`) is refused."""
    from jaxmeg.data import TokenFile
    from jaxmeg.data.corpus import recorded_tokenizer
    from jaxmeg.data.tokenizer import fingerprint, load_tokenizer

    token_file = TokenFile.open(dataset_prefix(cfg, show_progress))
    own = run_tokenizer(cfg)
    made_by = recorded_tokenizer(token_file.meta)
    if own is not None and made_by is not None and made_by != fingerprint(load_tokenizer(own)):
        raise ValueError(
            f"the dataset {token_file.prefix!r} was tokenized by "
            f"{token_file.meta.get('tokenizer', 'another tokenizer')}, not by the run's "
            f"data.tokenizer {str(own)!r}; make it with scripts/preprocess_data.py "
            f"--tokenizer {own}"
        )
    return token_file


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
