"""What a micro-batch holds, which samples each DP rank trains on, and the per-stage iterators.

Invariant (Megatron-LM's pretraining sampler): step k covers the global sample indices
[k*G, (k+1)*G) of the training dataset, G = global batch size; micro-batch j of that step covers
[k*G + j*b*D, k*G + (j+1)*b*D), of which DP rank r takes [r*b, (r+1)*b), b = micro-batch size,
D = data-parallel size. So the samples of a step do not depend on the layout's split of G into
micro-batches and ranks, and a run resumes exactly from ``consumed_samples``. Under a batch schedule
(--rampup-batch-size, --step-batch-size-schedule: ``batch_schedule.py``) the step that starts at
sample c covers [c, c + G(c)), G(c) the schedule's batch after c consumed samples.

Every rank of a pipeline (all its PP stages, virtual stages and TP ranks) fetches the same
micro-batches of the step before the schedule starts, and each virtual stage gets its own
iterator over that same list, in order; megatron-core's schedules then consume them in schedule
order. No data is sent through the pipeline's P2P activations.

Token validity has one encoding: a label equal to IGNORE_INDEX predicts nothing (a dataset's
``loss_mask`` is folded into the labels once, in ``normalize_sample``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from megatron_ext.config import ConfigError
from megatron_ext.context_parallel.layout import ContextParallelLayout

# Labels at this value predict nothing (megatron-core's and torch's cross-entropy convention).
IGNORE_INDEX = -100

# One sample as 1-D tensors: tokens, labels, position_ids [L] and, when packed, cu_seqlens [n + 1].
Sample = dict[str, torch.Tensor]


@dataclasses.dataclass
class Microbatch:
    """One micro-batch, as every model chunk of a pipeline sees it.

    Unpacked: b rows of s tokens. Packed (THD): one row (b = 1) holding one or more packs of
    whole documents, with ``cu_seqlens`` the document boundaries; the host copies of the
    boundaries and of the longest document are computed once here, so that no layer has to ask
    the device for them.

    Under context parallelism (``cp_layout`` set; ``context_split.py``) the tensors hold this CP
    rank's tokens: [b, s/c] unpacked, [1, t/c] packed, in the layout's local order, positions the
    sliced global ones (per document when packed); ``cu_seqlens``, ``cu_seqlens_host`` and
    ``max_seqlen`` stay the whole sequence's (after padding). The counters are then this rank's
    LOCAL SHARE: ``num_real_tokens`` its real tokens (per-document pads and padding excluded), and
    ``attention_pairs`` 2q + 1 per real token at offset q of its document (pads: 0); summed over the
    CP group they equal the whole micro-batch's, so tokens/s and FLOPs are summed over DP x CP (the
    loss's group), never over DP alone after multiplying (that would count them c times).
    """

    tokens: torch.Tensor  # [b, s] int64 ([b, s/c] or [1, t/c] under CP)
    labels: torch.Tensor  # [b, s] int64, IGNORE_INDEX where nothing is predicted
    position_ids: torch.Tensor  # [b, s] int64, restarting at 0 for each document when packed
    num_real_tokens: int  # tokens before padding (under CP: this rank's share)
    attention_pairs: int  # sum over documents (packed) or rows of real length^2 (FLOP count; CP: share)
    cu_seqlens: torch.Tensor | None = None  # [n + 1] int32 document boundaries (packed only)
    cu_seqlens_host: tuple[int, ...] | None = None  # the same boundaries on the host
    max_seqlen: int | None = None  # longest document, a Python int (kernels key caches on it)
    index: int = 0  # its place in the step (for the step watchdog's report)
    # Under context parallelism: this CP rank's share (the tensors above then hold its local tokens,
    # cu_seqlens_host / max_seqlen stay the whole sequence's); None without CP
    cp_layout: ContextParallelLayout | None = None

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def valid(self) -> torch.Tensor:
        """[b, s] bool: positions whose label counts in the loss."""
        return self.labels != IGNORE_INDEX

    @property
    def num_slots(self) -> int:
        """Token positions including padding."""
        return self.tokens.numel()

    def to(self, device: torch.device) -> Microbatch:
        """The tensors on ``device`` (pinned host memory and an asynchronous copy on CUDA; this
        object on the CPU)."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory().to(device, non_blocking=True)

        return dataclasses.replace(
            self,
            tokens=move(self.tokens),
            labels=move(self.labels),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            cp_layout=None if self.cp_layout is None else self.cp_layout.to(device),
        )


def get_microbatch_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Sample indices of this DP rank's micro-batches for the step starting at ``consumed_samples``."""
    per_mb = micro_batch_size * dp_size
    num_microbatches = global_batch_size // per_mb
    start = consumed_samples + dp_rank * micro_batch_size
    return [list(range(start + j * per_mb, start + j * per_mb + micro_batch_size)) for j in range(num_microbatches)]


def normalize_sample(sample: dict[str, Any]) -> Sample:
    """A dataset sample (megatron-core GPTDataset's numpy dict or ours) as 1-D torch tensors.

    Labels whose loss mask is 0 become IGNORE_INDEX, so the loss sees one notion of "invalid".
    """

    def get(key: str) -> torch.Tensor:
        value = sample[key]
        return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))

    tokens = get("tokens").long()
    labels = get("labels").long()
    if "loss_mask" in sample:
        masked = get("loss_mask") == 0
        if bool(masked.any()):
            labels = labels.masked_fill(masked, IGNORE_INDEX)
    out = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": get("position_ids").long() if "position_ids" in sample else torch.arange(len(tokens)),
    }
    if "cu_seqlens" in sample:
        out["cu_seqlens"] = get("cu_seqlens").to(torch.int32)
    return out


def fetch_step_samples(
    dataset: Any,
    indices: list[list[int]],
    vocab_size: int | None = None,
    check: Callable[[Sample, Any, int], None] | None = None,
) -> list[list[Sample]]:
    """The step's samples for this rank, unpadded, grouped by micro-batch (indices wrap around).
    With ``vocab_size``, a token id outside the vocabulary is a ConfigError naming the file and
    the documents it came from (instead of an IndexError inside the embedding); ``check(sample,
    dataset, index)`` raises its own error naming the sample (the CP layout's, ``context_split``)."""
    n = len(dataset)
    out = []
    for mb in indices:
        samples = [normalize_sample(dataset[i % n]) for i in mb]
        for i, s in zip(mb, samples):
            if vocab_size is not None:
                check_token_ids(s, vocab_size, dataset, i % n)
            if check is not None:
                check(s, dataset, i % n)
        out.append(samples)
    return out


def check_token_ids(sample: Sample, vocab_size: int, dataset: Any, index: int) -> None:
    top = int(sample["tokens"].max()) if sample["tokens"].numel() else 0
    low = int(sample["tokens"].min()) if sample["tokens"].numel() else 0
    if top >= vocab_size or low < 0:
        bad = top if top >= vocab_size else low
        raise ConfigError(
            [
                f"token id {bad} is outside the tokenizer's vocabulary [0, {vocab_size}) in "
                f"{describe_sample(dataset, index)}: the data was tokenized with another tokenizer than "
                f"--tokenizer-type/--tokenizer-model (or --vocab-size) say; preprocess it again or use that tokenizer"
            ]
        )


def describe_sample(dataset: Any, index: int) -> str:
    """Which file (and documents, where known) a dataset sample comes from."""
    if hasattr(dataset, "describe_sample"):
        return dataset.describe_sample(index)
    if hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):  # megatron-core BlendedDataset
        k = int(dataset.dataset_index[index])
        return describe_sample(dataset.datasets[k], int(dataset.dataset_sample_index[index]))
    prefix = getattr(getattr(dataset, "dataset", None), "path_prefix", None)  # megatron-core GPTDataset
    if prefix:
        where = f"{prefix}.bin (sample {index})"
        try:  # the documents of a window: GPTDataset's shuffle, sample and document indices
            j = int(dataset.shuffle_index[index])
            beg, end = int(dataset.sample_index[j][0]), int(dataset.sample_index[j + 1][0])
            docs = sorted({int(d) for d in dataset.document_index[beg : end + 1]})
            where = f"{prefix}.bin, document{'s' if len(docs) > 1 else ''} {', '.join(map(str, docs))} (sample {index})"
        except (AttributeError, IndexError, TypeError):
            pass
        return where
    return f"sample {index} of {type(dataset).__name__}"


def build_chunk_iterators(microbatches: list[Microbatch], num_chunks: int) -> list[Iterator[Microbatch]]:
    """One iterator per virtual stage, each over the same micro-batches in order."""
    return [iter(microbatches) for _ in range(num_chunks)]
