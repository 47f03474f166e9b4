"""Command line and config files -> JobConfig.

Flags are generated from the config dataclasses (one flag per field, Megatron-LM's names).
``--config FILE`` (YAML or TOML) supplies values under the same names; flags given on the
command line override the file. Nothing here validates layout rules: ``config.validate`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from typing import Any, Sequence

from megatron_ext.config import SECTION_TYPES, ConfigError, JobConfig, build_job_config, get_field_section


def _base_type(annotation: Any) -> Any:
    """int | None -> int; list[str] -> list."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return list
    return annotation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Megatron-style GPT pretraining on megatron-core (TP x PP x VPP x DP).",
        allow_abbrev=False,
    )
    parser.add_argument("--config", default=None, help="YAML or TOML file whose keys are flag names.")
    for section, cls in SECTION_TYPES.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)  # the annotations are strings (postponed evaluation)
        for f in dataclasses.fields(cls):
            _add_flag(group, f, hints[f.name])
    return parser


def _add_flag(group: Any, f: dataclasses.Field, annotation: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    kind = _base_type(annotation)
    help_text = f.metadata.get("help", "")
    if kind is bool:
        # Default of None means "not given" so that a config file value survives.
        group.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
        if f.metadata.get("negative_flag"):
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", default=None,
                               help=f"Turn {flag} off.")
        return
    kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
    if kind is list:
        kwargs["nargs"] = f.metadata.get("nargs", "*")
    else:
        kwargs["type"] = kind
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    group.add_argument(flag, **kwargs)


def load_config_file(path: str) -> dict[str, Any]:
    """Flat ``{field_name: value}`` from a YAML or TOML file (dashes or underscores in keys)."""
    if not os.path.isfile(path):
        raise ConfigError([f"--config {path}: no such file"])
    with open(path, "rb") as fh:
        raw = fh.read()
    if path.endswith(".toml"):
        data = tomllib.loads(raw.decode())
    elif path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(raw) or {}
    else:
        raise ConfigError([f"--config {path}: use a .yaml, .yml or .toml file"])
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a mapping of flag names to values"])
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):  # allow [section] tables / nested sections
            for k, v in value.items():
                flat[k.replace("-", "_")] = v
        else:
            flat[key.replace("-", "_")] = value
    known = get_field_section()
    unknown = sorted(k for k in flat if k not in known)
    if unknown:
        raise ConfigError([f"--config {path}: unknown key '{k}'" for k in unknown])
    if isinstance(flat.get("data_path"), str):
        flat["data_path"] = flat["data_path"].split()
    return flat


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Parse flags (and ``--config``) into a JobConfig; flags override the file."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if ns.config:
        values.update(load_config_file(ns.config))
    for name, value in vars(ns).items():
        if name != "config" and value is not None:
            values[name] = value
    return build_job_config(values)
