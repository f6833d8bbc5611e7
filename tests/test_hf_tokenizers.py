"""Hugging Face models with their tokenizers (scripts/convert_hf.py): a transformers model and
its tokenizer imported, trained on the tokenizer's tokens, generated from text, evaluated and
exported with the same tokenizer files; a dataset of another tokenizer refused; a model without
tokenizer kept as ids only; an imported run naming its tokenizer relative to itself. The
checkpoints themselves: tests/test_hf.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.models import hf
from jaxmeg.training import batches
from tests.test_hf import FIXTURES, MODELS, ROOT, assert_trees_equal, convert_hf, load_script


def tiny_tokenizer_dir(name: str, tmp_path: Path) -> Path:
    """The fixture `name` with a tokenizer of at most its 256 ids. GPT-2: a byte-level BPE
    without merges and a tokenizer config naming id 0 (the model's eos_token_id) as the end of a
    document. Llama: a Llama-2-style BPE over a text's characters (the `▁` word marker,
    `<unk>`, `<s>` and `</s>`), no tokenizer config: `</s>` ends a document by its name."""
    import json
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path / f"hf_{name}"
    shutil.copytree(FIXTURES / name, out)
    if name == "gpt2":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )  # fmt: skip
        tokenizer.train_from_iterator(["hello world"], trainer=trainer)
        assert tokenizer.get_vocab_size() == 256
        eos = tokenizer.id_to_token(0)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        )
        text = (ROOT / "README.md").read_text()
        tokenizer.train_from_iterator([text], trainer=trainer)
        assert tokenizer.get_vocab_size() == 256 and tokenizer.token_to_id("</s>") == 2
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def run_script(name: str, *args: str) -> str:
    import subprocess
    import sys

    from tests.test_train_cli import CLEAN_ENV

    result = subprocess.run(
        [sys.executable, f"scripts/{name}.py", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env=CLEAN_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(900)
def test_a_model_with_its_tokenizer_from_import_to_export(tmp_path):
    """The story, on GPT-2: a transformers model with its tokenizer -> import (no dataset read)
    -> a text file through preprocess_data.py into the run's tokens, each document ended by the
    tokenizer config's end-of-text -> train on (2, 2, 2) -> generate from text -> evaluate ->
    export, whose tokenizer files are the input's and whose weights import and export again
    unchanged. The other fixtures: the default corpus by a Llama tokenizer's `</s>` in
    test_a_dataset_of_another_tokenizer_..., their training on meshes in
    test_imported_llama_... and test_an_imported_mixture_..., their generation in
    test_import_needs_no_dataset_..., their run directories' export in
    test_run_directory_export_then_import_is_identity."""
    import json

    from jaxmeg.data import TokenFile

    name = "gpt2"
    hf_dir, run = tiny_tokenizer_dir(name, tmp_path), tmp_path / "run"
    small = [
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--set",
        "data.default_corpus_bytes=100000",
        "--set",
        "data.eval_fraction=0.05",
    ]
    run_script("convert_hf", "import", "--from", str(hf_dir), "--run", str(run), *small,
               "--set", "model.seq_len=16", "--set", "train.global_batch=4")  # fmt: skip
    assert C.load(run / "config.yaml").data.tokenizer == str((run / "tokenizer.json").absolute())
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    prefix = tmp_path / "data" / "tokens"
    run_script("preprocess_data", "--input", str(text), "--output-prefix", str(prefix),
               "--tokenizer", str(run), "--no-progress")  # fmt: skip
    data, eot = ["--set", f"data.dataset={prefix}"], 0
    mesh = ["--set", "parallel.data=2", "--set", "parallel.pipe=2", "--set", "parallel.tensor=2"]
    run_script("train", "--out", str(run), "--cpu-devices", "8", *mesh, "--steps", "2",
               *data, "--no-progress")  # fmt: skip
    prefix = batches.dataset_prefix(C.load(run / "config.yaml", [data[1]]), show_progress=False)
    tokens = TokenFile.open(prefix)
    assert tokens.meta["eot"] == eot and tokens.vocab_size == 256
    out = run_script("generate", "--out", str(run), "--prompt", "the quick", "--max-new-tokens",
                     "4")  # fmt: skip
    *text_lines, ids = out.strip().splitlines()
    # the decoded prompt and continuation (which may hold a newline), then the new ids
    assert "\n".join(text_lines).strip().startswith("the quick"), text_lines
    assert len(json.loads(ids)["ids"]) == 4
    loss = json.loads(run_script("evaluate", "--out", str(run), "--batches", "1").splitlines()[-1])
    assert np.isfinite(loss["loss"]) and loss["step"] == 2
    exported, again = tmp_path / "exported", tmp_path / "again"
    run_script("convert_hf", "export", "--run", str(run), "--to", str(exported))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / file).read_bytes() == (hf_dir / file).read_bytes(), file
    assert convert_hf.main(["import", "--from", str(exported), "--run", str(tmp_path / "r2")]) == 0
    assert convert_hf.main(["export", "--run", str(tmp_path / "r2"), "--to", str(again)]) == 0
    assert_trees_equal(hf.read_checkpoint(again)[1], hf.read_checkpoint(exported)[1])
    _, original = hf.read_checkpoint(hf_dir)
    assert {k: v.shape for k, v in hf.read_checkpoint(exported)[1].items()} == {
        k: (16, *v.shape[1:]) if k == "transformer.wpe.weight" else v.shape
        for k, v in original.items()
    }


def test_a_dataset_of_another_tokenizer_is_refused_and_the_default_corpus_is_per_tokenizer(
    tmp_path,
):
    """A run whose data.tokenizer did not make its token file is refused by name; the default
    corpus is tokenized by the run's own tokenizer, cached once per tokenizer."""
    from jaxmeg.data import TokenFile, prepare_dataset

    gpt2, llama = tiny_tokenizer_dir("gpt2", tmp_path), tiny_tokenizer_dir("llama_gqa", tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    prefix = tmp_path / "data" / "tokens"
    prepare_dataset([text], prefix, gpt2 / "tokenizer.json", show_progress=False)

    def cfg(tokenizer: Path, dataset: str) -> C.Config:
        return C.Config(data=C.DataConfig(
            dataset=dataset, tokenizer=str(tokenizer / "tokenizer.json"),
            cache_dir=str(tmp_path / "cache"), default_corpus_bytes=50_000,
        ))  # fmt: skip

    assert batches.open_dataset(cfg(gpt2, str(prefix)), show_progress=False).num_tokens > 0
    with pytest.raises(ValueError, match=r"was tokenized by .*hf_gpt2/tokenizer.json, not by the "
                       r"run's data.tokenizer '.*hf_llama_gqa/tokenizer.json'"):  # fmt: skip
        batches.open_dataset(cfg(llama, str(prefix)), show_progress=False)
    default = {t: batches.dataset_prefix(cfg(t, "default"), False) for t in (gpt2, llama)}
    assert default[gpt2] != default[llama]
    assert batches.dataset_prefix(cfg(gpt2, ""), False) == default[gpt2]  # cached
    assert TokenFile.open(default[llama]).meta["eot"] == 2
    with pytest.raises(ValueError, match=r"was tokenized by"):
        batches.open_dataset(cfg(llama, default[gpt2]), show_progress=False)
    none = dataclasses.replace(cfg(gpt2, ""), data=C.DataConfig(tokenizer="none"))
    with pytest.raises(ValueError, match="data.tokenizer: none"):
        batches.dataset_prefix(none, False)


@pytest.mark.parametrize("name", MODELS)
def test_import_needs_no_dataset_and_keeps_a_model_without_tokenizer_ids_only(
    name, tmp_path, capsys
):
    """A vocabulary of 256 imports without any dataset; with no tokenizer.json the run says
    `data.tokenizer: none`, --prompt is refused by name and --prompt-ids generates from the
    imported model (grouped-query attention and the mixtures of experts included)."""
    import json

    run = tmp_path / "run"
    assert convert_hf.main(["import", "--hf", str(FIXTURES / name), "--out", str(run)]) == 0
    cfg = C.load(run / "config.yaml")
    assert cfg.data.tokenizer == "none" and cfg.model.vocab_size == 256
    generate = load_script("generate")
    args = generate.parse_args(["--out", str(run), "--prompt", "hi", "--max-new-tokens", "2"])
    with pytest.raises(ValueError, match="has no tokenizer to encode --prompt"):
        generate.run(args)
    args = generate.parse_args(["--out", str(run), "--prompt-ids", "1,2,3", "--max-new-tokens",
                                "2"])  # fmt: skip
    new = generate.run(args)
    assert len(new) == 2 and all(0 <= i < 256 for i in new), new
    # no text to decode: the ids are all it prints after the import's own line
    assert capsys.readouterr().out.strip().splitlines()[-1] == json.dumps({"ids": new})


def test_an_imported_run_names_its_tokenizer_relative_to_it_and_can_move(tmp_path):
    """The import's config.yaml names the copied tokenizer as `tokenizer.json` (it stored an
    absolute, unnormalised path, so the run could not move): read beside the config file,
    it is the moved run's own."""
    import shutil

    import yaml

    from jaxmeg.training.generation import tokenizer_path

    hf_dir, run = tiny_tokenizer_dir("gpt2", tmp_path), tmp_path / "run"
    run_script("convert_hf", "import", "--from", str(hf_dir), "--run", str(run),
               "--set", "model.seq_len=16", "--set", "train.global_batch=4")  # fmt: skip
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["tokenizer"] == (
        "tokenizer.json"
    )
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(run, moved)
    cfg = C.load(moved / "config.yaml")
    assert cfg.data.tokenizer == str((moved / "tokenizer.json").absolute())
    assert tokenizer_path(cfg) == moved / "tokenizer.json"
