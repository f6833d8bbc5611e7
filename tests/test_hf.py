"""Hugging Face checkpoints: the converted models give transformers' logits, export then import
is the identity, a run imported by scripts/convert_hf.py trains on any mesh with one device's loss
and gradients; grouped-query attention, rope_theta and ffn_hidden in the config and the rules
(with tokenizers: tests/test_hf_tokenizers.py).

The fixtures (tests/fixtures/hf/, scripts/make_hf_fixtures.py) hold tiny random transformers
models and their logits; nothing here imports torch or transformers."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxmeg import config as C
from jaxmeg.models import GPT, hf
from jaxmeg.training.checkpoint import Checkpointer
from jaxmeg.training.state import state_specs, to_canonical_layout
from jaxmeg.training.step import make_loss_and_grads
from tests.helpers import put_batch, random_batch, trainable_for, without_bound_counts

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
MODELS = ["gpt2", "llama_gqa", "mixtral", "qwen2_moe", "qwen2_moe_dense", "qwen2_moe_every2",
          "qwen2_moe_pattern"]  # fmt: skip
LOGITS_TOL = 1e-4
GRADS_TOL = 1e-5  # as tests/test_tensor_parallel.py at the initial params


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_hf = load_script("convert_hf")


def fixture(name: str):
    """(ModelConfig, canonical params, HF tensors, reference.npz, MoeConfig) of a fixture."""
    hf_config, tensors = hf.read_checkpoint(FIXTURES / name)
    model, moe = hf.model_config(hf_config), hf.moe_config(hf_config)
    params = hf.from_hf(tensors, model, moe)
    return model, params, tensors, np.load(FIXTURES / name / "reference.npz"), moe


def assert_trees_equal(got, want) -> None:
    flat_want = jax.tree_util.tree_leaves_with_path(want)
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name):
    model, params, _, reference, moe = fixture(name)
    logits = GPT(model, model.vocab_size, moe=moe).apply(
        {"params": params}, jnp.asarray(reference["input_ids"])
    )
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], atol=LOGITS_TOL, rtol=0)


def test_qwen2_moe_layers_anywhere_read_as_first_dense_and_every_or_a_pattern():
    """Qwen2-MoE's mlp_only_layers and decoder_sparse_step: as `moe.first_dense` and
    `moe.every` where they say it (the layer stack's params do not change), else as
    `moe.pattern`, whose stack unit may start with its MoE layer or be all the layers."""
    qwen, _ = hf.read_checkpoint(FIXTURES / "qwen2_moe")
    layers = {"decoder_sparse_step": 2, "mlp_only_layers": [0, 1], "num_hidden_layers": 6}
    moe = hf.moe_config({**qwen, **layers})  # dense, dense, dense, MoE, dense, MoE
    assert (moe.first_dense, moe.every, moe.pattern) == (2, 2, ())
    moe = fixture("qwen2_moe_pattern")[4]  # mlp_only_layers 1, 3
    assert moe.pattern == ("moe", "dense", "moe", "dense") and moe.unit == (True, False)
    moe = hf.moe_config({**qwen, "decoder_sparse_step": 4, "num_hidden_layers": 6})
    assert moe.kinds(6) == (False, False, False, True, False, False)
    assert (moe.dense_layers, moe.layers_per_unit) == (0, 6)  # one entry: repeats nothing


def test_llama_fixture_has_gqa_rope_theta_and_ffn():
    model = fixture("llama_gqa")[0]
    assert (model.block, model.heads, model.kv_heads) == ("llama", 4, 2)
    assert (model.rope_theta, model.mlp_hidden, model.tie_embeddings) == (500000.0, 172, False)
    assert model.compute_dtype == "float32" and model.vocab_size == 256
    attn = fixture("llama_gqa")[1]["blocks"]["layers"]["attn"]
    assert attn["w_q"].shape == (2, 64, 4, 16) and attn["w_kv"].shape == (2, 64, 2, 2, 16)


@pytest.mark.parametrize("name", MODELS)
def test_export_then_import_is_identity(name, tmp_path):
    model, params, tensors, _, moe = fixture(name)
    hf.write_checkpoint(tmp_path, model, params, moe)
    hf_config, written = hf.read_checkpoint(tmp_path)
    assert hf.model_config(hf_config) == model and hf.moe_config(hf_config) == moe
    assert_trees_equal(hf.from_hf(written, model, moe), params)
    assert_trees_equal(written, tensors)  # and the fixture's own tensors, exactly


def test_old_names_and_buffers_are_read():
    model, params, tensors, *_ = fixture("gpt2")
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    old["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    old["lm_head.weight"] = tensors["transformer.wte.weight"]  # a tied copy
    assert_trees_equal(hf.from_hf(old, model), params)
    model, params, tensors, *_ = fixture("llama_gqa")
    buffer = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    assert_trees_equal(hf.from_hf({**tensors, **buffer}, model), params)
    with pytest.raises(hf.HFCheckpointError, match="does not use: .'model.layers.2"):
        hf.from_hf({**tensors, "model.layers.2.mlp.up_proj.weight": np.ones(1)}, model)


def test_sharded_checkpoint_reads_as_one(tmp_path):
    import json
    import shutil

    from safetensors.numpy import save_file

    hf_config, tensors = hf.read_checkpoint(FIXTURES / "llama_gqa")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(FIXTURES / "llama_gqa" / "config.json", tmp_path)
    assert_trees_equal(hf.read_checkpoint(tmp_path), (hf_config, tensors))


def token_file(tmp_path: Path) -> str:
    from jaxmeg.data import write_token_file

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 255, 200).tolist() for _ in range(10)]
    write_token_file(tmp_path / "tokens", docs, vocab_size=256, eot=255)
    return str(tmp_path / "tokens")


def import_run(name: str, tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / f"run_{name}"
    sets = [f"data.dataset={token_file(tmp_path)}", "model.seq_len=16", "train.global_batch=4",
            *overrides]  # fmt: skip
    convert_hf.import_checkpoint(FIXTURES / name, run, sets)
    return run


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """`imported(name)`: the fixture `name` imported once per module into a run directory (its
    256 vocabulary rows padded to 288), which the tests read and never change."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            runs[name] = import_run(name, tmp_path_factory.mktemp(name), "model.vocab_multiple=96")
        return runs[name]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_run_directory_export_then_import_is_identity(name, tmp_path, imported):
    run = imported(name)
    cfg = C.load(run / "config.yaml")
    assert cfg.model.seq_len == 16 and cfg.data.dataset.endswith("tokens")
    convert_hf.export_checkpoint(run, tmp_path / "exported")
    _, tensors = hf.read_checkpoint(FIXTURES / name)
    _, exported = hf.read_checkpoint(tmp_path / "exported")
    if name == "gpt2":  # the position table is cut to model.seq_len
        tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:16]
    assert_trees_equal(exported, tensors)


def test_a_run_trained_with_expert_capacity_exports_with_a_warning(tmp_path, capsys):
    """The same tensors (not the run's never-trained `router_kept`), and HF routes every choice."""
    run = import_run("mixtral", tmp_path, "moe.capacity_factor=1.0")
    convert_hf.export_checkpoint(run, tmp_path / "exported")
    assert "moe.capacity_factor=1 " in capsys.readouterr().err
    exported, fixture_tensors = (
        hf.read_checkpoint(d)[1] for d in (tmp_path / "exported", FIXTURES / "mixtral")
    )
    assert_trees_equal(exported, fixture_tensors)


def test_a_delayed_fp8_run_imports_empty_histories_and_exports_only_the_weights(tmp_path):
    """`model.fp8=delayed`: the import adds each linear's amax history and seen bins as zeros
    (an empty history); the export writes the fixture's tensors and none of them."""
    import flax.traverse_util as traverse

    from jaxmeg.models import fp8

    run = import_run("llama_gqa", tmp_path, "model.fp8=delayed")
    cfg = C.load(run / "config.yaml")
    assert cfg.model.fp8 == "delayed"
    trainable = convert_hf._trainable(convert_hf._one_device_config(cfg))
    checkpointer = Checkpointer(run / "checkpoints", trainable)
    try:
        _, state, _ = checkpointer.restore_latest()
    finally:
        checkpointer.close()
    flat = traverse.flatten_dict(state["params"])
    fp8_state = [k for k in flat if k[-1].endswith((fp8.HISTORY, fp8.SEEN))]
    assert len(fp8_state) == 2 * 6  # two leaves of each linear: q, kv, out; in, gate, out
    assert all(not np.asarray(flat[k]).any() for k in fp8_state)
    convert_hf.export_checkpoint(run, tmp_path / "exported")
    exported, fixture_tensors = (
        hf.read_checkpoint(d)[1] for d in (tmp_path / "exported", FIXTURES / "llama_gqa")
    )
    assert_trees_equal(exported, fixture_tensors)


def test_train_py_out_reads_the_run_config(tmp_path, imported):
    train = load_script("train")
    run = imported("llama_gqa")
    cfg = train.load_config(train.parse_args(["--out", str(run)]))
    assert (cfg.model.block, cfg.model.kv_heads, cfg.model.seq_len) == ("llama", 2, 16)
    tiny = train.load_config(train.parse_args(["--out", str(tmp_path / "new")]))
    assert tiny.model == C.load(ROOT / "configs" / "gpt_tiny.yaml").model


def test_import_refuses_architecture_overrides(tmp_path, capsys):
    out = tmp_path / "run"
    code = convert_hf.main(["import", "--hf", str(FIXTURES / "gpt2"), "--out", str(out),
                            "--set", "model.hidden=32"])  # fmt: skip
    assert code == 2
    assert "model.hidden comes from" in capsys.readouterr().err and not out.exists()


def loss_and_grads_from_run(
    run: Path, mesh: tuple[int, int, int], tokens: np.ndarray, **parallel
):  # fmt: skip
    """Loss and canonical fp32 gradients (vocab trimmed) of the imported step-0 params, restored
    from the run directory onto a (data, pipe, tensor) mesh (and `parallel`'s other axes)."""
    data, pipe, tensor = mesh
    cfg = C.load(run / "config.yaml")
    cfg = dataclasses.replace(
        cfg, parallel=C.ParallelConfig(data=data, pipe=pipe, tensor=tensor, **parallel)
    )
    trainable = trainable_for(cfg)
    checkpointer = Checkpointer(run / "checkpoints", trainable)
    step, state, _ = checkpointer.restore_latest()
    checkpointer.close()
    assert step == 0
    with jax.set_mesh(trainable.mesh):
        loss, grads = jax.jit(make_loss_and_grads(trainable))(
            state["params"], *put_batch(trainable, tokens)
        )
    grads = to_canonical_layout(jax.tree.map(np.asarray, grads), trainable.layout)
    return float(loss), convert_hf._padded_to(grads, trainable, pad=False)


def test_imported_llama_on_meshes_equals_one_device(imported):
    """GQA with kv_heads = 2: split over tensor = 2, replicated over tensor = 4; and through
    the pipeline."""
    run = imported("llama_gqa")
    tokens = random_batch(C.load(run / "config.yaml"))
    ref_loss, ref_grads = loss_and_grads_from_run(run, (1, 1, 1), tokens)
    for mesh in [(2, 2, 2), (1, 1, 4)]:  # kv heads split over tensor 2, replicated over 4
        assert_equal_to(loss_and_grads_from_run(run, mesh, tokens), ref_loss, ref_grads, mesh)


def assert_equal_to(loss_and_grads, ref_loss, ref_grads, mesh) -> None:
    loss, grads = loss_and_grads
    grads = without_bound_counts(grads)  # the exchange's statistic: one device runs none
    np.testing.assert_allclose(loss, ref_loss, rtol=GRADS_TOL)
    for (path, got), (_, want) in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree_util.tree_leaves_with_path(ref_grads),
        strict=True,
    ):
        np.testing.assert_allclose(
            got, want, rtol=GRADS_TOL, atol=GRADS_TOL * float(np.abs(want).max()),
            err_msg=f"{jax.tree_util.keystr(path)} on {mesh}",
        )  # fmt: skip


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen2_moe_every2", "qwen2_moe_pattern"])
def test_an_imported_mixture_of_experts_trains_on_expert_2_pipe_2_as_on_one_device(name, imported):
    """The experts split over 2 devices and the layers over 2 stages (4 devices): the imported
    step-0 loss and every gradient, routers and expert weights included, equal one device's."""
    run = imported(name)
    tokens = random_batch(C.load(run / "config.yaml"))
    ref_loss, ref_grads = loss_and_grads_from_run(run, (1, 1, 1), tokens)
    got = loss_and_grads_from_run(run, (1, 2, 1), tokens, expert=2)
    assert_equal_to(got, ref_loss, ref_grads, "expert 2 x pipe 2")


def test_what_mixtral_and_qwen2_moe_cannot_hold_is_refused_before_writing(tmp_path):
    model, params, _, _, moe = fixture("mixtral")
    moved = jax.tree.map(np.copy, params)
    moved["blocks"]["layers"]["moe"]["router_bias"][0, 1] = 0.25
    with pytest.raises(hf.HFCheckpointError, match="the routing bias moved"):
        hf.write_checkpoint(tmp_path / "moved", model, moved, moe)
    sigmoid = dataclasses.replace(moe, router="sigmoid")
    with pytest.raises(hf.HFCheckpointError, match="route by softmax"):
        hf.write_checkpoint(tmp_path / "sigmoid", model, params, sigmoid)
    assert not (tmp_path / "moved").exists() and not (tmp_path / "sigmoid").exists()
    qwen, _ = hf.read_checkpoint(FIXTURES / "qwen2_moe")
    with pytest.raises(hf.HFCheckpointError, match="no layer of 6 has experts"):
        hf.moe_config({**qwen, "decoder_sparse_step": 8, "num_hidden_layers": 6})
    dense_mixtral = dataclasses.replace(moe, first_dense=1)
    model = dataclasses.replace(model, layers=3)
    with pytest.raises(
        hf.HFCheckpointError, match=r"first_dense = 1, moe.every = 1, moe.pattern = \[\]: Mixtral"
    ):
        hf.write_checkpoint(tmp_path / "dense", model, params, dense_mixtral)


GQA = C.ModelConfig(
    block="llama", vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, seq_len=16,
    compute_dtype="float32",
)  # fmt: skip


def gqa_config(tensor: int, **model) -> C.Config:
    return C.Config(
        model=dataclasses.replace(GQA, **model),
        parallel=C.ParallelConfig(tensor=tensor),
        train=C.TrainConfig(global_batch=4),
    )


@pytest.mark.parametrize("tensor,kv_spec", [(2, "tensor"), (4, None)])
def test_kv_heads_split_over_tensor_only_where_it_divides_them(tensor, kv_spec):
    cfg = C.validate(gqa_config(tensor), tensor)
    assert cfg.parallel.param_rules == ({} if kv_spec else {"kv_heads": None})
    specs = state_specs(trainable_for(gqa_config(tensor)))["params"]["blocks"]["layers"]["attn"]
    # run layout [chunks, pipe, layers, ...], then w_kv [D, 2, K, H] and w_q [D, N, H]
    assert specs["w_kv"] == P(None, "pipe", None, None, None, kv_spec, None)
    assert specs["w_q"] == P(None, "pipe", None, None, "tensor", None)


def test_multi_head_keeps_the_fused_qkv_and_resolves_sentinels():
    cfg = C.validate(gqa_config(1, kv_heads=-1), 1)
    assert (cfg.model.kv_heads, cfg.model.ffn_hidden) == (4, 256)
    attn = state_specs(trainable_for(gqa_config(1, kv_heads=-1)))["params"]["blocks"]["layers"]
    assert set(attn["attn"]) == {"w_qkv", "w_out"}


KV_HEADS_ERROR = "model.kv_heads must be -1 (= heads) or a divisor of model.heads (4), got"


@pytest.mark.parametrize(
    "model,message",
    [
        (dict(kv_heads=3), f"{KV_HEADS_ERROR} 3"),
        (dict(kv_heads=0), f"{KV_HEADS_ERROR} 0"),
        (dict(ffn_hidden=0), "model.ffn_hidden must be -1 (= mlp_ratio x hidden) or >= 1, got 0"),
        (dict(ffn_hidden=171), "(model.ffn_hidden or model.mlp_ratio x model.hidden = 171) must "
                               "be divisible by parallel.tensor (2)"),
        (dict(rope_theta=0.0), "model.rope_theta must be > 0, got 0.0"),
    ],
)  # fmt: skip
def test_model_validation_errors_name_field_and_numbers(model, message):
    with pytest.raises(C.ConfigError) as err:
        C.validate(gqa_config(2, **model), 2)
    assert message in str(err.value)


def test_unsupported_hf_configs_are_refused():
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 10}  # fmt: skip
    assert hf.model_config(llama).rope_theta == 10000.0
    scaled = {**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(hf.HFCheckpointError, match="rope type 'llama3'"):
        hf.model_config(scaled)
    with pytest.raises(hf.HFCheckpointError, match="only"):
        hf.model_config({**llama, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(hf.HFCheckpointError, match="GPT-2 has no grouped-query attention"):
        hf.hf_config(dataclasses.replace(GQA, block="gpt"))
