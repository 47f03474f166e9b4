"""--tokenizer-type TikTokenizer (issue 31): Megatron's tiktoken vocabulary (.json) through
megatron-core's TikTokenTokenizer. The vocabulary is made here: the 256 bytes plus BPE merges learned
from this repository's README by a few lines of Python (nothing is downloaded). The reference is
tiktoken's own Encoding over the same ranks, shifted by the special ids as Megatron lays them out."""

from __future__ import annotations

import base64
import collections
import json
import os

import numpy
import pytest

from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.config import ConfigError
from megatron_ext.data.tokenizers import build_tokenizer
from tools.preprocess_data import preprocess_data

tiktoken = pytest.importorskip("tiktoken")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEXTS = ["Pipeline parallelism splits the layers.", "", "naïve café: 3 + 4 = 7\nand the tensor parallel ranks"]


def _learn_merges(text: bytes, merges: int) -> list[bytes]:
    """Byte-level BPE on whole words: the most frequent adjacent pair becomes the next rank."""
    words = collections.Counter(tuple(bytes([b]) for b in w) for w in text.split(b" ") if w)
    vocab = [bytes([i]) for i in range(256)]
    for _ in range(merges):
        pairs = collections.Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        vocab.append(a + b)
        merged = collections.Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return vocab


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    with open(os.path.join(REPO, "README.md"), "rb") as f:
        ranks = _learn_merges(f.read(), 150)
    path = str(tmp_path_factory.mktemp("tiktoken") / "vocab.json")
    entries = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for i, t in enumerate(ranks)
    ]
    with open(path, "w") as f:
        json.dump(entries, f)
    return path, ranks


def _reference(ranks: list[bytes], pattern: str):
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mod

    pat = {"v1": mod._PATTERN_TIKTOKEN_V1, "v2": mod._PATTERN_TIKTOKEN_V2}[pattern]
    return tiktoken.Encoding(
        name="ref", pat_str=pat, mergeable_ranks={t: i for i, t in enumerate(ranks)}, special_tokens={}
    )


@pytest.mark.parametrize("pattern, num_special", [("v2", 1000), ("v1", 16)])
def test_ids_are_tiktokens_ranks_after_the_special_ids(vocab, pattern, num_special):
    path, ranks = vocab
    size = num_special + len(ranks)
    tok = build_tokenizer("TikTokenizer", path, size, tiktoken_pattern=pattern, tiktoken_num_special_tokens=num_special)
    ref = _reference(ranks, pattern)
    assert (tok.vocab_size, tok.eod, tok.pad) == (size, 2, 4)  # </s> and <pad> of the default special list
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == [num_special + r for r in ref.encode(text)]
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize(TEXTS[0])) < len(TEXTS[0].encode())  # the merges are used


def test_preprocessing_writes_the_tokenizer_ids_and_eod(vocab, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path, ranks = vocab
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    size = 1000 + len(ranks)
    options = dict(tiktoken_pattern="v2", tiktoken_num_special_tokens=1000, tiktoken_special_tokens=None)
    prefix = str(tmp_path / "out")
    preprocess_data(
        str(jsonl), prefix, "TikTokenizer", path, size, append_eod=True, progress=False, tiktoken_options=options
    )
    ref = _reference(ranks, "v2")
    expected = [[1000 + r for r in ref.encode(t)] + [2] for t in TEXTS if t]
    data = IndexedDataset(prefix + "_text_document")
    assert [numpy.asarray(data[i]).tolist() for i in range(len(data))] == expected


def test_the_identity_changes_with_the_options(vocab):
    path, ranks = vocab
    size = 1000 + len(ranks)
    a, b = (build_tokenizer("TikTokenizer", path, size, tiktoken_pattern=p) for p in ("v2", "v1"))
    assert a.identity() != b.identity()  # a checkpoint trained with one refuses the other
    assert a.identity() == build_tokenizer("TikTokenizer", path, size, tiktoken_pattern="v2").identity()


def test_bad_tiktoken_input_is_one_error_naming_the_flag(vocab, tmp_path):
    path, ranks = vocab
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"not": "a list"}')
    cases = [
        (dict(tokenizer_model=str(tmp_path / "missing.json")), "needs --tokenizer-model PATH.json"),
        (dict(tokenizer_model=str(tmp_path)), "needs --tokenizer-model PATH.json"),
        (dict(tokenizer_model=path), "--vocab-size 131072 needs 130072 ranks"),  # megatron-core's default size
        (dict(tokenizer_model=str(bad_json), vocab_size=1100), "not Megatron's tiktoken vocabulary"),
        (
            dict(tokenizer_model=path, vocab_size=1000 + len(ranks), tiktoken_special_tokens=["<s>", "</s>"]),
            "--tiktoken-special-tokens must name each token once and include <unk>",
        ),
        (
            dict(tokenizer_model=path, vocab_size=200, tiktoken_num_special_tokens=300),
            "--tiktoken-num-special-tokens 300",
        ),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ConfigError) as err:
            build_tokenizer("TikTokenizer", **kwargs)
        assert len(err.value.problems) == 1 and needle in err.value.problems[0], err.value.problems


def test_the_flags_parse_and_are_noted_with_another_tokenizer(vocab):
    path, ranks = vocab
    argv = ["--mock-data", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", path]
    argv += [
        "--vocab-size",
        str(1000 + len(ranks)),
        "--tiktoken-pattern",
        "v1",
        "--tiktoken-num-special-tokens",
        "1000",
    ]
    cfg, notes = parse_args_with_notes(argv)
    assert (cfg.data.tokenizer_type, cfg.data.tiktoken_pattern, notes) == ("TikTokenizer", "v1", [])
    cfg, notes = parse_args_with_notes(["--mock-data", "--tiktoken-pattern", "v2"])
    assert [n for n in notes if n.startswith("--tiktoken-pattern v2 changes nothing")], notes
