"""Train a sentencepiece tokenizer (BPE by default) on the text fields of a JSONL file.

Special ids are fixed so every model this tool writes agrees with ``megatron_ext.data.tokenizers``:
``<unk>=0, <s>=1, </s>=2 (EOD), <pad>=3``; EOD and pad are real, distinct tokens.

The text is kept verbatim (``identity`` normalisation, whitespace runs kept, whitespace-only pieces
allowed) so code in docstrings round-trips; ``\\n`` is a user-defined piece, and byte fallback
means no input ever maps to ``<unk>``. Training sees one line per sentence (sentencepiece's unit),
in file order, single-threaded, so the same input gives the same model.
"""

import argparse
import json
import os
import re
import sys
from typing import Iterator, Sequence

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def iter_jsonl_texts(path: str, json_keys: Sequence[str]) -> Iterator[str]:
    """The ``json_keys`` fields of each line of ``path``; ValueError names a malformed line."""
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                texts = [record[key] for key in json_keys]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"--input {path} line {line_number}: expected a JSON object with keys "
                    f"{list(json_keys)} ({type(exc).__name__}: {exc})"
                ) from exc
            yield from texts


def iter_training_sentences(path: str, json_keys: Sequence[str]) -> Iterator[str]:
    """Non-empty lines of every document, the unit sentencepiece trains on."""
    for text in iter_jsonl_texts(path, json_keys):
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_tokenizer(input_path: str, output_prefix: str, vocab_size: int = 8192,
                    json_keys: Sequence[str] = ("text",), model_type: str = "bpe") -> str:
    """Train and write ``{output_prefix}.model`` / ``.vocab``; returns the .model path."""
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type must be bpe or unigram, got {model_type!r}")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if vocab_size < 300:  # 256 byte-fallback pieces, the special tokens and "\n" come first
        raise ValueError(f"--vocab-size {vocab_size} is too small: byte fallback alone takes 256 pieces; give >= 300")
    try:
        _train(input_path, output_prefix, vocab_size, json_keys, model_type)
    except RuntimeError as err:
        found = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(err))
        if found is None:
            raise
        raise ValueError(f"--vocab-size {found.group(1)} is more pieces than {input_path} holds: give "
                         f"--vocab-size {found.group(2)} or less, or more text") from None
    return output_prefix + ".model"


def _train(input_path: str, output_prefix: str, vocab_size: int, json_keys: Sequence[str], model_type: str) -> None:
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_training_sentences(input_path, json_keys),
        model_prefix=output_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=0.9995,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=1 << 14,
        num_threads=1,
        minloglevel=2,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL file")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--output-prefix", required=True,
                        help="writes OUTPUT_PREFIX.model and OUTPUT_PREFIX.vocab")
    args = parser.parse_args(argv)
    try:
        path = train_tokenizer(args.input, args.output_prefix, args.vocab_size, args.json_keys,
                               args.model_type)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {path} (vocab size {args.vocab_size})")


if __name__ == "__main__":
    main()
