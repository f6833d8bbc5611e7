"""Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx): our writer's bytes against the
published layout, writer -> reader round trips with document boundaries, detection by format,
named errors on corrupt files, the loader's batches equal to those of our own token file, and
scripts/train.py training on a Megatron pair."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxmeg.data import (
    BatchLoader,
    TokenFile,
    dataset_format,
    open_megatron_dataset,
    write_megatron_dataset,
    write_token_file,
)
from tests.test_train_cli import CLEAN_ENV

ROOT = Path(__file__).resolve().parent.parent
DOCS = [[5, 6, 7], [8], [], [9, 10, 11, 12]]


def random_docs(num_docs=40, vocab=300, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, n).tolist() for n in rng.integers(0, 120, num_docs)]


def test_writer_bytes_follow_the_published_layout(tmp_path):
    info = write_megatron_dataset(tmp_path / "d", DOCS, dtype=np.uint16, eod=1)
    lengths = [4, 2, 1, 5]  # each document + its EOD, one sequence each
    pointers = [0, 8, 12, 14]  # byte offsets of 2-byte tokens
    expected_idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 4)  # sequences
        + struct.pack("<Q", 5)  # document index entries: documents + 1
        + struct.pack("<4i", *lengths)
        + struct.pack("<4q", *pointers)
        + struct.pack("<5q", 0, 1, 2, 3, 4)
    )
    assert (tmp_path / "d.idx").read_bytes() == expected_idx
    tokens = [5, 6, 7, 1, 8, 1, 1, 9, 10, 11, 12, 1]
    assert (tmp_path / "d.bin").read_bytes() == struct.pack(f"<{len(tokens)}H", *tokens)
    assert info == {
        "format": "megatron",
        "dtype": "uint16",
        "num_tokens": 12,
        "num_sequences": 4,
        "num_docs": 4,
    }
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("eod", [None, 299])
def test_round_trip_documents_and_boundaries(tmp_path, dtype, eod):
    docs = random_docs()
    write_megatron_dataset(tmp_path / "d", docs, dtype=dtype, eod=eod)
    data = open_megatron_dataset(tmp_path / "d")
    tail = [] if eod is None else [eod]
    assert data.tokens.dtype == np.dtype(dtype) and isinstance(data.tokens, np.memmap)
    assert [d.tolist() for d in data.documents()] == [d + tail for d in docs]
    lengths = [len(d) + len(tail) for d in docs]
    assert data.doc_offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert data.index.document_indices.tolist() == list(range(len(docs) + 1))


def test_split_sentences_keep_document_boundaries(tmp_path):
    # Megatron's --split-sentences: one sequence per sentence, the EOD after the last one.
    docs = [[[1, 2], [3]], [[4, 5, 6]], [], [[7], [8], [9, 10]]]
    write_megatron_dataset(tmp_path / "s", docs, dtype=np.int32, eod=0, split_sentences=True)
    data = open_megatron_dataset(tmp_path / "s")
    assert data.index.sequence_lengths.tolist() == [2, 2, 4, 1, 1, 3]
    assert data.index.document_indices.tolist() == [0, 2, 3, 3, 6]
    assert [d.tolist() for d in data.documents()] == [
        [1, 2, 3, 0],
        [4, 5, 6, 0],
        [],
        [7, 8, 9, 10, 0],
    ]


def test_detection_picks_the_reader(tmp_path, capsys):
    write_token_file(tmp_path / "ours", DOCS, vocab_size=20, eot=19)
    write_megatron_dataset(tmp_path / "theirs", DOCS, dtype=np.uint16, eod=19)
    assert dataset_format(tmp_path / "ours") == "jaxmeg"
    assert dataset_format(tmp_path / "theirs") == "megatron"
    ours, theirs = TokenFile.open(tmp_path / "ours"), TokenFile.open(tmp_path / "theirs")
    assert "format" not in ours.meta and ours.vocab_size == 20
    assert theirs.meta["format"] == "megatron" and theirs.meta["eot"] is None
    assert theirs.vocab_size == 20  # largest id (the EOD, 19) + 1
    assert "Megatron-LM indexed dataset" in capsys.readouterr().err
    assert theirs.tokens.tolist() == ours.tokens.tolist()
    # both formats over one prefix is ambiguous; neither is today's missing-file error
    (tmp_path / "theirs.json").write_text((tmp_path / "ours.json").read_text())
    with pytest.raises(ValueError, match="both a jaxmeg token file .* and a Megatron-LM"):
        TokenFile.open(tmp_path / "theirs")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenFile.open(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="without the file extension"):
        TokenFile.open(tmp_path / "theirs.bin")


def _corrupt_idx(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: (p / "c.bin").write_bytes((p / "c.bin").read_bytes()[:-2]),
         r"c.bin' has 22 bytes; its index .*c.idx' says 12 tokens of uint16 = 24 bytes \(trunc"),
        (lambda p: (p / "c.idx").write_bytes((p / "c.idx").read_bytes()[:40]),
         r"c.idx' has 40 bytes; its header says 4 sequences and 5 document index entries = 122"),
        (lambda p: (p / "c.idx").write_bytes((p / "c.idx").read_bytes()[:20]),
         r"c.idx' is truncated: 20 bytes, its header alone is 34"),
        (lambda p: (p / "c.idx").write_bytes((p / "c.idx").read_bytes() + b"\0" * 4),
         r"multimodal index"),
        (lambda p: _corrupt_idx(p / "c.idx", 9, struct.pack("<Q", 2)),
         r"c.idx' has index version 2; jaxmeg reads version 1"),
        (lambda p: _corrupt_idx(p / "c.idx", 17, struct.pack("<B", 7)),
         r"holds float32 values \(code 7\), not integer token ids"),
        (lambda p: _corrupt_idx(p / "c.idx", 17, struct.pack("<B", 9)),
         r"has dtype code 9"),
        (lambda p: _corrupt_idx(p / "c.idx", 34 + 16 + 16, struct.pack("<q", 10)),
         r"sequence 2 starts at byte 10, not 12 where sequence 1 ends"),
        (lambda p: _corrupt_idx(p / "c.idx", 34 + 48 + 32, struct.pack("<q", 3)),
         r"document index must run from sequence 0 to the sequence count 4; it is 0 \.\.\. 3"),
        (lambda p: _corrupt_idx(p / "c.idx", 0, b"TNTIDX\x00\x00"),
         r"older `lazy`/`cached` index \(TNTIDX\)"),
        (lambda p: _corrupt_idx(p / "c.idx", 0, b"NOTMAGIC!"),
         r"c.idx' is not a Megatron-LM index: it starts with b'NOTMAGIC!'"),
        (lambda p: (p / "c.bin").unlink(),
         r"Megatron-LM dataset file .*c.bin' does not exist"),
    ],
)  # fmt: skip
def test_corrupt_files_are_named(tmp_path, corrupt, message):
    write_megatron_dataset(tmp_path / "c", DOCS, dtype=np.uint16, eod=1)
    corrupt(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        TokenFile.open(tmp_path / "c")


def test_out_of_range_ids_are_refused(tmp_path):
    write_megatron_dataset(tmp_path / "n", [[3, -2, 4]], dtype=np.int16)
    with pytest.raises(ValueError, match=r"token ids in \[-2, 4\], outside \[0, 2\*\*31\)"):
        TokenFile.open(tmp_path / "n")
    with pytest.raises(ValueError, match=r"document 1 has token ids in \[0, 70000\], outside"):
        write_megatron_dataset(tmp_path / "w", [[1], [0, 70000]], dtype=np.uint16)
    write_megatron_dataset(tmp_path / "e", [[], []], dtype=np.uint16)
    with pytest.raises(ValueError, match="holds no tokens"):
        TokenFile.open(tmp_path / "e")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_loader_batches_match_our_token_file(tmp_path, dtype):
    vocab = 300
    docs = random_docs(num_docs=60, vocab=vocab, seed=3)
    write_token_file(tmp_path / "ours", docs, vocab_size=vocab, eot=vocab - 1)
    write_megatron_dataset(tmp_path / "theirs", docs, dtype=dtype, eod=vocab - 1)
    ours, theirs = TokenFile.open(tmp_path / "ours"), TokenFile.open(tmp_path / "theirs")
    assert theirs.num_tokens == ours.num_tokens and theirs.vocab_size == vocab
    assert theirs.doc_offsets.tolist() == ours.doc_offsets.tolist()
    a, b = BatchLoader(ours, 16, 8, seed=1), BatchLoader(theirs, 16, 8, seed=1)
    assert a.num_samples == b.num_samples
    for step in range(a.num_samples // 8 + 2):  # past one epoch
        inputs, targets = a.next_batch()
        other_inputs, other_targets = b.next_batch()
        assert other_inputs.dtype == np.int32
        np.testing.assert_array_equal(other_inputs, inputs, err_msg=f"step {step}")
        np.testing.assert_array_equal(other_targets, targets, err_msg=f"step {step}")


@pytest.mark.timeout(300)
def test_train_cli_on_a_megatron_pair(tmp_path):
    write_megatron_dataset(tmp_path / "corpus", random_docs(vocab=64, seed=5), eod=63)
    metrics = tmp_path / "m.jsonl"
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "configs/gpt_tiny.yaml", "--no-progress",
         "--cpu-devices", "1", "--steps", "2", "--metrics-file", str(metrics),
         "--set", f"data.dataset={tmp_path / 'corpus'}", "--set", "model.layers=2",
         "--set", "model.seq_len=16", "--set", "train.global_batch=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, env=CLEAN_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Megatron-LM indexed dataset" in result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in records)
