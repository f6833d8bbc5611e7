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


END_OF_DOCUMENT = (EOT, "<|end_of_text|>", "</s>", "<eos>")
"""End-of-document tokens that tokenizers name (GPT-2, Llama 3, Llama 2 and others), in the
order they are looked for when the tokenizer's config names none."""


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one in a directory (a Hugging
    Face model, a run directory that `scripts/convert_hf.py import` made)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises plain Exceptions for bad files
        raise ValueError(f"{path} is not a tokenizer.json the tokenizers library reads: "
                         f"{str(err).splitlines()[0][:200]}") from None  # fmt: skip


def fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of everything that decides how `tokenizer` encodes (the library's own
    serialization of it: vocabulary, merges, normalizer, pre-tokenizer, special tokens), so two
    copies of one tokenizer.json, however formatted, give the same string."""
    import hashlib

    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def eot_id(tokenizer: Tokenizer, path: str | Path | None = None) -> int:
    """The end-of-document token: the `eos_token` of the tokenizer_config.json beside `path`
    (a tokenizer.json), else the first of END_OF_DOCUMENT the tokenizer has."""
    names = list(END_OF_DOCUMENT)
    config = Path(path).with_name("tokenizer_config.json") if path else None
    if config is not None and config.is_file():
        import json

        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos:
            names.insert(0, eos)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise ValueError(f"the tokenizer has none of the end-of-document tokens {names}")


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
