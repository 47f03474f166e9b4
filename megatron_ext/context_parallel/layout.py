"""Which tokens of a micro-batch each CP rank holds, and which keys each of its queries attends to.

Head-tail split (Megatron-LM's and Transformer Engine's): a span of n tokens (n a multiple of 2c) is
cut into 2c chunks of k = n / 2c; CP rank r holds chunks r and 2c-1-r, in that order. Under causal
attention chunk i's queries see i + 1 chunks of keys, so a rank's two chunks see (r + 1) + (2c - r) =
2c + 1 chunks' worth whatever r: equal attention work, and equal tokens.

What is split: packed documents each on its own (per-document head-tail, the layout of TE's
``thd_get_partitioned_indices``: every rank holds 1/2c of every document, balance 1.000 whatever the
document mix); other rows (unpacked rows, GPTDataset windows with document boundaries) per row
(megatron-core's ``get_batch_on_this_cp_rank``), a chunk crossing a document boundary being cut
there: attention never crosses a document. Both are ``build_layout(split_bounds, attention_bounds)``.

A layout describes a sequence of T tokens: a THD micro-batch (all its documents), or one row of an
unpacked [b, s] micro-batch (every row alike). Rank r's local tokens are the global positions
``local_index``, in that order. Its queries form ``pieces`` (ls, le, ks, ke): local rows [ls, le)
hold global positions [ke - (le - ls), ke) of one document starting at ks and attend, causally, to
the global keys [ks, ke) (bottom-right aligned: the piece's last query sees every one of them).
After the CP all-gather (rank-major: rank 0's local tokens, then rank 1's, ...), global position i
is row ``gather_index[i]`` of the gathered buffer.

Pure and host-side (numpy), built once per micro-batch in the step-data collate (the prefetch
thread); nothing here touches a device or a process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

Piece = tuple[int, int, int, int]  # (local start, local end, key start, key end)


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelLayout:
    """One CP rank's share of a sequence of ``num_tokens`` tokens (see the module docstring)."""

    cp_size: int
    cp_rank: int
    num_tokens: int  # T: the whole sequence, all CP ranks together
    local_index: torch.Tensor  # [T / c] int64: the global position of each local token
    gather_index: torch.Tensor  # [T] int64: the row of the rank-major all-gathered buffer of each position
    pieces: tuple[Piece, ...]  # this rank's query runs, in local order, covering [0, T / c)

    def to(self, device: torch.device) -> ContextParallelLayout:
        """The index tensors on ``device`` (the attention's gather reorders on the device)."""
        if self.gather_index.device == device:
            return self
        move = lambda t: t.pin_memory().to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(self, local_index=move(self.local_index), gather_index=move(self.gather_index))

    @property
    def num_local_tokens(self) -> int:
        return self.num_tokens // self.cp_size

    @property
    def max_piece_keys(self) -> int:
        """The most keys one piece attends to (a kernel's ``max_seqlen_k``)."""
        return max(ke - ks for _, _, ks, ke in self.pieces)

    @property
    def max_piece_queries(self) -> int:
        return max(le - ls for ls, le, _, _ in self.pieces)

    def attention_pairs(self) -> int:
        """(query, key) pairs this rank's causal attention computes: a piece of q queries ending at
        key ke, its document starting at ks, sees q (ke - ks) - q (q - 1) / 2 of them."""
        return sum((le - ls) * (ke - ks) - (le - ls) * (le - ls - 1) // 2 for ls, le, ks, ke in self.pieces)


def head_tail_chunks(start: int, length: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two chunks [a, b) of the span [start, start + length) that CP rank ``cp_rank`` holds."""
    k = length // (2 * cp_size)
    head = (start + cp_rank * k, start + (cp_rank + 1) * k)
    tail = (start + (2 * cp_size - 1 - cp_rank) * k, start + (2 * cp_size - cp_rank) * k)
    return head, tail


def _check_bounds(bounds: np.ndarray, num_tokens: int, what: str) -> None:
    if (
        bounds.ndim != 1
        or bounds.size < 2
        or bounds[0] != 0
        or bounds[-1] != num_tokens
        or np.any(np.diff(bounds) <= 0)
    ):
        shown = bounds.tolist() if bounds.size <= 8 else bounds[:4].tolist() + ["..."] + bounds[-2:].tolist()
        raise ValueError(
            f"context parallelism: {what} {shown} do not tile {num_tokens} tokens (need 0 = b_0 < b_1 < ... "
            f"< b_n = {num_tokens})"
        )


def get_owners(split_bounds: np.ndarray, cp_size: int) -> np.ndarray:
    """[T] the CP rank holding each position: chunk j of its span belongs to j, or 2c-1-j for j >= c."""
    num_tokens = int(split_bounds[-1])
    lengths = np.diff(split_bounds)
    bad = np.nonzero(lengths % (2 * cp_size))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"context parallelism: a span of {int(lengths[i])} tokens (at position {int(split_bounds[i])}; "
            f"{bad.size} of {lengths.size} spans) is not a multiple of 2 x CP = {2 * cp_size}: every document or "
            f"row must be padded to a multiple of 2c (--document-pad-multiple, --pad-to-multiple-of)"
        )
    positions = np.arange(num_tokens, dtype=np.int64)
    span = np.repeat(np.arange(lengths.size), lengths)
    chunk = (positions - split_bounds[span]) // (lengths[span] // (2 * cp_size))
    return np.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)


def build_pieces(local_index: np.ndarray, attention_bounds: np.ndarray) -> tuple[Piece, ...]:
    """The query runs of one rank: a new piece wherever its next local token is not the next global
    position or starts another document."""
    doc = np.searchsorted(attention_bounds, local_index, side="right") - 1
    breaks = np.nonzero((np.diff(local_index) != 1) | (np.diff(doc) != 0))[0] + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [local_index.size]))
    key_starts = attention_bounds[doc[starts]]
    key_ends = local_index[ends - 1] + 1
    return tuple(zip(starts.tolist(), ends.tolist(), key_starts.tolist(), key_ends.tolist()))


def build_layout(
    split_bounds: Sequence[int], attention_bounds: Sequence[int], cp_size: int, cp_rank: int
) -> ContextParallelLayout:
    """Rank ``cp_rank``'s layout of a sequence whose spans [split_bounds[i], split_bounds[i+1]) are
    each split head-tail over ``cp_size`` ranks, and whose documents [attention_bounds[j], ...) bound
    attention. ValueError when the bounds do not tile the sequence or a span is not a multiple of 2c."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} is not in [0, {cp_size})")
    split = np.asarray(split_bounds, dtype=np.int64)
    attention = np.asarray(attention_bounds, dtype=np.int64)
    num_tokens = int(split[-1]) if split.size else 0
    _check_bounds(split, num_tokens, "split boundaries")
    _check_bounds(attention, num_tokens, "document boundaries")
    owners = get_owners(split, cp_size)
    gathered = np.argsort(owners, kind="stable")  # rank-major: each rank's tokens in position order
    gather_index = np.empty_like(gathered)
    gather_index[gathered] = np.arange(num_tokens, dtype=np.int64)
    per_rank = num_tokens // cp_size
    local = gathered[cp_rank * per_rank : (cp_rank + 1) * per_rank]
    return ContextParallelLayout(
        cp_size=cp_size,
        cp_rank=cp_rank,
        num_tokens=num_tokens,
        local_index=torch.from_numpy(np.ascontiguousarray(local)),
        gather_index=torch.from_numpy(gather_index),
        pieces=build_pieces(local, attention),
    )


def build_document_layout(cu_seqlens: Sequence[int], cp_size: int, cp_rank: int) -> ContextParallelLayout:
    """Per-document head-tail (packed documents, each a multiple of 2c tokens)."""
    return build_layout(cu_seqlens, cu_seqlens, cp_size, cp_rank)


def build_row_layout(
    row_length: int, num_rows: int, cp_size: int, cp_rank: int, cu_seqlens: Sequence[int] | None = None
) -> ContextParallelLayout:
    """Row head-tail over ``num_rows`` rows of ``row_length`` tokens laid end to end (a THD sequence
    of GPTDataset windows, or one row of an unpacked micro-batch with ``num_rows`` 1); attention
    bounded by the documents ``cu_seqlens`` when given, else by the rows."""
    rows = [i * row_length for i in range(num_rows + 1)]
    return build_layout(rows, rows if cu_seqlens is None else cu_seqlens, cp_size, cp_rank)


def slice_local(t: torch.Tensor, layout: ContextParallelLayout, dim: int = -1) -> torch.Tensor:
    """``t``'s tokens along ``dim`` (of length T) that this rank holds, in local order."""
    return t.index_select(dim, layout.local_index.to(t.device))
