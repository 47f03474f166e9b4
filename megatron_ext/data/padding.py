"""Padding a step's micro-batches to one length that every pipeline rank agrees on.

Invariant: all ranks of one pipeline replica (its PP stages, virtual stages and TP ranks, which
share a DP rank) pad micro-batch i of a step to the same length, so every P2P buffer of
megatron-core's schedule matches. Modes (``--sequence-padding``):

- ``static``: every micro-batch to ``--seq-length`` (no collective);
- ``negotiated``: one all-reduce MAX of the step's longest micro-batch over the replica's
  model-parallel group (TP x PP), once per step, rounded up to ``--pad-to-multiple-of`` and never
  above ``--seq-length``; the schedule is called with that ``seq_length``;
- ``variable``: each micro-batch to its own rounded length, and megatron-core's
  ``variable_seq_lengths`` shape handshake before every P2P message.

Padding a sample: tokens with the pad id, labels IGNORE_INDEX, loss mask 0, position ids 0; in
``cu_seqlens`` the LAST DOCUMENT GROWS to the padded length (a new zero-length document would make
varlen kernels produce NaN); ``max_seqlen`` is recomputed from the grown boundaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.cpu_platform import get_collective_device

MODES = ("static", "negotiated", "variable")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def get_step_length(global_max: int, multiple: int, seq_length: int) -> int:
    """The padded length for a step whose longest micro-batch has ``global_max`` tokens."""
    if global_max > seq_length:
        raise ValueError(f"a micro-batch has {global_max} tokens, more than --seq-length {seq_length}")
    return min(seq_length, round_up(max(global_max, 1), multiple))


def get_max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """Longest document of a boundary table (a Python int: kernels use it as a cache key)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def pad_sample(sample: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
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
        "loss_mask": pad(sample["loss_mask"], 0.0),
        "position_ids": pad(sample["position_ids"], 0),
    }
    if "cu_seqlens" in sample:
        cu = sample["cu_seqlens"].clone()
        cu[-1] = length  # the last document grows over the padding
        out["cu_seqlens"] = cu
    return out


def collate_padded(samples: list[dict[str, torch.Tensor]], length: int, pad_id: int) -> dict:
    """A micro-batch of [b, length] tensors; packed micro-batches (b = 1) keep their boundaries."""
    padded = [pad_sample(s, length, pad_id) for s in samples]
    mb = {k: torch.stack([p[k] for p in padded]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    if "cu_seqlens" in padded[0]:
        if len(padded) != 1:
            raise ValueError("packed sequences (THD) need --micro-batch-size 1")
        mb["cu_seqlens"] = padded[0]["cu_seqlens"]
        mb["max_seqlen"] = get_max_seqlen(mb["cu_seqlens"])
    mb["num_real_tokens"] = sum(int(s["tokens"].shape[0]) for s in samples)
    return mb


def get_local_max(raw_microbatches: list[list[dict[str, torch.Tensor]]]) -> int:
    return max(int(s["tokens"].shape[0]) for mb in raw_microbatches for s in mb)


def negotiate_step_length(local_max: int, group, multiple: int, seq_length: int) -> int:
    """THE collective of this feature: one all-reduce MAX over the replica's TP x PP group."""
    if group is not None and dist.get_world_size(group) > 1:
        t = torch.tensor([local_max], dtype=torch.int64, device=get_collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        local_max = int(t.item())
    return get_step_length(local_max, multiple, seq_length)


def collate_step(
    raw: list[list[dict[str, torch.Tensor]]], mode: str, group, multiple: int, seq_length: int, pad_id: int,
) -> tuple[list[dict], int]:
    """Pad the step's micro-batches as ``mode`` says; returns them and the schedule's seq_length."""
    if mode == "static":
        length = seq_length
        return [collate_padded(mb, length, pad_id) for mb in raw], length
    if mode == "negotiated":
        length = negotiate_step_length(get_local_max(raw), group, multiple, seq_length)
        return [collate_padded(mb, length, pad_id) for mb in raw], length
    if mode == "variable":
        mbs = [collate_padded(mb, get_step_length(get_local_max([mb]), multiple, seq_length), pad_id) for mb in raw]
        return mbs, seq_length
    raise ValueError(f"--sequence-padding {mode}: use one of {', '.join(MODES)}")
