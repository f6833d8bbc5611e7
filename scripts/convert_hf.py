"""Hugging Face checkpoints (GPT2LMHeadModel, LlamaForCausalLM) to and from jaxmeg run directories.

python scripts/convert_hf.py import --from DIR --run RUN_DIR [--set section.key=value ...]
python scripts/train.py --out RUN_DIR [--set parallel.tensor=2 ...]   # continues, any mesh
python scripts/convert_hf.py export --run RUN_DIR --to DIR
(--hf and --out are the older names of --from / --to and --run.)

import writes RUN_DIR/config.yaml (the model from DIR/config.json in float32, the rest defaults
and --set) and a step-0 checkpoint (the weights, fresh AdamW state) in RUN_DIR/checkpoints, which
train.py resumes from on any mesh. Import reads no dataset (any vocabulary imports): the first
train.py run draws the first batch, so data.* may be set here or there, e.g. --set
data.dataset=PREFIX for a token file made with the model's tokenizer
(scripts/preprocess_data.py --tokenizer DIR/tokenizer.json); --set model.seq_len=N trains on
shorter sequences. DIR's tokenizer files (tokenizer.json and its config) are copied into
RUN_DIR and `data.tokenizer` names the copy (`none` when DIR has no tokenizer.json), so
generate.py --prompt encodes with the model's own tokenizer.

export writes DIR/config.json and DIR/model.safetensors (float32) of
RUN_DIR's newest checkpoint, with the config it was saved with (any jaxmeg run, imported or
not), and the run's tokenizer (tokenizer.json and a tokenizer config), for transformers'
AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxmeg.cli import add_overrides, run_reporting_errors  # noqa: E402
from jaxmeg.config import RUN_CONFIG  # noqa: E402


def _one_device_config(cfg):
    """`cfg` validated for one device: the canonical checkpoint is the same on every mesh."""
    from jaxmeg import config as C

    single = dataclasses.replace(
        cfg,
        parallel=C.ParallelConfig(),
        compression=C.CompressionConfig(),
        train=dataclasses.replace(cfg.train, microbatch_size=-1, microbatches=-1),
    )
    return C.validate(single, 1)


def _trainable(cfg):
    """The one-device Trainable of `cfg`, on the host: a whole model with its AdamW state may
    not fit one accelerator."""
    import jax

    from jaxmeg.parallel import make_mesh
    from jaxmeg.training.state import Trainable

    try:
        devices = jax.devices("cpu")[:1]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        devices = jax.devices()[:1]
    return Trainable.create(cfg, make_mesh(cfg.parallel, devices))


def _padded_to(params, trainable, pad: bool):
    """Canonical params with their vocabulary dims zero-padded to the table (`pad`) or trimmed
    to model.vocab_size."""
    import jax
    import numpy as np

    from jaxmeg.training.state import NO_VOCAB_DIM, vocab_dims

    def fit(x, dim):
        x = np.asarray(x)
        if dim == NO_VOCAB_DIM:
            return x
        if not pad:
            return np.take(x, np.arange(trainable.cfg.model.vocab_size), axis=dim)
        widths = [(0, 0)] * x.ndim
        widths[dim] = (0, trainable.vocab - x.shape[dim])
        return np.pad(x, widths)

    return jax.tree.map(fit, params, vocab_dims(trainable)["params"])


def _with_empty_fp8_state(params, trainable):
    """The imported params with `model.fp8: delayed`'s leaves that Hugging Face checkpoints do
    not hold (each linear's amax history and seen bins, `jaxmeg.models.fp8`) added as zeros:
    an empty history."""
    import flax.traverse_util as traverse
    import jax
    import numpy as np

    from jaxmeg.models import fp8
    from jaxmeg.training.state import abstract_state, to_canonical_layout

    if trainable.cfg.model.fp8 != "delayed":
        return params
    expected = jax.eval_shape(
        lambda p: to_canonical_layout(p, trainable.layout), abstract_state(trainable)["params"]
    )
    flat = traverse.flatten_dict(params)
    for key, shape in traverse.flatten_dict(expected).items():
        if key[-1].endswith((fp8.HISTORY, fp8.SEEN)) and key not in flat:
            flat[key] = np.zeros(shape.shape, np.float32)
    return traverse.unflatten_dict(flat)


def _check_shapes(params, trainable) -> None:
    import jax

    from jaxmeg.models.hf import HFCheckpointError
    from jaxmeg.training.state import abstract_state, to_canonical_layout

    expected = jax.eval_shape(
        lambda p: to_canonical_layout(p, trainable.layout), abstract_state(trainable)["params"]
    )
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    if [p for p, _ in got] != [p for p, _ in want]:
        raise HFCheckpointError(
            f"parameter tree {[jax.tree_util.keystr(p) for p, _ in got]} is not the model's "
            f"{[jax.tree_util.keystr(p) for p, _ in want]}"
        )
    for (path, x), (_, s) in zip(got, want, strict=True):
        if tuple(x.shape) != tuple(s.shape):
            raise HFCheckpointError(
                f"{jax.tree_util.keystr(path)}: the checkpoint gives shape {tuple(x.shape)}, "
                f"the model has {tuple(s.shape)}"
            )


def import_checkpoint(
    hf_dir: str | Path, run_dir: str | Path, overrides: Sequence[str] = ()
) -> Path:
    """Writes RUN_DIR/config.yaml and a step-0 checkpoint from a Hugging Face checkpoint;
    returns the config path."""
    import jax
    import yaml

    from jaxmeg import config as C
    from jaxmeg import paths
    from jaxmeg.models import hf
    from jaxmeg.training.checkpoint import Checkpointer
    from jaxmeg.training.checkpoint_meta import schedule_of
    from jaxmeg.training.state import state_shardings, to_stage_layout

    run_dir = Path(run_dir)
    config_path, checkpoints = run_dir / RUN_CONFIG, run_dir / "checkpoints"
    problem = paths.directory_problem(str(run_dir), "--run")
    if problem:
        raise paths.PathError(problem)
    if config_path.exists() or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        raise ValueError(f"{run_dir} already holds a run; pass a new --out (nothing is changed)")
    hf_config, tensors = hf.read_checkpoint(hf_dir)
    moe = hf.moe_config(hf_config)
    base = C.Config(model=hf.model_config(hf_config), moe=moe)
    cfg = C.apply_overrides(base, list(overrides))
    has_tokenizer = (Path(hf_dir) / "tokenizer.json").is_file()
    own = not cfg.data.tokenizer and has_tokenizer
    if not cfg.data.tokenizer:  # the model's own tokenizer, copied below, or none
        # named relative to the run (beside its config.yaml): the run directory can move
        tokenizer = OWN_TOKENIZER if has_tokenizer else "none"
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    model = hf.model_config(hf_config, cfg.model.seq_len)
    _check_tokenizer(cfg.data.tokenizer, hf_dir, model.vocab_size, own)
    fixed = [
        (f"model.{n}", getattr(model, n), getattr(cfg.model, n)) for n in hf.CONFIG_JSON_FIELDS
    ]
    if moe.experts:
        fixed += [(f"moe.{n}", getattr(moe, n), getattr(cfg.moe, n)) for n in hf.MOE_JSON_FIELDS]
    changed = [(name, theirs, ours) for name, theirs, ours in fixed if theirs != ours]
    if changed:
        name, theirs, ours = changed[0]
        raise C.ConfigError(
            f"{name} comes from {hf_dir}/config.json ({theirs}); --set gives {ours}"
        )
    single = _one_device_config(cfg)
    trainable = _trainable(single)
    params = _with_empty_fp8_state(hf.from_hf(tensors, single.model, single.moe), trainable)
    params = _padded_to(params, trainable, pad=True)
    _check_shapes(params, trainable)
    params = to_stage_layout(params, trainable.layout)

    def fresh_state(params):
        params = jax.tree.map(lambda p: p.astype(single.model.param_dtype), params)
        return {"step": jax.numpy.zeros((), "int32"), "params": params,
                "opt_state": trainable.tx.init(params)}  # fmt: skip

    state = jax.jit(fresh_state, out_shardings=state_shardings(trainable))(params)
    meta = {
        "step": 0,
        "loader": None,  # no batch drawn: train.py starts its loader at the first
        "seed": single.train.seed,
        "schedule": schedule_of(single),
        "skipped_steps": 0,
        "skipped_in_row": 0,
        "mesh": {**trainable.mesh.shape, "chunks": 1},
        "config": C.to_dict(single),
        "imported_from": str(Path(hf_dir).absolute()),
    }
    with _undone_on_error(run_dir, "--run", parts=(checkpoints, config_path)):
        checkpointer = Checkpointer(checkpoints, trainable, single.checkpoint.keep)
        try:
            checkpointer.save(0, state, meta, wait=True)
        finally:
            checkpointer.close()
        hf.copy_tokenizer(hf_dir, run_dir)
        config_path.write_text(yaml.safe_dump(C.to_dict(cfg), sort_keys=False))
    return config_path


OWN_TOKENIZER = "tokenizer.json"
"""An import's `data.tokenizer`: the model's own, copied into the run, named relative to its
config.yaml (`config.load` reads it beside the file)."""


def _check_tokenizer(tokenizer: str, hf_dir, vocab_size: int, own: bool) -> None:
    """Refuses, before anything is written, a data.tokenizer that does not exist or whose ids
    do not fit the model's vocabulary (every id past it would fail at the first batch)."""
    from jaxmeg import config as C
    from jaxmeg.data import load_tokenizer

    if tokenizer == "none":
        return
    path = Path(tokenizer)
    if own:  # the model's own, copied at the end
        path = Path(hf_dir) / "tokenizer.json"
    elif not path.exists():
        raise C.ConfigError(f"data.tokenizer {tokenizer} does not exist")
    size = load_tokenizer(path).get_vocab_size()
    if size > vocab_size:
        raise C.ConfigError(
            f"data.tokenizer {tokenizer} has {size} token ids, more than the model's "
            f"vocabulary of {vocab_size} (vocab_size in {hf_dir}/config.json): its ids past "
            f"{vocab_size - 1} have no embedding; give the model's own tokenizer"
        )


def _saved_config(checkpoints: Path):
    """The config that the newest checkpoint under `checkpoints` was written with (its meta)."""
    from jaxmeg import config as C
    from jaxmeg.training.checkpoint import read_meta

    found = read_meta(checkpoints)
    if found is None:
        raise ValueError(f"{checkpoints} holds no checkpoint to export")
    return C.from_dict(found[1]["config"])


def export_checkpoint(run_dir: str | Path, hf_dir: str | Path, overwrite: bool = False) -> int:
    """Writes HF_DIR/config.json and model.safetensors of RUN_DIR's newest checkpoint (any
    jaxmeg run, imported or not); returns its step."""
    import jax

    from jaxmeg.models import hf
    from jaxmeg.training.checkpoint import Checkpointer
    from jaxmeg.training.state import to_canonical_layout

    checkpoints = Path(run_dir) / "checkpoints"
    if not checkpoints.is_dir():  # checked first: reading would create it
        raise ValueError(f"{run_dir} holds no checkpoints to export ({checkpoints} is missing)")
    if Path(hf_dir).exists() and not Path(hf_dir).is_dir():
        raise ValueError(f"{hf_dir} exists and is not a directory; export writes a directory")
    _check_export_target(Path(run_dir), Path(hf_dir), overwrite)
    cfg = _one_device_config(_saved_config(checkpoints))
    if cfg.moe.experts and cfg.moe.capacity_factor > 0:
        print(capacity_warning(cfg.moe.capacity_factor), file=sys.stderr)
    trainable = _trainable(cfg)
    checkpointer = Checkpointer(checkpoints, trainable, cfg.checkpoint.keep)
    try:
        step, state, _ = checkpointer.restore_latest()
    finally:
        checkpointer.close()
    params = to_canonical_layout(jax.device_get(state["params"]), trainable.layout)
    with _undone_on_error(Path(hf_dir), "--to"):
        params = _padded_to(params, trainable, pad=False)
        hf.write_checkpoint(hf_dir, cfg.model, params, cfg.moe)
        _export_tokenizer(run_dir, cfg, Path(hf_dir))
        marker = {"run": str(Path(run_dir).absolute().resolve()), "step": step}
        (Path(hf_dir) / EXPORT_MARKER).write_text(json.dumps(marker) + "\n")
    return step


def capacity_warning(capacity_factor: float) -> str:
    """What export says of a run that trained with expert capacity limits."""
    return (
        f"warning: this run trained with moe.capacity_factor={capacity_factor:g} (an expert "
        f"drops the choices beyond its capacity); Hugging Face's MoE models route every "
        f"choice, so the exported model's outputs differ from the trained model's wherever "
        f"capacity dropped choices"
    )


EXPORT_MARKER = ".jaxmeg-export.json"
"""Written beside an export's files: the run it came from. Exporting the same run there again
replaces them without --overwrite (jaxmeg wrote them for that run)."""


def _exported_from(hf_dir: Path) -> str | None:
    """The run whose export `hf_dir` holds (its marker), or None."""
    try:
        return json.loads((hf_dir / EXPORT_MARKER).read_text())["run"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_export_target(run_dir: Path, hf_dir: Path, overwrite: bool) -> None:
    """Refuses a target that is the run itself (or inside it), or that holds a model's files
    that export would replace (unless `overwrite`, or they are an export of this same run), or
    that cannot be written."""
    from jaxmeg import paths
    from jaxmeg.models import hf

    target, run = hf_dir.absolute().resolve(), run_dir.absolute().resolve()
    if target == run or run in target.parents:
        raise paths.PathError(
            f"--to {hf_dir} is inside the run directory {run_dir}; give a directory outside it"
        )
    problem = paths.directory_problem(str(hf_dir), "--to")
    if problem:
        raise paths.PathError(problem)
    held = [hf_dir / n for n in (hf.CONFIG_FILE, hf.WEIGHTS_FILE) if (hf_dir / n).exists()]
    if held and not overwrite and _exported_from(hf_dir) != str(run):
        raise paths.PathError(
            f"--to {hf_dir} already holds {held[0]}; pass --overwrite to replace it, or give "
            f"another directory"
        )


@contextlib.contextmanager
def _undone_on_error(directory: Path, flag: str, parts: Sequence[Path] = ()):
    """An OS error while writing `directory` (full, read-only) as one line. What this wrote is
    removed again on any failure: the directory if it created it, else the `parts` it created
    (a half-written import would otherwise be trained from scratch as another model)."""
    import shutil

    from jaxmeg import paths

    created = [p for p in (directory, *parts) if not p.exists()]
    try:
        yield
    except Exception as err:
        for path in created[:1] if directory in created else created:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        # an OS error, or one a library wrapped (safetensors' SafetensorError names the errno)
        problem = paths.os_error(err, directory, flag)
        if problem is None:
            raise
        raise problem from err


def _export_tokenizer(run_dir, saved_cfg, hf_dir: Path) -> None:
    """The run's tokenizer next to the weights: the files an import copied (tokenizer.json and
    its config), or the tokenizer.json of the run's data with a config naming its
    end-of-text token, so that transformers' AutoTokenizer loads the directory."""
    import shutil

    from jaxmeg import config as C
    from jaxmeg.models import hf
    from jaxmeg.training.generation import tokenizer_path

    run_config = Path(run_dir) / RUN_CONFIG
    cfg = C.load(run_config) if run_config.is_file() else saved_cfg
    path = tokenizer_path(cfg)
    if path is None:
        return
    if hf.copy_tokenizer(path.parent, hf_dir) and path.name == "tokenizer.json":
        if (path.parent / "tokenizer_config.json").is_file():
            return
    shutil.copyfile(path, hf_dir / "tokenizer.json")
    hf.with_umask(hf_dir / "tokenizer.json")
    eos = "<|endoftext|>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
              "unk_token": eos, "model_max_length": cfg.model.seq_len}  # fmt: skip
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        name: sub.add_parser(name, help=what)
        for name, what in (("import", "Hugging Face -> run"), ("export", "run -> Hugging Face"))
    }
    # import: --from DIR --run RUN; export: --run RUN --to DIR. --hf and --out (the run, for
    # both) are the same flags' older names.
    where = {"import": ("--from", "Hugging Face checkpoint directory to read"),
             "export": ("--to", "Hugging Face directory to write")}  # fmt: skip
    for name, command in commands.items():
        flag, what = where[name]
        command.add_argument(flag, "--hf", dest="hf", required=True, help=what)
        command.add_argument("--run", "--out", dest="out", required=True,
                             help="jaxmeg run directory")  # fmt: skip
    add_overrides(commands["import"], "a value of the run's config besides the model (repeatable)")
    commands["export"].add_argument(
        "--overwrite", action="store_true", help="replace the model files DIR already holds"
    )
    args = parser.parse_args(argv)
    args.repeated = _repeated_flag(sys.argv[1:] if argv is None else argv)
    return args


def _repeated_flag(argv: Sequence[str]) -> str | None:
    """'--from and --hf' when one of the flags that share a value is given twice: the last
    would silently win."""
    for names in (("--from", "--to", "--hf"), ("--run", "--out")):
        given = [a.split("=")[0] for a in argv if a.split("=")[0] in names]
        if len(given) > 1:
            return " and ".join(given)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeated:
        print(f"error: {args.repeated} name the same directory; give it once", file=sys.stderr)
        return 2

    def convert() -> None:
        if args.command == "import":
            path = import_checkpoint(args.hf, args.out, args.overrides)
            print(f"wrote {path} and step 0 in {Path(args.out) / 'checkpoints'}; train with: "
                  f"python scripts/train.py --out {args.out}")  # fmt: skip
        else:
            step = export_checkpoint(args.out, args.hf, args.overwrite)
            print(f"wrote step {step} of {args.out} to {args.hf}")

    return run_reporting_errors(convert)


if __name__ == "__main__":
    sys.exit(main())
