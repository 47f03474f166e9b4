"""Which indexed datasets each split reads, from Megatron-LM's data flags (its
``get_blend_and_blend_per_split``), as pure functions of the flags and the files they name.

- ``--data-path [w1] p1 [w2 p2 ...]``, or the same list in the file ``--data-args-path``: one blend;
  each prefix's documents are divided into train/valid/test by ``--split``.
- ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (each ``[w1] p1 ...``), or
  the JSON file ``--per-split-data-args-path`` (``{"train": "...", "valid": ..., "test": ...}``):
  one blend per split, each prefix read whole; ``--split`` does not apply.

Weights, where given, are the share of samples each prefix contributes (megatron-core's
``BlendedDataset``); without weights megatron-core blends by dataset size.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from megatron_ext.config import ConfigError, DataConfig
from megatron_ext.data.gpt_datasets import Blend, parse_data_path

SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


@dataclasses.dataclass(frozen=True)
class DataBlends:
    """``blend`` (divided by --split) or ``per_split`` ([train, valid, test], None where absent)."""

    blend: Blend | None = None
    per_split: tuple[Blend | None, Blend | None, Blend | None] | None = None
    source: str = "--data-path"  # the flag(s) errors name

    @property
    def prefixes(self) -> list[str]:
        blends = [self.blend] if self.blend else [b for b in self.per_split or () if b]
        return [p for b in blends for p in b[0]]

    def for_split(self, k: int) -> Blend | None:
        """The blend split ``k`` reads (with --data-path: every prefix, divided by --split)."""
        return self.blend if self.blend is not None else (self.per_split or (None,) * 3)[k]


def _parse(items: Sequence[str], flag: str) -> Blend:
    try:
        return parse_data_path(items)
    except ConfigError as exc:
        raise ConfigError([p.replace("--data-path", flag) for p in exc.problems]) from None


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError([f"{flag} {path}: cannot read it ({exc.strerror})"]) from None


def resolve_data_blends(
    data_path: Sequence[str] = (),
    data_args_path: str | None = None,
    train_data_path: Sequence[str] = (),
    valid_data_path: Sequence[str] = (),
    test_data_path: Sequence[str] = (),
    per_split_data_args_path: str | None = None,
) -> DataBlends | None:
    """The blends the flags describe; None when no data flag is given (mock data). A
    ConfigError names the flags when they conflict or a list is malformed."""
    whole = bool(data_path) or data_args_path is not None
    per_split_lists = [list(train_data_path), list(valid_data_path), list(test_data_path)]
    per_split = any(per_split_lists) or per_split_data_args_path is not None
    if whole and per_split:
        raise ConfigError(
            [
                "--data-path/--data-args-path (one blend divided by --split) and --train/valid/test-data-path"
                "/--per-split-data-args-path (a blend per split) are exclusive: give one kind"
            ]
        )
    if data_path and data_args_path is not None:
        raise ConfigError(["--data-path and --data-args-path are exclusive (the file holds what --data-path would)"])
    if data_args_path is not None:
        items = _read_text(data_args_path, "--data-args-path").split()
        if not items:
            raise ConfigError(
                [f"--data-args-path {data_args_path} is empty: it should hold [w1] prefix1 [w2 prefix2 ...]"]
            )
        return DataBlends(blend=_parse(items, f"--data-args-path {data_args_path}"), source="--data-args-path")
    if data_path:
        return DataBlends(blend=_parse(data_path, "--data-path"))
    if not per_split:
        return None
    flags = SPLIT_FLAGS
    if per_split_data_args_path is not None:
        if any(per_split_lists):
            raise ConfigError(["--per-split-data-args-path and --train/valid/test-data-path are exclusive: give one"])
        try:
            spec = json.loads(_read_text(per_split_data_args_path, "--per-split-data-args-path"))
        except json.JSONDecodeError as exc:
            raise ConfigError([f"--per-split-data-args-path {per_split_data_args_path}: not JSON ({exc})"]) from None
        if not isinstance(spec, dict) or set(spec) - {"train", "valid", "test"}:
            raise ConfigError(
                [
                    f"--per-split-data-args-path {per_split_data_args_path} must be a JSON object with keys "
                    f"train, valid, test (each '[w1] prefix1 ...' or a list)"
                ]
            )
        per_split_lists = [spec.get(k) or [] for k in ("train", "valid", "test")]
        per_split_lists = [v.split() if isinstance(v, str) else [str(x) for x in v] for v in per_split_lists]
        flags = tuple(
            f"--per-split-data-args-path {per_split_data_args_path} [{k}]" for k in ("train", "valid", "test")
        )
    if not per_split_lists[0]:
        raise ConfigError([f"{flags[0]} is missing: a run with a blend per split needs a training blend"])
    blends = tuple(_parse(items, flag) if items else None for items, flag in zip(per_split_lists, flags))
    source = "--per-split-data-args-path" if per_split_data_args_path is not None else "--train/valid/test-data-path"
    return DataBlends(per_split=blends, source=source)


def get_data_blends(d: DataConfig) -> DataBlends | None:
    """The run's blends from its data flags (``resolve_data_blends``); None for no data flag."""
    return resolve_data_blends(
        d.data_path,
        d.data_args_path,
        d.train_data_path,
        d.valid_data_path,
        d.test_data_path,
        d.per_split_data_args_path,
    )


def get_blend_weights(blend: Blend) -> list[float] | None:
    """Normalised weights, or None (megatron-core: blend by size)."""
    weights = blend[1]
    if weights is None:
        return None
    total = float(sum(weights))
    return [w / total for w in weights]
