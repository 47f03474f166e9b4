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
    stats = preprocess_data(
        tiny_jsonl,
        str(tmp_path / "out"),
        "SentencePieceTokenizer",
        SHIPPED_MODEL,
        append_eod=append_eod,
        progress=False,
    )
    dataset, documents = read_documents(str(tmp_path / "out_text_document"))
    assert documents == expected
    assert dataset.index.dtype == numpy.uint16
    assert stats.num_documents == 5 and stats.num_empty == {"text": 1}
    assert dataset.document_indices.tolist() == [0, 1, 2, 2, 3, 4]  # the empty third document holds no sequence
    assert stats.num_tokens["text"] == sum(map(len, expected))


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_null_tokenizer(tmp_path, append_eod):
    texts = ["3 1 4 1 5", "9 2 6", "5 3 5 8 9 7 9"]
    path = write_jsonl(tmp_path / "ids.jsonl", texts)
    preprocess_data(path, str(tmp_path / "ids"), "NullTokenizer", vocab_size=10, append_eod=append_eod, progress=False)
    _, documents = read_documents(str(tmp_path / "ids_text_document"))
    expected = [[int(x) for x in t.split()] + ([10] if append_eod else []) for t in texts]
    assert documents == expected


def test_workers_do_not_change_output(tmp_path):
    texts = [f"Document number {i}: " + "word " * (i % 17) for i in range(300)]
    path = write_jsonl(tmp_path / "many.jsonl", texts)
    for workers in (1, 2):
        preprocess_data(
            path,
            str(tmp_path / f"w{workers}"),
            "SentencePieceTokenizer",
            SHIPPED_MODEL,
            append_eod=True,
            workers=workers,
            progress=False,
        )
    for ext in (".bin", ".idx"):
        with open(tmp_path / f"w1_text_document{ext}", "rb") as a, open(tmp_path / f"w2_text_document{ext}", "rb") as b:
            assert a.read() == b.read()


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_json_names_line_and_leaves_nothing(tmp_path, workers):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 4"):
        preprocess_data(
            str(path), str(tmp_path / "out"), "SentencePieceTokenizer", SHIPPED_MODEL, workers=workers, progress=False
        )
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_missing_json_key_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", ["abc"], key="content")
    with pytest.raises(ValueError, match="line 1: no key 'text'"):
        preprocess_data(path, str(tmp_path / "out"), "NullTokenizer", vocab_size=10, progress=False)


def test_cli_writes_megatron_lm_names(tmp_path, tiny_jsonl, capsys):
    preprocess_main(
        [
            "--input",
            tiny_jsonl,
            "--output-prefix",
            str(tmp_path / "cli"),
            "--tokenizer-type",
            "GPTSentencePieceTokenizer",
            "--tokenizer-model",
            SHIPPED_MODEL,
            "--append-eod",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert {"cli_text_document.bin", "cli_text_document.idx"} <= set(os.listdir(tmp_path))
    assert "5 documents" in capsys.readouterr().out
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        preprocess_main(
            [
                "--input",
                tiny_jsonl,
                "--output-prefix",
                str(tmp_path / "x"),
                "--tokenizer-type",
                "NullTokenizer",
                "--no-progress",
            ]
        )
    assert exit_info.value.code == 2  # a user error: one error block on stderr, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--vocab-size" in err


def test_cli_unwritable_output_prefix_is_one_error(tmp_path, tiny_jsonl, capsys):
    # an --output-prefix under a file (or a read-only directory) ended in a PermissionError traceback
    (tmp_path / "file").write_text("x")
    prefix = str(tmp_path / "file" / "out")
    argv = ["--input", tiny_jsonl, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer"]
    with pytest.raises(SystemExit) as exit_info:
        preprocess_main(argv + ["--vocab-size", "300", "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and f"(writing --output-prefix {prefix})" in err, err
    assert sorted(os.listdir(tmp_path)) == ["file", "tiny.jsonl"]


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
    models = [train_tokenizer(corpus, str(tmp_path / name), vocab_size=512) for name in ("t1", "t2")]
    sp, sp2 = (sentencepiece.SentencePieceProcessor(model_file=m) for m in models)
    # The .model bytes embed the output prefix, so compare the learned pieces and scores.
    assert [(sp.id_to_piece(i), sp.get_score(i)) for i in range(512)] == [
        (sp2.id_to_piece(i), sp2.get_score(i)) for i in range(512)
    ]
    assert sp.get_piece_size() == 512
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert sp.eos_id() == 2 and sp.pad_id() == 3


def test_train_tokenizer_names_a_vocabulary_size_the_text_cannot_fill(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"tiny text {i}"}) for i in range(20)) + "\n")
    with pytest.raises(
        ValueError, match=r"--vocab-size 32000 is more pieces than .*c.jsonl holds: give --vocab-size \d+ or less"
    ):
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
    preprocess_data(
        path, str(tmp_path / "ours"), "SentencePieceTokenizer", SHIPPED_MODEL, append_eod=append_eod, progress=False
    )
    megatron_lm_reference(
        path, str(tmp_path / "theirs"), build_tokenizer("SentencePieceTokenizer", SHIPPED_MODEL), append_eod
    )
    for ext in (".bin", ".idx"):
        with open(tmp_path / f"ours_text_document{ext}", "rb") as a, open(tmp_path / f"theirs{ext}", "rb") as b:
            assert a.read() == b.read(), ext


def _write_lines(path, records):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    return str(path)


def test_split_long_line_cuts_bytes_at_whitespace_or_character_boundaries():
    from tools.train_tokenizer import MAX_SENTENCE_BYTES, split_long_line

    assert split_long_line("short line") == ["short line"]
    words = "naïve café 数据 " * 20  # 2- and 3-byte characters
    pieces = split_long_line(words, limit=64)
    assert "".join(pieces) == words and len(pieces) > 1
    assert all(len(p.encode()) <= 64 for p in pieces)
    assert all(p.startswith(" ") for p in pieces[1:])  # cut before a space, as sentencepiece's ▁word
    solid = "数" * 50  # 150 bytes, no whitespace: cut at character boundaries only
    pieces = split_long_line(solid, limit=64)
    assert "".join(pieces) == solid and [len(p.encode()) for p in pieces] == [63, 63, 24]
    long_line = "word " * (MAX_SENTENCE_BYTES // 2)
    assert max(len(p.encode()) for p in split_long_line(long_line)) <= MAX_SENTENCE_BYTES


def test_train_tokenizer_trains_on_lines_longer_than_sentencepieces_limit(tmp_path, capsys):
    """sentencepiece skips a sentence over 16 KB: documents without newlines must still be seen."""
    import sentencepiece

    # Long documents (> 20 KB, one line each) are the only ones holding "zqxjkv"; short ones are ordinary text.
    records = [{"text": " ".join(["zqxjkv blorf"] * 2000)} for _ in range(5)]
    records += [{"text": text} for text in DOCS * 4]
    corpus = _write_lines(tmp_path / "long.jsonl", records)
    total = sum(len(r["text"].encode()) for r in records)
    model = train_tokenizer(corpus, str(tmp_path / "t"), vocab_size=320)
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    assert sp.encode("zqxjkv", out_type=str) == ["▁zqxjkv"]
    out = capsys.readouterr().out
    used = int(out.split("trained on ")[1].split(" of the")[0].replace(",", ""))
    assert f"of the {total:,} bytes of text in {len(records)} documents" in out
    assert "5 lines over 16,384 bytes cut at whitespace" in out
    newlines = sum(r["text"].count("\n") for r in records)
    blank = sum(len(line.encode()) for r in records for line in r["text"].split("\n") if line and not line.strip())
    assert used == total - newlines - blank  # every byte but newlines and whitespace-only lines


def test_gzipped_input_in_both_tools(tmp_path, tiny_jsonl):
    import gzip

    import sentencepiece

    gz = tmp_path / "tiny.jsonl.gz"
    with open(tiny_jsonl, "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    for name, path in (("plain", tiny_jsonl), ("gz", str(gz))):
        preprocess_data(
            path,
            str(tmp_path / name),
            "SentencePieceTokenizer",
            SHIPPED_MODEL,
            append_eod=True,
            workers=2 if name == "gz" else 1,
            progress=False,
        )
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"gz_text_document{ext}").read_bytes() == (
            tmp_path / f"plain_text_document{ext}"
        ).read_bytes()
    with pytest.raises(ValueError, match=r"--vocab-size 300 is fewer pieces than the characters of .*tiny\.jsonl need"):
        train_tokenizer(tiny_jsonl, str(tmp_path / "small"), vocab_size=300)
    models = [
        train_tokenizer(path, str(tmp_path / name), vocab_size=310)
        for name, path in (("t_plain", tiny_jsonl), ("t_gz", str(gz)))
    ]
    sp, sp_gz = (sentencepiece.SentencePieceProcessor(model_file=m) for m in models)
    assert [sp.id_to_piece(i) for i in range(310)] == [sp_gz.id_to_piece(i) for i in range(310)]
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gz.read_bytes()[:-12])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: the gzip data is truncated or corrupt"):
        preprocess_data(str(truncated), str(tmp_path / "cut"), "SentencePieceTokenizer", SHIPPED_MODEL, progress=False)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("cut_")]


@pytest.mark.parametrize("workers", [1, 2])
def test_lone_surrogate_names_the_line(tmp_path, workers, capsys):
    from tools.train_tokenizer import main as train_tokenizer_main

    path = tmp_path / "sur.jsonl"
    path.write_text('{"text":"ok"}\n{"text":"bad \\ud800"}\n')  # valid JSON, but not Unicode text
    with pytest.raises(
        ValueError, match=r"sur\.jsonl line 2: 'text' holds a lone surrogate \('\\ud800' at character 4\)"
    ):
        preprocess_data(
            str(path), str(tmp_path / "out"), "SentencePieceTokenizer", SHIPPED_MODEL, workers=workers, progress=False
        )
    assert sorted(os.listdir(tmp_path)) == ["sur.jsonl"]
    with pytest.raises(SystemExit) as exit_info:
        train_tokenizer_main(["--input", str(path), "--output-prefix", str(tmp_path / "t"), "--vocab-size", "300"])
    assert exit_info.value.code == 2
    assert "sur.jsonl line 2: 'text' holds a lone surrogate" in capsys.readouterr().err


def test_train_tokenizer_unwritable_output_prefix_exits_2_before_training(tmp_path, tiny_jsonl, capsys, monkeypatch):
    # sentencepiece failed only when writing the .model, after the whole training, with a traceback
    from tools import train_tokenizer

    monkeypatch.setattr(train_tokenizer, "_train", lambda *a: pytest.fail("trained before refusing"))
    (tmp_path / "file").write_text("x")
    prefix = str(tmp_path / "file" / "tok")
    with pytest.raises(SystemExit) as exit_info:
        train_tokenizer.main(["--input", tiny_jsonl, "--output-prefix", prefix, "--vocab-size", "300"])
    assert exit_info.value.code == 2
    assert f"error: --output-prefix {prefix}: cannot write {prefix}.model (" in capsys.readouterr().err


def test_train_tokenizer_missing_empty_or_malformed_input_exits_2(tmp_path, capsys):
    from tools.train_tokenizer import main as train_tokenizer_main

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n{"text": " \\n "}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    expected = {
        "nope.jsonl": r"--input \S*nope\.jsonl does not exist",
        "empty.jsonl": r"empty\.jsonl holds no text to train on: 0 non-blank lines",
        "blank.jsonl": r"blank\.jsonl holds no text to train on: 2 non-blank lines, 3 bytes",
        "bad.jsonl": r"bad\.jsonl line 2: malformed JSON",
    }
    for name, message in expected.items():
        with pytest.raises(SystemExit) as exit_info:
            train_tokenizer_main(
                ["--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "out" / "t"), "--vocab-size", "300"]
            )
        assert exit_info.value.code == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: --input") and err.count("\n") == 1, err  # one line, no traceback
        import re

        assert re.search(message, err), err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_preprocess_counts_empty_documents_per_key_and_bytes_without_progress(tmp_path, capsys):
    import re

    words = "word " * 5000
    path = _write_lines(
        tmp_path / "two.jsonl",
        [{"text": "", "title": words}, {"text": words, "title": ""}, {"text": words, "title": words}],
    )
    preprocess_main(
        [
            "--input",
            path,
            "--output-prefix",
            str(tmp_path / "two"),
            "--json-keys",
            "text",
            "title",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            SHIPPED_MODEL,
            "--no-progress",
            "--log-interval",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert out.count(": 3 documents") == 2 and out.count("(1 of them empty") == 2, out
    rates = [float(rate) for rate in re.findall(r"([\d.]+) MB/s", out)]
    assert len(rates) == 3 and all(rate > 0 for rate in rates), out
    stats = preprocess_data(
        path,
        str(tmp_path / "lib"),
        "SentencePieceTokenizer",
        SHIPPED_MODEL,
        json_keys=("text", "title"),
        progress=False,
    )
    assert stats.num_empty == {"text": 1, "title": 1} and stats.num_bytes == os.path.getsize(path)


def test_preprocess_refuses_repeated_keys_and_inputs_training_would_refuse(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    no_title = _write_lines(tmp_path / "no_title.jsonl", [{"text": "some text", "title": ""}] * 3)
    cases = [
        ((no_title, "text", "text"), r"--json-keys text text names 'text' more than once"),
        ((str(empty), "text"), r"empty\.jsonl holds no JSON line"),
        ((no_title, "text", "title"), r"no_title\.jsonl: every one of its 3 documents is empty under 'title'"),
    ]
    import re

    for (path, *keys), message in cases:
        with pytest.raises(SystemExit) as exit_info:
            preprocess_main(
                [
                    "--input",
                    path,
                    "--output-prefix",
                    str(tmp_path / "out"),
                    "--json-keys",
                    *keys,
                    "--tokenizer-type",
                    "SentencePieceTokenizer",
                    "--tokenizer-model",
                    SHIPPED_MODEL,
                    "--no-progress",
                ]
            )
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err, err
        assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "no_title.jsonl"]  # nothing written


def test_sigterm_removes_the_temporary_files(tmp_path):
    """The input is a named pipe kept open, so the tool is surely mid-run (its main thread waiting
    on the pipe, which the signal must interrupt) when SIGTERM comes."""
    import signal
    import subprocess
    import sys
    import time

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO, "tools", "preprocess_data.py"),
            "--input",
            str(fifo),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            SHIPPED_MODEL,
            "--workers",
            "2",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 120
    fd = None
    try:
        while fd is None:  # the writer's open fails until the tool opens the pipe
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
        os.set_blocking(fd, True)
        # 40 of the tool's batches of 256 lines: more than it keeps in flight, so tokens reach the .bin.tmp
        os.write(
            fd, (json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 4}) + "\n").encode() * 10240
        )
        tmp_bin = tmp_path / "out_text_document.bin.tmp"
        while not (tmp_bin.exists() and tmp_bin.stat().st_size):  # tokens reached the file: mid-run
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failed test leaves no process (nor its pool's workers) behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if fd is not None:
            os.close(fd)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM; removed the unfinished" in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["pipe.jsonl"]


def test_preprocess_records_its_tokenizer_and_training_under_another_is_refused(tmp_path):
    # Megatron-LM's .bin/.idx say nothing of the tokenizer: ids of one trained silently under another
    # (NullTokenizer: EOD is --vocab-size, so another --vocab-size moves EOD to an ordinary id)
    import shutil

    import pretrain_gpt
    from megatron_ext.config import ConfigError
    from megatron_ext.data.indexed_check import check_tokenizer_record
    from megatron_ext.data.tokenizers import build_tokenizer

    path = write_jsonl(tmp_path / "ids.jsonl", [" ".join(str(i % 50) for i in range(j, j + 300)) for j in range(40)])
    preprocess_data(path, str(tmp_path / "ids"), "NullTokenizer", vocab_size=100, append_eod=True, progress=False)
    prefix = str(tmp_path / "ids_text_document")
    with open(prefix + ".tokenizer.json") as f:
        record = json.load(f)
    assert record["tokenizer"] == build_tokenizer("NullTokenizer", vocab_size=100).identity()
    assert record["json_key"] == "text" and record["append_eod"] is True
    assert sorted(os.listdir(tmp_path)) == [
        "ids.jsonl",
        "ids_text_document.bin",
        "ids_text_document.idx",
        "ids_text_document.tokenizer.json",
    ]  # no .tmp left
    assert check_tokenizer_record(prefix, build_tokenizer("NullTokenizer", vocab_size=100).identity()) == []
    (problem,) = check_tokenizer_record(prefix, build_tokenizer("NullTokenizer", vocab_size=120).identity())
    assert (
        "was tokenized with NullTokenizer (vocabulary 101)" in problem
        and "this run's tokenizer is NullTokenizer (vocabulary 121)" in problem
        and "--tokenizer-type/--tokenizer-model/--vocab-size" in problem
    )

    # sentencepiece: the same model under another name (and type) is the same tokenizer; another is not
    texts = [DOCS[0], DOCS[1], DOCS[3]] * 5
    sp_input = write_jsonl(tmp_path / "sp.jsonl", texts)
    preprocess_data(
        sp_input, str(tmp_path / "sp"), "SentencePieceTokenizer", SHIPPED_MODEL, append_eod=True, progress=False
    )
    sp_prefix = str(tmp_path / "sp_text_document")
    shutil.copy(SHIPPED_MODEL, tmp_path / "copy.model")
    assert (
        check_tokenizer_record(
            sp_prefix, build_tokenizer("GPTSentencePieceTokenizer", str(tmp_path / "copy.model")).identity()
        )
        == []
    )
    other = train_tokenizer(sp_input, str(tmp_path / "other"), vocab_size=320)
    (problem,) = check_tokenizer_record(sp_prefix, build_tokenizer("SentencePieceTokenizer", other).identity())
    assert f"from {SHIPPED_MODEL})" in problem and "files sha256" in problem

    # the entry point: one error naming the flag and the prefix, before any process group or model
    job = [
        "--data-path",
        prefix,
        "--tokenizer-type",
        "NullTokenizer",
        "--device",
        "cpu",
        "--seq-length",
        "64",
        "--split",
        "100,0,0",
    ]
    with pytest.raises(
        ConfigError,
        match=r"--data-path .*ids_text_document was tokenized with NullTokenizer "
        r"\(vocabulary 101\)",
    ):
        pretrain_gpt.main(job + ["--vocab-size", "120"])
    with open(prefix + ".tokenizer.json", "w") as f:
        f.write("{broken")
    with pytest.raises(
        ConfigError,
        match=r"ids_text_document.tokenizer.json \(the tokenizer the pair was made "
        r"with\) cannot be read",
    ):
        pretrain_gpt.main(job + ["--vocab-size", "100"])


def test_sigterm_during_the_renames_leaves_a_whole_dataset(tmp_path, monkeypatch):
    """SIGTERM between the renames of .bin, .idx and .tokenizer.json left the new .bin beside the
    previous run's .idx (a pair training refuses, or reads wrong); the renames now finish first."""
    import signal

    from megatron_ext.data.indexed_check import check_indexed_dataset
    from tools.preprocess_data import Interrupted

    prefix = str(tmp_path / "out_text_document")
    preprocess_data(
        write_jsonl(tmp_path / "old.jsonl", ["1 2 3", "4 5"]),
        str(tmp_path / "out"),
        "NullTokenizer",
        vocab_size=100,
        progress=False,
    )  # a previous dataset at the same prefix
    new_input = write_jsonl(tmp_path / "new.jsonl", [" ".join(str(i % 50) for i in range(300))] * 7)
    real_replace, calls = os.replace, []

    def replace_then_signal(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the .bin is in place, the .idx next
            signal.raise_signal(signal.SIGTERM)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_signal)
    with pytest.raises(Interrupted):
        preprocess_data(new_input, str(tmp_path / "out"), "NullTokenizer", vocab_size=100, progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert check_indexed_dataset(prefix) == []
    _, documents = read_documents(prefix)
    assert len(documents) == 7  # the new dataset, whole
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def _start_like_a_pool_worker(encoder, ready_dir):
    import time

    from tools.preprocess_data import _init_worker

    open(os.path.join(ready_dir, str(os.getpid())), "w").close()
    time.sleep(1)  # the signals come now, before the worker's own dispositions are set
    _init_worker(encoder)
    time.sleep(60)  # then it waits for tasks


def test_a_worker_signalled_before_its_initializer_ends_quietly_or_ignores_ctrl_c(tmp_path, capfd):
    """A pool worker is forked with the tool's signal handlers until ``_init_worker`` sets its own.
    The parent's ``pool.terminate()`` right after an error SIGTERMs workers still starting, and
    Ctrl-C reaches every worker: each ran the parent's handler, raising inside multiprocessing's
    start-up code ("Process ForkPoolWorker-3: ... Interrupted: stopped by SIGTERM"), or lost the
    signal, surviving terminate() and hanging pool.join() (seen under load). Workers now start with
    both blocked: SIGTERM ends them once ``_init_worker`` ran, Ctrl-C is left to the parent."""
    import multiprocessing
    import signal
    import time

    from tools.preprocess_data import _Encoder, _pool_signals_held, _sigterm_raises

    encoder = _Encoder("in.jsonl", ["text"], dict(tokenizer_type="NullTokenizer", vocab_size=10), False)
    fork = multiprocessing.get_context("fork")
    with _sigterm_raises():  # as in preprocess_data, which starts its pool inside it
        with _pool_signals_held():
            workers = [fork.Process(target=_start_like_a_pool_worker, args=(encoder, str(tmp_path))) for _ in range(2)]
            for worker in workers:
                worker.start()
        try:
            deadline = time.time() + 30
            while len(os.listdir(tmp_path)) < 2:  # both are in their first second
                assert time.time() < deadline
                time.sleep(0.01)
            terminated, ctrl_c = workers
            terminated.terminate()
            os.kill(ctrl_c.pid, signal.SIGINT)
            terminated.join(30)
            assert terminated.exitcode == -signal.SIGTERM
            ctrl_c.join(2)
            assert ctrl_c.exitcode is None  # still waiting for tasks: Ctrl-C is the parent's
            ctrl_c.terminate()
            ctrl_c.join(30)
            assert ctrl_c.exitcode == -signal.SIGTERM
        finally:
            for worker in workers:
                worker.kill()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # the test process's mask is restored
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Interrupted" not in err, err


def test_every_file_is_durable_before_it_replaces_a_previous_dataset(tmp_path, monkeypatch):
    """The .bin, .idx and .tokenizer.json were renamed over a previous run's without an fsync: a
    power loss after the renames could leave them empty or truncated where a whole dataset was.
    Each is now fsynced under its temporary name before the renames, and the directory after."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    preprocess_data(
        write_jsonl(tmp_path / "in.jsonl", ["1 2 3", "4 5"]), str(tmp_path / "out"), "NullTokenizer", vocab_size=100
    )
    replaced = [path for what, path in events if what == "replace"]
    assert len(replaced) == 3
    first_replace = events.index(("replace", replaced[0]))
    assert all(("fsync", path) in events[:first_replace] for path in replaced)
    assert ("fsync", str(tmp_path)) in events[events.index(("replace", replaced[-1])) :]


class _Killed(BaseException):
    """A SIGKILL at that instant: no except clause of ours runs."""


def test_a_rerun_killed_between_its_renames_leaves_no_record_of_another_tokenizer(tmp_path, monkeypatch):
    """Preprocessing again into a prefix with another tokenizer, killed after the new .bin/.idx were
    renamed in but before the new .tokenizer.json: the previous run's record stayed beside the new
    pair and vouched for it under the previous tokenizer (training read the new ids as that one's,
    silently). The old record now goes before the renames: the pair is left unchecked at worst."""
    from megatron_ext.data.indexed_check import check_indexed_dataset
    from megatron_ext.data.tokenizers import build_tokenizer

    path = write_jsonl(tmp_path / "ids.jsonl", [" ".join(str(i % 50) for i in range(j, j + 30)) for j in range(9)])
    preprocess_data(path, str(tmp_path / "ids"), "NullTokenizer", vocab_size=100, append_eod=True, progress=False)
    prefix = str(tmp_path / "ids_text_document")
    real_replace = os.replace

    def replace(src, dst):
        if dst.endswith(".tokenizer.json"):
            raise _Killed
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Killed):
        preprocess_data(path, str(tmp_path / "ids"), "NullTokenizer", vocab_size=120, append_eod=True, progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert check_indexed_dataset(prefix) == []
    _, documents = read_documents(prefix)
    assert documents[0][-1] == build_tokenizer("NullTokenizer", vocab_size=120).eod  # the new pair is in place
    if os.path.exists(prefix + ".tokenizer.json"):
        with open(prefix + ".tokenizer.json") as f:
            assert (
                json.load(f)["tokenizer"]["vocab_size"] == build_tokenizer("NullTokenizer", vocab_size=120).vocab_size
            )
