"""Tokenize a JSONL file into megatron-core indexed datasets (``.bin`` + ``.idx``).

Same output as Megatron-LM's ``tools/preprocess_data.py`` without sentence splitting: for each
``--json-keys`` key, ``{output_prefix}_{key}_document.bin/.idx`` written by megatron-core's
``IndexedDatasetBuilder``, one document (holding one sequence) per non-blank JSON line, token
dtype ``DType.optimal_dtype(vocab_size)`` (uint16 below 65,500 ids). ``--append-eod`` ends every
non-empty document with the tokenizer's EOD. A document that tokenizes to nothing is recorded, as
Megatron-LM records it, as a document holding no sequence (so the ``.idx`` is byte-identical to
Megatron-LM's; training reads sequences and never sees it). Beside each pair,
``{output_prefix}_{key}_document.tokenizer.json`` records the tokenizer (type, sha256 of its files,
vocabulary size), so that training under another tokenizer is refused at start-up (Megatron-LM's
format records none; a pair without the record is not checked).

``--workers N`` tokenizes in a process pool, batches collected in input order, so the output is
byte-identical for any N. Everything is written under ``*.tmp`` names and renamed only after the
whole input succeeded, so a malformed line (reported with file and line number: bad JSON, a missing
key, a lone surrogate such as ``\\ud800``), an input that gives a key no token at all (a dataset
training refuses), SIGTERM or Ctrl-C leave no half-written dataset behind; each file is fsynced
before the renames (and the directory after them), so a power loss cannot leave an empty or
truncated file where an earlier run's dataset was. ``--input`` may be gzipped
(``corpus.jsonl.gz``, found by gzip's magic bytes; Megatron-LM's tool reads .gz too).

``--tokenizer-type Llama2Tokenizer`` writes what Megatron-LM core_v0.16.1's tool writes: by default
sentencepiece's ids alone (its default tokenizer system, megatron-core's), with
``--legacy-tokenizer`` BOS first, as its legacy ``_Llama2Tokenizer.tokenize`` puts it (an empty
document then holds BOS, and EOD with ``--append-eod``). Other types' legacy classes are not
reproduced: ``--legacy-tokenizer`` is refused with them.
"""

import collections
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()  # before megatron-core's imports: no TE/Apex warnings before an error line

from megatron_ext.checkpoint.directory import fsync_path  # noqa: E402
from megatron_ext.cli_args import ToolParser, integer  # noqa: E402
from megatron_ext.data.indexed_check import TOKENIZER_RECORD_SUFFIX, build_tokenizer_record  # noqa: E402
from megatron_ext.data.tokenizer_flags import LLAMA2_TYPES, REFUSED_TYPES, TOKENIZER_TYPES  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer  # noqa: E402
from tools.train_tokenizer import check_input_path, is_gzip, iter_jsonl_lines, parse_jsonl_line  # noqa: E402


@dataclass
class PreprocessStats:
    """What ``preprocess_data`` wrote."""

    num_documents: int = 0
    num_bytes: int = 0  # JSONL bytes read (after gunzip)
    num_empty: dict = field(default_factory=dict)  # key -> documents that tokenized to nothing (no sequence)
    num_tokens: dict = field(default_factory=dict)  # key -> total tokens
    document_lengths: dict = field(default_factory=dict)  # key -> [tokens per document]
    output_prefixes: dict = field(default_factory=dict)  # key -> dataset path prefix


class _Encoder:
    """Per-process tokenizer; ``encode`` turns one JSON line into ids for each key."""

    def __init__(self, input_path, json_keys, tokenizer_args, append_eod, prepend_bos=False):
        self.input_path = input_path
        self.json_keys = list(json_keys)
        self.tokenizer_args = tokenizer_args
        self.append_eod = append_eod
        self.prepend_bos = prepend_bos  # Megatron-LM's legacy Llama2Tokenizer: BOS first, even before nothing
        self.tokenizer = None

    def initialize(self) -> None:
        self.tokenizer = build_tokenizer(**self.tokenizer_args)

    def encode(self, numbered_line: tuple[int, bytes]) -> tuple[dict, int]:
        line_number, raw = numbered_line
        where = f"--input {self.input_path} line {line_number}"
        # ValueError naming the line for bad JSON, a missing or non-string key, a lone surrogate
        texts = parse_jsonl_line(self.input_path, line_number, raw, self.json_keys)
        ids_per_key = {}
        for key, (text, _) in texts.items():
            try:
                ids = self.tokenizer.tokenize(text)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            if self.prepend_bos:
                ids = [self.tokenizer.bos] + ids
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            ids_per_key[key] = ids
        return ids_per_key, len(raw)


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    # The parent cleans up and ends the pool: Ctrl-C (sent to the whole process group) is its alone,
    # and its pool.terminate()'s SIGTERM just ends a worker (not the parent's handler, inherited).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_SIGNALS)  # blocked since the fork: see _pool_signals_held
    _WORKER_ENCODER = encoder
    _WORKER_ENCODER.initialize()


_WORKER_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextlib.contextmanager
def _pool_signals_held():
    """Start pool workers inside this: SIGTERM and SIGINT are blocked in the calling thread while it
    is open, so each worker (and each thread of the pool, which forks replacements) starts with them
    blocked, kept pending until ``_init_worker`` has set the worker's own dispositions and unblocks
    them. Without it, a signal reaching a worker before that (the parent's ``pool.terminate()``
    right after an error, Ctrl-C to the process group while the workers start) ran the parent's
    Python handler in the worker, raising inside multiprocessing's start-up code, or was lost: caught
    by Python's C-level handler, which ``_init_worker`` then replaced before it ran. That worker
    survived ``terminate()``, waited forever on the task queue's lock, which ``terminate()`` holds,
    and ``pool.join()`` with it (seen in the tests, under load). A signal that reaches this process
    meanwhile (through another thread, or pending as the mask is restored) takes effect as this
    closes, once the pool is assigned and so ended by the caller's cleanup."""
    with _signals_deferred():
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _encode_batch_in_worker(batch):
    return [_WORKER_ENCODER.encode(numbered_line) for numbered_line in batch]


def _batches(lines, max_lines: int = 256, max_bytes: int = 1 << 20):
    batch, size = [], 0
    for numbered_line in lines:
        batch.append(numbered_line)
        size += len(numbered_line[1])
        if len(batch) == max_lines or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_in_pool(pool, lines, workers: int):
    """``encode`` of every line, in input order. The main thread reads the input and keeps 8 batches
    (256 lines or about 1 MB each) per worker in flight: the pool's task thread never reads the
    input, so it is never stuck on a stalled pipe when ``Pool.terminate()`` needs it (on an error or
    a signal; with ``imap`` over the input a SIGTERM could hang there)."""
    pending = collections.deque()
    for batch in _batches(lines):
        pending.append(pool.apply_async(_encode_batch_in_worker, (batch,)))
        if len(pending) >= 8 * workers:
            yield from pending.popleft().get()
    while pending:
        yield from pending.popleft().get()


class Interrupted(BaseException):
    """A signal stopped ``preprocess_data`` (raised by its SIGTERM handler, so the ``*.tmp`` files are
    removed as on an error; Ctrl-C raises KeyboardInterrupt, which does the same)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises ``Interrupted`` in the main thread while this is open (unless a handler is
    already set, or this is not the main thread: signals reach only it)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_deferred():
    """SIGTERM and SIGINT received while this is open take effect when it closes, delivered to the
    handlers it found (main thread only: elsewhere no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = {
        signum: signal.signal(signum, lambda got, frame: received.append(got))
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(received):
        signal.raise_signal(signum)


def get_output_prefix(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def preprocess_data(
    input_path: str,
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 10000,
    progress: bool = True,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tiktoken_options: dict | None = None,
    legacy_tokenizer: bool = False,
) -> PreprocessStats:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document.{bin,idx}`` per key
    (``legacy_tokenizer``: Megatron-LM's --legacy-tokenizer, BOS first with Llama2Tokenizer)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    json_keys = list(json_keys)
    _check_arguments(input_path, json_keys, workers, tokenizer_type, legacy_tokenizer)
    tokenizer_args = dict(
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        vocab_size=vocab_size,
        vocab_file=vocab_file,
        merge_file=merge_file,
        **(tiktoken_options or {}),  # tiktoken_pattern, tiktoken_num_special_tokens, tiktoken_special_tokens
    )
    encoder = _Encoder(input_path, json_keys, tokenizer_args, append_eod, prepend_bos=legacy_tokenizer)
    encoder.initialize()  # fail fast on tokenizer flags, and gives us the dtype
    if legacy_tokenizer and encoder.tokenizer.bos < 0:
        raise ValueError(
            f"--legacy-tokenizer puts BOS first, but --tokenizer-model {tokenizer_model} defines no BOS piece "
            f"(Megatron-LM would write id -1): leave --legacy-tokenizer out, or use a model with one"
        )
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    stats, final_paths = _start_stats(output_prefix, json_keys)
    builders = {}
    pool = bar = None
    # total: the bytes to read, known for a plain file (not a .gz's, nor a pipe's)
    total = os.path.getsize(input_path) if os.path.isfile(input_path) and not is_gzip(input_path) else None
    with _sigterm_raises():
        try:
            for key in json_keys:
                builders[key] = IndexedDatasetBuilder(stats.output_prefixes[key] + ".bin.tmp", dtype=dtype)
            lines = iter_jsonl_lines(input_path)
            if workers > 1:
                with _pool_signals_held():
                    pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,))
                encoded = _encode_in_pool(pool, lines, workers)
            else:
                encoded = map(encoder.encode, lines)
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", disable=not progress, file=sys.stderr)
            _add_documents(encoded, builders, stats, dtype, bar, log_interval)
            bar.close()
            _check_not_empty(input_path, stats)
            _finalize_tmp_files(builders, stats, encoder, tokenizer_model)
            _replace_with_tmp_files(final_paths, os.path.dirname(os.path.abspath(output_prefix)))
        except BaseException:
            if bar is not None:
                bar.close()  # so the error starts a line of its own
            _remove_tmp_files(builders, final_paths)
            raise
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    return stats


def _start_stats(output_prefix: str, json_keys: list[str]) -> tuple[PreprocessStats, list[str]]:
    """Empty stats with each key's dataset prefix, and the paths the run writes (each first as ``*.tmp``)."""
    stats = PreprocessStats()
    final_paths = []
    for key in json_keys:
        prefix = get_output_prefix(output_prefix, key)
        stats.output_prefixes[key] = prefix
        stats.num_tokens[key] = 0
        stats.num_empty[key] = 0
        stats.document_lengths[key] = []
        final_paths += [prefix + ".bin", prefix + ".idx", prefix + TOKENIZER_RECORD_SUFFIX]
    return stats, final_paths


def _finalize_tmp_files(builders: dict, stats: PreprocessStats, encoder: _Encoder, tokenizer_model: str | None) -> None:
    """Each key's ``.idx.tmp`` and tokenizer record ``.tmp`` beside its ``.bin.tmp``."""
    for key, builder in builders.items():
        builder.finalize(stats.output_prefixes[key] + ".idx.tmp")
        record = build_tokenizer_record(encoder.tokenizer.identity(), tokenizer_model, key, encoder.append_eod)
        record["prepend_bos"] = encoder.prepend_bos
        with open(stats.output_prefixes[key] + TOKENIZER_RECORD_SUFFIX + ".tmp", "w") as f:
            json.dump(record, f, indent=1)


def _remove_tmp_files(builders: dict, final_paths: list[str]) -> None:
    """After a failure: the builders' open ``.bin.tmp`` closed and every ``*.tmp`` written so far removed."""
    for builder in builders.values():
        builder.data_file.close()
    for path in final_paths:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")


def _replace_with_tmp_files(final_paths: list[str], out_dir: str) -> None:
    """Each ``*.tmp`` renamed to its final name (over a previous run's file), made durable first (a
    power loss after the renames must not leave an empty or truncated file where a previous run's
    dataset was), the renames after them. A previous run's tokenizer record goes first: a kill
    between the renames leaves a pair without a record (unchecked), never one vouching for it as
    another tokenizer's ids."""
    for path in final_paths:
        fsync_path(path + ".tmp")
    with _signals_deferred():  # SIGTERM or Ctrl-C between two renames: a new .bin beside an old .idx
        for path in final_paths:
            if path.endswith(TOKENIZER_RECORD_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        for path in final_paths:
            os.replace(path + ".tmp", path)
    fsync_path(out_dir)


def _check_arguments(
    input_path: str, json_keys: list[str], workers: int, tokenizer_type: str, legacy_tokenizer: bool
) -> None:
    """ValueError naming the flag, before any work."""
    check_input_path(input_path)
    if legacy_tokenizer and tokenizer_type not in LLAMA2_TYPES:
        raise ValueError(
            f"--legacy-tokenizer with --tokenizer-type {tokenizer_type}: only Llama2Tokenizer's legacy "
            f"behaviour (BOS first) is reproduced here; leave it out (for SentencePieceTokenizer, Megatron-LM's "
            f"legacy <EOD> and other added ids lie outside the model's vocabulary here: docs/running.md)"
        )
    if not json_keys:
        raise ValueError("--json-keys is empty: name at least one key (default: text)")
    repeated = sorted({key for key in json_keys if json_keys.count(key) > 1})
    if repeated:
        raise ValueError(
            f"--json-keys {' '.join(json_keys)} names {', '.join(map(repr, repeated))} more than "
            f"once: each key writes its own dataset; give each once"
        )
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")


def _add_documents(encoded, builders: dict, stats: PreprocessStats, dtype, bar, log_interval: int) -> None:
    """Each encoded line's ids into its key's builder, counted in ``stats``; progress on ``bar``."""
    import numpy

    start = time.time()
    for ids_per_key, num_bytes in encoded:
        bar.update(num_bytes)
        stats.num_bytes += num_bytes  # (a disabled bar counts nothing)
        for key, ids in ids_per_key.items():
            # Megatron-LM's add_document(ids, sentence_lens): no sequence for an empty document
            builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)] if ids else [])
            stats.num_tokens[key] += len(ids)
            if ids:
                stats.document_lengths[key].append(len(ids))
            else:
                stats.num_empty[key] += 1
        stats.num_documents += 1
        if log_interval and stats.num_documents % log_interval == 0:
            elapsed = max(time.time() - start, 1e-9)
            bar.write(
                f"processed {stats.num_documents} documents "
                f"({stats.num_documents / elapsed:.0f} docs/s, "
                f"{stats.num_bytes / elapsed / 1e6:.2f} MB/s)"
            )


def _check_not_empty(input_path: str, stats: PreprocessStats) -> None:
    """ValueError for a dataset training would refuse ("has no documents": no sequence at all)."""
    if not stats.num_documents:
        raise ValueError(
            f"--input {input_path} holds no JSON line (it is empty or blank): nothing to "
            f"tokenize; give a JSONL file with one document per line"
        )
    empty = [key for key in stats.output_prefixes if not stats.num_tokens[key]]
    if empty:
        raise ValueError(
            f"--input {input_path}: every one of its {stats.num_documents} documents is empty under "
            f'{", ".join(map(repr, empty))}: no tokens, a dataset training refuses ("has no documents"); '
            f"wrote nothing; leave {'it' if len(empty) == 1 else 'them'} out of --json-keys or give text"
        )


def build_parser() -> ToolParser:
    parser = ToolParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line; gzipped (.jsonl.gz) too")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; each gets its own dataset")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES + tuple(REFUSED_TYPES))
    group.add_argument(
        "--tokenizer-model", default=None, help="sentencepiece .model, or a local Hugging Face tokenizer directory"
    )
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument(
        "--vocab-size",
        type=integer(1, what="token ids"),
        default=None,
        help="for NullTokenizer; TikTokenizer's whole vocabulary",
    )
    group.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"], help="TikTokenizer (default v2)")
    group.add_argument(
        "--tiktoken-num-special-tokens", type=integer(0, what="special ids"), default=1000, help="TikTokenizer"
    )
    group.add_argument("--tiktoken-special-tokens", nargs="*", default=None, help="TikTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    group.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="Megatron-LM's legacy tokenizer system: with Llama2Tokenizer, BOS first in each document",
    )
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=integer(1, what="tokenizer processes"), default=1, help="tokenizer processes")
    group.add_argument(
        "--log-interval", type=integer(0, what="documents; 0: none"), default=10000, help="documents between logs"
    )
    group.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        stats = preprocess_data(
            args.input,
            args.output_prefix,
            args.tokenizer_type,
            args.tokenizer_model,
            args.vocab_size,
            args.json_keys,
            args.append_eod,
            args.workers,
            args.log_interval,
            progress=not args.no_progress,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tiktoken_options=dict(
                tiktoken_pattern=args.tiktoken_pattern,
                tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                tiktoken_special_tokens=args.tiktoken_special_tokens,
            ),
            legacy_tokenizer=args.legacy_tokenizer,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:  # an unwritable --output-prefix, a full disk: named, without a traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where} (writing --output-prefix {args.output_prefix})", file=sys.stderr)
        sys.exit(2)
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(
            f"error: stopped by {signal.Signals(signum).name}; removed the unfinished "
            f"{args.output_prefix}_*_document.bin.tmp/.idx.tmp files (earlier datasets are untouched)",
            file=sys.stderr,
        )
        sys.exit(128 + signum)
    if args.tokenizer_type in LLAMA2_TYPES and not args.legacy_tokenizer:
        print(
            "note: Llama2Tokenizer: no BOS before each document, as Megatron-LM core_v0.16.1's tool writes by "
            "default (its --legacy-tokenizer puts BOS first: so does --legacy-tokenizer here)"
        )
    for key, prefix in stats.output_prefixes.items():
        print(
            f"wrote {prefix}.bin/.idx/{TOKENIZER_RECORD_SUFFIX[1:]}: {stats.num_documents} documents, "
            f"{stats.num_tokens[key]} tokens ({stats.num_empty[key]} of them empty, recorded without a sequence "
            f"as Megatron-LM does)"
        )


if __name__ == "__main__":
    main()
