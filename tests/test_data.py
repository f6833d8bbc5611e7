"""Tokenizer round trip, token files, the default corpus, and the loader's determinism,
data-parallel shards and resumable state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxmeg.data import (
    BatchLoader,
    TokenFile,
    load_tokenizer,
    prepare_dataset,
    prepare_default_dataset,
    shard_rows,
    train_bpe_tokenizer,
    write_token_file,
)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = [
    "def f(x):\n    return x ** 2  # squares\n",
    "Grüße, 世界! naïve café — «quotes» \t tabs\r\nand\n\nblank lines   ",
    "emoji 🙂🚀 and \x00 control",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    text = [s * 20 for s in SAMPLES] + [
        p.read_text() for p in sorted((ROOT / "jaxmeg").rglob("*.py"))
    ]
    return train_bpe_tokenizer(text, 400, tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_tokenizer_saved_and_loaded(tokenizer, tmp_path):
    path = tmp_path / "t.json"
    tokenizer.save(str(path))
    assert load_tokenizer(path).encode(SAMPLES[0]).ids == tokenizer.encode(SAMPLES[0]).ids


def make_token_file(tmp_path, num_tokens=5000, vocab=300, seed=0) -> TokenFile:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab - 1, n).tolist() for n in rng.integers(1, 200, num_tokens // 100)]
    write_token_file(tmp_path / "toks", docs, vocab_size=vocab, eot=vocab - 1)
    return TokenFile.open(tmp_path / "toks")


def test_token_file_round_trip(tmp_path):
    docs = [[1, 2, 3], [4], []]
    info = write_token_file(tmp_path / "x", docs, vocab_size=10, eot=9)
    tf = TokenFile.open(tmp_path / "x")
    assert info["num_docs"] == 3 and tf.num_tokens == 7
    assert tf.tokens.dtype == np.uint16
    assert tf.tokens.tolist() == [1, 2, 3, 9, 4, 9, 9]
    assert tf.doc_offsets.tolist() == [0, 4, 6, 7]
    assert not list(tmp_path.glob("*.tmp*"))


def test_corrupt_token_file_is_reported(tmp_path):
    write_token_file(tmp_path / "x", [[1, 2, 3]], vocab_size=10, eot=9)
    with open(tmp_path / "x.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="has 10 bytes, its metadata says 4 tokens"):
        TokenFile.open(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenFile.open(tmp_path / "missing")


def test_preprocess_script_end_to_end(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i}: " + SAMPLES[i % 3] * 5}) for i in range(50)]
    jsonl.write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "out" / "corpus"
    result = subprocess.run(
        [sys.executable, "scripts/preprocess_data.py", "--input", str(jsonl),
         "--output-prefix", str(prefix), "--vocab-size", "300", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "50 documents" in result.stdout
    tf = TokenFile.open(prefix)
    tok = load_tokenizer(str(prefix) + ".tokenizer.json")
    first = tf.tokens[tf.doc_offsets[0] : tf.doc_offsets[1] - 1]
    assert tok.decode(first.tolist()) == json.loads(lines[0])["text"]


def test_jsonl_missing_field_names_line(tmp_path):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 has no 'text' field"):
        prepare_dataset([jsonl], tmp_path / "o", vocab_size=300, show_progress=False)


def test_jsonl_bad_json_names_file_and_line(tmp_path):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "ok"}\n\n{"text": "cut\n')
    result = subprocess.run(
        [sys.executable, "scripts/preprocess_data.py", "--input", str(jsonl),
         "--output-prefix", str(tmp_path / "o"), "--vocab-size", "300", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"error: {jsonl}:3 is not valid JSON" in result.stderr


def test_loader_deterministic_and_seeded(tmp_path):
    tf = make_token_file(tmp_path)
    a, b = BatchLoader(tf, 16, 8, seed=1), BatchLoader(tf, 16, 8, seed=1)
    c = BatchLoader(tf, 16, 8, seed=2)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, _ = b.next_batch()
        xc, _ = c.next_batch()
        np.testing.assert_array_equal(xa, xb)
        assert xa.shape == (8, 16) and xa.dtype == np.int32
        np.testing.assert_array_equal(xa[:, 1:], ya[:, :-1])
    assert not np.array_equal(xa, xc)


def test_loader_crosses_epochs_visiting_every_sample(tmp_path):
    tf = make_token_file(tmp_path, num_tokens=1000)
    loader = BatchLoader(tf, 16, 4, seed=0)
    n = loader.num_samples
    ids = np.concatenate([loader.global_sample_ids(k) for k in range(n // 4)])
    assert len(set(ids.tolist())) == len(ids)  # one epoch without repeats


def test_data_parallel_shards_disjoint_and_cover(tmp_path):
    tf = make_token_file(tmp_path)
    loader = BatchLoader(tf, 16, 8, seed=0)
    full_x, _ = loader.rows(5, 0, 8)
    pieces = [loader.rows(5, *shard_rows(8, 4, k))[0] for k in range(4)]
    np.testing.assert_array_equal(np.concatenate(pieces), full_x)
    ids = loader.global_sample_ids(5)
    shards = [set(ids[slice(*shard_rows(8, 4, k))].tolist()) for k in range(4)]
    assert all(shards[i].isdisjoint(shards[j]) for i in range(4) for j in range(i + 1, 4))


def test_loader_state_resumes_exactly(tmp_path):
    tf = make_token_file(tmp_path)
    loader = BatchLoader(tf, 16, 8, seed=3)
    for _ in range(4):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state()))
    expected = [loader.next_batch()[0] for _ in range(3)]
    resumed = BatchLoader(tf, 16, 8, seed=3)
    resumed.restore(state)
    for batch in expected:
        np.testing.assert_array_equal(resumed.next_batch()[0], batch)
    with pytest.raises(ValueError, match="global_batch was 8, now 4"):
        BatchLoader(tf, 16, 4, seed=3).restore(state)


def test_loader_rejects_too_small_dataset(tmp_path):
    write_token_file(tmp_path / "s", [[1] * 20], vocab_size=10, eot=9)
    with pytest.raises(ValueError, match=r"fewer than train.global_batch \(8\)"):
        BatchLoader(TokenFile.open(tmp_path / "s"), 16, 8, seed=0)


def test_loader_names_an_empty_dataset(tmp_path):
    write_token_file(tmp_path / "e", [], vocab_size=10, eot=9)
    with pytest.raises(ValueError, match=r"the dataset '.*e' holds no tokens"):
        BatchLoader(TokenFile.open(tmp_path / "e"), 16, 8, seed=0)


def test_default_corpus_built_once_then_cached(tmp_path):
    prefix = prepare_default_dataset(
        tmp_path, vocab_size=512, max_bytes=300_000, show_progress=False
    )
    tf = TokenFile.open(prefix)
    assert tf.vocab_size <= 512 and tf.num_tokens > 10_000
    written = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert (
        prepare_default_dataset(tmp_path, vocab_size=512, max_bytes=300_000, show_progress=False)
        == prefix
    )
    # cached: nothing is tokenized or written again
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == written
    tok = load_tokenizer(tf.meta["tokenizer"])
    text = tok.decode(tf.tokens[: tf.doc_offsets[1] - 1].tolist())
    assert "import" in text or "def " in text or '"""' in text


def test_a_corrupt_index_names_its_file(tmp_path):
    from jaxmeg.data import prepare_dataset

    (tmp_path / "a.txt").write_text("hello world")
    prepare_dataset([tmp_path / "a.txt"], tmp_path / "t", vocab_size=300, show_progress=False)
    (tmp_path / "t.idx.npy").write_bytes(b"garbage")
    with pytest.raises(
        ValueError, match=f"token file index '{tmp_path / 't.idx.npy'}' is unreadable"
    ):
        TokenFile.open(tmp_path / "t")
