"""--save-hf's tokenizer for SentencePiece runs: ``AutoTokenizer.from_pretrained(export)`` gives our
tokenizer's ids (``megatron_ext.data.tokenizers``, the reference) on a few hundred varied texts, with
or without ``add_special_tokens``, and decodes them as ours does; a model it cannot reproduce exactly
still gets the note, saying why. The SentencePiece models are trained here on text shipped in this
repository (tools/train_tokenizer.py's options and variants of them); nothing is downloaded."""

from __future__ import annotations

import json
import os
import random

import pytest

from megatron_ext.config import build_job_config
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.hf.export import TOKENIZER_NOTE, get_special_token_ids, write_tokenizer_files
from tools.train_tokenizer import TRAINER_OPTIONS

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED_MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")
# tools/train_tokenizer.py's options (the models a run here uses)
TRAIN_OPTIONS = dict(model_type="bpe", **TRAINER_OPTIONS)
EXACT_VARIANTS = {
    "train_tokenizer": {},
    "no_dummy_prefix": dict(add_dummy_prefix=False),
    # unknown characters become <unk> (one per run of them) and decode as " ⁇ "
    "no_byte_fallback": dict(byte_fallback=False, character_coverage=0.98),
    "no_pad_no_newline_piece": dict(pad_id=-1, user_defined_symbols=[]),
}
CRAFTED = [
    "Hello world",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "",
    " ",
    "\n",
    "\nstarts with a newline",
    "a\n\nb\n",
    "line one\r\nline two",
    "digits 12345 and x1y2z3, 3.14159",
    "naïve café, 数据, Ünïcødé, emoji 😀🚀",
    "tab\there\tand\tthere",
    "<s> and </s> and <pad> and <unk> as text",
    "<s>",
    "▁ the escaped-space character itself ▁▁",
    "<0x41> looks like a byte piece",
    "control \x00\x01\x7f bytes",
    "def f(x):\n    return x * 2  # comment\n",
]


def _training_lines() -> list[str]:
    lines = []
    for name in ("README.md", os.path.join("docs", "data.md")):
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            lines += [line for line in f.read().split("\n") if line.strip()]
    return lines


def _texts() -> list[str]:
    """Crafted edge cases, slices of shipped text, and random strings of spaces, newlines, digits,
    special-token characters and multi-byte characters (seeded)."""
    rng = random.Random(1234)
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        source = f.read()
    texts = list(CRAFTED)
    for _ in range(200):
        start = rng.randrange(len(source))
        texts.append(source[start : start + rng.randrange(1, 400)])
    alphabet = " \n\t▁<>/spad0123456789aeé数😀"
    for _ in range(200):
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))))
    return texts


TEXTS = _texts()


def _train(root, name: str, **overrides) -> str:
    options = {**TRAIN_OPTIONS, **overrides}
    prefix = os.path.join(root, name)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines()), model_prefix=prefix, vocab_size=400, **options
    )
    return prefix + ".model"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("spm"))
    out = {name: _train(root, name, **overrides) for name, overrides in EXACT_VARIANTS.items()}
    out["shipped"] = SHIPPED_MODEL
    out["unigram"] = _train(root, "unigram", model_type="unigram")
    out["nmt_nfkc"] = _train(root, "nmt_nfkc", normalization_rule_name="nmt_nfkc")
    return out


def _export(model: str, tokenizer_type: str, out_dir) -> str:
    cfg = build_job_config(dict(mock_data=True, num_layers=2, tokenizer_type=tokenizer_type, tokenizer_model=model))
    os.makedirs(out_dir, exist_ok=True)
    return write_tokenizer_files(cfg.data, str(out_dir))


def _load(out_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(out_dir))


def _mismatches(hf, ours, add_special_tokens: bool) -> list[tuple[str, list[int], list[int]]]:
    out = []
    for text in TEXTS:
        got = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        want = ours.tokenize(text)
        if got != want:
            out.append((text, want, got))
    return out


@pytest.mark.parametrize("variant", ["shipped", *EXACT_VARIANTS])
@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_the_exported_tokenizer_gives_our_ids_and_decodes_as_ours(
    models, variant, tokenizer_type, tmp_path, monkeypatch
):
    ours = build_tokenizer(tokenizer_type, models[variant])
    said = _export(models[variant], tokenizer_type, tmp_path)
    assert "written" in said, said
    names = ["special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert sorted(os.listdir(tmp_path)) == names
    with open(tmp_path / "tokenizer.model", "rb") as a, open(models[variant], "rb") as b:
        assert a.read() == b.read()
    hf = _load(tmp_path, monkeypatch)
    assert len(hf) == ours.vocab_size
    assert (hf.eos_token_id, hf.pad_token_id) == (ours.eod, ours.pad)
    for add_special_tokens in (False, True):  # ours adds neither BOS nor EOS
        bad = _mismatches(hf, ours, add_special_tokens)
        assert not bad, f"{len(bad)} of {len(TEXTS)} texts differ, e.g. {bad[0]}"
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert hf.decode(ids) == ours.detokenize(ids), text


def test_the_texts_tell_a_near_miss_apart(models, tmp_path, monkeypatch):
    """The check above can fail: the same tokenizer.json without the dummy-prefix normalizer (what
    a Metaspace pre-tokenizer does to text starting with a space) differs on some texts."""
    ours = build_tokenizer("SentencePieceTokenizer", models["train_tokenizer"])
    _export(models["train_tokenizer"], "SentencePieceTokenizer", tmp_path)
    with open(tmp_path / "tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    with open(tmp_path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(spec, f)
    assert _mismatches(_load(tmp_path, monkeypatch), ours, add_special_tokens=False)


@pytest.mark.parametrize("variant, reason", [("unigram", "not a BPE model"), ("nmt_nfkc", "normalization 'nmt_nfkc'")])
def test_a_model_hf_cannot_reproduce_gets_the_note_saying_why(models, variant, reason, tmp_path):
    said = _export(models[variant], "SentencePieceTokenizer", tmp_path)
    assert TOKENIZER_NOTE in said
    assert os.listdir(tmp_path) == [TOKENIZER_NOTE]
    note = (tmp_path / TOKENIZER_NOTE).read_text()
    assert reason in note and models[variant] in note and "--tokenizer-type SentencePieceTokenizer" in note


def test_config_names_our_eod_pad_and_bos_as_the_models_eos_pad_and_bos(models):
    """--save-hf's config.json: eos_token_id / pad_token_id / bos_token_id are the SentencePiece
    model's own eos, pad and bos (what our EOD and pad are), read here through sentencepiece itself
    (a model trained without a BOS piece: null, not transformers' default 1); a pad that is the EOD
    (NullTokenizer's) is not named (transformers would freeze that embedding row), and NullTokenizer
    has no BOS."""
    processor = sentencepiece.SentencePieceProcessor(model_file=SHIPPED_MODEL)
    for tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        cfg = build_job_config(dict(mock_data=True, tokenizer_type=tokenizer_type, tokenizer_model=SHIPPED_MODEL))
        assert get_special_token_ids(cfg.data) == {
            "eos_token_id": processor.eos_id(),
            "pad_token_id": processor.pad_id(),
            "bos_token_id": processor.bos_id(),
        }
    no_bos = _train(os.path.dirname(models["unigram"]), "no_bos", bos_id=-1)
    assert sentencepiece.SentencePieceProcessor(model_file=no_bos).bos_id() == -1
    cfg = build_job_config(dict(mock_data=True, tokenizer_type="SentencePieceTokenizer", tokenizer_model=no_bos))
    assert get_special_token_ids(cfg.data)["bos_token_id"] is None
    gone = build_job_config(
        dict(mock_data=True, tokenizer_type="SentencePieceTokenizer", tokenizer_model="/gone.model")
    )
    assert get_special_token_ids(gone.data) == {}
    null = build_job_config(dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100))
    # its pad is its EOD: no padding_idx made of it
    assert get_special_token_ids(null.data) == {"eos_token_id": 100, "bos_token_id": None}
