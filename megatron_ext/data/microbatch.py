"""Which samples each DP rank trains on at each step, and the step's micro-batch iterators.

Invariant (Megatron-LM's pretraining sampler): step k covers the global sample indices
[k*G, (k+1)*G) of the training dataset, G = global batch size; micro-batch j of that step covers
[k*G + j*b*D, k*G + (j+1)*b*D), of which DP rank r takes [r*b, (r+1)*b), b = micro-batch size,
D = data-parallel size. So the samples of a step do not depend on the layout's split of G into
micro-batches and ranks, and a run resumes exactly from ``consumed_samples``.

Every rank of a pipeline (all its PP stages, virtual stages and TP ranks) fetches the same
micro-batches of the step before the schedule starts, and each virtual stage gets its own
iterator over that same list, in order; megatron-core's schedules then consume them in schedule
order. No data is sent through the pipeline's P2P activations.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch

# Labels at this value predict nothing (megatron-core's and torch's cross-entropy convention).
IGNORE_INDEX = -100

Microbatch = dict[str, torch.Tensor]


def get_microbatch_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Sample indices of this DP rank's micro-batches for the step starting at ``consumed_samples``."""
    per_mb = micro_batch_size * dp_size
    num_microbatches = global_batch_size // per_mb
    start = consumed_samples + dp_rank * micro_batch_size
    return [
        list(range(start + j * per_mb, start + j * per_mb + micro_batch_size))
        for j in range(num_microbatches)
    ]


def normalize_sample(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A dataset sample (megatron-core GPTDataset's numpy dict or ours) as 1-D torch tensors.

    Labels whose loss mask is 0 become IGNORE_INDEX, so the loss sees one notion of "invalid".
    """
    def get(key: str) -> torch.Tensor:
        value = sample[key]
        return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))

    tokens = get("tokens").long()
    labels = get("labels").long()
    loss_mask = get("loss_mask").float() if "loss_mask" in sample else (labels != IGNORE_INDEX).float()
    if not bool((loss_mask == 0).any()):
        valid_labels = labels
    else:
        valid_labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
    out = {
        "tokens": tokens,
        "labels": valid_labels,
        "loss_mask": loss_mask,
        "position_ids": get("position_ids").long() if "position_ids" in sample else torch.arange(len(tokens)),
    }
    if "cu_seqlens" in sample:
        out["cu_seqlens"] = get("cu_seqlens").to(torch.int32)
    return out


def fetch_step_samples(dataset: Any, indices: list[list[int]]) -> list[list[dict[str, torch.Tensor]]]:
    """The step's samples for this rank, unpadded, grouped by micro-batch (indices wrap around)."""
    n = len(dataset)
    return [[normalize_sample(dataset[i % n]) for i in mb] for mb in indices]


def collate(samples: Sequence[dict[str, Any]], pad_id: int = 0) -> Microbatch:
    """One micro-batch, padded to its longest sample (no padding for fixed-length samples)."""
    from megatron_ext.data.padding import collate_padded

    normalized = [normalize_sample(s) for s in samples]
    return collate_padded(normalized, max(len(s["tokens"]) for s in normalized), pad_id)


def build_chunk_iterators(microbatches: list[Microbatch], num_chunks: int) -> list[Iterator[Microbatch]]:
    """One iterator per virtual stage, each over the same micro-batches in order."""
    return [iter(microbatches) for _ in range(num_chunks)]
