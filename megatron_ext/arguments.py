"""Command line and config files -> JobConfig.

Flags are generated from the config dataclasses (one flag per field, Megatron-LM's names).
``--config FILE`` (YAML or TOML) supplies values under the same names; flags given on the
command line override the file. Nothing here validates layout rules: ``config.validate`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import tomllib
import types
import typing
from typing import Any, Sequence

from megatron_ext.config import (
    REMOVED_SETTINGS, SECTION_TYPES, ConfigError, JobConfig, adjust_like_megatron, build_job_config,
)
from megatron_ext.megatron_flags import (
    MEGATRON_FLAG_NAMES, add_megatron_flags, escape_help, judge_megatron_flags, pop_megatron_flags,
)


def _base_type(annotation: Any) -> Any:
    """int | None -> int; list[str] -> list."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return list
    return annotation


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ConfigError (printed once, exit 2) instead of the
    whole usage text from every rank."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings]

            def hinted(flag: str) -> str:
                close = difflib.get_close_matches(flag.split("=")[0], known, 1, 0.8) if flag.startswith("--") else []
                return f"{flag} (did you mean {close[0]}?)" if close else flag

            message = "unrecognized arguments: " + " ".join(hinted(f) for f in message.split(":", 1)[1].split())
        raise ConfigError([f"{message} (python pretrain_gpt.py --help lists the flags)"])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        description="Megatron-style GPT pretraining on megatron-core (TP x PP x VPP x DP).",
        allow_abbrev=False,
    )
    parser.add_argument("--config", default=None, help="YAML or TOML file whose keys are flag names.")
    for section, cls in SECTION_TYPES.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)  # the annotations are strings (postponed evaluation)
        for f in dataclasses.fields(cls):
            _add_flag(group, f, hints[f.name])
    add_megatron_flags(parser)
    for name in REMOVED_SETTINGS:  # accepted by the parser, so that build_job_config names the replacement
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=argparse.SUPPRESS)
    return parser


def _add_flag(group: Any, f: dataclasses.Field, annotation: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    kind = _base_type(annotation)
    help_text = escape_help(f.metadata.get("help", ""))
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


def _read_config_file(path: str) -> Any:
    with open(path, "rb") as fh:
        raw = fh.read()
    if path.endswith(".toml"):
        try:
            return tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError([f"--config {path}: not valid TOML: {err}"]) from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(raw) or {}
        except yaml.YAMLError as err:
            where = " ".join(str(err).split())
            raise ConfigError([f"--config {path}: not valid YAML: {where}"]) from None
    raise ConfigError([f"--config {path}: use a .yaml, .yml or .toml file"])


def get_field_types() -> dict[str, tuple[Any, bool, tuple | None]]:
    """Field name -> (base type, None allowed, choices), over every section."""
    out = {}
    for cls in SECTION_TYPES.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            args = typing.get_args(hints[f.name])
            out[f.name] = (_base_type(hints[f.name]), type(None) in args, f.metadata.get("choices"))
    return out


def _looks_like_exponent(text: str) -> bool:
    return re.fullmatch(r"[+-]?\d+[eE][+-]?\d+", text.strip()) is not None


def _with_dot(text: str) -> str:
    mantissa, exponent = re.split(r"[eE]", text.strip())
    return f"{mantissa}.0e{exponent}"


def check_value(name: str, value: Any, types: dict) -> tuple[Any, str | None]:
    """A config-file value converted to its field's type, or a problem naming what was expected.
    Booleans take YAML/TOML booleans only: the string "false" is an error, not True."""
    kind, optional, choices = types[name]
    if value is None:
        return value, None if optional else "a value (null is not allowed)"
    if kind is bool:
        return value, None if isinstance(value, bool) else "a boolean (true or false, unquoted)"
    if kind is int:
        return value, None if type(value) is int else "an integer"
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return (float(value) if ok else value), None if ok else "a number"
    if kind is list:
        if isinstance(value, str):
            value = value.split()
        if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            return [str(v) for v in value], None
        return value, "a list of strings (or one space-separated string)"
    if not isinstance(value, str):
        return value, "a string"
    if choices and value not in choices:
        return value, f"one of {', '.join(choices)}"
    return value, None


def load_config_file(path: str) -> dict[str, Any]:
    """Flat ``{field_name: value}`` from a YAML or TOML file (dashes or underscores in keys), every
    value checked against its field's type; all problems reported at once, naming file and key."""
    if not os.path.isfile(path):
        raise ConfigError([f"--config {path}: no such file"])
    data = _read_config_file(path)
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a mapping of flag names to values"])
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):  # allow [section] tables / nested sections
            for k, v in value.items():
                flat[str(k).replace("-", "_")] = v
        else:
            flat[str(key).replace("-", "_")] = value
    types = get_field_types()
    problems = [f"--config {path}: {REMOVED_SETTINGS[k]}" for k in sorted(k for k in flat if k in REMOVED_SETTINGS)]
    for k in sorted(k for k in flat if k not in types and k not in REMOVED_SETTINGS):
        close = difflib.get_close_matches(k, list(types), 1, 0.8)
        dashed = "--" + k.replace("_", "-")
        if dashed in MEGATRON_FLAG_NAMES:
            hint = f" ({dashed} is a Megatron-LM flag: give it on the command line, where it is judged)"
        else:
            hint = f" (did you mean '{close[0].replace('_', '-')}'?)" if close else ""
        problems.append(f"--config {path}: unknown key '{k}'{hint}")
    for key in sorted(k for k in flat if k in types):
        flat[key], expected = check_value(key, flat[key], types)
        if expected:
            hint = ""
            if expected == "a number" and isinstance(flat[key], str) and _looks_like_exponent(flat[key]):
                hint = f" (YAML reads {flat[key]} as a string: write it with a dot, e.g. {_with_dot(flat[key])})"
            problems.append(f"--config {path}: key '{key.replace('_', '-')}' = {flat[key]!r} should be {expected}{hint}")
    if problems:
        raise ConfigError(problems)
    return flat


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Parse flags (and ``--config``) into a JobConfig; flags override the file."""
    return parse_args_with_notes(argv)[0]


def parse_args_with_notes(argv: Sequence[str] | None = None) -> tuple[JobConfig, list[str]]:
    """``parse_args``, plus the warnings of Megatron-LM flags accepted without effect
    (``megatron_flags.py``); the refused ones raise one ConfigError."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if ns.config:
        values.update(load_config_file(ns.config))
    for name, value in vars(ns).items():
        if name != "config" and value is not None:
            values[name] = value
    megatron_flags = pop_megatron_flags(values)
    cfg = build_job_config(values)
    notes, problems = judge_megatron_flags(megatron_flags, cfg)
    if problems:
        raise ConfigError(problems)
    return cfg, notes + adjust_like_megatron(cfg)
