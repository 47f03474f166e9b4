"""megatron_ext.data.tokenizers against sentencepiece and megatron-core's NullTokenizer directly."""

import hashlib
import os

import pytest

from megatron_ext.data.tokenizers import build_tokenizer, check_tokenizer_flags

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED_MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")

SAMPLE_TEXT = "Return the sum of *x* and *y*.\n\n    >>> add(2, 40)\n    42\nUnicode: naïve café, 数据, tab\there."


@pytest.fixture(scope="module")
def sp_processor():
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=SHIPPED_MODEL)


def test_null_tokenizer_matches_megatron_core():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    reference = NullTokenizer(100)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tokenizer.tokenize("5 17 99 0") == reference.text_to_ids("5 17 99 0") == [5, 17, 99, 0]
    assert tokenizer.eod == reference.eod == 100
    assert tokenizer.vocab_size == reference.vocab_size == 101
    assert tokenizer.pad == tokenizer.eod
    assert tokenizer.detokenize([5, 17, 99]) == "5 17 99"
    assert tokenizer.identity() == {"type": "NullTokenizer", "model_sha256": None, "vocab_size": 101}


def test_null_tokenizer_errors():
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=10)
    with pytest.raises(ValueError, match="--vocab-size"):
        tokenizer.tokenize("3 11")
    with pytest.raises(ValueError, match="integer ids"):
        tokenizer.tokenize("hello world")


def test_sentencepiece_ids_match_sentencepiece(sp_processor):
    tokenizer = build_tokenizer("SentencePieceTokenizer", SHIPPED_MODEL)
    ids = tokenizer.tokenize(SAMPLE_TEXT)
    assert ids == sp_processor.encode(SAMPLE_TEXT)
    assert tokenizer.detokenize(ids) == SAMPLE_TEXT  # identity normalisation keeps whitespace
    assert tokenizer.vocab_size == sp_processor.get_piece_size() == 8192
    assert sp_processor.id_to_piece(tokenizer.eod) == "</s>"
    assert sp_processor.id_to_piece(tokenizer.pad) == "<pad>"
    assert tokenizer.pad != tokenizer.eod
    assert 0 <= tokenizer.eod < tokenizer.vocab_size
    assert sp_processor.unk_id() not in ids  # byte fallback: nothing maps to <unk>


def test_sentencepiece_identity_and_alias():
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", SHIPPED_MODEL)
    with open(SHIPPED_MODEL, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert tokenizer.identity() == {"type": "GPTSentencePieceTokenizer", "model_sha256": sha, "vocab_size": 8192}
    assert dict(tokenizer.unique_identifiers)["model_sha256"] == sha


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nonexistent.model"), "--tokenizer-model"),
        (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=SHIPPED_MODEL, vocab_size=1000), "--vocab-size"),
        (dict(tokenizer_type="GPT2BPETokenizer"), "--tokenizer-type"),
    ],
)
def test_build_tokenizer_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        build_tokenizer(**kwargs)


def test_a_directory_given_as_sentencepiece_model_says_so_and_names_the_file_inside(tmp_path):
    # it said "does not exist" of a directory that plainly exists
    with pytest.raises(ValueError) as err:
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path))
    (problem,) = err.value.problems
    assert problem == (
        f"--tokenizer-model {tmp_path} is a directory: SentencePieceTokenizer takes the sentencepiece "
        f".model file itself ({tmp_path} holds none; tools/train_tokenizer.py writes one)"
    ), problem
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(ValueError, match=f"is a directory: .* \\(e.g. {tmp_path}/tokenizer.model\\)"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path))


def test_gpt2_files_without_the_tokenizer_type_name_gpt2bpetokenizer(tmp_path):
    # a Megatron-LM GPT-2 script gives --vocab-file/--merge-file; without --tokenizer-type the default
    # SentencePieceTokenizer asked for a --tokenizer-model the user never meant to give
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("{}")
    merges.write_text("#version: 0.2\n")
    problems = check_tokenizer_flags("SentencePieceTokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert len(problems) == 1 and "--tokenizer-type GPT2BPETokenizer" in problems[0], problems
    assert check_tokenizer_flags("SentencePieceTokenizer", tokenizer_model=SHIPPED_MODEL, vocab_file=str(vocab)) == []


def test_gpt2_file_flags_say_which_is_not_given_and_which_does_not_exist(tmp_path):
    # "missing: --vocab-file /x/vocab.json" read as if the flag had not been given
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    absent = str(tmp_path / "vocab.json")
    assert check_tokenizer_flags("GPT2BPETokenizer", vocab_file=absent, merge_file=str(merges)) == [
        f"--vocab-file {absent} does not exist: give the path of GPT2BPETokenizer's vocab.json file"
    ]
    (problem,) = check_tokenizer_flags("GPT2BPETokenizer", merge_file=str(merges))
    assert problem.endswith("needs --vocab-file (vocab.json) and --merge-file (merges.txt); not given: --vocab-file")
    assert check_tokenizer_flags("GPT2BPETokenizer", vocab_file=str(tmp_path), merge_file=str(merges)) == [
        f"--vocab-file {tmp_path} is a directory: give the path of GPT2BPETokenizer's vocab.json file"
    ]
