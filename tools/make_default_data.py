"""Build the shipped default data in one command: corpus JSONL -> tokenizer -> .bin/.idx.

    python tools/make_default_data.py            # writes data/default/

Outputs ``tokenizer.model`` (+ ``.vocab``), ``corpus_text_document.bin/.idx`` (EOD appended to
every document) and ``README.md`` with the numbers. The JSONL is built in a temporary directory
and not shipped unless ``--keep-jsonl``; it is reproducible from the installed Python, numpy and
torch (the README records their versions).
"""

import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cli_args import ToolParser, integer, output_dir  # noqa: E402
from tools.build_default_corpus import DEFAULT_PACKAGES, build_default_corpus  # noqa: E402
from tools.preprocess_data import preprocess_data  # noqa: E402
from tools.train_tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, train_tokenizer  # noqa: E402

DEFAULT_MAX_BYTES = 4_000_000


def get_percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    index = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values))) - 1))
    return sorted_values[index]


def write_readme(output_dir: str, corpus: dict, stats, vocab_size: int, max_bytes: int) -> str:
    import numpy
    import sentencepiece
    import torch

    lengths = sorted(stats.document_lengths["text"])
    sizes = {
        name: os.path.getsize(os.path.join(output_dir, name))
        for name in (
            "tokenizer.model",
            "corpus_text_document.bin",
            "corpus_text_document.idx",
            "corpus_text_document.tokenizer.json",
        )
    }
    lines = [
        "# Default data",
        "",
        "Real English text that ships with CPython and the installed numpy/torch: the language",
        "reference topics (`pydoc_data.topics`) then the docstrings of public stdlib, numpy and",
        "torch modules, classes and functions (`tools/build_default_corpus.py`).",
        "",
        "Rebuild (about 10 seconds on 2 cores; byte-identical for the same versions):",
        "",
        "    python tools/make_default_data.py",
        "",
        "which runs, in a temporary directory:",
        "",
        f"    python tools/build_default_corpus.py --output corpus.jsonl --max-bytes {max_bytes}",
        f"    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size {vocab_size} "
        "--output-prefix data/default/tokenizer",
        "    python tools/preprocess_data.py --input corpus.jsonl --output-prefix "
        "data/default/corpus --tokenizer-type SentencePieceTokenizer "
        "--tokenizer-model data/default/tokenizer.model --append-eod --workers 2",
        "",
        "The corpus JSONL is not shipped (`--keep-jsonl` keeps it as `data/default/corpus.jsonl`).",
        "",
        "| | |",
        "|---|---|",
        f"| documents | {stats.num_documents} |",
        f"| text | {corpus['bytes']:,} bytes UTF-8 |",
        f"| tokens (incl. one EOD per document) | {stats.num_tokens['text']:,} |",
        f"| document length, tokens: min / median / p90 / max | {lengths[0]} / "
        f"{get_percentile(lengths, 50)} / {get_percentile(lengths, 90)} / {lengths[-1]} |",
        f"| tokenizer | sentencepiece BPE, {vocab_size} pieces; unk=0 bos=1 eod=2 pad=3 |",
    ]
    lines += [f"| `{name}` | {size:,} bytes |" for name, size in sizes.items()]
    lines += [
        f"| built with | Python {platform.python_version()}, numpy {numpy.__version__}, "
        f"torch {torch.__version__}, sentencepiece {sentencepiece.__version__} |",
        "",
        "Use: `--data-path data/default/corpus_text_document --tokenizer-type "
        "SentencePieceTokenizer --tokenizer-model data/default/tokenizer.model`.",
        "",
    ]
    path = os.path.join(output_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def make_default_data(
    output_dir: str = "data/default",
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int = 8192,
    workers: int = 2,
    keep_jsonl: bool = False,
) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(output_dir if keep_jsonl else tmp, "corpus.jsonl")
        print(f"[1/3] corpus -> {jsonl}", flush=True)
        corpus = build_default_corpus(jsonl, max_bytes=max_bytes, packages=DEFAULT_PACKAGES)
        print("[2/3] tokenizer", flush=True)
        model = train_tokenizer(jsonl, os.path.join(output_dir, "tokenizer"), vocab_size)
        print("[3/3] preprocess", flush=True)
        stats = preprocess_data(
            jsonl,
            os.path.join(output_dir, "corpus"),
            "SentencePieceTokenizer",
            model,
            append_eod=True,
            workers=workers,
            log_interval=0,
        )
    readme = write_readme(output_dir, corpus, stats, vocab_size, max_bytes)
    print(open(readme).read())


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=output_dir, default="data/default")
    parser.add_argument("--max-bytes", type=integer(1, what="bytes of corpus text"), default=DEFAULT_MAX_BYTES)
    parser.add_argument("--vocab-size", type=integer(MIN_VOCAB_SIZE, MAX_VOCAB_SIZE, what="pieces"), default=8192)
    parser.add_argument("--workers", type=integer(1, what="tokenizer processes"), default=2)
    parser.add_argument("--keep-jsonl", action="store_true")
    args = parser.parse_args(argv)
    make_default_data(args.output_dir, args.max_bytes, args.vocab_size, args.workers, args.keep_jsonl)


if __name__ == "__main__":
    main()
