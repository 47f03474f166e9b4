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

from megatron_ext.loss import IGNORE_INDEX

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


def collate(samples: Sequence[dict[str, Any]]) -> Microbatch:
    """Stack megatron-core GPTDataset samples into one micro-batch of [b, s] tensors.

    Labels whose loss mask is 0 become IGNORE_INDEX, so the loss sees one notion of "invalid".
    """
    def stack(key: str) -> torch.Tensor:
        return torch.stack([torch.as_tensor(np.asarray(s[key])) for s in samples])

    tokens = stack("tokens").long()
    labels = stack("labels").long()
    loss_mask = stack("loss_mask").float()
    labels = torch.where(loss_mask > 0, labels, torch.full_like(labels, IGNORE_INDEX))
    if "position_ids" in samples[0]:
        position_ids = stack("position_ids").long()
    else:
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def fetch_step_microbatches(dataset: Any, indices: list[list[int]]) -> list[Microbatch]:
    """The step's micro-batches for this rank (indices wrap around the dataset's length)."""
    n = len(dataset)
    return [collate([dataset[i % n] for i in mb]) for mb in indices]


def build_chunk_iterators(microbatches: list[Microbatch], num_chunks: int) -> list[Iterator[Microbatch]]:
    """One iterator per virtual stage, each over the same micro-batches in order."""
    return [iter(microbatches) for _ in range(num_chunks)]


def count_valid_tokens(microbatches: list[Microbatch]) -> int:
    return int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches))
