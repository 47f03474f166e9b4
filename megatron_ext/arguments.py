"""Command line and config files -> JobConfig.

Flags are generated from the config dataclasses (one flag per field, Megatron-LM's names).
``--config FILE`` (YAML or TOML) supplies values under the same names, at the top level or in
sections (any mapping: ``[training]``, ``model:``), each setting once: a key given twice in one
mapping, in two sections, or with dashes and with underscores is an error naming it (PyYAML would
keep the last silently; TOML refuses the first case itself). Flags given on the command line
override the file. Settings Megatron-LM adjusts rather than refuses are adjusted here, each with a
notice (``adjust_like_megatron``); nothing here checks layout rules: ``validation.validate`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from typing import Any

from megatron_ext.config import (
    REMOVED_SETTINGS,
    SECTION_TYPES,
    ConfigError,
    DataConfig,
    JobConfig,
    TrainingConfig,
    build_job_config,
)
from megatron_ext.data.tokenizer_flags import infer_tokenizer_type
from megatron_ext.derived import precision_name
from megatron_ext.megatron_argv import read_split, rejoin_word_split_values
from megatron_ext.megatron_flags import (
    MEGATRON_FLAG_NAMES,
    add_megatron_flags,
    escape_help,
    judge_megatron_flags,
    pop_megatron_flags,
)
from megatron_ext.model.compile_checks import get_shape_notes


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
        kind = re.search(r"invalid (int|float) value: (.*)$", message)
        if kind:  # argparse names the type, not the fix
            number = "a whole number" if kind.group(1) == "int" else "a number"
            message = f"{message[: kind.start()]}{kind.group(2)} is not {number}: give {number}"
        if "invalid choice:" in message:
            message += ": give one of those"
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
    aliases = f.metadata.get("aliases", ())  # Megatron-LM's own spellings (--override-opt_param-scheduler)
    kind = _base_type(annotation)
    help_text = escape_help(f.metadata.get("help", ""))
    if kind is bool:
        # Default of None means "not given" so that a config file value survives.
        group.add_argument(flag, *aliases, dest=f.name, action="store_true", default=None, help=help_text)
        if f.metadata.get("negative_flag"):
            group.add_argument(
                "--no-" + flag[2:], dest=f.name, action="store_false", default=None, help=f"Turn {flag} off."
            )
        return
    kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
    if kind is list:
        kwargs["nargs"] = f.metadata.get("nargs", "*")
    else:
        kwargs["type"] = kind
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    group.add_argument(flag, *aliases, **kwargs)


def _read_config_file(path: str) -> Any:
    with open(path, "rb") as fh:
        raw = fh.read()
    if path.endswith(".toml"):
        try:
            return tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError([f"--config {path}: not valid TOML: {err}{_quote_toml_line(raw, err)}"]) from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.load(raw, Loader=_build_unique_key_yaml_loader()) or {}
        except DuplicateKeyError as err:
            raise ConfigError([f"--config {path}: {err}"]) from None
        except yaml.YAMLError as err:
            where = " ".join(str(err).split())
            raise ConfigError([f"--config {path}: not valid YAML: {where}"]) from None
    raise ConfigError([f"--config {path}: use a .yaml, .yml or .toml file"])


def _quote_toml_line(raw: bytes, err: Exception) -> str:
    """ ": `a = 2`", the line tomllib's message points at (its message names no key: "Cannot
    overwrite a value (at line 2, column 6)"), or nothing."""
    match = re.search(r"at line (\d+)", str(err))
    lines = raw.decode(errors="replace").splitlines()
    if not match or not 0 < int(match.group(1)) <= len(lines):
        return ""
    return f": `{lines[int(match.group(1)) - 1].strip()}`"


def _build_unique_key_yaml_loader() -> type:
    """PyYAML's safe loader, refusing a key given twice in one mapping (``safe_load`` keeps the
    last one silently). Keys merged in with ``<<`` may still be overridden, as YAML intends."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKeyError(
                        f"key '{key}' is given twice (lines {seen[key]} and {line}): give each setting once"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


class DuplicateKeyError(ValueError):
    """A YAML mapping that gives one key twice (raised through PyYAML's loader as it is)."""


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


def flatten_config_sections(data: dict[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    """``{field_name: value}`` from a config file's top level and its sections (any nested mapping,
    e.g. TOML ``[training]``), and a problem for each setting given twice: in two sections, at the
    top level and in a section, or spelled with dashes and with underscores (last one kept)."""
    flat: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    problems = []
    for key, value in data.items():
        section = str(key) if isinstance(value, dict) else None
        for k, v in value.items() if section is not None else [(key, value)]:
            name = str(k).replace("-", "_")
            where = f"'{k}' in section '{section}'" if section is not None else f"'{k}'"
            if name in given_as:
                problems.append(
                    f"--config {path}: key '{name.replace('_', '-')}' is given twice ({given_as[name]} "
                    f"and {where}): give each setting once"
                )
            flat[name], given_as[name] = v, where
    return flat, problems


def load_config_file(path: str) -> dict[str, Any]:
    """Flat ``{field_name: value}`` from a YAML or TOML file (dashes or underscores in keys), every
    value checked against its field's type; all problems reported at once, naming file and key."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "no such file"
        raise ConfigError([f"--config {path}: {what}: give a YAML or TOML config file (configs/ holds examples)"])
    data = _read_config_file(path)
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a mapping of flag names to values"])
    flat, problems = flatten_config_sections(data, path)
    types = get_field_types()
    problems += [f"--config {path}: {REMOVED_SETTINGS[k]}" for k in sorted(k for k in flat if k in REMOVED_SETTINGS)]
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
            problems.append(
                f"--config {path}: key '{key.replace('_', '-')}' = {flat[key]!r} should be {expected}{hint}"
            )
    if problems:
        raise ConfigError(problems)
    return flat


def parse_args(argv: Sequence[str] | None = None) -> JobConfig:
    """Parse flags (and ``--config``) into a JobConfig; flags override the file."""
    return parse_args_with_notes(argv)[0]


def parse_args_with_notes(argv: Sequence[str] | None = None) -> tuple[JobConfig, list[str]]:
    """``parse_args``, plus the start-up warnings: a tokenizer type inferred as Megatron-LM's
    ``pretrain_gpt.py`` infers it (``infer_tokenizer_type``), Megatron-LM flags accepted without effect
    (``megatron_flags.py``; the refused ones raise one ConfigError, with a value bash split into words:
    ``megatron_argv.py``), settings adjusted as Megatron-LM adjusts them, and compiled or graphed
    layers facing many padded lengths (``get_shape_notes``)."""
    parser = build_parser()
    # Megatron-LM scripts' argv as bash passes it (megatron_argv.py): a value bash split is one error
    argv, split_values = rejoin_word_split_values(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if ns.config:
        values.update(load_config_file(ns.config))
    for name, value in vars(ns).items():
        if name != "config" and value is not None:
            values[name] = value
    if isinstance(values.get("split"), str):
        values["split"] = read_split(values["split"])  # '99,1,0', quotes kept by bash: as Megatron-LM reads it
    inferred = [note for note in [infer_tokenizer_type(values)] if note]
    megatron_flags = pop_megatron_flags(values)
    try:
        cfg = build_job_config(values)
    except ConfigError as err:  # reported with the split value's problem, all at once
        raise ConfigError(split_values + err.problems) from None
    notes, problems = judge_megatron_flags(megatron_flags, cfg)
    if split_values or problems:
        raise ConfigError(split_values + problems)
    return cfg, inferred + notes + adjust_like_megatron(cfg) + get_shape_notes(cfg)


def _adjust_evaluation(t: TrainingConfig) -> list[str]:
    """--eval-iters 0 turns validation off (as Megatron-LM); --eval-iters N without --eval-interval
    runs none either, our --eval-interval default being 0 (Megatron-LM's: 1000): said, not silent."""
    if t.eval_interval and t.eval_iters == 0 and not t.full_validation:  # (it reads whole sets)
        t.eval_interval = 0  # Megatron-LM: no validation without validation batches
        return ["--eval-iters 0: no validation (--eval-interval is ignored)"]
    if (
        not t.eval_interval
        and t.eval_iters > 0
        and t.eval_iters != TrainingConfig.__dataclass_fields__["eval_iters"].default
    ):
        return [
            f"--eval-iters {t.eval_iters}: no validation runs, --eval-interval is 0 (our default; "
            f"Megatron-LM's is 1000): add --eval-interval N to validate every N steps"
        ]
    return []


def adjust_like_megatron(cfg: JobConfig) -> list[str]:
    """Settings Megatron-LM adjusts rather than refuses, adjusted the same way in ``cfg``; returns
    one notice line for each (printed at start-up)."""
    notes = []
    p, t = cfg.parallel, cfg.training
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        p.sequence_parallel = False  # Megatron-LM: sequence parallelism is off without TP
        notes.append(
            "--sequence-parallel is off: it splits activations over the tensor-parallel ranks, "
            "and --tensor-model-parallel-size is 1 (Megatron-LM turns it off too)"
        )
    m = cfg.model
    if m.num_query_groups is not None and not m.group_query_attention:
        notes.append(
            f"--num-query-groups {m.num_query_groups}: ignored without --group-query-attention, every "
            f"attention head keeps its own key/value head (as in Megatron-LM); add --group-query-attention "
            f"for grouped-query attention"
        )
    d = cfg.data
    if d.tokenizer_type != "TikTokenizer":  # Megatron-LM ignores them with other tokenizers
        given = [
            ("--tiktoken-pattern", d.tiktoken_pattern),
            ("--tiktoken-special-tokens", " ".join(d.tiktoken_special_tokens)),
            (
                "--tiktoken-num-special-tokens",
                d.tiktoken_num_special_tokens if d.tiktoken_num_special_tokens != 1000 else None,
            ),
        ]
        notes += [
            f"{flag} {value} changes nothing with --tokenizer-type {d.tokenizer_type} (a TikTokenizer flag)"
            for flag, value in given
            if value
        ]
    notes += _adjust_evaluation(t)
    c = cfg.checkpoint
    for flag, value in (
        ("--exit-signal-handler", c.exit_signal_handler),
        ("--exit-interval", c.exit_interval),
        ("--exit-duration-in-mins", c.exit_duration_in_mins),
    ):
        if value and not c.save:  # Megatron-LM: exits, and saves only with --save
            notes.append(f"{flag} without --save: the run stops there without saving a checkpoint")
    d = cfg.data
    per_split = [
        flag
        for flag, given in (
            ("--train-data-path", d.train_data_path),
            ("--per-split-data-args-path", d.per_split_data_args_path),
        )
        if given
    ]
    if per_split and d.split != DataConfig.__dataclass_fields__["split"].default:
        notes.append(
            f"--split {d.split}: ignored, {per_split[0]} gives each split its own data "
            f"(read whole; Megatron-LM ignores --split there too)"
        )
    if not t.fp16:
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
            if getattr(t, name) != TrainingConfig.__dataclass_fields__[name].default
        ]
        if given:
            notes.append(
                f"{', '.join(given)}: loss scaling is for --fp16 only; ignored in {precision_name(t.bf16, t.fp16)}"
            )
    return notes
