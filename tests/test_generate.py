"""Generation with a key/value cache and held-out evaluation.

Greedy ids with the cache equal those of recomputing the full forward at every step, and on a
(1, 1, 4) tensor mesh those of one device (GPT, Llama with grouped-query attention, and a Llama
mixture of experts with a dense leading layer and MoE every other layer); seeded sampling
repeats and never yields a padding id; the eval loss on a (2, 2, 2) pipelined mesh equals one
device's; a trained run records eval_loss at train.eval_every steps, and scripts/generate.py and
scripts/evaluate.py read its run directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sysconfig
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmeg import config as C
from jaxmeg.data import BatchLoader, TokenFile, train_bpe_tokenizer, write_token_file
from jaxmeg.models import cross_entropy
from jaxmeg.parallel import make_mesh
from jaxmeg.training import evaluation, generation
from jaxmeg.training.state import (
    Trainable,
    state_shardings,
    to_canonical_layout,
    to_stage_layout,
    vocab_dims,
)
from tests.helpers import put_batch, random_batch, tiny_config, trainable_for

VOCAB = 100
PROMPTS = np.array([[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]], np.int32)
NEW_TOKENS = 20
BLOCKS = {
    "gpt": {},
    "llama_gqa": {"block": "llama", "kv_heads": 2, "tie_embeddings": False},
    # a dense leading layer, then two groups of a dense and an MoE layer: the cache splits
    # between the two stacks, and the groups' part into their layers
    "llama_moe_first_dense_every2": {"block": "llama", "tie_embeddings": False, "layers": 5},
}
MOE = {
    "llama_moe_first_dense_every2": C.MoeConfig(
        experts=4, top_k=2, ffn_hidden=16, first_dense=1, every=2
    )
}


def tiny_trainable(block: str, tensor: int = 1) -> Trainable:
    # init_std 0.3 (not 0.02): a random tiny GPT at 0.02 repeats one token, which would hide
    # a wrong position or cache entry.
    fields = {"layers": 2, **BLOCKS[block]}
    model = C.ModelConfig(vocab_size=VOCAB, hidden=32, heads=4, seq_len=32,
                          compute_dtype="float32", init_std=0.3, **fields)  # fmt: skip
    cfg = C.Config(model=model, parallel=C.ParallelConfig(tensor=tensor),
                   train=C.TrainConfig(global_batch=8),
                   moe=MOE.get(block, C.MoeConfig()))  # fmt: skip
    cfg = C.validate(cfg, tensor)
    return Trainable.create(cfg, make_mesh(cfg.parallel, jax.devices()[:tensor]))


def canonical_params(trainable: Trainable, seed: int = 0):
    """Random params in canonical layout, vocabulary dims trimmed to the vocabulary."""
    tokens = np.zeros((1, trainable.cfg.model.seq_len), np.int32)
    params = nn.meta.unbox(trainable.model().init(jax.random.key(seed), tokens)["params"])
    trim = lambda x, dim: x if dim < 0 else np.take(x, np.arange(VOCAB), axis=dim)  # noqa: E731
    return jax.tree.map(
        lambda x, d: trim(np.asarray(x), d), params, vocab_dims(trainable)["params"]
    )


def placed(trainable: Trainable, canonical, padding_value: float = 0.0):
    """`canonical` padded to the trainable's table, in its layout and shardings."""

    def pad(x, dim):
        if dim < 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, trainable.vocab - x.shape[dim])
        return np.pad(x, widths, constant_values=padding_value)

    params = jax.tree.map(pad, canonical, vocab_dims(trainable)["params"])
    params = to_stage_layout(params, trainable.layout)
    return jax.device_put(params, state_shardings(trainable)["params"])


@pytest.fixture(scope="module", params=sorted(BLOCKS))
def one_device(request):
    """(block, canonical params, greedy ids with the cache on one device)."""
    trainable = tiny_trainable(request.param)
    params = canonical_params(trainable)
    ids = generation.generate(trainable, placed(trainable, params), PROMPTS, NEW_TOKENS)
    return request.param, params, ids


def test_greedy_with_cache_equals_recomputing_the_full_forward(one_device):
    block, params, ids = one_device
    trainable = tiny_trainable(block)
    recomputed = generation.generate(
        trainable, placed(trainable, params), PROMPTS, NEW_TOKENS, use_cache=False
    )
    assert ids.shape == (2, NEW_TOKENS) and len(set(ids.ravel().tolist())) > 3
    np.testing.assert_array_equal(ids, recomputed)


def test_greedy_on_a_tensor_mesh_equals_one_device(one_device):
    block, params, ids = one_device
    trainable = tiny_trainable(block, tensor=4)  # llama_gqa: 2 kv heads, replicated over 4
    sharded = generation.generate(trainable, placed(trainable, params), PROMPTS, NEW_TOKENS)
    np.testing.assert_array_equal(sharded, ids)


def test_sampling_is_seeded_and_never_yields_a_padding_id():
    logits = jnp.concatenate([jnp.zeros((64, VOCAB)), jnp.full((64, 28), 1e4)], axis=1)
    for temperature, top_k in ((1.0, 0), (2.0, 5)):
        drawn = generation.sample(logits, jax.random.key(0), temperature, top_k, VOCAB)
        assert int(drawn.max()) < VOCAB and len(set(drawn.tolist())) > 1
    trainable = tiny_trainable("gpt")
    # Padding rows that would win every draw if they were not cut off.
    params = placed(trainable, canonical_params(trainable), padding_value=5.0)
    runs = [
        generation.generate(
            trainable, params, PROMPTS, NEW_TOKENS, temperature=1.0, top_k=20, seed=seed
        )  # fmt: skip
        for seed in (1, 1, 2)
    ]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])
    assert max(int(r.max()) for r in runs) < VOCAB


def test_requests_that_cannot_run_are_named():
    trainable = tiny_trainable("gpt")
    with pytest.raises(ValueError, match=r"\(30 tokens\) \+ max_new_tokens \(3\) = 33 tokens "
                                         r"exceed model.seq_len \(32\)"):  # fmt: skip
        generation.check_request(trainable, 30, 3)
    with pytest.raises(ValueError, match="prompt is empty"):
        generation.check_request(trainable, 0, 3)
    with pytest.raises(ValueError, match=r"prompt id 100 is outside the vocabulary \[0, 100\)"):
        generation.generate(trainable, None, [1, 100], 2)


def test_eval_loss_on_a_pipelined_mesh_equals_one_device():
    one, mesh = trainable_for(tiny_config()), trainable_for(tiny_config(2, 2, 2))
    tokens = random_batch(one.cfg)
    with jax.set_mesh(one.mesh):
        canonical = one.model().init(jax.random.key(1), tokens[:1, :-1])["params"]
        canonical = jax.device_get(nn.meta.unbox(canonical))
        params = to_stage_layout(canonical, one.layout)
        loss = evaluation.make_eval_loss(one)(params, *put_batch(one, tokens))
        plain = cross_entropy(
            one.model().apply({"params": canonical}, tokens[:, :-1]), tokens[:, 1:], 500
        )
    np.testing.assert_allclose(float(loss), float(plain), rtol=1e-6)
    assert one.vocab == mesh.vocab  # 500 pads to 512 on tensor 1 and 2
    staged = jax.device_put(
        to_stage_layout(canonical, mesh.layout), state_shardings(mesh)["params"]
    )
    with jax.set_mesh(mesh.mesh):
        pipelined = evaluation.make_eval_loss(mesh)(staged, *put_batch(mesh, tokens))
    np.testing.assert_allclose(float(pipelined), float(loss), rtol=1e-5)
    back = to_canonical_layout(jax.device_get(staged), mesh.layout)
    assert jax.tree.structure(back) == jax.tree.structure(canonical)


def test_held_out_samples_are_the_last_and_never_trained_on(tmp_path):
    write_token_file(tmp_path / "t", [list(range(1, 200))] * 9, vocab_size=200, eot=0)
    token_file = TokenFile.open(tmp_path / "t")
    loader = BatchLoader(token_file, 16, 4, seed=0, eval_fraction=0.25)
    assert (loader.num_samples, loader.eval_samples) == (112, 28)
    trained = np.concatenate([loader.global_sample_ids(k) for k in range(2 * 84 // 4)])
    assert set(trained.tolist()) == set(range(84))  # two epochs over the first 84 only
    held = loader.held_out()
    assert (held.first, held.num_batches) == (84, 7)
    inputs, targets = held.rows(1, 1, 3)
    np.testing.assert_array_equal(inputs[0], token_file.tokens[89 * 16 : 90 * 16])
    np.testing.assert_array_equal(targets[1], token_file.tokens[90 * 16 + 1 : 91 * 16 + 1])
    assert BatchLoader(token_file, 16, 4, seed=0).train_samples == 112  # default: none held out
    state = {**loader.state(), "step": 3}
    with pytest.raises(ValueError, match="held out 28 samples, data.eval_fraction holds out 11"):
        BatchLoader(token_file, 16, 4, seed=0, eval_fraction=0.1).restore(state)
    with pytest.raises(C.ConfigError, match=r"data.eval_fraction must be in \[0, 0.5\)"):
        C.validate(dataclasses.replace(tiny_config(), data=C.DataConfig(eval_fraction=0.5)), 1)
    every = dataclasses.replace(tiny_config().train, eval_every=10)
    with pytest.raises(C.ConfigError, match="train.eval_every = 10 .* data.eval_fraction is 0"):
        C.validate(dataclasses.replace(tiny_config(), train=every), 1)


# -- a trained run directory ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """2 steps of a tiny GPT on 8 data-parallel devices, 10% of its data held out and evaluated
    at step 2, on a small local corpus with its own BPE: (run directory, metrics records)."""
    from jaxmeg.training import Trainer

    root = tmp_path_factory.mktemp("generate")
    texts = [p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("json/*.py"))]
    tokenizer_json = root / "tokenizer.json"
    tokenizer = train_bpe_tokenizer(texts, 300, tokenizer_json)
    write_token_file(root / "tokens", (tokenizer.encode(t).ids for t in texts),
                     tokenizer.get_vocab_size(), eot=tokenizer.token_to_id("<|endoftext|>"),
                     meta={"tokenizer": str(tokenizer_json)})  # fmt: skip
    cfg = C.Config(
        model=C.ModelConfig(hidden=32, layers=2, heads=4, seq_len=32, compute_dtype="float32"),
        parallel=C.ParallelConfig(data=8),
        train=C.TrainConfig(global_batch=8, steps=2, eval_every=2, eval_batches=2),
        data=C.DataConfig(dataset=str(root / "tokens"), eval_fraction=0.1),
        optimizer=C.OptimizerConfig(warmup_steps=1),
    )
    out = root / "run"
    Trainer(cfg, out_dir=str(out), show_progress=False).run()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, records, tokenizer


def test_trainer_records_held_out_loss_every_eval_every_steps(run_dir):
    _, records, _ = run_dir
    assert [r["step"] for r in records] == [1, 2]
    assert "eval_loss" not in records[0]
    loss, perplexity = records[1]["eval_loss"], records[1]["eval_perplexity"]
    assert np.isfinite(loss) and perplexity == pytest.approx(math.exp(loss))


def test_generate_cli_prints_text_then_the_new_ids(run_dir, capsys):
    from scripts import generate

    out, _, tokenizer = run_dir
    args = ["--out", str(out), "--max-new-tokens", "6"]
    assert generate.main([*args, "--prompt", "def load(", "--set", "parallel.tensor=2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    ids = json.loads(lines[-1])["ids"]
    assert len(ids) == 6 and max(ids) < tokenizer.get_vocab_size()
    assert lines[0].startswith("def load(")
    prompt = ",".join(map(str, tokenizer.encode("def load(").ids))
    assert generate.main([*args, "--prompt-ids", prompt]) == 0  # one device: the same ids
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"] == ids
    assert generate.main([*args, "--prompt-ids", "1,2", "--max-new-tokens", "40"]) == 2
    assert "exceed model.seq_len (32)" in capsys.readouterr().err


def test_evaluate_cli_prints_the_held_out_loss(run_dir, capsys):
    from scripts import evaluate

    out, records, _ = run_dir
    assert evaluate.main(["--out", str(out), "--batches", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["batches"] == 2 and report["step"] == 2 and np.isfinite(report["loss"])
    assert report["perplexity"] == pytest.approx(math.exp(report["loss"]), rel=1e-12)
    # the trainer's evaluation of the same step and batches, there on 8 data-parallel devices
    assert report["loss"] == pytest.approx(records[1]["eval_loss"], rel=1e-5)
