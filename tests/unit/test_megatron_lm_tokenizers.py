"""Megatron-LM's tokenizer settings read as Megatron-LM core_v0.16.1 reads them (issue 43):

- GPT2BPETokenizer inferred from --vocab-file and --merge-file alone (Megatron-LM's pretrain_gpt.py
  default type), with one start-up line, and recorded so in the checkpoint;
- Llama2Tokenizer: piece-count vocabulary, eod = eos, pad = eod; tools/preprocess_data.py writes
  what Megatron-LM's tool writes: sentencepiece's ids by default (megatron-core's tokenizer, checked
  against it here), BOS first with --legacy-tokenizer (its legacy ``_Llama2Tokenizer.tokenize``);
- SentencePieceTokenizer: none of the specials Megatron-LM's legacy class adds (docs/running.md).

Sentencepiece models are trained here on the repository's own text (nothing is downloaded); the
Llama-2-shaped one has Llama-2's special ids: <unk> 0, <s> 1, </s> 2 and no pad piece."""

from __future__ import annotations

import json
import os

import pytest

import pretrain_gpt
from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.checkpoint.reader import read_common
from megatron_ext.config import ConfigError
from megatron_ext.data.tokenizers import build_tokenizer
from tools.preprocess_data import main as preprocess_main
from tools.preprocess_data import preprocess_data
from tools.train_tokenizer import TRAINER_OPTIONS

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEXTS = ["Pipeline stages span nodes.", "", "def f(x):\n    return x * 2  # naïve café", "a<EOD>b </s> <s>"]


def _train_sentencepiece(prefix: str, **options) -> str:
    import sentencepiece

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=400, **{**TRAINER_OPTIONS, **options}
    )
    return prefix + ".model"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sentencepiece")
    return {
        "llama2": _train_sentencepiece(str(root / "llama2"), pad_id=-1),  # Llama-2's layout: no pad piece
        "no_bos": _train_sentencepiece(str(root / "no_bos"), bos_id=-1, pad_id=-1),
    }


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def _write_jsonl(path, texts) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- Llama2Tokenizer


def test_llama2_tokenizer_is_megatron_lms(models):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=models["llama2"])
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    tokenizer = build_tokenizer("Llama2Tokenizer", models["llama2"])
    assert tokenizer.vocab_size == sp.get_piece_size() == 400  # its _Llama2Tokenizer: len(pieces)
    assert (tokenizer.eod, tokenizer.pad, tokenizer.bos) == (sp.eos_id(), sp.eos_id(), sp.bos_id())
    assert tokenizer.identity()["type"] == "Llama2Tokenizer"
    # the shipped model has a pad piece: Llama2Tokenizer still pads with eod (Megatron-LM's class has no pad)
    shipped = build_tokenizer("Llama2Tokenizer", os.path.join(REPO, "data", "default", "tokenizer.model"))
    assert shipped.pad == shipped.eod == 2


def test_llama2_tokenizer_ids_are_megatron_cores(models):
    """Megatron-LM core_v0.16.1's preprocessing and datasets build this type through megatron-core's
    tokenizer (its default system): sentencepiece's ids, no BOS."""
    from argparse import Namespace

    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build_megatron_core

    reference = build_megatron_core(
        Namespace(
            tokenizer_type="Llama2Tokenizer",
            tokenizer_model=models["llama2"],
            tokenizer_sentencepiece_legacy=False,
            tokenizer_special_tokens=None,
            tokenizer_metadata=None,
        )
    )
    tokenizer = build_tokenizer("Llama2Tokenizer", models["llama2"])
    for text in TEXTS:
        assert tokenizer.tokenize(text) == reference.tokenize(text), text
    assert (tokenizer.eod, tokenizer.vocab_size) == (reference.eod, reference.vocab_size)


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_llama2_writes_megatron_lms_ids_with_bos_first_under_legacy_tokenizer(models, tmp_path, append_eod):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=models["llama2"])
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    eos = [sp.eos_id()] if append_eod else []
    for legacy, expected in (
        (False, [sp.encode(t) + eos for t in TEXTS if t]),  # an empty document holds no sequence
        # its legacy tokenize gives [bos] for "" too: that document holds BOS (and EOD)
        (True, [[sp.bos_id()] + sp.encode(t) + eos for t in TEXTS]),
    ):
        out = str(tmp_path / f"legacy{legacy}")
        preprocess_data(
            jsonl,
            out,
            "Llama2Tokenizer",
            models["llama2"],
            append_eod=append_eod,
            progress=False,
            legacy_tokenizer=legacy,
        )
        documents = [d for d in _documents(out + "_text_document") if d]
        assert documents == expected, legacy
        with open(out + "_text_document.tokenizer.json") as f:
            assert json.load(f)["prepend_bos"] is legacy


def test_preprocess_says_which_llama2_reading_it_wrote(models, tmp_path, capsys):
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", TEXTS[:1])
    common = ["--input", jsonl, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", models["llama2"]]
    preprocess_main(common + ["--output-prefix", str(tmp_path / "a"), "--no-progress"])
    assert "note: Llama2Tokenizer: no BOS before each document" in capsys.readouterr().out
    preprocess_main(common + ["--output-prefix", str(tmp_path / "b"), "--no-progress", "--legacy-tokenizer"])
    assert "no BOS" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "tokenizer_type, model, needle",
    [
        ("SentencePieceTokenizer", "llama2", "--legacy-tokenizer with --tokenizer-type SentencePieceTokenizer: only"),
        ("Llama2Tokenizer", "no_bos", "--legacy-tokenizer puts BOS first, but --tokenizer-model"),
    ],
)
def test_legacy_tokenizer_is_refused_where_it_is_not_reproduced(models, tmp_path, tokenizer_type, model, needle):
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", TEXTS[:1])
    with pytest.raises(ValueError, match=needle):
        preprocess_data(
            jsonl, str(tmp_path / "o"), tokenizer_type, models[model], progress=False, legacy_tokenizer=True
        )
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o_")]


def test_llama3_tokenizer_stays_refused_with_the_type_to_use():
    with pytest.raises(ConfigError, match="--tokenizer-type Llama3Tokenizer is not supported: use --tokenizer-type "):
        build_tokenizer("Llama3Tokenizer", "x")


# ----------------------------------------------------------------------------- SentencePieceTokenizer


def test_sentencepiece_tokenizer_adds_none_of_megatron_lms_legacy_specials(models):
    """Megatron-LM's legacy SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK> after the pieces
    and reads them (and the model's own specials) inside the text; ours is the model alone, as
    docs/running.md says: its vocabulary the piece count, EOD the model's eos, the text encoded by
    sentencepiece only (megatron-core's tokenizer, Megatron-LM's default system, reads it so too)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=models["llama2"])
    tokenizer = build_tokenizer("SentencePieceTokenizer", models["llama2"])
    assert tokenizer.vocab_size == sp.get_piece_size() and tokenizer.eod == sp.eos_id()
    assert tokenizer.tokenize(TEXTS[3]) == sp.encode(TEXTS[3])
    assert sp.piece_to_id("<EOD>") == sp.unk_id()  # not a piece: nothing maps to an added id


# ----------------------------------------------------------------------------- GPT2BPETokenizer inferred


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        tok.train_from_iterator([f.read()], trainer)
    root = tmp_path_factory.mktemp("gpt2")
    tok.model.save(str(root))
    return str(root / "vocab.json"), str(root / "merges.txt")


INFERRED = "--tokenizer-type GPT2BPETokenizer: inferred from --vocab-file and --merge-file"


def test_gpt2_files_alone_infer_gpt2bpetokenizer_with_one_line(gpt2_files):
    vocab, merges = gpt2_files
    cfg, notes = parse_args_with_notes(["--mock-data", "--vocab-file", vocab, "--merge-file", merges])
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    assert [n for n in notes if n.startswith(INFERRED)] == notes[:1] and len(notes[0].splitlines()) == 1


@pytest.mark.parametrize(
    "extra",
    [
        ["--tokenizer-type", "HuggingFaceTokenizer"],
        ["--tokenizer-type", "SentencePieceTokenizer"],
        ["--tokenizer-model", "tokenizer.model"],
    ],
    ids=" ".join,
)
def test_gpt2bpetokenizer_is_not_inferred_when_a_type_or_model_is_given(gpt2_files, extra):
    vocab, merges = gpt2_files
    cfg, notes = parse_args_with_notes(["--vocab-file", vocab, "--merge-file", merges] + extra)
    assert cfg.data.tokenizer_type == (extra[1] if extra[0] == "--tokenizer-type" else "SentencePieceTokenizer")
    assert not [n for n in notes if n.startswith(INFERRED)]


def test_gpt2bpetokenizer_is_not_inferred_from_one_file_nor_over_a_config_files_type(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    cfg, _ = parse_args_with_notes(["--vocab-file", vocab])
    assert cfg.data.tokenizer_type == "SentencePieceTokenizer"  # and validation names GPT2BPETokenizer
    config = tmp_path / "job.yaml"
    config.write_text("tokenizer-type: HuggingFaceTokenizer\n")
    cfg, notes = parse_args_with_notes(["--config", str(config), "--vocab-file", vocab, "--merge-file", merges])
    assert cfg.data.tokenizer_type == "HuggingFaceTokenizer" and not [n for n in notes if n.startswith(INFERRED)]


def test_the_inferred_gpt2bpetokenizer_is_what_the_checkpoint_records(gpt2_files, tmp_path, capsys):
    vocab, merges = gpt2_files
    save = tmp_path / "ckpt"
    pretrain_gpt.main(
        ["--mock-data", "--vocab-file", vocab, "--merge-file", merges, "--device", "cpu", "--num-layers", "1"]
        + ["--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32"]
        + ["--train-iters", "1", "--micro-batch-size", "1", "--save", str(save), "--save-interval", "1"]
    )
    assert capsys.readouterr().out.count(INFERRED) == 1
    common = read_common(str(save / "iter_0000001"))
    assert common["tokenizer"] == build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges).identity()
    assert common["tokenizer"]["type"] == common["args"]["tokenizer_type"] == "GPT2BPETokenizer"
