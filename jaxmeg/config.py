"""Typed run configuration: frozen dataclasses, YAML loading, `section.key=value` overrides, and
`validate`.

The one module to import: it re-exports its parts (`config_io` and `config_validation` import
`config_sections`; none imports this module or anything built on it, so they form no cycle):
  `jaxmeg.config_sections`    the sections (frozen dataclasses, every field with a docstring;
                              the `moe` one in `jaxmeg.config_moe`), the choice tuples.
  `jaxmeg.config_io`          loading, YAML and `key=value` overrides, `to_dict` / `from_dict`.
  `jaxmeg.config_validation`  `validate`: every divisibility and product check, run once before
                              anything is compiled, each error naming the field and the numbers;
                              it resolves the `-1` sentinels (mesh shape, batching, kv heads,
                              learning-rate decay; `with_steps`).

Words: axis = mesh axis (`data`, `pipe`, `tensor`); dim = tensor dimension.
"""

from __future__ import annotations

from jaxmeg.config_io import apply_overrides, from_dict, load, to_dict
from jaxmeg.config_moe import MOE_ROUTERS, MoeConfig
from jaxmeg.config_sections import (
    DTYPES,
    ERROR_FEEDBACK,
    FP8_RECIPES,
    MESH_AXES,
    OUTER_AXES,
    PIPE_GRAD_PHASES,
    PLACEMENTS,
    REMAT_POLICIES,
    RUN_CONFIG,
    STAGE_LAYERS_MODES,
    ZERO_STAGES,
    CheckpointConfig,
    CompressionConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    padded_vocab_size,
)
from jaxmeg.config_validation import (
    LazyErrorOnEverySendWarning,
    kv_head_rules,
    resolve_batching,
    resolve_decay_steps,
    resolve_mesh_shape,
    settle_sequence_parallel,
    validate,
    with_steps,
)

__all__ = [
    "DTYPES",
    "ERROR_FEEDBACK",
    "FP8_RECIPES",
    "MESH_AXES",
    "MOE_ROUTERS",
    "OUTER_AXES",
    "PIPE_GRAD_PHASES",
    "PLACEMENTS",
    "REMAT_POLICIES",
    "RUN_CONFIG",
    "STAGE_LAYERS_MODES",
    "ZERO_STAGES",
    "CheckpointConfig",
    "CompressionConfig",
    "Config",
    "ConfigError",
    "LazyErrorOnEverySendWarning",
    "DataConfig",
    "ModelConfig",
    "MoeConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "kv_head_rules",
    "load",
    "padded_vocab_size",
    "resolve_batching",
    "resolve_decay_steps",
    "resolve_mesh_shape",
    "settle_sequence_parallel",
    "to_dict",
    "validate",
    "with_steps",
]
