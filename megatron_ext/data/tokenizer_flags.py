"""The tokenizer flags, checked without loading anything: which ``--tokenizer-type`` names are built
(``tokenizers.build_tokenizer``), which of Megatron-LM's are refused, and which type a Megatron-LM
GPT-2 script means when it names none.

Invariant: a flag combination this module passes names files that exist, of the kind the type
reads; loading them (``tokenizers.py``) can still fail on their contents, with its own error.

Megatron-LM's ``pretrain_gpt.py`` defaults ``--tokenizer-type`` to GPT2BPETokenizer; ours stays
SentencePieceTokenizer (the shipped data's), and GPT2BPETokenizer is inferred only where a script
means it beyond doubt: ``--vocab-file`` and ``--merge-file`` given, neither ``--tokenizer-type`` nor
``--tokenizer-model`` (``infer_tokenizer_type``, one start-up line; the checkpoint records the type).
"""

from __future__ import annotations

import os
from typing import Any

NULL_TYPES = ("NullTokenizer",)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
LLAMA2_TYPES = ("Llama2Tokenizer",)  # a sentencepiece model too, read as Megatron-LM core_v0.16.1 reads it
HF_TYPES = ("HuggingFaceTokenizer",)
GPT2_TYPES = ("GPT2BPETokenizer",)
TIKTOKEN_TYPES = ("TikTokenizer",)
TOKENIZER_TYPES = NULL_TYPES + SENTENCEPIECE_TYPES + LLAMA2_TYPES + HF_TYPES + GPT2_TYPES + TIKTOKEN_TYPES
REFUSED_TYPES = {
    "Llama3Tokenizer": "use --tokenizer-type HuggingFaceTokenizer --tokenizer-model <Llama-3's local tokenizer directory>",
}


def infer_tokenizer_type(given: dict[str, Any]) -> str | None:
    """Sets ``given["tokenizer_type"]`` to GPT2BPETokenizer when a Megatron-LM GPT-2 script gives
    ``--vocab-file`` and ``--merge-file`` and neither ``--tokenizer-type`` nor ``--tokenizer-model``
    (``given``: the flags and config-file values set, by field name); returns the start-up line
    saying so, or None when nothing is inferred."""
    if given.get("tokenizer_type") or given.get("tokenizer_model"):
        return None
    if not (given.get("vocab_file") and given.get("merge_file")):
        return None
    given["tokenizer_type"] = "GPT2BPETokenizer"
    return (
        "--tokenizer-type GPT2BPETokenizer: inferred from --vocab-file and --merge-file (Megatron-LM's "
        "pretrain_gpt.py default; ours, without them, is SentencePieceTokenizer); give --tokenizer-type to choose"
    )


def describe_model_files(directory: str) -> str:
    """Which sentencepiece ``.model`` files a directory given as --tokenizer-model holds, as a hint."""
    try:
        found = sorted(n for n in os.listdir(directory) if n.endswith(".model"))
    except OSError:
        found = []
    if not found:
        return f"{directory} holds none; tools/train_tokenizer.py writes one"
    return "e.g. " + ", ".join(os.path.join(directory, n) for n in found[:3])


def _check_sentencepiece(
    tokenizer_type: str, model: str | None, vocab_file: str | None, merge_file: str | None
) -> list[str]:
    if not model and (vocab_file or merge_file):  # GPT-2 files: one alone, or both with this type given
        return [
            f"--vocab-file/--merge-file are GPT-2 BPE files: add --tokenizer-type GPT2BPETokenizer "
            f"(--tokenizer-type {tokenizer_type}{', the default,' if tokenizer_type == 'SentencePieceTokenizer' else ''} "
            f"reads --tokenizer-model PATH.model)"
        ]
    if not model:
        return [
            f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH to a sentencepiece .model (e.g. "
            f"data/default/tokenizer.model, or train one with tools/train_tokenizer.py)"
        ]
    if os.path.isdir(model):
        return [
            f"--tokenizer-model {model} is a directory: {tokenizer_type} takes the sentencepiece "
            f".model file itself ({describe_model_files(model)})"
        ]
    if not os.path.isfile(model):
        return [
            f"--tokenizer-model {model} does not exist; pass the path of a sentencepiece .model "
            f"(e.g. data/default/tokenizer.model)"
        ]
    return []


def _check_huggingface(model: str | None) -> list[str]:
    if not model:
        return [
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR, a local tokenizer directory "
            "(tokenizer.json, tokenizer_config.json)"
        ]
    if os.path.isfile(model):
        return [
            f"--tokenizer-model {model} is a file: a bare tokenizer file names no eos token; pass "
            f"the tokenizer's directory (with tokenizer_config.json)"
        ]
    if not os.path.isdir(model):
        return [
            f"--tokenizer-model {model} is not a local directory (hub ids are not downloaded: "
            f"fetch the tokenizer beforehand, e.g. huggingface-cli download, and pass its directory)"
        ]
    return []


def _check_gpt2(vocab_file: str | None, merge_file: str | None) -> list[str]:
    files = (("--vocab-file", vocab_file, "vocab.json"), ("--merge-file", merge_file, "merges.txt"))
    problems = []
    missing = ", ".join(flag for flag, path, _ in files if not path)
    if missing:
        problems.append(
            f"--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt); "
            f"not given: {missing}"
        )
    return problems + [
        f"{flag} {path} {'is a directory' if os.path.isdir(path) else 'does not exist'}: give the path of "
        f"GPT2BPETokenizer's {name} file"
        for flag, path, name in files
        if path and not os.path.isfile(path)
    ]


def check_tokenizer_flags(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> list[str]:
    """The tokenizer flags' problems, without loading anything (pure but for path checks)."""
    if tokenizer_type in REFUSED_TYPES:
        return [f"--tokenizer-type {tokenizer_type} is not supported: {REFUSED_TYPES[tokenizer_type]}"]
    if tokenizer_type not in TOKENIZER_TYPES:
        return [f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"]
    if tokenizer_type in NULL_TYPES:
        if vocab_size is None or int(vocab_size) <= 0:
            return [
                f"--tokenizer-type NullTokenizer needs a positive --vocab-size (got {vocab_size}); "
                f"the model vocabulary is then --vocab-size + 1 (EOD = --vocab-size)"
            ]
        return []
    if tokenizer_type in SENTENCEPIECE_TYPES + LLAMA2_TYPES:
        return _check_sentencepiece(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if tokenizer_type in HF_TYPES:
        return _check_huggingface(tokenizer_model)
    if tokenizer_type in TIKTOKEN_TYPES:
        if not tokenizer_model or not os.path.isfile(tokenizer_model) or not tokenizer_model.endswith(".json"):
            return [
                f"--tokenizer-type TikTokenizer needs --tokenizer-model PATH.json, Megatron's tiktoken vocabulary "
                f"(got {tokenizer_model}{'' if not tokenizer_model or os.path.isfile(tokenizer_model) else ': no such file'})"
            ]
        return []
    return _check_gpt2(vocab_file, merge_file)
