"""A step's micro-batches under context parallelism (CP): documents padded to g, then this CP rank's share.

Invariant: put back at their global positions (``cp_layout.local_index``), the micro-batches of the
c CP ranks of a replica are exactly the micro-batch one process builds with the same document pad
multiple g: tokens, labels and positions are sliced, never recomputed, and the boundaries
(``cu_seqlens``, ``cu_seqlens_host``, ``max_seqlen``) stay the whole sequence's.

What the step-data collate (``padding.collate_padded``, in the prefetch thread) does with a
``ContextSplit``:

1. packed documents (layout ``document``, ``--packed-sequences``): every document padded at its end
   to a multiple of g = ``--document-pad-multiple`` (pad id, labels IGNORE_INDEX, positions
   continue), g = 2c by default under CP and 1 without; the packer counted the pieces padded
   (``packing.py``), so a pack still fits ``--seq-length``, and the negotiation counts them so too
   (``get_sample_length``). Real queries never see the pads as keys: they follow the document;
2. joined and padded to the step's length (``padding.py``): the last document or row grows; the
   length is a multiple of 2c (``--pad-to-multiple-of`` and ``--seq-length`` are), so every
   document, window or row stays a multiple of 2c;
3. sliced (c > 1): per-document head-tail for packed documents (``build_document_layout``: balance
   1.000 whatever the mix, ``bench/cp_balance.py``); row head-tail for unpacked rows and
   ``--one-document-per-row`` (``build_row_layout(s, 1, c, r)``, the same for every row); row
   head-tail over the b GPTDataset windows of a micro-batch with document boundaries, the documents
   bounding attention (``build_row_layout(s, b, c, r, cu_seqlens)``). Host index work only (numpy,
   no device read): 0.6 ms to pad and 4.8 ms to pad and split a 128k-token micro-batch at c = 8
   (16 documents; 0.1 ms without either), in the prefetch thread.

Counters (``Microbatch.num_real_tokens`` / ``attention_pairs``) are the rank's local share under CP:
a real token at offset q of its document counts 2q + 1 pairs (sum over q < n: n^2, Megatron-LM's
accounting), a pad counts nothing, so the shares of the c ranks sum to the one-process values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from megatron_ext.config import DataConfig
from megatron_ext.context_parallel.layout import build_document_layout, build_row_layout, slice_local
from megatron_ext.data.microbatch import IGNORE_INDEX, Microbatch, Sample, describe_sample
from megatron_ext.derived import get_document_pad_multiple

LAYOUTS = ("document", "row")


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """How a rank's micro-batches are split over its CP group, and its packed documents padded."""

    cp_size: int = 1
    cp_rank: int = 0
    # "document": packed documents, each padded to g and split head-tail on its own; "row": rows
    # (unpacked, one document per row) or the b windows of a micro-batch, split head-tail per row
    layout: str = "document"
    document_pad_multiple: int = 1  # g (packed documents only)

    def __post_init__(self) -> None:
        c, g = self.cp_size, self.document_pad_multiple
        if self.layout not in LAYOUTS:
            raise ValueError(f"CP layout {self.layout!r}: use one of {', '.join(LAYOUTS)}")
        if c < 1 or not 0 <= self.cp_rank < c:
            raise ValueError(f"CP rank {self.cp_rank} is not in [0, --context-parallel-size {c})")
        if g < 1 or (g > 1 and self.layout != "document"):
            raise ValueError(f"--document-pad-multiple {g}: >= 1, and > 1 only with --packed-sequences")
        if c > 1 and self.layout == "document" and g % (2 * c):
            raise ValueError(
                f"--document-pad-multiple {g} is not a multiple of 2 x --context-parallel-size {c}: every "
                f"document is split into 2c chunks; use a multiple of {2 * c}"
            )

    @property
    def pads_documents(self) -> bool:
        return self.layout == "document" and self.document_pad_multiple > 1

    @property
    def checks_samples(self) -> bool:
        """Whether samples are checked as they are read (``check_sample``): they are padded or sliced."""
        return self.cp_size > 1 or self.pads_documents


NO_SPLIT = ContextSplit()


def get_document_padding(d: DataConfig, cp_size: int) -> int:
    """The run's g: --document-pad-multiple (default 2 x CP under CP, else 1) with --packed-sequences;
    1 for any other data (rows and windows are split per row, padded by --pad-to-multiple-of)."""
    return get_document_pad_multiple(d, cp_size) if d.packed_sequences else 1


def build_context_split(d: DataConfig, cp_size: int, cp_rank: int) -> ContextSplit:
    """The split of a run's data flags for CP rank ``cp_rank`` of ``cp_size``."""
    return ContextSplit(
        cp_size=cp_size,
        cp_rank=cp_rank,
        layout="document" if d.packed_sequences else "row",
        document_pad_multiple=get_document_padding(d, cp_size),
    )


def round_up(n: torch.Tensor | np.ndarray, multiple: int):
    return -(-n // multiple) * multiple


def get_sample_length(sample: Sample, split: ContextSplit) -> int:
    """Tokens of a sample once the collate has padded its documents to g."""
    if not (split.pads_documents and "cu_seqlens" in sample):
        return int(sample["tokens"].shape[0])
    cu = sample["cu_seqlens"].long()
    return int(round_up(cu[1:] - cu[:-1], split.document_pad_multiple).sum())


def pad_documents(sample: Sample, multiple: int, pad_id: int) -> Sample:
    """A packed sample with every document padded at its end to a multiple of ``multiple``: pad id,
    labels IGNORE_INDEX, positions continuing the document's; boundaries moved to match (numpy on
    the host: ~0.5 ms per 128k tokens)."""
    cu = sample["cu_seqlens"].numpy().astype(np.int64)
    lengths = np.diff(cu)
    padded = round_up(lengths, multiple)
    if np.array_equal(padded, lengths):
        return sample
    new_cu = np.zeros_like(cu)
    np.cumsum(padded, out=new_cu[1:])
    total = int(new_cu[-1])
    dest = np.arange(int(cu[-1])) + np.repeat(new_cu[:-1] - cu[:-1], lengths)  # each real token's new place
    positions = sample["position_ids"].numpy()
    # pads continue their document's positions: its first position + their offset in it
    out_positions = np.arange(total) - np.repeat(new_cu[:-1] - positions[cu[:-1]], padded)
    out_positions[dest] = positions

    def scatter(t: torch.Tensor, fill: int) -> torch.Tensor:
        out = np.full(total, fill, dtype=np.int64)
        out[dest] = t.numpy()
        return torch.from_numpy(out)

    return {
        "tokens": scatter(sample["tokens"], pad_id),
        "labels": scatter(sample["labels"], IGNORE_INDEX),
        "position_ids": torch.from_numpy(out_positions),
        "cu_seqlens": torch.from_numpy(new_cu.astype(np.int32)),
    }


def check_sample(sample: Sample, split: ContextSplit, max_length: int, dataset: Any, index: int) -> None:
    """ValueError naming the sample when the split cannot lay it out: its documents do not tile it,
    padded to g it exceeds ``max_length`` (a pack's longest: --seq-length), or, a window of the row
    layout, it is not ``max_length`` tokens long (every window of a micro-batch splits alike)."""
    if "cu_seqlens" not in sample:
        return
    n = int(sample["tokens"].shape[0])
    cu = sample["cu_seqlens"].long()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
        shown = cu.tolist() if cu.numel() <= 8 else cu[:4].tolist() + ["..."] + cu[-2:].tolist()
        raise ValueError(
            f"{describe_sample(dataset, index)}: its document boundaries (cu_seqlens) {shown} do not tile its {n} "
            f"tokens (need 0 = b_0 < b_1 < ... < b_k = {n}); the dataset must give every document's boundaries"
        )
    padded = get_sample_length(sample, split)
    if padded > max_length:
        raise ValueError(
            f"{describe_sample(dataset, index)}: its documents padded to a multiple of --document-pad-multiple "
            f"{split.document_pad_multiple} take {padded} tokens, more than --seq-length {max_length}: its pack was "
            f"built for another g; rebuild the packing index with this run's --document-pad-multiple"
        )
    if split.layout == "row" and split.cp_size > 1 and n != max_length:
        raise ValueError(
            f"{describe_sample(dataset, index)}: a window of {n} tokens, not --seq-length {max_length}: under "
            f"--context-parallel-size {split.cp_size} every window of a micro-batch is split head-tail alike"
        )


def get_pair_weights(bounds: np.ndarray, real_lengths: np.ndarray) -> np.ndarray:
    """[T] per token: 2q + 1 for a real token at offset q of its span (document or row) [bounds[i],
    bounds[i+1]), whose first ``real_lengths[i]`` tokens are real; 0 for a pad. Sums to sum n_i^2."""
    spans = np.diff(bounds)
    offsets = np.arange(int(bounds[-1]), dtype=np.int64) - np.repeat(bounds[:-1], spans)
    return np.where(offsets < np.repeat(real_lengths, spans), 2 * offsets + 1, 0)


def split_microbatch(mb: Microbatch, split: ContextSplit, real_lengths: list[int], num_windows: int) -> Microbatch:
    """This CP rank's share of a padded micro-batch (``split.cp_size`` > 1): its layout, tokens,
    labels and positions sliced, its counters the local share; ``real_lengths``: the documents'
    (packed, windows) or rows' real lengths; ``num_windows``: the b windows of the row layout's THD
    micro-batch (1 for packed documents)."""
    c, r = split.cp_size, split.cp_rank
    if mb.is_packed:
        bounds = np.asarray(mb.cu_seqlens_host, dtype=np.int64)
        total = int(bounds[-1])
        if split.layout == "document":
            layout = build_document_layout(mb.cu_seqlens_host, c, r)
        else:
            layout = build_row_layout(total // num_windows, num_windows, c, r, mb.cu_seqlens_host)
        weights = get_pair_weights(bounds, np.asarray(real_lengths, dtype=np.int64))
    else:
        b, s = mb.tokens.shape
        layout = build_row_layout(s, 1, c, r)
        rows = np.arange(b + 1, dtype=np.int64) * s
        weights = get_pair_weights(rows, np.asarray(real_lengths, dtype=np.int64)).reshape(b, s)
    local = weights[..., layout.local_index.numpy()]
    return dataclasses.replace(
        mb,
        tokens=slice_local(mb.tokens, layout),
        labels=slice_local(mb.labels, layout),
        position_ids=slice_local(mb.position_ids, layout),
        num_real_tokens=int(np.count_nonzero(local)),
        attention_pairs=int(local.sum()),
        cp_layout=layout,
    )
