"""Hugging Face checkpoint directories on disk: config.json and safetensors files (one, or
shards listed in model.safetensors.index.json) read tensor by tensor as float32, the tokenizer's
files copied, new files given the user's umask. `jaxmeg.models.hf` maps what they hold."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmeg.models.hf_moe import HFCheckpointError

SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
WEIGHTS_FILE, INDEX_FILE, CONFIG_FILE = (
    "model.safetensors",
    "model.safetensors.index.json",
    "config.json",
)

Tensors = dict[str, np.ndarray]


def _read_safetensors(path: Path) -> Tensors:
    """Every tensor of one file as float32, read from a memory map one tensor at a time. The
    format: an 8-byte little-endian header size, a JSON header {name: {dtype, shape,
    data_offsets}} and the data; bf16 goes through ml_dtypes (safetensors' NumPy loader has
    none)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    size = int(np.frombuffer(data[:8].tobytes(), "<u8")[0])
    header = json.loads(data[8 : 8 + size].tobytes())
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise HFCheckpointError(f"{path}: tensor {name} has dtype {entry['dtype']}")
        start, stop = (8 + size + offset for offset in entry["data_offsets"])
        array = data[start:stop].view(dtype).reshape(entry["shape"])
        tensors[name] = array.astype(np.float32)
    return tensors


def read_checkpoint(directory: str | Path) -> tuple[dict, Tensors]:
    """(config.json, tensors by name) of a Hugging Face checkpoint directory."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise HFCheckpointError(f"{directory} has no {CONFIG_FILE}")
    try:
        hf = json.loads((directory / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{directory / CONFIG_FILE} is not JSON: {err}") from None
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"{directory / CONFIG_FILE} is not a JSON object")
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise HFCheckpointError(
            f"{directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}; re-save the model with "
            f"save_pretrained(..., safe_serialization=True)"
        )
    tensors: Tensors = {}
    for name in files:
        try:
            tensors.update(_read_safetensors(directory / name))
        except (ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
            raise HFCheckpointError(
                f"{directory / name} is not a readable safetensors file (truncated or corrupt: "
                f"{type(err).__name__} {err})"
            ) from None
    return hf, tensors


def with_umask(path: Path) -> None:
    """Gives `path` the permissions a new file gets under the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")  # fmt: skip
"""A Hugging Face model directory's tokenizer files (`tokenizer.json` is what jaxmeg reads)."""


def copy_tokenizer(source: str | Path, target: str | Path) -> list[str]:
    """Copies the tokenizer files of directory `source` into `target`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(target) / name)
            with_umask(Path(target) / name)
            copied.append(name)
    return copied
