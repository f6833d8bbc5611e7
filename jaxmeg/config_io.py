"""The run configuration in and out: YAML files, `section.key=value` overrides, and the
plain-dict form that run directories and checkpoints keep, each value checked against its
field's type and named when it is not (`jaxmeg.config_sections` holds the sections)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from jaxmeg.config_sections import SECTION_TYPES, STAGE_LAYERS_MODES, Config, ConfigError


def _as_number(v):
    """A list entry of a numbers field: a string such as "1e3" as its float, else as is."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def _coerce(section: str, field: dataclasses.Field, value: Any) -> Any:
    default = getattr(SECTION_TYPES[section](), field.name)
    name = f"{section}.{field.name}"
    if field.type == "bool | None":  # true, false or null (= decided from other fields)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name} must be true, false or null (auto), got {value!r}")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads `2e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        if value in STAGE_LAYERS_MODES and field.name == "stage_layers":
            return value
        names = str(field.type) == "tuple[str, ...]"
        numbers = bool(default) and isinstance(default[0], float)
        kinds = (str,) if names else (int, float) if numbers else (int,)
        if isinstance(value, (*kinds, str)) and not isinstance(value, bool):
            value = yaml.safe_load(f"[{value}]") if isinstance(value, str) else [value]
        if numbers and isinstance(value, (list, tuple)):  # YAML 1.1 reads 1e3 as a string
            value = [_as_number(v) for v in value]
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, kinds) and not isinstance(v, bool) for v in value
        ):
            example = "[dense, moe]" if names else "[1.25, 2.0]" if numbers else "[5, 3]"
            what = "names" if names else "numbers" if numbers else "integers"
            raise ConfigError(f"{name} must be a list of {what}, e.g. {example}, got {value!r}")
        return tuple(float(v) for v in value) if numbers else tuple(value)
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    return value


def from_dict(raw: dict) -> Config:
    """Builds a Config from nested dicts, rejecting unknown sections and keys by name."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    sections = {}
    for section, values in raw.items():
        if section not in SECTION_TYPES:
            raise ConfigError(f"unknown config section {section!r}; known: {sorted(SECTION_TYPES)}")
        cls = SECTION_TYPES[section]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = values or {}
        if not isinstance(values, dict):
            raise ConfigError(
                f"config section {section!r} must be a mapping of keys (e.g. {section}:\n"
                f"  key: value), got {values!r}"
            )
        for key in values:
            if key not in fields:
                raise ConfigError(f"unknown config key {section}.{key}; known: {sorted(fields)}")
        sections[section] = cls(**{k: _coerce(section, fields[k], v) for k, v in values.items()})
    return Config(**sections)


def to_dict(cfg: Config) -> dict:
    """Plain nested dicts and lists (YAML- and JSON-safe)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Applies `section.key=value` strings; values are parsed as YAML (`true`, `3`, `1e-3`)."""
    raw = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) != 2:
            raise ConfigError(f"override key {path!r} must be section.key, e.g. parallel.tensor")
        section, key = parts
        if section not in raw:
            raise ConfigError(f"unknown config section {section!r}; known: {sorted(raw)}")
        if key not in raw[section]:
            raise ConfigError(f"unknown config key {path}; known: {sorted(raw[section])}")
        try:
            raw[section][key] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as err:
            first = str(err).splitlines()[0]
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({first})") from None
    return from_dict(raw)


def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Loads a YAML config file and applies overrides. Does not validate (see `validate`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config {str(path)!r} is a directory; pass a YAML file in it, e.g. "
            f"{str(path / 'gpt_tiny.yaml')!r}"
        )
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    from jaxmeg.yaml_files import read_yaml

    cfg = from_dict(read_yaml(path, "config file", ConfigError))
    return apply_overrides(_beside(cfg, path.parent), overrides or [])


def _beside(cfg: Config, directory: Path) -> Config:
    """A relative `data.tokenizer` that names a file beside the config file (a run's own
    tokenizer, which an import names relative to the run) as that file's absolute path."""
    tokenizer = cfg.data.tokenizer
    if tokenizer in ("", "none") or Path(tokenizer).expanduser().is_absolute():
        return cfg
    beside = directory / tokenizer
    if not beside.is_file():
        return cfg
    data = dataclasses.replace(cfg.data, tokenizer=str(beside.absolute()))
    return dataclasses.replace(cfg, data=data)
