"""Tokenize a JSONL file into megatron-core indexed datasets (``.bin`` + ``.idx``).

Same output as Megatron-LM's ``tools/preprocess_data.py`` without sentence splitting: for each
``--json-keys`` key, ``{output_prefix}_{key}_document.bin/.idx`` written by megatron-core's
``IndexedDatasetBuilder``, one document (holding one sequence) per non-blank JSON line, token
dtype ``DType.optimal_dtype(vocab_size)`` (uint16 below 65,500 ids). ``--append-eod`` ends every
non-empty document with the tokenizer's EOD. A document that tokenizes to nothing is recorded, as
Megatron-LM records it, as a document holding no sequence (so the ``.idx`` is byte-identical to
Megatron-LM's; training reads sequences and never sees it).

``--workers N`` tokenizes in a process pool; ``imap`` keeps the input order, so the output is
byte-identical for any N. Everything is written under ``*.tmp`` names and renamed only after the
whole input succeeded, so a malformed line (reported with file and line number) leaves no
half-written dataset behind.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()  # before megatron-core's imports: no TE/Apex warnings before an error line

from megatron_ext.data.tokenizers import REFUSED_TYPES, TOKENIZER_TYPES, build_tokenizer  # noqa: E402


@dataclass
class PreprocessStats:
    """What ``preprocess_data`` wrote."""

    num_documents: int = 0
    num_empty: int = 0  # documents that tokenized to nothing (recorded without a sequence)
    num_tokens: dict = field(default_factory=dict)  # key -> total tokens
    document_lengths: dict = field(default_factory=dict)  # key -> [tokens per document]
    output_prefixes: dict = field(default_factory=dict)  # key -> dataset path prefix


class _Encoder:
    """Per-process tokenizer; ``encode`` turns one JSON line into ids for each key."""

    def __init__(self, input_path, json_keys, tokenizer_args, append_eod):
        self.input_path = input_path
        self.json_keys = list(json_keys)
        self.tokenizer_args = tokenizer_args
        self.append_eod = append_eod
        self.tokenizer = None

    def initialize(self) -> None:
        self.tokenizer = build_tokenizer(**self.tokenizer_args)

    def encode(self, numbered_line: tuple[int, bytes]) -> tuple[dict, int]:
        line_number, raw = numbered_line
        where = f"--input {self.input_path} line {line_number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: malformed JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        ids_per_key = {}
        for key in self.json_keys:
            if key not in record:
                raise ValueError(
                    f"{where}: no key {key!r} (--json-keys {' '.join(self.json_keys)})")
            if not isinstance(record[key], str):
                raise ValueError(f"{where}: {key!r} is {type(record[key]).__name__}, not a string")
            try:
                ids = self.tokenizer.tokenize(record[key])
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            ids_per_key[key] = ids
        return ids_per_key, len(raw)


_WORKER_ENCODER: Optional[_Encoder] = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    _WORKER_ENCODER.initialize()


def _encode_in_worker(numbered_line):
    return _WORKER_ENCODER.encode(numbered_line)


def _iter_numbered_lines(path: str):
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if raw.strip():
                yield line_number, raw


def get_output_prefix(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def preprocess_data(input_path: str, output_prefix: str, tokenizer_type: str,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                    workers: int = 1, log_interval: int = 10000,
                    progress: bool = True, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None) -> PreprocessStats:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document.{bin,idx}`` per key."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    if not os.path.isfile(input_path):
        raise ValueError(f"--input {input_path} does not exist")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tokenizer_args = dict(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
                          vocab_size=vocab_size, vocab_file=vocab_file, merge_file=merge_file)
    encoder = _Encoder(input_path, json_keys, tokenizer_args, append_eod)
    encoder.initialize()  # fail fast on tokenizer flags, and gives us the dtype
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    stats = PreprocessStats()
    final_paths, builders = [], {}
    for key in json_keys:
        prefix = get_output_prefix(output_prefix, key)
        stats.output_prefixes[key] = prefix
        stats.num_tokens[key] = 0
        stats.document_lengths[key] = []
        final_paths += [prefix + ".bin", prefix + ".idx"]
        builders[key] = IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype)

    pool = None
    try:
        lines = _iter_numbered_lines(input_path)
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,))
            encoded = pool.imap(_encode_in_worker, lines, chunksize=32)
        else:
            encoded = map(encoder.encode, lines)
        bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True,
                   desc="preprocess", disable=not progress, file=sys.stderr)
        start = time.time()
        for ids_per_key, num_bytes in encoded:
            bar.update(num_bytes)
            if not any(ids_per_key.values()):
                stats.num_empty += 1
            for key, ids in ids_per_key.items():
                # Megatron-LM's add_document(ids, sentence_lens): no sequence for an empty document
                builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)] if ids else [])
                stats.num_tokens[key] += len(ids)
                if ids:
                    stats.document_lengths[key].append(len(ids))
            stats.num_documents += 1
            if log_interval and stats.num_documents % log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                bar.write(f"processed {stats.num_documents} documents "
                          f"({stats.num_documents / elapsed:.0f} docs/s, "
                          f"{bar.n / elapsed / 1e6:.2f} MB/s)")
        bar.close()
        for key, builder in builders.items():
            builder.finalize(stats.output_prefixes[key] + ".idx.tmp")
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for path in final_paths:
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for path in final_paths:
        os.replace(path + ".tmp", path)
    return stats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract; each gets its own dataset")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES + tuple(REFUSED_TYPES))
    group.add_argument("--tokenizer-model", default=None,
                       help="sentencepiece .model, or a local Hugging Face tokenizer directory")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between logs")
    group.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        stats = preprocess_data(args.input, args.output_prefix, args.tokenizer_type,
                                args.tokenizer_model, args.vocab_size, args.json_keys,
                                args.append_eod, args.workers, args.log_interval,
                                progress=not args.no_progress, vocab_file=args.vocab_file,
                                merge_file=args.merge_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    for key, prefix in stats.output_prefixes.items():
        print(f"wrote {prefix}.bin/.idx: {stats.num_documents} documents, "
              f"{stats.num_tokens[key]} tokens ({stats.num_empty} of them empty, recorded without a sequence as "
              f"Megatron-LM does)")


if __name__ == "__main__":
    main()
