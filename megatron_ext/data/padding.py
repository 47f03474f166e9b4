"""Padding a step's micro-batches to one length that every pipeline rank agrees on.

Invariant: all ranks of one pipeline replica (its PP stages, virtual stages, TP and CP ranks, which
share a DP rank and read the same samples) pad micro-batch i of a step to the same length, so every
P2P buffer of megatron-core's schedule and every CP all-gather matches. Modes (``--sequence-padding``):

- ``static``: every micro-batch to its longest possible length (no collective);
- ``negotiated``: one all-reduce MAX of [longest, -longest] micro-batch of the step over the
  replica's group (TP x CP x PP), once per step: the longest, rounded up to ``--pad-to-multiple-of``
  and never above the longest possible length, is the schedule's ``seq_length``; ranks that found
  different longest micro-batches read different samples, a ValueError on every rank (before any
  CP all-gather, which would abort the process on mismatched sizes);
- ``variable``: each micro-batch to its own rounded length, and megatron-core's
  ``variable_seq_lengths`` shape handshake before every P2P message.

A micro-batch's length is its longest row, or, packed, the sum of its packs: the b packs of a
packed micro-batch (``--micro-batch-size b``) are joined into ONE THD sequence of up to
b x ``--seq-length`` tokens with joined ``cu_seqlens`` (attention still never crosses a document),
so the longest possible length is ``--seq-length`` unpacked and b x ``--seq-length`` packed.

Padding: tokens with the pad id, labels IGNORE_INDEX, position ids 0; in ``cu_seqlens`` the LAST
DOCUMENT GROWS to the padded length (a new zero-length document would make varlen kernels produce
NaN); ``max_seqlen`` is recomputed from the grown boundaries. Before that, with a ``ContextSplit``,
packed documents are each padded to a multiple of g, and after it the micro-batch is cut to this CP
rank's share (``context_split.py``); lengths are counted with the documents padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.cpu_platform import get_collective_device
from megatron_ext.data.context_split import (
    NO_SPLIT,
    ContextSplit,
    get_sample_length,
    pad_documents,
    split_microbatch,
)
from megatron_ext.data.microbatch import IGNORE_INDEX, Microbatch, Sample, normalize_sample

MODES = ("static", "negotiated", "variable")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


BUCKETS = ("multiple", "power-of-two")


def get_step_length(global_max: int, multiple: int, max_length: int, bucket: str = "multiple") -> int:
    """The padded length for a step whose longest micro-batch has ``global_max`` tokens: rounded up to
    ``multiple``, or with ``bucket="power-of-two"`` to ``multiple`` times a power of two (the lengths
    a run sees: log2(max_length / multiple) + 1 or so, as compiled layers and CUDA graphs want);
    never above ``max_length``."""
    if global_max > max_length:
        raise ValueError(f"a micro-batch has {global_max} tokens, more than its longest possible length {max_length}")
    if bucket not in BUCKETS:
        raise ValueError(f"--pad-length-bucket {bucket}: use one of {', '.join(BUCKETS)}")
    blocks = -(-max(global_max, 1) // multiple)
    if bucket == "power-of-two":
        blocks = 1 << (blocks - 1).bit_length()
    return min(max_length, blocks * multiple)


def get_max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """Longest document of a boundary table (a Python int: kernels use it as a cache key)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def get_microbatch_length(samples: list[Sample], split: ContextSplit = NO_SPLIT) -> int:
    """Tokens of a micro-batch before padding: the joined packs (documents padded to ``split``'s g),
    or the longest row."""
    lengths = [get_sample_length(s, split) for s in samples]
    return sum(lengths) if "cu_seqlens" in samples[0] else max(lengths)


def join_packs(samples: list[Sample]) -> Sample:
    """b packed samples as one: tokens, labels and positions concatenated, boundaries joined."""
    if len(samples) == 1:
        return samples[0]
    out = {k: torch.cat([s[k] for s in samples]) for k in ("tokens", "labels", "position_ids")}
    cus, start = [], 0
    for s in samples:
        cu = s["cu_seqlens"]
        cus.append(cu[:-1] + start)
        start += int(s["tokens"].shape[0])
    out["cu_seqlens"] = torch.cat(cus + [torch.tensor([start], dtype=torch.int32)]).to(torch.int32)
    return out


def pad_sample(sample: Sample, length: int, pad_id: int) -> Sample:
    """One 1-D sample padded to ``length`` tokens (see the module docstring)."""
    n = sample["tokens"].shape[0]
    if n > length:
        raise ValueError(f"cannot pad a {n}-token sample to {length}")
    extra = length - n

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((extra,), value, dtype=t.dtype)]) if extra else t

    out = {
        "tokens": pad(sample["tokens"], pad_id),
        "labels": pad(sample["labels"], IGNORE_INDEX),
        "position_ids": pad(sample["position_ids"], 0),
    }
    if "cu_seqlens" in sample:
        cu = sample["cu_seqlens"].clone()
        cu[-1] = length  # the last document grows over the padding
        out["cu_seqlens"] = cu
    return out


def collate_padded(samples: list[Sample], length: int, pad_id: int, split: ContextSplit = NO_SPLIT) -> Microbatch:
    """A micro-batch of ``length`` tokens per row: unpacked, b rows; packed, the b packs joined
    into one THD row (b = 1) that keeps every document boundary; with ``split``, packed documents
    padded to its g first and the micro-batch cut to its CP rank's share last."""
    if "cu_seqlens" in samples[0]:
        doc_lengths = [n for s in samples for n in (s["cu_seqlens"][1:] - s["cu_seqlens"][:-1]).tolist()]
        if split.pads_documents:
            samples = [pad_documents(s, split.document_pad_multiple, pad_id) for s in samples]
        padded = pad_sample(join_packs(samples), length, pad_id)
        cu = padded["cu_seqlens"]
        mb = Microbatch(
            tokens=padded["tokens"][None],
            labels=padded["labels"][None],
            position_ids=padded["position_ids"][None],
            num_real_tokens=sum(doc_lengths),
            attention_pairs=sum(n * n for n in doc_lengths),
            cu_seqlens=cu,
            cu_seqlens_host=tuple(cu.tolist()),
            max_seqlen=get_max_seqlen(cu),
        )
    else:
        padded = [pad_sample(s, length, pad_id) for s in samples]
        doc_lengths = [int(s["tokens"].shape[0]) for s in samples]
        mb = Microbatch(
            tokens=torch.stack([p["tokens"] for p in padded]),
            labels=torch.stack([p["labels"] for p in padded]),
            position_ids=torch.stack([p["position_ids"] for p in padded]),
            num_real_tokens=sum(doc_lengths),
            attention_pairs=sum(n * n for n in doc_lengths),
        )
    return split_microbatch(mb, split, doc_lengths, len(samples)) if split.cp_size > 1 else mb


def collate(samples: Sequence[dict[str, Any]], pad_id: int = 0) -> Microbatch:
    """One micro-batch padded to its own length: the longest row, or the joined packs."""
    normalized = [normalize_sample(s) for s in samples]
    return collate_padded(normalized, get_microbatch_length(normalized), pad_id)


def get_local_max(raw_microbatches: list[list[Sample]], split: ContextSplit = NO_SPLIT) -> int:
    return max(get_microbatch_length(mb, split) for mb in raw_microbatches)


def negotiate_step_length(local_max: int, group, multiple: int, max_length: int, bucket: str = "multiple") -> int:
    """THE collective of this feature: one all-reduce MAX of [local_max, -local_max] over the replica's
    group (TP x CP x PP), the longest and the shortest of the ranks' longest micro-batches at once;
    ValueError on every rank when they differ (see the module docstring)."""
    if group is not None and dist.get_world_size(group) > 1:
        t = torch.tensor([local_max, -local_max], dtype=torch.int64, device=get_collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        longest, negated_shortest = t.tolist()  # one device read, as before
        shortest = -negated_shortest
        if longest != shortest:
            raise ValueError(
                f"the {dist.get_world_size(group)} ranks reading the same samples (one data-parallel replica: "
                f"TP x CP x PP) disagree on this step's longest micro-batch: {shortest} to {longest} tokens (this "
                f"rank {local_max}); every one of them must read the same samples (the same --data-path, --split, "
                f"--seed, data cache and --document-pad-multiple); under context parallelism their attention's "
                f"all-gather would abort the process"
            )
        local_max = longest
    return get_step_length(local_max, multiple, max_length, bucket)


def collate_step(
    raw: list[list[Sample]],
    mode: str,
    group,
    multiple: int,
    max_length: int,
    pad_id: int,
    bucket: str = "multiple",
    split: ContextSplit = NO_SPLIT,
) -> tuple[list[Microbatch], int]:
    """Pad the step's micro-batches as ``mode`` says (and as ``split`` pads and cuts them); returns
    them and the schedule's seq_length (the whole sequence's, before the CP split).
    ``max_length``: a micro-batch's longest possible length (``--seq-length``, x b when packed)."""
    if mode == "static":
        mbs, length = [collate_padded(mb, max_length, pad_id, split) for mb in raw], max_length
    elif mode == "negotiated":
        length = negotiate_step_length(get_local_max(raw, split), group, multiple, max_length, bucket)
        mbs = [collate_padded(mb, length, pad_id, split) for mb in raw]
    elif mode == "variable":
        mbs = [
            collate_padded(mb, get_step_length(get_local_max([mb], split), multiple, max_length, bucket), pad_id, split)
            for mb in raw
        ]
        length = max_length
    else:
        raise ValueError(f"--sequence-padding {mode}: use one of {', '.join(MODES)}")
    for i, mb in enumerate(mbs):
        mb.index = i
    return mbs, length
