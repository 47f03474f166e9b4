"""Validation sets and whole-split reads (``--full-validation``, ``--multiple-validation-sets``).

Without ``--full-validation`` evaluation k reads the k-th ``--eval-iters`` global batches of the one
validation dataset. With it, each evaluation reads every sample of each set exactly once, from its
first: ceil(N / global batch) global batches, the last one filled up with fully masked copies of
sample 0 (no valid token: they add nothing to the loss sum or the token count), so the token mean is
that of the whole set whatever N is. (Megatron-LM 0.16.1 drops the last N mod (micro batch x DP)
samples and, through a cyclic iterator, reads the set num_microbatches times per evaluation: the
same mean, num_microbatches times the work.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


class ValidationSet(NamedTuple):
    """One set evaluated and logged on its own: ``name`` (its prefix) and its dataset."""

    name: str
    dataset: Any


def get_validation_sets(valid: Any) -> list[ValidationSet]:
    """The run's validation sets: a list of ValidationSet (``--multiple-validation-sets``) as is, one
    dataset as the single unnamed set, None as none."""
    if valid is None:
        return []
    if isinstance(valid, list):
        return valid
    return [ValidationSet("", valid)]


def get_num_full_batches(num_samples: int, global_batch_size: int) -> int:
    """Global batches that read ``num_samples`` samples once each (the last one possibly partial)."""
    return -(-num_samples // global_batch_size)


def _masked(sample: dict[str, Any]) -> dict[str, Any]:
    """``sample`` with every loss position masked (a filler that adds no token to the loss)."""
    labels = sample["labels"]
    shape = labels.shape if hasattr(labels, "shape") else (len(labels),)
    out = dict(sample)
    out["loss_mask"] = torch.zeros(shape) if isinstance(labels, torch.Tensor) else np.zeros(shape, dtype=np.float32)
    return out


class FullPassDataset:
    """``dataset`` followed by masked copies of its sample 0 up to a whole number of global batches:
    index i < len(dataset) is sample i, beyond it a filler with no valid token."""

    def __init__(self, dataset: Any, global_batch_size: int):
        self.dataset = dataset
        self.num_real = len(dataset)
        if self.num_real == 0:
            raise ValueError("a validation set without samples cannot be evaluated")
        self.num_batches = get_num_full_batches(self.num_real, global_batch_size)
        self.length = self.num_batches * global_batch_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < self.num_real:
            return self.dataset[index]
        return _masked(self.dataset[0])
