"""Train a sentencepiece tokenizer (BPE by default) on the text fields of a JSONL file.

Special ids are fixed so every model this tool writes agrees with ``megatron_ext.data.tokenizers``:
``<unk>=0, <s>=1, </s>=2 (EOD), <pad>=3``; EOD and pad are real, distinct tokens.

The text is kept verbatim (``identity`` normalisation, whitespace runs kept, whitespace-only pieces
allowed) so code in docstrings round-trips; ``\\n`` is a user-defined piece, and byte fallback
means no input ever maps to ``<unk>``. Training sees one line per sentence (sentencepiece's unit),
in file order, single-threaded, so the same input gives the same model. sentencepiece skips any
sentence over ``MAX_SENTENCE_BYTES`` bytes of UTF-8, so a longer line is cut, before a whitespace
near the limit, into sentences it keeps: every non-blank line is trained on, and the tool reports
how much text that was. ``--input`` may be gzipped (``corpus.jsonl.gz``, found by gzip's magic
bytes, as for ``tools/preprocess_data.py``).
"""

import contextlib
import gzip
import json
import os
import re
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cli_args import ToolParser, integer  # noqa: E402

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
MIN_VOCAB_SIZE = 300  # 256 byte-fallback pieces, the special tokens and "\n" come first
MAX_VOCAB_SIZE = 2**31 - 1  # sentencepiece's vocab_size is an int32
MAX_SENTENCE_BYTES = 1 << 14  # sentencepiece's max_sentence_length, in bytes of UTF-8
GZIP_MAGIC = b"\x1f\x8b"
_WHITESPACE = (b" ", b"\t", b"\r", b"\x0b", b"\x0c")  # a line holds no b"\n"


def check_input_path(path: str) -> None:
    """ValueError unless ``--input`` names something readable that is not a directory."""
    if not os.path.exists(path):
        raise ValueError(f"--input {path} does not exist: give a JSONL file (or a .jsonl.gz)")
    if os.path.isdir(path):
        raise ValueError(f"--input {path} is a directory: give a JSONL file (or a .jsonl.gz)")


def is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.peek(2)[:2] == GZIP_MAGIC


@contextlib.contextmanager
def open_jsonl(path: str):
    """``path`` as a binary file of lines, gunzipped when it starts with gzip's magic bytes (any
    name, e.g. ``corpus.jsonl.gz`` as Megatron-LM's tool reads it). Peeks and never seeks, so a
    pipe works too (``--input <(zcat ...)``)."""
    with open(path, "rb") as f:
        if f.peek(2)[:2] == GZIP_MAGIC:
            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                yield g
        else:
            yield f


def iter_jsonl_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line_number, raw line)`` of every non-blank line; ValueError names a broken gzip."""
    line_number = 0
    with open_jsonl(path) as f:
        try:
            for line_number, raw in enumerate(f, start=1):
                if raw.strip():
                    yield line_number, raw
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ValueError(
                f"--input {path}: the gzip data is truncated or corrupt after line {line_number} "
                f"({exc}); compress the file again"
            ) from None


def check_text(where: str, key: str, text: str) -> bytes:
    """``text`` as UTF-8; ValueError for a lone surrogate (``\\ud800`` in JSON), which no tokenizer reads."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: {key!r} holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is "
            f"not text: JSON \\ud800-\\udfff escapes must come in high-low pairs; fix or drop the line"
        ) from None


def parse_jsonl_line(path: str, line_number: int, raw: bytes, json_keys: Sequence[str]) -> dict:
    """``{key: (text, its UTF-8 bytes)}`` of one line; ValueError names the file, line and problem."""
    where = f"--input {path} line {line_number}"
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: malformed JSON ({exc}): give a JSONL file, one JSON object per line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    texts = {}
    for key in json_keys:
        if key not in record:
            raise ValueError(f"{where}: no key {key!r} (--json-keys {' '.join(json_keys)})")
        if not isinstance(record[key], str):
            raise ValueError(f"{where}: {key!r} is {type(record[key]).__name__}, not a string")
        texts[key] = (record[key], check_text(where, key, record[key]))
    return texts


def split_long_line(line: str, limit: int = MAX_SENTENCE_BYTES) -> list[str]:
    """``line`` in pieces of at most ``limit`` bytes of UTF-8 that join back to it: each cut goes
    before the last whitespace in the second half of the window (so the next piece starts with it,
    as sentencepiece's ``▁word`` does), else at the last character boundary."""
    data = line.encode("utf-8")
    if len(data) <= limit:
        return [line]
    pieces, start = [], 0
    while len(data) - start > limit:
        end = start + limit
        cut = max(data.rfind(ws, start + limit // 2, end + 1) for ws in _WHITESPACE)
        if cut < 0:
            cut = end
            while data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: not a character boundary
                cut -= 1
        pieces.append(data[start:cut].decode("utf-8"))
        start = cut
    pieces.append(data[start:].decode("utf-8"))
    return pieces


@dataclass
class TrainingText:
    """How much of ``--input`` the tokenizer was trained on."""

    documents: int = 0  # non-blank JSONL lines
    text_bytes: int = 0  # UTF-8 bytes of their --json-keys fields
    sentences: int = 0  # sentences given to sentencepiece
    sentence_bytes: int = 0  # their bytes: the text less newlines and whitespace-only lines
    long_lines: int = 0  # lines over MAX_SENTENCE_BYTES, each cut into several sentences

    def summary(self) -> str:
        notes = [f"{self.sentences:,} sentences"]
        if self.sentence_bytes < self.text_bytes:
            notes.append("left out: newlines and whitespace-only lines")
        if self.long_lines:
            notes.append(f"{self.long_lines:,} lines over {MAX_SENTENCE_BYTES:,} bytes cut at whitespace")
        return (
            f"trained on {self.sentence_bytes:,} of the {self.text_bytes:,} bytes of text in "
            f"{self.documents:,} documents ({'; '.join(notes)})"
        )


def iter_training_sentences(path: str, json_keys: Sequence[str], stats: TrainingText | None = None) -> Iterator[str]:
    """Non-blank lines of every document, each cut to at most ``MAX_SENTENCE_BYTES`` bytes: the
    unit sentencepiece trains on. Counts what it yields into ``stats``."""
    stats = TrainingText() if stats is None else stats
    for line_number, raw in iter_jsonl_lines(path):
        texts = parse_jsonl_line(path, line_number, raw, json_keys)
        stats.documents += 1
        for text, data in texts.values():
            stats.text_bytes += len(data)
            for line in text.split("\n"):
                if not line.strip():
                    continue
                pieces = split_long_line(line)
                stats.long_lines += len(pieces) > 1
                for piece in pieces:
                    if piece.strip():
                        stats.sentences += 1
                        stats.sentence_bytes += len(piece.encode("utf-8"))
                        yield piece


def check_output_prefix(output_prefix: str) -> None:
    """ValueError now when ``{output_prefix}.model`` cannot be written (a read-only directory, a file
    in the path): sentencepiece would fail only after training, with a RuntimeError traceback."""
    probe = f"{output_prefix}.model.probe-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ValueError(
            f"--output-prefix {output_prefix}: cannot write {output_prefix}.model ({err.strerror}); give a "
            f"prefix in a directory this user can write"
        ) from None


def train_tokenizer(
    input_path: str,
    output_prefix: str,
    vocab_size: int = 8192,
    json_keys: Sequence[str] = ("text",),
    model_type: str = "bpe",
) -> str:
    """Train and write ``{output_prefix}.model`` / ``.vocab``; returns the .model path and prints
    how much text it was trained on."""
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type must be bpe or unigram, got {model_type!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: byte fallback alone takes 256 pieces; give >= {MIN_VOCAB_SIZE}"
        )
    check_input_path(input_path)
    stats = TrainingText()
    sentences = iter_training_sentences(input_path, json_keys, stats)
    first = next(sentences, None)  # reads up to the first text: a malformed or empty input fails here
    if first is None:
        raise ValueError(
            f"--input {input_path} holds no text to train on: {stats.documents} non-blank lines, "
            f"{stats.text_bytes} bytes in --json-keys {' '.join(json_keys)} (all empty or "
            f"whitespace); give a JSONL file with text"
        )
    check_output_prefix(output_prefix)
    reader = _Reader(first, sentences)
    try:
        _train(reader, output_prefix, vocab_size, model_type)
    except RuntimeError as err:
        if reader.error is not None:  # sentencepiece turns the reader's ValueError into a RuntimeError
            raise reader.error from None
        found = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if found is not None:
            raise ValueError(
                f"--vocab-size {found.group(1)} is fewer pieces than the characters of {input_path} "
                f"need ({found.group(2)}): give --vocab-size {found.group(2)} or more"
            ) from None
        found = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(err))
        if found is None:
            raise
        raise ValueError(
            f"--vocab-size {found.group(1)} is more pieces than {input_path} holds: give --vocab-size "
            f"{found.group(2)} or less, or more text ({stats.summary()})"
        ) from None
    print(stats.summary())
    return output_prefix + ".model"


class _Reader:
    """The sentence iterator given to sentencepiece, keeping the exception it raised (sentencepiece
    reports any as ``RuntimeError: INTERNAL: ...``, without our message's type)."""

    def __init__(self, first: str, rest: Iterator[str]):
        self.first, self.rest, self.error = first, rest, None

    def __iter__(self):
        yield self.first
        try:
            yield from self.rest
        except BaseException as exc:
            self.error = exc
            raise


# sentencepiece's trainer options for our models (tests train tiny models with them)
TRAINER_OPTIONS = dict(
    character_coverage=0.9995,
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    user_defined_symbols=["\n"],
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
    num_threads=1,
    minloglevel=2,
)


def _train(sentences, output_prefix: str, vocab_size: int, model_type: str) -> None:
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_prefix=output_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=MAX_SENTENCE_BYTES,  # no sentence is longer: iter_training_sentences cuts them
        **TRAINER_OPTIONS,
    )


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL file, or gzipped JSONL (.jsonl.gz)")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument(
        "--vocab-size",
        type=integer(MIN_VOCAB_SIZE, MAX_VOCAB_SIZE, what="pieces; 256 are byte fallback"),
        default=8192,
    )
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.model and OUTPUT_PREFIX.vocab")
    args = parser.parse_args(argv)
    try:
        path = train_tokenizer(args.input, args.output_prefix, args.vocab_size, args.json_keys, args.model_type)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {path} (vocab size {args.vocab_size})")


if __name__ == "__main__":
    main()
