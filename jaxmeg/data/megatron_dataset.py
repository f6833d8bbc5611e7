"""Megatron-LM's indexed dataset (`MMapIndexedDataset`, megatron/core/datasets/indexed_dataset.py):
the `PREFIX.bin` + `PREFIX.idx` pair that Megatron's `tools/preprocess_data.py` writes.

`PREFIX.idx`, little-endian, in this order:

    magic                  9 bytes   b"MMIDIDX\\x00\\x00"
    version                uint64    1
    dtype code             uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                     6 float64, 7 float32, 8 uint16
    sequence count  S      uint64
    document count  D      uint64    entries of the document index: documents + 1
    sequence lengths       int32[S]  tokens per sequence
    sequence pointers      int64[S]  byte offset of each sequence in PREFIX.bin
    document index         int64[D]  the sequence each document starts at: 0, ..., S

`PREFIX.bin` is the tokens of every sequence, concatenated in order, in the dtype. Megatron
writes one sequence per document (one per sentence with `--split-sentences`), the EOD token
appended to each document's last sequence with `--append-eod`. Nothing records the vocabulary
or the EOD id: they belong to the tokenizer that wrote the files.

The reader memory-maps both files (no token is read until used), checks every count against
the file sizes, and reads only integer token ids stored contiguously (as every Megatron writer
stores them); the multimodal variant (a mode byte per sequence) and the older `TNTIDX` format
are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"  # Megatron's older `lazy`/`cached` IndexedDataset
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
TOKEN_DTYPES = [np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16)]
_CHUNK = 1 << 24  # elements per step of the scans, so memory stays bounded on any corpus


def megatron_paths(prefix: str | Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx)."""
    return Path(str(prefix) + ".bin"), Path(str(prefix) + ".idx")


def is_megatron_index(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the indexed dataset's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


@dataclasses.dataclass(frozen=True)
class MegatronIndex:
    """A validated `PREFIX.idx`; the arrays are memory-mapped."""

    path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_pointers: np.ndarray  # int64 [S]
    document_indices: np.ndarray  # int64 [D] = documents + 1

    @property
    def num_tokens(self) -> int:
        return _sum_int64(self.sequence_lengths)


def _sum_int64(values: np.ndarray) -> int:
    return sum(
        int(values[i : i + _CHUNK].sum(dtype=np.int64)) for i in range(0, len(values), _CHUNK)
    )


def _section(path: Path, dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def read_megatron_index(path: str | Path) -> MegatronIndex:
    """Reads and checks a `.idx` file; every error names the file and the numbers that
    disagree."""
    path = Path(path)
    name = repr(str(path))
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if head.startswith(LEGACY_MAGIC):
        raise ValueError(
            f"{name} is Megatron-LM's older `lazy`/`cached` index (TNTIDX), not the mmap "
            f"indexed dataset (MMIDIDX); rewrite it with a current tools/preprocess_data.py"
        )
    if not head.startswith(MAGIC):
        raise ValueError(
            f"{name} is not a Megatron-LM index: it starts with {head[:9]!r}, not {MAGIC!r}"
        )
    if len(head) < HEADER.size:
        raise ValueError(f"{name} is truncated: {size} bytes, its header alone is {HEADER.size}")
    _, version, code, num_seqs, num_doc_entries = HEADER.unpack(head)
    if version != VERSION:
        raise ValueError(f"{name} has index version {version}; jaxmeg reads version {VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{name} has dtype code {code}; known codes are 1-8")
    dtype = DTYPE_CODES[code]
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{name} holds {dtype.name} values (code {code}), not integer token ids")
    expected = HEADER.size + 12 * num_seqs + 8 * num_doc_entries
    if size != expected:
        why = ""
        if num_seqs > 0 and size == expected + num_seqs:
            why = (
                " (plus one mode byte per sequence: a multimodal index, which jaxmeg does not read)"
            )
        raise ValueError(
            f"{name} has {size} bytes; its header says {num_seqs} sequences and "
            f"{num_doc_entries} document index entries = {expected} bytes{why}"
        )
    lengths = _section(path, np.int32, HEADER.size, num_seqs)
    pointers = _section(path, np.int64, HEADER.size + 4 * num_seqs, num_seqs)
    doc_index = _section(path, np.int64, HEADER.size + 12 * num_seqs, num_doc_entries)
    if num_doc_entries == 0 or doc_index[0] != 0 or doc_index[-1] != num_seqs:
        ends = f"{doc_index[0]} ... {doc_index[-1]}" if num_doc_entries else "empty"
        raise ValueError(
            f"{name}: the document index must run from sequence 0 to the sequence count "
            f"{num_seqs}; it is {ends}"
        )
    if np.any(np.diff(doc_index) < 0):
        raise ValueError(f"{name}: the document index decreases")
    _check_contiguous(name, lengths, pointers, dtype.itemsize)
    return MegatronIndex(path, dtype, lengths, pointers, doc_index)


def _check_contiguous(name: str, lengths, pointers, itemsize: int) -> None:
    """Sequence k must start where sequence k - 1 ends: the .bin is then one flat token array."""
    start = 0
    for i in range(0, len(lengths), _CHUNK):
        chunk = np.asarray(lengths[i : i + _CHUNK], dtype=np.int64)
        if np.any(chunk < 0):
            k = i + int(np.argmax(chunk < 0))
            raise ValueError(f"{name}: sequence {k} has length {int(lengths[k])}")
        ends = start + np.cumsum(chunk) * itemsize
        expected = np.concatenate([[start], ends[:-1]])
        bad = np.flatnonzero(np.asarray(pointers[i : i + _CHUNK]) != expected)
        if bad.size:
            k = i + int(bad[0])
            raise ValueError(
                f"{name}: sequence {k} starts at byte {int(pointers[k])}, not "
                f"{int(expected[bad[0]])} where sequence {k - 1} ends; jaxmeg reads only "
                f"contiguous sequences (as Megatron-LM's tools write them)"
            )
        start = int(ends[-1])


@dataclasses.dataclass(frozen=True)
class MegatronDataset:
    """A `PREFIX.bin` + `PREFIX.idx` pair: `tokens` is every token, memory-mapped, and
    `doc_offsets` the token offset where each document starts, then the token count."""

    prefix: str
    index: MegatronIndex
    tokens: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return len(self.index.document_indices) - 1

    @property
    def doc_offsets(self) -> np.ndarray:
        """int64 [documents + 1], in tokens (the layout of jaxmeg's own `PREFIX.idx.npy`)."""
        doc_index = np.asarray(self.index.document_indices)
        seq_count = len(self.index.sequence_lengths)
        if seq_count == 0:
            return np.zeros_like(doc_index)
        starts = np.asarray(self.index.sequence_pointers[np.minimum(doc_index, seq_count - 1)])
        return np.where(doc_index < seq_count, starts // self.index.dtype.itemsize, self.num_tokens)

    def documents(self) -> Iterable[np.ndarray]:
        offsets = self.doc_offsets
        for start, stop in zip(offsets[:-1], offsets[1:], strict=True):
            yield self.tokens[start:stop]


def open_megatron_dataset(prefix: str | Path) -> MegatronDataset:
    """Opens PREFIX.bin + PREFIX.idx without reading the tokens."""
    bin_path, idx_path = megatron_paths(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise FileNotFoundError(f"Megatron-LM dataset file {str(path)!r} does not exist")
    index = read_megatron_index(idx_path)
    num_tokens = index.num_tokens
    expected = num_tokens * index.dtype.itemsize
    size = bin_path.stat().st_size
    if size != expected:
        raise ValueError(
            f"{str(bin_path)!r} has {size} bytes; its index {str(idx_path)!r} says "
            f"{num_tokens} tokens of {index.dtype.name} = {expected} bytes"
            + (" (truncated)" if size < expected else "")
        )
    tokens = _section(bin_path, index.dtype, 0, num_tokens)
    return MegatronDataset(prefix=str(prefix), index=index, tokens=tokens)


def token_id_range(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) token id, read in chunks (one pass over a memory-mapped file)."""
    if tokens.size == 0:
        raise ValueError("no tokens")
    low, high = None, None
    for i in range(0, tokens.shape[0], _CHUNK):
        chunk = np.asarray(tokens[i : i + _CHUNK])
        low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
        high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
    return low, high


def write_megatron_dataset(
    prefix: str | Path,
    documents: Iterable[Sequence[int] | Sequence[Sequence[int]]],
    dtype=np.uint16,
    eod: int | None = None,
    split_sentences: bool = False,
) -> dict:
    """Writes PREFIX.bin + PREFIX.idx in Megatron-LM's layout (see the module docstring), as its
    `tools/preprocess_data.py` does: each document one sequence, or with `split_sentences` each
    document a list of sentences, one sequence each; `eod`, when given, appended to each
    document's last sequence (Megatron's `--append-eod`). Files go to temporary names first and
    are renamed into place, the index last. Returns counts."""
    dtype = np.dtype(dtype)
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype {dtype.name} is not one of {[t.name for t in TOKEN_DTYPES]}")
    code = next(c for c, t in DTYPE_CODES.items() if t == dtype)
    info = np.iinfo(dtype)
    bin_path, idx_path = megatron_paths(prefix)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    lengths, doc_index = [], [0]
    tmp_bin = bin_path.with_name(bin_path.name + f".tmp{os.getpid()}")
    with open(tmp_bin, "wb") as f:
        for n, document in enumerate(documents):
            sequences = [list(s) for s in document] if split_sentences else [list(document)]
            if eod is not None and sequences:
                sequences[-1].append(eod)
            for sequence in sequences:
                array = np.asarray(sequence, dtype=np.int64)
                if array.size and (array.min() < info.min or array.max() > info.max):
                    raise ValueError(
                        f"document {n} has token ids in [{array.min()}, {array.max()}], outside "
                        f"{dtype.name}'s [{info.min}, {info.max}]"
                    )
                f.write(array.astype(dtype).tobytes())
                lengths.append(array.size)
            doc_index.append(len(lengths))
    lengths_array = np.asarray(lengths, dtype=np.int32)
    pointers = (np.cumsum(lengths_array, dtype=np.int64) - lengths_array) * dtype.itemsize
    tmp_idx = idx_path.with_name(idx_path.name + f".tmp{os.getpid()}")
    with open(tmp_idx, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, code, len(lengths), len(doc_index)))
        f.write(lengths_array.tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(doc_index, dtype=np.int64).tobytes())
    os.replace(tmp_bin, bin_path)
    os.replace(tmp_idx, idx_path)
    return {
        "format": "megatron",
        "dtype": dtype.name,
        "num_tokens": int(lengths_array.sum(dtype=np.int64)),
        "num_sequences": len(lengths),
        "num_docs": len(doc_index) - 1,
    }
