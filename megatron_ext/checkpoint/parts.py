"""The typed parts of a training run that a checkpoint saves and restores.

``checkpoint/`` works on these and never on the ``TrainingRun`` (``training/checkpointing.py`` builds
the parts from a run), so it imports nothing from ``training/``. The objects are the run's own: a
load changes them in place (weights, optimizer and scheduler state, and the ``TrainState``'s
fields), so the run sees the loaded state without being handed anything back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_ext.config import JobConfig


@dataclasses.dataclass
class TrainState:
    """What a resume needs besides weights and optimizer state."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0

    def restore(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's ``train_state`` (fields it lacks, from an older checkpoint, get
        their defaults), in place."""
        loaded = TrainState(**saved)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(loaded, f.name))


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about the run besides its state (built by the entry point)."""

    tokenizer: dict[str, Any]  # tokenizer.identity()
    padded_vocab_size: int
    # where the padded vocabulary came from when not from this run's flags ("megatron-lm": a
    # Megatron-LM checkpoint's, padded by --make-vocab-size-divisible-by x its TP); saved with it
    padded_vocab_from: str | None = None


@dataclasses.dataclass
class CheckpointParts:
    """This rank's share of what a checkpoint holds, and what a load compares against it."""

    model: list[torch.nn.Module]  # the model chunks in megatron-core's DDP, one per virtual stage
    optimizer: Any  # megatron-core's (chained) optimizer
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    train_state: TrainState
    cfg: JobConfig  # the run's flags: recorded flat in the checkpoint, compared with its record on load
    meta: CheckpointMeta
    # each parameter group's flag-given settings as built (optim.record_flag_settings): given back
    # after a load under --override-opt-param-scheduler
    optimizer_flags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    global_batch_size: int = 0  # samples per step: shows a checkpoint's schedule in this run's steps
    # more entries of the save's marker (complete.json): the weight check's (replica_check.py)
    marker_record: dict[str, Any] = dataclasses.field(default_factory=dict)
