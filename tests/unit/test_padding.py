"""Padding (pure): the step length, and what padding does to a sample's tensors and boundaries."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packed_dataset import build_packed_sample
from megatron_ext.data.padding import collate_padded, get_step_length, pad_sample
import numpy as np


def test_step_length_rounds_up_and_never_exceeds_seq_length():
    assert get_step_length(1, 64, 512) == 64  # every micro-batch shorter than the multiple
    assert get_step_length(65, 64, 512) == 128
    assert get_step_length(512, 64, 512) == 512  # one exactly at --seq-length
    assert get_step_length(500, 64, 512) == 512
    with pytest.raises(ValueError, match="more than --seq-length"):
        get_step_length(513, 64, 512)


def test_pad_grows_the_last_document():
    s = build_packed_sample([np.array([1, 2, 3]), np.array([4, 5])])
    p = pad_sample(s, 8, pad_id=0)
    assert p["tokens"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert p["labels"].tolist()[5:] == [IGNORE_INDEX] * 3
    assert p["loss_mask"].tolist()[5:] == [0, 0, 0]
    assert p["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert p["cu_seqlens"].tolist() == [0, 3, 8]  # no new (empty) document
    assert s["cu_seqlens"].tolist() == [0, 3, 5], "the input sample is not modified"


def test_only_document_grows_and_max_seqlen_is_recomputed():
    s = build_packed_sample([np.array([7, 8, 9])])
    mb = collate_padded([s], 16, pad_id=0)
    assert mb["cu_seqlens"].tolist() == [0, 16]
    assert mb["max_seqlen"] == 16 and isinstance(mb["max_seqlen"], int)
    assert mb["tokens"].shape == (1, 16) and mb["num_real_tokens"] == 3


def test_rows_pad_to_the_same_length():
    rows = [build_packed_sample([np.arange(n)]) for n in (3, 9, 5)]
    for r in rows:
        del r["cu_seqlens"]
    mb = collate_padded(rows, 16, pad_id=1)
    assert mb["tokens"].shape == (3, 16) and "cu_seqlens" not in mb
    assert int((mb["labels"] != IGNORE_INDEX).sum()) == 2 + 8 + 4
    with pytest.raises(ValueError, match="--micro-batch-size 1"):
        collate_padded([build_packed_sample([np.arange(3)])] * 2, 8, 0)
