"""The ground floor: the typed job configuration, with Megatron-LM's flag names, and ConfigError.

Each section is a small dataclass; each field's ``help`` is its flag's help text. The flag of a
field is ``--`` + its name with dashes (``tensor_model_parallel_size`` ->
``--tensor-model-parallel-size``). Config files (YAML or TOML) use the same names, with dashes or
underscores; flags given on the command line override them; unknown keys are an error.

Invariant: this module imports nothing of ours but ``config_sections.py`` (the section dataclasses,
which imports nothing of ours), so every module may import it. What the flags
imply (sizes, lengths, dtypes) is ``derived.py``; the rules they must satisfy, checked in one
place before anything is built, are ``validation.validate``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.config_sections import (  # noqa: F401  (re-exported: every module imports them from here)
    DEFAULT_TRAIN_ITERS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)

# Settings that no longer exist: each name -> the one error that says what replaces it (flags and
# config files alike), instead of "unknown setting".
REMOVED_SETTINGS = {
    "ckpt_reader": "--ckpt-reader was removed: checkpoints always load through megatron-core's torch_dist reader "
    "(what '--ckpt-reader megatron' chose; ours, 'direct', was slower from disk), checked by "
    "--ckpt-verify; delete the setting",
}


@dataclass
class JobConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_flat_dict(self) -> dict[str, Any]:
        return {k: v for section in self.sections() for k, v in dataclasses.asdict(section).items()}

    def sections(self) -> list[Any]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


SECTION_TYPES: dict[str, type] = {
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


def get_field_section() -> dict[str, str]:
    """Field name -> section name, over every section."""
    return {f.name: s for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)}


class ConfigError(ValueError):
    """A problem a user can cause and fix (flags, config files, data, tokenizer, checkpoint
    directories): every one found, one per line, each naming the flag or file and the fix. The
    entry point prints it once as an ``error:`` block and exits 2, without a traceback."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))

    def __reduce__(self):  # from a worker process with its problems intact (not re-split per character)
        return type(self), (self.problems,)


def build_job_config(values: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from flat ``{field_name: value}``; unknown names are an error."""
    where = get_field_section()
    removed = [REMOVED_SETTINGS[k] for k in sorted(values) if k in REMOVED_SETTINGS]
    if removed:
        raise ConfigError(removed)
    unknown = sorted(k for k in values if k not in where)
    if unknown:
        raise ConfigError([f"unknown setting '{k}' (no flag --{k.replace('_', '-')})" for k in unknown])
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTION_TYPES}
    for k, v in values.items():
        per_section[where[k]][k] = v
    cfg = JobConfig(**{s: SECTION_TYPES[s](**kw) for s, kw in per_section.items()})
    if cfg.training.train_iters is None and cfg.training.train_samples is None:
        cfg.training.train_iters = DEFAULT_TRAIN_ITERS
    return cfg
