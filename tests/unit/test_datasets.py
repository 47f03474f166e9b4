"""megatron_ext.data.gpt_datasets on the shipped data, a NullTokenizer blend partner and mock data."""

import os
import shutil

import numpy
import pytest
import torch

from megatron_ext.data.gpt_datasets import (
    build_gpt_datasets,
    get_missing_dataset_files,
    parse_data_path,
    parse_split,
)
from megatron_ext.data.tokenizers import build_tokenizer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED_PREFIX = os.path.join(REPO, "data", "default", "corpus_text_document")
SHIPPED_MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")
SEQ = 64


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("SentencePieceTokenizer", SHIPPED_MODEL)


@pytest.fixture(scope="module")
def shipped_stream():
    """The shipped token stream as raw bytes, to find sample windows in (uint16 tokens)."""
    with open(SHIPPED_PREFIX + ".bin", "rb") as f:
        return f.read()


def contains_tokens(stream: bytes, tokens) -> bool:
    """Whether ``tokens`` occur contiguously, token-aligned, in the uint16 ``stream``."""
    needle = numpy.asarray(tokens, dtype=numpy.uint16).tobytes()
    start = stream.find(needle)
    while start != -1 and start % 2:
        start = stream.find(needle, start + 1)
    return start != -1


# ---- pure helpers -------------------------------------------------------------------------


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "7", "b"]) == (["a", "b"], [0.3, 7.0])
    for bad in (["0.3", "a", "b"], ["0.3", "a", "0.7"], [], ["1", "2"], ["-1", "a"]):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)


def test_parse_split_agrees_with_megatron_core():
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    for split in ("969,30,1", "98,2,0", "1", "3,1"):
        assert parse_split(split) == pytest.approx(parse_and_normalize_split(split))
    for bad in ("a,b", "0,0,0", "1,2,3,4", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_get_missing_dataset_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"")
    prefix = str(tmp_path / "x")
    assert get_missing_dataset_files([prefix, SHIPPED_PREFIX]) == [prefix + ".idx"]


# ---- megatron-core datasets ---------------------------------------------------------------


def test_samples_are_shifted_windows_of_the_corpus(tokenizer, shipped_stream, tmp_path):
    train, valid, test = build_gpt_datasets(
        tokenizer, SEQ, [200, 20, 0], [SHIPPED_PREFIX], split="98,2,0", path_to_cache=str(tmp_path)
    )
    assert test is None
    assert len(train) >= 200 and len(valid) >= 20
    for index in (0, 1, 57, len(train) - 1):
        sample = train[index]
        tokens, labels = sample["tokens"], sample["labels"]
        assert tokens.shape == labels.shape == (SEQ,)
        assert torch.equal(tokens[1:], labels[:-1])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ))
        assert torch.all(sample["loss_mask"] == 1)  # pad (3) never occurs, eod is trained on
        window = tokens.tolist() + [labels[-1].item()]  # seq_length + 1 tokens
        # Every piece of the window up to and including an EOD, and the tail, is real text.
        pieces, current = [], []
        for token in window:
            current.append(token)
            if token == tokenizer.eod:
                pieces.append(current)
                current = []
        pieces.append(current)
        assert all(contains_tokens(shipped_stream, piece) for piece in pieces if piece)
    assert sum(int((train[i]["tokens"] == tokenizer.eod).sum()) for i in range(50)) > 0


def test_blend_of_two_prefixes_follows_weights(tokenizer, tmp_path):
    from tools.preprocess_data import preprocess_data

    # Second dataset: ids 8100..8179 only, so a sample's source is visible from its tokens.
    path = tmp_path / "ids.jsonl"
    rng = numpy.random.default_rng(0)
    path.write_text(
        "".join(
            '{"text": "' + " ".join(map(str, rng.integers(8100, 8180, size=int(n)))) + '"}\n'
            for n in rng.integers(20, 200, size=300)
        )
    )
    preprocess_data(str(path), str(tmp_path / "ids"), "NullTokenizer", vocab_size=8191, append_eod=True, progress=False)
    high_prefix = str(tmp_path / "ids_text_document")
    num_train = 2000
    train, _, _ = build_gpt_datasets(
        tokenizer,
        SEQ,
        [num_train, 10, 10],
        ["0.25", SHIPPED_PREFIX, "0.75", high_prefix],
        split="90,5,5",
        path_to_cache=str(tmp_path / "cache"),
    )
    assert len(train) == num_train
    from_high = [bool(torch.all(train[i]["tokens"] >= 8100)) for i in range(num_train)]
    assert sum(from_high) / num_train == pytest.approx(0.75, abs=0.03)


def test_mock_data(tmp_path):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=500)
    train, valid, test = build_gpt_datasets(tokenizer, SEQ, [30, 5, 5], mock_data=True, path_to_cache=str(tmp_path))
    assert min(len(train), len(valid), len(test)) >= 5
    sample = train[3]
    assert sample["tokens"].shape == (SEQ,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["tokens"].max()) < tokenizer.vocab_size
    from megatron_ext.data.builder import describe_windows

    assert describe_windows(train, SEQ).startswith(f"> MockGPTDataset: {len(train)} samples")  # no files to name


def test_missing_files_name_data_path(tokenizer, tmp_path):
    shutil.copy(SHIPPED_PREFIX + ".bin", tmp_path / "only_bin.bin")
    for prefix, missing in ((str(tmp_path / "nope"), "nope.bin"), (str(tmp_path / "only_bin"), "only_bin.idx")):
        with pytest.raises(ValueError, match="--data-path") as info:
            build_gpt_datasets(tokenizer, SEQ, [10, 1, 1], [prefix], path_to_cache=str(tmp_path))
        assert missing in str(info.value)
    with pytest.raises(ValueError, match="--data-path"):
        build_gpt_datasets(tokenizer, SEQ, [10, 1, 1], None)


def test_weighted_blend_needs_all_sample_counts(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="sample count"):
        build_gpt_datasets(tokenizer, SEQ, [10, None, 1], ["1", SHIPPED_PREFIX], path_to_cache=str(tmp_path))


def test_an_unwritable_index_cache_names_data_cache_path(tokenizer, tmp_path):
    """megatron-core writes its index cache beside the data (read-only on many clusters) unless
    --data-cache-path says where: its failure is one error naming the flag, not a traceback."""
    from megatron_ext.config import ConfigError

    for suffix in (".bin", ".idx"):
        shutil.copy(SHIPPED_PREFIX + suffix, tmp_path / ("corpus" + suffix))
    (tmp_path / "corpus").write_text("a file where megatron-core's cache directory (<prefix>/cache) would be")
    with pytest.raises(ConfigError) as err:
        build_gpt_datasets(tokenizer, SEQ, [20, 2, 0], [str(tmp_path / "corpus")], split="98,2,0")
    assert "--data-cache-path" in str(err.value) and "Not a directory" in str(err.value), err.value


def test_the_window_line_says_how_many_epochs_the_run_reads(tokenizer, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.builder import describe_windows

    train, _, _ = build_gpt_datasets(
        tokenizer, SEQ, [2000, 20, 0], [SHIPPED_PREFIX], split="98,2,0", path_to_cache=str(tmp_path)
    )
    indexed = IndexedDataset(SHIPPED_PREFIX)  # kept: its lengths are a view of its memory map
    tokens = int(indexed.sequence_lengths[train.indices].sum())
    line = describe_windows(train, SEQ)
    assert f"over {len(train.indices)} documents ({tokens:,} tokens)" in line, line
    assert f"this run reads 2000 samples, {2000 * SEQ / tokens:.2f} epochs" in line, line


def test_mock_data_builds_without_megatron_cores_expected_noise(caplog):
    # without a cache path MockGPTDataset logged "Unable to save ... indexes" per split, and pad = EOD
    # (NullTokenizer's, our tokenizers' without a pad piece) warned of a pad collision per split
    import logging
    import warnings

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=500)
    assert tokenizer.pad == tokenizer.eod
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG):
        warnings.simplefilter("always")
        build_gpt_datasets(tokenizer, SEQ, [30, 5, 5], mock_data=True)
    assert not [w for w in caught if "pad token id" in str(w.message)], [str(w.message) for w in caught]
    assert "Unable to save" not in caplog.text
    assert "MockGPTDataset" in caplog.text  # megatron-core's other messages still pass
