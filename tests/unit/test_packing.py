"""Packing invariants (pure): every token kept exactly once, order kept within a document,
bins within --seq-length, boundaries monotone and ending at the sample length, no empty document,
labels never crossing a document."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packed_dataset import build_packed_sample, check_index_matches_documents, get_split_ranges
from megatron_ext.data.packing import STRATEGIES, PackingIndex, build_packing_index, check_packing_index

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lengths(seed: int, n: int = 500) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(4.0, 1.2, n).astype(np.int64)
    lengths[rng.integers(0, n, 5)] = 0  # empty documents are skipped, never packed
    lengths[rng.integers(0, n, 5)] = 1000  # longer than any bin: split, never dropped
    return lengths


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_token_once_in_order_within_bins(strategy, seed):
    lengths = _lengths(seed)
    index = build_packing_index(np.arange(len(lengths)), lengths, 256, strategy)
    check_packing_index(index, {d: int(n) for d, n in enumerate(lengths)}, 256)
    assert index.bin_lengths().max() <= 256 and index.piece_len.min() > 0
    assert index.piece_len.sum() == lengths.sum()
    # a 1000-token document is split into ceil(1000/256) = 4 pieces
    long_doc = int(np.flatnonzero(lengths == 1000)[0])
    assert (index.piece_doc == long_doc).sum() == 4


def test_best_fit_leaves_fewer_pad_tokens_than_sequential():
    lengths = _lengths(3, 2000)
    seq = build_packing_index(np.arange(len(lengths)), lengths, 512, "sequential")
    best = build_packing_index(np.arange(len(lengths)), lengths, 512, "best_fit")
    assert best.num_bins < seq.num_bins
    assert best.efficiency(512) > 0.95 > seq.efficiency(512)


def test_sequential_keeps_corpus_order():
    lengths = np.array([5, 7, 3, 9, 2])
    index = build_packing_index(np.arange(5), lengths, 10, "sequential")
    assert index.piece_doc.tolist() == [0, 1, 2, 3, 4]
    assert index.bin_lengths().tolist() == [5, 10, 9, 2]


def test_check_catches_a_corrupted_index():
    lengths = np.array([5, 7, 3])
    index = build_packing_index(np.arange(3), lengths, 8, "best_fit")
    broken = PackingIndex(index.piece_doc[1:], index.piece_start[1:], index.piece_len[1:], index.bin_offsets[1:] - 1)
    with pytest.raises(ValueError):
        check_packing_index(broken, {0: 5, 1: 7, 2: 3}, 8)
    with pytest.raises(ValueError, match="delete it"):
        check_index_matches_documents(index, np.array([5, 7]), "cache.npz")


def test_packed_sample_boundaries_positions_and_labels():
    docs = [np.array([10, 11, 12]), np.array([20]), np.array([30, 31])]
    s = build_packed_sample(docs)
    assert s["tokens"].tolist() == [10, 11, 12, 20, 30, 31]
    assert s["cu_seqlens"].tolist() == [0, 3, 4, 6] and s["cu_seqlens"].dtype == torch.int32
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 0, 1]
    # a document's last token predicts nothing: never the next document's first token
    assert s["labels"].tolist() == [11, 12, IGNORE_INDEX, IGNORE_INDEX, 31, IGNORE_INDEX]
    assert "loss_mask" not in s  # validity has one encoding: the labels


def test_split_ranges_cover_all_documents():
    assert get_split_ranges(100, [98, 2, 0]) == [(0, 98), (98, 100), (100, 100)]
    ranges = get_split_ranges(3663, [969, 30, 1])
    assert ranges[0][0] == 0 and ranges[-1][1] == 3663
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_real_corpus_train_split_keeps_every_token_once(tmp_path):
    """On the shipped corpus: the packed train split reproduces each document's tokens exactly."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.packed_dataset import build_packed_datasets

    prefix = os.path.join(ROOT, "data", "default", "corpus_text_document")
    train, _, _ = build_packed_datasets(prefix, [1.0], 256, "best_fit", 0, [1, 1, 1], str(tmp_path))
    indexed = IndexedDataset(prefix)
    rebuilt: dict[int, list[np.ndarray]] = {}
    for b in range(train.index.num_bins):
        lo, hi = train.index.bin_offsets[b], train.index.bin_offsets[b + 1]
        sample = train[b]  # epoch 0 visits every bin once (shuffled)
        cu = sample["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == len(sample["tokens"]) <= 256
        assert all(x < y for x, y in zip(cu, cu[1:]))
    for d, s, n in zip(train.index.piece_doc, train.index.piece_start, train.index.piece_len):
        rebuilt.setdefault(int(d), []).append((int(s), indexed.get(int(d), offset=int(s), length=int(n))))
    for d in range(len(indexed)):
        pieces = [p for _, p in sorted(rebuilt[d], key=lambda x: x[0])]
        assert np.array_equal(np.concatenate(pieces), indexed[d])
    assert os.listdir(tmp_path), "the packing index is cached"
