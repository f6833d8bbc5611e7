"""Corpora -> token files: the default corpus (this Python installation's standard-library
sources, real text that every Python install has) and user text/JSONL files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from jaxmeg.data.token_file import write_token_file
from jaxmeg.data.tokenizer import (
    encode_batches,
    eot_id,
    fingerprint,
    load_tokenizer,
    tokenizer_file,
    train_bpe_tokenizer,
)


def default_corpus_files(max_bytes: int) -> list[Path]:
    """Standard-library `.py` files in sorted order (no site-packages), up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    if not chosen:
        raise FileNotFoundError(f"no standard-library sources found under {root}")
    return chosen


STRUCTURED_SUFFIXES = frozenset(
    {".csv", ".tsv", ".json", ".parquet", ".arrow", ".xlsx", ".gz", ".zst", ".bz2", ".xz", ".zip"}
)
"""Inputs that are not text nor JSONL: refused by name rather than tokenized as one document."""


def _read_texts(paths: list[Path], text_key: str = "text") -> Iterator[str]:
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as err:
                            raise ValueError(
                                f"{path}:{n} is not valid JSON ({err.msg} at column {err.colno})"
                            ) from None
                        if not isinstance(record, dict) or text_key not in record:
                            raise ValueError(f"{path}:{n} has no {text_key!r} field")
                        yield record[text_key]
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def output_prefix(prefix: str | Path) -> Path:
    """The PREFIX a token file is written to: a directory (or a path ending in /) gets
    DIR/tokens."""
    if str(prefix).endswith(("/", "\\")) or Path(prefix).is_dir():
        return Path(prefix) / "tokens"
    return Path(prefix)


def prepare_dataset(
    inputs: list[str | Path],
    out_prefix: str | Path,
    tokenizer_json: str | Path | None = None,
    vocab_size: int = 32000,
    text_key: str = "text",
    show_progress: bool = True,
) -> dict:
    """Tokenizes text (.txt, one document per file) or JSONL (one document per line) files
    into a token file; trains a BPE of `vocab_size` next to it unless a tokenizer is given."""
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input file {str(path)!r} does not exist")
        if path.suffix.lower() in STRUCTURED_SUFFIXES:
            raise ValueError(
                f"input file {str(path)!r}: a {path.suffix} file would be read as one "
                f"plain-text document, its structure as text; give .txt files (a document "
                f"each) or .jsonl (a document per line, in the --text-key field)"
            )
    out_prefix = output_prefix(out_prefix)
    if not any(_read_texts(paths, text_key)):
        raise ValueError(f"the inputs {[str(p) for p in paths]} hold no text (no document)")
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None:
        tokenizer_json = Path(str(out_prefix) + ".tokenizer.json")
        tokenizer = train_bpe_tokenizer(
            _read_texts(paths, text_key), vocab_size, tokenizer_json, show_progress
        )
    else:
        tokenizer_json = tokenizer_file(tokenizer_json)
        tokenizer = load_tokenizer(tokenizer_json)
    texts = _read_texts(paths, text_key)
    if show_progress:
        texts = tqdm(texts, desc="tokenizing", unit="doc", file=sys.stderr)
    start = time.perf_counter()
    info = write_token_file(
        out_prefix,
        encode_batches(tokenizer, texts),
        vocab_size=tokenizer.get_vocab_size(),
        eot=eot_id(tokenizer, tokenizer_json),
        meta={
            "tokenizer": str(Path(tokenizer_json).resolve()),
            "tokenizer_fingerprint": fingerprint(tokenizer),
        },
    )
    info["seconds"] = time.perf_counter() - start
    info["prefix"] = str(out_prefix)
    return info


def _cache_key(files: list[Path], vocab: str, max_bytes: int) -> str:
    digest = hashlib.sha256()
    digest.update(f"{sys.version_info[:3]} {vocab} {max_bytes}".encode())
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def prepare_default_dataset(
    cache_dir: str | Path,
    vocab_size: int,
    max_bytes: int,
    show_progress: bool = True,
    tokenizer_json: str | Path | None = None,
) -> str:
    """The default corpus as a token-file prefix, built once and cached under `cache_dir`:
    tokenized with `tokenizer_json` (a run's own tokenizer; cached per tokenizer, whose copy goes
    with it) or, when None, with a byte-level BPE of `vocab_size` trained on it."""
    files = default_corpus_files(max_bytes)
    if tokenizer_json is not None:
        tokenizer_json = tokenizer_file(tokenizer_json)
        vocab = f"tokenizer {fingerprint(load_tokenizer(tokenizer_json))}"
        described = f"the tokenizer {tokenizer_json}"
    else:
        vocab, described = str(vocab_size), f"BPE vocabulary {vocab_size}"
    final = Path(cache_dir).expanduser() / f"stdlib-{_cache_key(files, vocab, max_bytes)}"
    prefix = str(final / "tokens")
    if (final / "tokens.json").is_file():
        return prefix
    if show_progress:
        print(
            f"jaxmeg: building the default corpus: {len(files)} standard-library files, "
            f"{described} -> {final}",
            file=sys.stderr,
        )
    staging = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if tokenizer_json is not None:  # the cache keeps its own copy (with the config naming EOS)
        for name in (tokenizer_json.name, "tokenizer_config.json"):
            if (tokenizer_json.parent / name).is_file():
                shutil.copyfile(tokenizer_json.parent / name, staging / name)
        tokenizer_json = staging / tokenizer_json.name
    prepare_dataset(
        files, staging / "tokens", tokenizer_json, vocab_size, show_progress=show_progress
    )
    meta_path = staging / "tokens.json"
    meta = json.loads(meta_path.read_text())
    name = "tokens.tokenizer.json" if tokenizer_json is None else tokenizer_json.name
    meta["tokenizer"] = str(final / name)
    meta_path.write_text(json.dumps(meta, indent=1))
    try:
        os.replace(staging, final)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return prefix


def recorded_tokenizer(meta: dict) -> str | None:
    """The fingerprint of the tokenizer that made a token file (its metadata `meta`): of the
    file it names when that is still there, else the one it recorded; None if it names none."""
    path = meta.get("tokenizer")
    if path and Path(path).is_file():
        try:
            return fingerprint(load_tokenizer(path))
        except ValueError:
            pass
    return meta.get("tokenizer_fingerprint")
