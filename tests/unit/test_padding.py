"""Padding (pure): the step length, and what padding does to a sample's tensors and boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packed_dataset import build_packed_sample
from megatron_ext.data.padding import collate_padded, collate_step, get_step_length, join_packs, pad_sample


def test_step_length_rounds_up_and_never_exceeds_seq_length():
    assert get_step_length(1, 64, 512) == 64  # every micro-batch shorter than the multiple
    assert get_step_length(65, 64, 512) == 128
    assert get_step_length(512, 64, 512) == 512  # one exactly at --seq-length
    assert get_step_length(500, 64, 512) == 512
    with pytest.raises(ValueError, match="more than its longest possible length 512"):
        get_step_length(513, 64, 512)


def test_power_of_two_buckets_give_a_handful_of_lengths():
    lengths = {get_step_length(n, 64, 2048, "power-of-two") for n in range(1, 2049)}
    assert lengths == {64, 128, 256, 512, 1024, 2048}  # against 32 multiples of 64
    assert get_step_length(129, 64, 2048, "power-of-two") == 256 and get_step_length(65, 64, 192, "power-of-two") == 128
    assert get_step_length(129, 64, 192, "power-of-two") == 192  # capped at the longest length
    with pytest.raises(ValueError, match="--pad-length-bucket"):
        get_step_length(1, 64, 512, "pow2")


def test_pad_grows_the_last_document():
    s = build_packed_sample([np.array([1, 2, 3]), np.array([4, 5])])
    p = pad_sample(s, 8, pad_id=0)
    assert p["tokens"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert p["labels"].tolist()[5:] == [IGNORE_INDEX] * 3
    assert p["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert p["cu_seqlens"].tolist() == [0, 3, 8]  # no new (empty) document
    assert s["cu_seqlens"].tolist() == [0, 3, 5], "the input sample is not modified"


def test_only_document_grows_and_max_seqlen_is_recomputed():
    s = build_packed_sample([np.array([7, 8, 9])])
    mb = collate_padded([s], 16, pad_id=0)
    assert mb.cu_seqlens.tolist() == [0, 16] and mb.cu_seqlens_host == (0, 16)
    assert mb.max_seqlen == 16 and isinstance(mb.max_seqlen, int)
    assert mb.tokens.shape == (1, 16) and mb.num_real_tokens == 3 and mb.attention_pairs == 9


def test_rows_pad_to_the_same_length():
    rows = [build_packed_sample([np.arange(n)]) for n in (3, 9, 5)]
    for r in rows:
        del r["cu_seqlens"]
    mb = collate_padded(rows, 16, pad_id=1)
    assert mb.tokens.shape == (3, 16) and not mb.is_packed and mb.cu_seqlens_host is None
    assert int(mb.valid.sum()) == 2 + 8 + 4
    assert mb.num_real_tokens == 17 and mb.attention_pairs == 9 + 81 + 25


def test_packs_of_a_microbatch_join_into_one_thd_sequence():
    """--micro-batch-size 2 with packing: one THD row, the second pack's boundaries shifted; the
    padding grows only the very last document."""
    a = build_packed_sample([np.array([1, 2, 3]), np.array([4, 5])])
    b = build_packed_sample([np.array([6, 7, 8, 9])])
    joined = join_packs([a, b])
    assert joined["cu_seqlens"].tolist() == [0, 3, 5, 9] and joined["cu_seqlens"].dtype == torch.int32
    assert joined["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert joined["labels"].tolist() == [2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX]
    mb = collate_padded([a, b], 12, pad_id=0)
    assert mb.tokens.shape == (1, 12) and mb.cu_seqlens_host == (0, 3, 5, 12) and mb.max_seqlen == 7
    assert mb.num_real_tokens == 9 and mb.attention_pairs == 9 + 4 + 16


def test_joined_packs_negotiate_their_sum_capped_at_b_times_seq_length():
    """A micro-batch's length is the sum of its packs; static padding pads to b x --seq-length."""
    packs = [build_packed_sample([np.arange(n)]) for n in (10, 7, 16, 3)]
    mbs, length = collate_step([packs[:2], packs[2:]], "negotiated", None, 8, 32, pad_id=0)
    assert length == 24 and [m.num_real_tokens for m in mbs] == [17, 19]  # max 19 -> 24
    mbs, length = collate_step([packs[:2], packs[2:]], "static", None, 8, 32, pad_id=0)
    assert length == 32 and all(m.tokens.shape == (1, 32) for m in mbs)
