"""tools/: corpus builder, tokenizer trainer and preprocess_data, checked against direct
tokenisation and megatron-core's own IndexedDataset reader."""

import json
import os

import numpy
import pytest

from tools.build_default_corpus import build_default_corpus
from tools.preprocess_data import main as preprocess_main
from tools.preprocess_data import preprocess_data
from tools.train_tokenizer import train_tokenizer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED_MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2\n",
    "",  # tokenizes to nothing: a document without a sequence, as Megatron-LM writes it
    "Unicode survives: naïve café, 数据.",
    "A longer document. " * 40,
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text, "id": len(text)}) + "\n")
    return str(path)


def read_documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return dataset, [dataset[i].tolist() for i in range(len(dataset))]


@pytest.fixture
def tiny_jsonl(tmp_path):
    return write_jsonl(tmp_path / "tiny.jsonl", DOCS)


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_sentencepiece_matches_direct_tokenisation(tmp_path, tiny_jsonl, append_eod):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=SHIPPED_MODEL)
    expected = [sp.encode(t) + ([sp.eos_id()] if append_eod else []) for t in DOCS if t]
    stats = preprocess_data(tiny_jsonl, str(tmp_path / "out"), "SentencePieceTokenizer",
                            SHIPPED_MODEL, append_eod=append_eod, progress=False)
    dataset, documents = read_documents(str(tmp_path / "out_text_document"))
    assert documents == expected
    assert dataset.index.dtype == numpy.uint16
    assert stats.num_documents == 5 and stats.num_empty == 1
    assert dataset.document_indices.tolist() == [0, 1, 2, 2, 3, 4]  # the empty third document holds no sequence
    assert stats.num_tokens["text"] == sum(map(len, expected))


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_null_tokenizer(tmp_path, append_eod):
    texts = ["3 1 4 1 5", "9 2 6", "5 3 5 8 9 7 9"]
    path = write_jsonl(tmp_path / "ids.jsonl", texts)
    preprocess_data(path, str(tmp_path / "ids"), "NullTokenizer", vocab_size=10,
                    append_eod=append_eod, progress=False)
    _, documents = read_documents(str(tmp_path / "ids_text_document"))
    expected = [[int(x) for x in t.split()] + ([10] if append_eod else []) for t in texts]
    assert documents == expected


def test_workers_do_not_change_output(tmp_path):
    texts = [f"Document number {i}: " + "word " * (i % 17) for i in range(300)]
    path = write_jsonl(tmp_path / "many.jsonl", texts)
    for workers in (1, 2):
        preprocess_data(path, str(tmp_path / f"w{workers}"), "SentencePieceTokenizer",
                        SHIPPED_MODEL, append_eod=True, workers=workers, progress=False)
    for ext in (".bin", ".idx"):
        with open(tmp_path / f"w1_text_document{ext}", "rb") as a, \
                open(tmp_path / f"w2_text_document{ext}", "rb") as b:
            assert a.read() == b.read()


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_json_names_line_and_leaves_nothing(tmp_path, workers):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 4"):
        preprocess_data(str(path), str(tmp_path / "out"), "SentencePieceTokenizer",
                        SHIPPED_MODEL, workers=workers, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_missing_json_key_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", ["abc"], key="content")
    with pytest.raises(ValueError, match="line 1: no key 'text'"):
        preprocess_data(path, str(tmp_path / "out"), "NullTokenizer", vocab_size=10,
                        progress=False)


def test_cli_writes_megatron_lm_names(tmp_path, tiny_jsonl, capsys):
    preprocess_main(["--input", tiny_jsonl, "--output-prefix", str(tmp_path / "cli"),
                     "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                     SHIPPED_MODEL, "--append-eod", "--workers", "2", "--no-progress"])
    assert {"cli_text_document.bin", "cli_text_document.idx"} <= set(os.listdir(tmp_path))
    assert "5 documents" in capsys.readouterr().out
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        preprocess_main(["--input", tiny_jsonl, "--output-prefix", str(tmp_path / "x"),
                         "--tokenizer-type", "NullTokenizer", "--no-progress"])
    assert exit_info.value.code == 2  # a user error: one error block on stderr, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--vocab-size" in err


def test_build_default_corpus_small(tmp_path):
    from pydoc_data.topics import topics

    out = str(tmp_path / "corpus.jsonl")
    info = build_default_corpus(out, max_bytes=60_000, min_chars=200, packages=())
    with open(out, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    # Independent expectation: the first pydoc topics (sorted keys) that fit in the budget.
    expected, size = [], 0
    for key in sorted(topics):
        text = topics[key].strip()
        if len(text) < 200 or text in expected:
            continue
        if size + len(text.encode()) > 60_000:
            break
        expected.append(text)
        size += len(text.encode())
    assert texts == expected
    assert len(set(texts)) == len(texts) == info["documents"] > 3
    assert info["bytes"] == size <= 60_000
    assert len({len(t) for t in texts}) > 1  # varied lengths


def test_build_default_corpus_is_deterministic_and_reaches_docstrings(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    for path in (a, b):
        build_default_corpus(path, max_bytes=700_000, packages=())
    with open(a, "rb") as fa, open(b, "rb") as fb:
        content = fa.read()
        assert content == fb.read()
    texts = [json.loads(line)["text"] for line in content.decode().splitlines()]
    import argparse
    import inspect

    assert inspect.cleandoc(argparse.__doc__) in texts  # stdlib docstrings follow the topics


def test_train_tokenizer_defines_special_ids_and_is_deterministic(tmp_path):
    import sentencepiece

    corpus = str(tmp_path / "c.jsonl")
    build_default_corpus(corpus, max_bytes=200_000, packages=())
    models = [train_tokenizer(corpus, str(tmp_path / name), vocab_size=512)
              for name in ("t1", "t2")]
    sp, sp2 = (sentencepiece.SentencePieceProcessor(model_file=m) for m in models)
    # The .model bytes embed the output prefix, so compare the learned pieces and scores.
    assert [(sp.id_to_piece(i), sp.get_score(i)) for i in range(512)] == \
        [(sp2.id_to_piece(i), sp2.get_score(i)) for i in range(512)]
    assert sp.get_piece_size() == 512
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert sp.eos_id() == 2 and sp.pad_id() == 3


def test_train_tokenizer_names_a_vocabulary_size_the_text_cannot_fill(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"tiny text {i}"}) for i in range(20)) + "\n")
    with pytest.raises(ValueError, match=r"--vocab-size 32000 is more pieces than .*c.jsonl holds: give --vocab-size \d+ or less"):
        train_tokenizer(str(corpus), str(tmp_path / "t"), vocab_size=32000)
    with pytest.raises(ValueError, match="--vocab-size 100 is too small"):
        train_tokenizer(str(corpus), str(tmp_path / "t"), vocab_size=100)


def megatron_lm_reference(path, prefix, tokenizer, append_eod):
    """What Megatron-LM's tools/preprocess_data.py writes (its Encoder and main loop, written out
    here for one key without sentence splitting): every JSON line is a document; its ids, EOD
    appended only when it has ids; ``add_document(ids, [len])``, or ``add_document([], [])``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    with open(path, encoding="utf-8") as f:
        for line in f:
            doc_ids, lens = [], []
            ids = tokenizer.tokenize(json.loads(line)["text"])
            if len(ids) > 0:
                doc_ids.extend(ids)
                lens.append(len(ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(tokenizer.eod)
                lens[-1] += 1
            builder.add_document(numpy.asarray(doc_ids, dtype=dtype), lens)
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_is_byte_identical_to_megatron_lm_with_empty_documents(tmp_path, append_eod):
    from megatron_ext.data.tokenizers import build_tokenizer

    texts = ["", "First document.", "", "", "Second one, after empty ones.", ""]
    path = write_jsonl(tmp_path / "empty.jsonl", texts)
    preprocess_data(path, str(tmp_path / "ours"), "SentencePieceTokenizer", SHIPPED_MODEL,
                    append_eod=append_eod, progress=False)
    megatron_lm_reference(path, str(tmp_path / "theirs"), build_tokenizer("SentencePieceTokenizer", SHIPPED_MODEL),
                          append_eod)
    for ext in (".bin", ".idx"):
        with open(tmp_path / f"ours_text_document{ext}", "rb") as a, open(tmp_path / f"theirs{ext}", "rb") as b:
            assert a.read() == b.read(), ext
