"""What the scripts used to accept where train.py refuses, or refused blaming the wrong thing:
each now one `error:` (or `config error:`) line naming the flag or field, before compiling."""

from __future__ import annotations

import pytest

from jaxmeg import config as C
from tests.test_cli_errors import assert_clean_error, script_cli
from tests.test_train_cli import ROOT

pytestmark = pytest.mark.timeout(120)


PLAN = ["--config", "configs/gpt_1.3b.yaml", "--gpus", "8", "--batch", "64"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tensor", "3"], "--tensor 3: model.heads (16) must be divisible by parallel.tensor"),
        (["--schedule", "zb_h1", "--pipe", "1"], "--pipe: zb_h1 needs --pipe >= 2, got 1"),
        (["--schedule", "zbv", "--chunks", "3"], "--chunks: zbv runs 2 chunks per stage"),
        (["--context", "16"], "--context 16 needs at least 16 GPUs, got --gpus 8"),
        (["--top", "0"], "--top must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_plan_refuses_what_train_refuses(args, message):
    result = script_cli("plan", *PLAN, *args)
    assert_clean_error(result, f"error: {message}")
    assert "80 GB" not in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cpu-devices", "0"], "--cpu-devices must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_bench_refuses_counts_before_compiling(args, message):
    result = script_cli("bench", "--config", "configs/gpt_tiny.yaml", *args)
    assert_clean_error(result, f"error: {message}")
    assert "median" not in result.stderr


def test_a_key_given_twice_in_a_yaml_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden: 128\n  layers: 4\n  hidden: 256\n")
    with pytest.raises(C.ConfigError, match=r"line 4.*'hidden' is given twice \(lines 2 and 4\)"):
        C.load(path)


def test_a_section_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel: 4\n")
    with pytest.raises(C.ConfigError, match="config section 'parallel' must be a mapping"):
        C.load(path)


@pytest.mark.parametrize(
    "text,message",
    [("a: [\n", "at line 2"), ("5\n", "must be a mapping of keys, got int"),
     ("name: x\n", "missing 10 required keyword-only arguments: .gpus_per_node")],
)  # fmt: skip
def test_a_garbage_hardware_file_is_one_line(text, message, tmp_path):
    from jaxmeg.perf.hardware import load_hardware

    path = tmp_path / "hw.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_hardware(str(path))


def test_generation_refuses_a_context_mesh():
    from jaxmeg.training.generation import check_request
    from tests.helpers import tiny_config, trainable_for

    trainable = trainable_for(tiny_config(context=2))
    with pytest.raises(
        ValueError, match="parallel.context must be 1, got data=1, pipe=1, context=2"
    ):
        check_request(trainable, prompt_len=1, max_new_tokens=1)


def test_import_refuses_a_missing_or_too_large_tokenizer(tmp_path):
    import shutil

    from jaxmeg.data import train_bpe_tokenizer

    model = tmp_path / "model"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "gpt2", model)
    missing = tmp_path / "nope.json"
    result = script_cli("convert_hf", "import", "--from", str(model), "--run",
                        str(tmp_path / "a"), "--set", f"data.tokenizer={missing}")  # fmt: skip
    assert_clean_error(result, f"config error: data.tokenizer {missing} does not exist")
    texts = [f"word{i} other{i * 7} thing{i * 13}" for i in range(400)]
    train_bpe_tokenizer(texts, 400, model / "tokenizer.json", show_progress=False)
    result = script_cli("convert_hf", "import", "--from", str(model), "--run", str(tmp_path / "b"))
    assert_clean_error(result, "token ids, more than the model's vocabulary of 256")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cudnn_attention_on_cpu_devices_is_a_config_error():
    from jaxmeg.training.trainer import Trainer
    from tests.helpers import replace_model, tiny_config

    cfg = replace_model(tiny_config(data=2, tensor=4), attention="cudnn")
    with pytest.raises(C.ConfigError, match="model.attention=cudnn .* needs a GPU; these devices"):
        Trainer(cfg)


def test_resuming_on_another_dataset_names_the_dataset_not_the_vocabulary(tmp_path):
    import dataclasses

    from jaxmeg.training.checkpoint_meta import IncompatibleCheckpoint, check_compatible
    from tests.helpers import replace_model, tiny_config

    def on(dataset: str, vocab: int) -> C.Config:
        cfg = replace_model(tiny_config(), vocab_size=vocab)
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset=dataset))

    meta = {"config": C.to_dict(on("data/a", 300))}
    with pytest.raises(
        IncompatibleCheckpoint,
        match="trained on data.dataset data/a, this run "
        "reads data/b, whose vocabulary differs .model.vocab_size 300 there, 500",
    ):
        check_compatible(meta, on("data/b", 500), tmp_path)
    with pytest.raises(IncompatibleCheckpoint, match="model.vocab_size is 300 there, 500 here"):
        check_compatible(meta, on("data/a", 500), tmp_path)  # the same data: the field itself


def test_plot_schedule_names_an_unusable_out(tmp_path):
    args = ["--schedule", "1f1b", "--stages", "2", "--microbatches", "4"]
    missing = tmp_path / "no-such-dir" / "s.png"
    result = script_cli("plot_schedule", *args, "--out", str(missing))
    assert_clean_error(result, f"error: --out {missing}: directory {missing.parent} does not exist")
    result = script_cli("plot_schedule", *args, "--out", str(tmp_path))
    assert_clean_error(result, f"error: --out {tmp_path} is a directory")


def test_plot_schedule_refuses_a_zero_bubble_schedule_on_one_stage(tmp_path):
    """zb_h1 on one stage was drawn (training refuses it): `schedules.check`, the one home of
    the rule, refuses it in the script's own flags."""
    out = tmp_path / "s.png"
    result = script_cli("plot_schedule", "--schedule", "zb_h1", "--stages", "1",
                        "--microbatches", "4", "--out", str(out))  # fmt: skip
    assert_clean_error(result, "error: zb_h1 needs --stages >= 2, got 1")
    assert not out.exists()


def test_a_checkpoint_of_another_tree_is_refused_by_name_and_left_in_place(tmp_path):
    """Arrays of another tree (here a delayed-FP8 run's amax histories, under a meta that
    claims this run's config, as a checkpoint from other code would) are an incompatible
    checkpoint, named, not an unreadable one moved aside."""
    import jax

    from jaxmeg.training.checkpoint import Checkpointer
    from jaxmeg.training.checkpoint_meta import IncompatibleCheckpoint
    from jaxmeg.training.state import init_state
    from tests.helpers import replace_model, tiny_config, trainable_for

    source = trainable_for(replace_model(tiny_config(), fp8="delayed", fp8_history=2))
    target = trainable_for(tiny_config())
    with jax.set_mesh(source.mesh):
        state = init_state(source, seed=0)
    writer = Checkpointer(tmp_path, source)
    writer.save(1, state, {"config": C.to_dict(target.cfg)}, wait=True)
    writer.close()
    reader = Checkpointer(tmp_path, target)
    try:
        with pytest.raises(IncompatibleCheckpoint, match="another tree of arrays .*amax_history"):
            reader.restore_latest()
    finally:
        reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
