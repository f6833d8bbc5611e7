"""Token files: `PREFIX.bin` (flat uint16/uint32 token ids), `PREFIX.idx.npy` (int64 document
start offsets, docs + 1 entries) and `PREFIX.json` (metadata). Written atomically: every file
goes to a temporary name first and is renamed into place, the metadata last.

`TokenFile.open` also reads Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`,
`megatron_dataset`), told apart by its files (`dataset_format`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxmeg.data.megatron_dataset import (
    is_megatron_index,
    megatron_paths,
    open_megatron_dataset,
    token_id_range,
)
from jaxmeg.paths import os_error


def _paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx.npy"), Path(prefix + ".json")


def dataset_format(prefix: str | Path) -> str:
    """The format of PREFIX's files: jaxmeg's own ("jaxmeg") when PREFIX.json exists,
    Megatron-LM's ("megatron") when PREFIX.idx starts with its index magic (an .idx of another
    kind is left to the Megatron reader to explain when no PREFIX.json exists); both at once is
    ambiguous and an error."""
    meta_path = _paths(prefix)[2]
    bin_path, megatron_idx = megatron_paths(prefix)
    ours, megatron = meta_path.is_file(), is_megatron_index(megatron_idx)
    if ours and megatron:
        raise ValueError(
            f"dataset {str(prefix)!r} is both a jaxmeg token file ({str(meta_path)!r}) and a "
            f"Megatron-LM indexed dataset ({str(megatron_idx)!r}) over one {str(bin_path)!r}; "
            f"remove the one that does not describe it"
        )
    if ours:
        return "jaxmeg"
    if megatron or megatron_idx.is_file():
        return "megatron"
    hint = ""
    if str(prefix).endswith((".bin", ".idx", ".json", ".npy")):
        hint = "; give the prefix, without the file extension"
    raise FileNotFoundError(
        f"dataset {str(prefix)!r} does not exist: no jaxmeg token file ({str(meta_path)!r}, "
        f"written by scripts/preprocess_data.py) and no Megatron-LM indexed dataset "
        f"({str(megatron_idx)!r} + .bin){hint}"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def write_token_file(
    prefix: str | Path,
    documents: Iterable[list[int]],
    vocab_size: int,
    eot: int,
    meta: dict | None = None,
) -> dict:
    """Streams documents (lists of ids) to PREFIX.*, an EOT after each; returns the metadata."""
    bin_path, idx_path, meta_path = _paths(prefix)
    temporaries = [p.with_name(p.name + f".tmp{os.getpid()}") for p in (bin_path, idx_path)]
    tmp_meta = meta_path.with_name(meta_path.name + f".tmp{os.getpid()}")
    try:
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        info = _write_temporaries(*temporaries, tmp_meta, documents, vocab_size, eot, meta)
        os.replace(temporaries[0], bin_path)
        os.replace(temporaries[1], idx_path)
        os.replace(tmp_meta, meta_path)
    except BaseException as err:  # a half-written token file would fill the disk for nothing
        for tmp in [*temporaries, tmp_meta]:
            tmp.unlink(missing_ok=True)
        problem = os_error(err, bin_path.parent, "--output-prefix")
        if problem is None:
            raise
        raise problem from err
    return info


def _write_temporaries(tmp_bin, tmp_idx, tmp_meta, documents, vocab_size, eot, meta) -> dict:
    dtype = token_dtype(vocab_size)
    offsets, total = [0], 0
    with open(tmp_bin, "wb") as f:
        for ids in documents:
            array = np.asarray(list(ids) + [eot], dtype=np.int64)
            if array.size and (array.min() < 0 or array.max() >= vocab_size):
                raise ValueError(
                    f"token id out of range [0, {vocab_size}) in document {len(offsets) - 1}"
                )
            f.write(array.astype(dtype).tobytes())
            total += array.size
            offsets.append(total)
    with open(tmp_idx, "wb") as f:  # np.save to a path would add .npy to the temporary's name
        np.save(f, np.asarray(offsets, dtype=np.int64))
    info = {
        "dtype": dtype.name,
        "num_tokens": total,
        "num_docs": len(offsets) - 1,
        "vocab_size": vocab_size,
        "eot": eot,
        **(meta or {}),
    }
    tmp_meta.write_text(json.dumps(info, indent=1))
    return info


def existing_files(prefix: str | Path) -> list[Path]:
    """The files of a token file at PREFIX that exist (its tokenizer too)."""
    candidates = [*_paths(prefix), Path(str(prefix) + ".tokenizer.json")]
    return [p for p in candidates if p.exists()]


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A read-only token file: `tokens` is a memmap, nothing is loaded until read."""

    prefix: str
    tokens: np.ndarray
    doc_offsets: np.ndarray
    meta: dict

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @classmethod
    def open(cls, prefix: str | Path) -> TokenFile:
        """Opens PREFIX in whichever format its files are: jaxmeg's own or Megatron-LM's."""
        if dataset_format(prefix) == "megatron":
            return cls._open_megatron(prefix)
        return cls._open_jaxmeg(prefix)

    @classmethod
    def _open_megatron(cls, prefix: str | Path) -> TokenFile:
        """A Megatron-LM indexed dataset as a token file. Its files record neither the
        vocabulary nor the EOD id (both are the tokenizer's), so `vocab_size` is the largest
        token id + 1, from one chunked pass over PREFIX.bin (which also rejects ids an int32
        batch or an embedding cannot take): the trainer checks a set `model.vocab_size`
        against it and uses it when `model.vocab_size` is unset. `eot` is None; the loader
        does not need it (its windows run across documents, as over jaxmeg's own files)."""
        data = open_megatron_dataset(prefix)
        if data.num_tokens == 0:
            raise ValueError(f"Megatron-LM dataset {str(prefix)!r} holds no tokens")
        low, high = token_id_range(data.tokens)
        if low < 0 or high >= 2**31:
            raise ValueError(
                f"Megatron-LM dataset {str(prefix)!r} has token ids in [{low}, {high}], outside "
                f"[0, 2**31)"
            )
        meta = {
            "format": "megatron",
            "dtype": data.index.dtype.name,
            "num_tokens": data.num_tokens,
            "num_docs": data.num_docs,
            "num_sequences": len(data.index.sequence_lengths),
            "vocab_size": high + 1,
            "eot": None,
        }
        print(
            f"jaxmeg: {str(prefix)!r} is a Megatron-LM indexed dataset: {data.num_docs:,} "
            f"documents, {data.num_tokens:,} tokens of {meta['dtype']}, token ids up to {high}; "
            f"it records no vocabulary size, so model.vocab_size must be at least {high + 1} "
            f"and is {high + 1} when unset (set it to the tokenizer's to match its other runs)",
            file=sys.stderr,
        )
        return cls(prefix=str(prefix), tokens=data.tokens, doc_offsets=data.doc_offsets, meta=meta)

    @classmethod
    def _open_jaxmeg(cls, prefix: str | Path) -> TokenFile:
        bin_path, idx_path, meta_path = _paths(prefix)
        for path in (meta_path, bin_path, idx_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"token file {str(path)!r} does not exist; write it with "
                    f"scripts/preprocess_data.py"
                )
        try:
            meta = json.loads(meta_path.read_text())
            dtype = np.dtype(meta["dtype"])
            expected = int(meta["num_tokens"]) * dtype.itemsize
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"token file metadata {str(meta_path)!r} is unreadable: {err}"
            ) from err
        size = bin_path.stat().st_size
        if size != expected:
            raise ValueError(
                f"token file {str(bin_path)!r} has {size} bytes, its metadata says "
                f"{meta['num_tokens']} tokens of {dtype.name} = {expected} bytes"
            )
        tokens = np.memmap(bin_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        try:
            offsets = np.load(idx_path)
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"token file index {str(idx_path)!r} is unreadable: {err}") from None
        if offsets.shape != (int(meta["num_docs"]) + 1,) or int(offsets[-1]) != meta["num_tokens"]:
            raise ValueError(f"token file index {str(idx_path)!r} does not match its metadata")
        return cls(prefix=str(prefix), tokens=tokens, doc_offsets=offsets, meta=meta)
