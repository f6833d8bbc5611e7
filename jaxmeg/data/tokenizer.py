"""Byte-level BPE tokenizers, trained locally with the `tokenizers` library."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_path: str | Path | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """Trains a byte-level BPE (GPT-2 style) on `texts`; saves tokenizer.json if `out_path`."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOT}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if out_path is not None:
        tokenizer.save(str(out_path))
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    return Tokenizer.from_file(str(path))


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {EOT} token")
    return token_id


def encode_batches(
    tokenizer: Tokenizer, texts: Iterable[str], batch: int = 256
) -> Iterator[list[int]]:
    """Token ids of each text, encoded `batch` texts at a time (parallel inside tokenizers)."""
    pending: list[str] = []
    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            yield from (e.ids for e in tokenizer.encode_batch(pending))
            pending = []
    if pending:
        yield from (e.ids for e in tokenizer.encode_batch(pending))
