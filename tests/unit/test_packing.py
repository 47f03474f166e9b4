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


def _write_sentence_dataset(prefix: str, docs: list[list[list[int]]]) -> None:
    """A Megatron-LM --split-sentences style dataset: each document several sequences (sentences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.tensor([t for sentence in doc for t in sentence]), [len(x) for x in doc])
    builder.finalize(prefix + ".idx")


def test_documents_of_several_sequences_are_packed_whole(tmp_path):
    """Sentences of one document are one document: packed together, positions running on, the
    last token of a sentence predicting the next sentence's first (only the document's last
    predicts nothing)."""
    from megatron_ext.data.packed_dataset import build_packed_datasets

    rng = np.random.default_rng(0)
    docs = [
        [list(rng.integers(1, 1000, int(rng.integers(2, 9)))) for _ in range(int(rng.integers(1, 5)))]
        for _ in range(40)
    ]
    prefix = str(tmp_path / "sent_text_sentence")
    _write_sentence_dataset(prefix, docs)
    train, _, _ = build_packed_datasets(prefix, [1.0], 64, "best_fit", 0, [1, 1, 1], str(tmp_path))
    whole = {tuple(t for sentence in doc for t in sentence) for doc in docs}
    seen = []
    for b in range(train.index.num_bins):
        sample = train[b]
        cu = sample["cu_seqlens"].tolist()
        for s, e in zip(cu, cu[1:]):
            tokens = tuple(sample["tokens"][s:e].tolist())
            assert tokens in whole, f"bin {b} holds {tokens}: not one whole document"
            assert sample["position_ids"][s:e].tolist() == list(range(e - s))
            assert sample["labels"][s : e - 1].tolist() == list(tokens[1:]) and sample["labels"][e - 1] == IGNORE_INDEX
            seen.append(tokens)
    assert sorted(seen) == sorted(tuple(t for sentence in doc for t in sentence) for doc in docs)


@pytest.mark.parametrize("strategy", STRATEGIES + ("one_per_row",))
def test_a_document_longer_than_seq_length_keeps_every_label(tmp_path, strategy):
    """Against a per-document reference: a document cut into pieces of at most --seq-length still
    predicts each next token of its own, across the cut (a piece's last token predicts the next
    piece's first, as a megatron-core GPTDataset window does); only the document's last token
    predicts nothing. The cut once dropped that label, one per --seq-length tokens."""
    from megatron_ext.data.packed_dataset import build_packed_datasets

    docs = [list(range(1, 41)), [50, 51, 52], list(range(60, 76)), list(range(80, 97))]  # 40, 3, 16, 17 tokens
    prefix = str(tmp_path / "long_text_document")
    _write_sentence_dataset(prefix, [[d] for d in docs])
    train, _, _ = build_packed_datasets(prefix, [1.0], 16, strategy, 0, [1, 1, 1], str(tmp_path / "cache"))
    expected = {
        (d, i): (doc[i + 1] if i + 1 < len(doc) else IGNORE_INDEX)
        for d, doc in enumerate(docs)
        for i in range(len(doc))
    }
    got = {}
    for i in range(train.index.num_bins):  # epoch 0: every bin once
        sample, b = train[i], train._bin(i)
        lo, hi = train.index.bin_offsets[b], train.index.bin_offsets[b + 1]
        at = 0
        for d, s, n in zip(train.index.piece_doc[lo:hi], train.index.piece_start[lo:hi], train.index.piece_len[lo:hi]):
            for k in range(int(n)):
                got[(int(d), int(s) + k)] = int(sample["labels"][at + k])
            at += int(n)
    assert got == expected


def test_a_split_of_empty_documents_is_refused_by_name(tmp_path):
    """A --split range whose documents hold no token (empty texts preprocessed without
    --append-eod) packs into no bin: refused at build time naming --split, as a range without
    documents is, instead of a ZeroDivisionError at the first evaluation."""
    from megatron_ext.config import ConfigError
    from megatron_ext.data.packed_dataset import build_packed_datasets

    prefix = str(tmp_path / "tail_text_document")
    _write_sentence_dataset(prefix, [[[1, 2, 3]] for _ in range(9)] + [[]])  # the last document is empty
    with pytest.raises(ConfigError, match=r"--split 9,1,0 leaves valid of .*tail_text_document.* without tokens"):
        build_packed_datasets(prefix, [0.9, 0.1, 0.0], 16, "best_fit", 0, [3, 2, 1], str(tmp_path), split_flag="9,1,0")
    train, valid, _ = build_packed_datasets(
        prefix, [0.9, 0.1, 0.0], 16, "best_fit", 0, [3, 2, 1], str(tmp_path), unused_splits=(1, 2)
    )  # without evaluation nothing reads it
    assert valid is None and len(train) >= 3


def test_a_dataset_written_again_gets_a_new_packing_index(tmp_path):
    """The index is keyed on the documents' lengths: preprocessing another corpus into the same
    prefix must not reuse the old index (it read a shorter corpus without a word)."""
    from megatron_ext.data.packed_dataset import build_packed_datasets

    prefix = str(tmp_path / "x_text_document")
    _write_sentence_dataset(prefix, [[[1, 2, 3]] for _ in range(20)])
    first, _, _ = build_packed_datasets(prefix, [1.0], 16, "best_fit", 0, [1, 1, 1], str(tmp_path / "cache"))
    _write_sentence_dataset(prefix, [[[1, 2, 3, 4, 5, 6, 7]] for _ in range(20)])
    again, _, _ = build_packed_datasets(prefix, [1.0], 16, "best_fit", 0, [1, 1, 1], str(tmp_path / "cache"))
    assert int(first.index.piece_len.sum()) == 60 and int(again.index.piece_len.sum()) == 140
    assert len(os.listdir(tmp_path / "cache")) == 2


def test_an_unwritable_cache_directory_names_data_cache_path(tmp_path):
    from megatron_ext.config import ConfigError
    from megatron_ext.data.packed_dataset import build_packed_datasets

    prefix = str(tmp_path / "ro_text_document")
    _write_sentence_dataset(prefix, [[[1, 2, 3]] for _ in range(5)])
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    with pytest.raises(ConfigError) as err:
        build_packed_datasets(prefix, [1.0], 16, "best_fit", 0, [1, 1, 1], str(blocked / "cache"))
    assert "--data-cache-path" in str(err.value) and not list(tmp_path.glob("**/*.tmp-*")), err.value


def _best_fit_reference(lengths: np.ndarray, seq_length: int) -> list[list[int]]:
    """Best-fit decreasing, plainly: each piece into the bin with the least room that fits; among
    equal rooms the bin that reached that room last; else a new bin."""
    bins, rooms, stamp, clock = [], [], [], 0
    for p in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[p])
        fits = [b for b in range(len(bins)) if rooms[b] >= n]
        if not fits:
            bins.append([p]), rooms.append(seq_length - n), stamp.append(clock)
        else:
            b = min(fits, key=lambda b: (rooms[b], -stamp[b]))
            bins[b].append(p)
            rooms[b] -= n
            stamp[b] = clock
        clock += 1
    return bins


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_matches_a_plain_reference(seed):
    from megatron_ext.data.packing import pack_best_fit

    lengths = np.minimum(64, np.maximum(1, np.random.default_rng(seed).lognormal(2.5, 1.0, 300).astype(np.int64)))
    order, offsets = pack_best_fit(lengths, 64)
    got = [order[offsets[b] : offsets[b + 1]].tolist() for b in range(len(offsets) - 1)]
    assert got == _best_fit_reference(lengths, 64)


def test_an_unreadable_index_cache_is_named_with_its_fix_and_rebuilt_once_deleted(tmp_path):
    """A cache cut short (a crash of a version that did not fsync it) gives one error naming the file
    and saying it may be deleted, not numpy's BadZipFile; deleted, it is rebuilt equal."""
    from megatron_ext.config import ConfigError
    from megatron_ext.data.packed_dataset import load_or_build_arrays

    path = str(tmp_path / "d_packed_0123.npz")
    built = {"a": np.arange(1000, dtype=np.int64), "b": np.ones(7)}
    first = load_or_build_arrays(path, lambda: built)
    assert all(np.array_equal(first[k], built[k]) for k in built)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ConfigError, match="d_packed_0123.npz cannot be read.*delete it"):
        load_or_build_arrays(path, lambda: pytest.fail("a cache that exists is not rebuilt silently"))
    os.remove(path)
    again = load_or_build_arrays(path, lambda: built)
    assert all(np.array_equal(again[k], built[k]) for k in built)
