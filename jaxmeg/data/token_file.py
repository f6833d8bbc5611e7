"""Token files: `PREFIX.bin` (flat uint16/uint32 token ids), `PREFIX.idx.npy` (int64 document
start offsets, docs + 1 entries) and `PREFIX.json` (metadata). Written atomically: every file
goes to a temporary name first and is renamed into place, the metadata last."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def _paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx.npy"), Path(prefix + ".json")


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
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    offsets, total = [0], 0
    tmp_bin = bin_path.with_name(bin_path.name + f".tmp{os.getpid()}")
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
    tmp_idx = idx_path.with_name(idx_path.name + f".tmp{os.getpid()}.npy")
    np.save(tmp_idx, np.asarray(offsets, dtype=np.int64))
    info = {
        "dtype": dtype.name,
        "num_tokens": total,
        "num_docs": len(offsets) - 1,
        "vocab_size": vocab_size,
        "eot": eot,
        **(meta or {}),
    }
    tmp_meta = meta_path.with_name(meta_path.name + f".tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(info, indent=1))
    os.replace(tmp_bin, bin_path)
    os.replace(tmp_idx, idx_path)
    os.replace(tmp_meta, meta_path)
    return info


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
        offsets = np.load(idx_path)
        if offsets.shape != (int(meta["num_docs"]) + 1,) or int(offsets[-1]) != meta["num_tokens"]:
            raise ValueError(f"token file index {str(idx_path)!r} does not match its metadata")
        return cls(prefix=str(prefix), tokens=tokens, doc_offsets=offsets, meta=meta)
