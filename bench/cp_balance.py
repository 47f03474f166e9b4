"""Context parallelism: per-rank work balance of the three token layouts on packed documents, and
what padding every document to g = 2c costs (pure CPU, about 10 s).

    python -m bench.cp_balance [--rows-8k 256] [--rows-128k 48] [--seed 0] [--packing-strategy best_fit]

Model (the design's, docs/context-parallel.md): a token at offset p of its document costs 4 h p
(its scores and weighted values over the p keys before it) plus 24 h^2 (the rest of the layer),
h = 4096; a rank's work on a micro-batch is the sum over the tokens it holds, and a layer waits for
its slowest CP rank: the figure is sum over micro-batches of max_r work / sum of mean_r work (1.000:
perfect balance). Documents are packed as the run packs them (``packing.build_packing_index``,
best_fit by default, pieces of at most --seq-length), each row padded to --seq-length by growing its last
document (as static or negotiated padding does); one micro-batch = one row.

- contiguous: rank r holds the row's r-th of c equal slices;
- row head-tail (megatron-core's ``get_batch_on_this_cp_rank``; ours for unpacked rows and
  windows): ``context_parallel.layout.build_row_layout``;
- per-document head-tail (ours for --packed-sequences, Transformer Engine's THD layout): every
  document padded to a multiple of g = 2c (packed with the padded sizes, ``--document-pad-multiple``),
  then ``build_document_layout``. Equal by construction: target <= 1.01. "pads" is the tokens that
  padding adds, over the real tokens.

Mixes: lognormal document lengths (median, sigma) in 8k and 128k rows (the design's table), and the
embedded corpus's documents (data/default, built by tools/make_default_data.py) in 8k rows.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import numpy as np  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from megatron_ext.context_parallel.layout import build_document_layout, build_row_layout, get_owners  # noqa: E402
from megatron_ext.data.packed_dataset import IndexedDocuments  # noqa: E402
from megatron_ext.data.packing import STRATEGIES, build_packing_index, round_up_lengths, split_documents  # noqa: E402

H = 4096
PREFIX = "data/default/corpus_text_document"
TARGET = 1.01
# (row length, median, sigma, CP sizes): the design's table
MIXES = ((8192, 2000, 1.0, (8,)), (131072, 8000, 1.2, (4, 8)), (131072, 2000, 1.0, (8,)))


def build_rows(lengths: np.ndarray, seq: int, g: int, max_rows: int | None, strategy: str) -> list[np.ndarray]:
    """Each row's document spans (padded to g), the last grown to ``seq``: the packs the run builds."""
    index = build_packing_index(np.arange(len(lengths)), lengths, seq, strategy, pad_multiple=g)
    rows = []
    # every bin, or max_rows spread evenly over them: best-fit fills its first bins with the longest
    # pieces, so the first bins alone would be a biased sample
    count = index.num_bins if max_rows is None else min(max_rows, index.num_bins)
    for b in np.unique(np.linspace(0, index.num_bins - 1, count).round().astype(int)).tolist():
        spans = round_up_lengths(index.piece_len[index.bin_offsets[b] : index.bin_offsets[b + 1]], g)
        spans[-1] += seq - spans.sum()
        rows.append(spans)
    return rows


def get_token_work(spans: np.ndarray) -> np.ndarray:
    """[seq] the model's work of each token: 4 h p + 24 h^2, p its offset in its document."""
    bounds = np.concatenate([[0], np.cumsum(spans)])
    offsets = np.arange(int(bounds[-1])) - np.repeat(bounds[:-1], spans)
    return 4.0 * H * offsets + 24.0 * H * H


def get_rank_work(spans: np.ndarray, c: int, layout: str) -> np.ndarray:
    """[c] each CP rank's work on one row under ``layout`` (owners as context_parallel.layout gives them)."""
    work = get_token_work(spans)
    seq = len(work)
    if layout == "contiguous":
        return work.reshape(c, -1).sum(1)
    bounds = np.concatenate([[0], np.cumsum(spans)]) if layout == "document" else np.array([0, seq])
    return np.bincount(get_owners(bounds, c), weights=work, minlength=c)


def get_balance(rows: list[np.ndarray], c: int, layout: str) -> float:
    per_rank = np.stack([get_rank_work(spans, c, layout) for spans in rows])
    return float(per_rank.max(1).sum() / per_rank.mean(1).sum())


def check_owners_are_the_layouts(spans: np.ndarray, c: int) -> None:
    """The owners used above are the layouts' own: every rank's local tokens (one row, both layouts)."""
    bounds = np.concatenate([[0], np.cumsum(spans)])
    seq = int(bounds[-1])
    for layout, owners in (("document", get_owners(bounds, c)), ("row", get_owners(np.array([0, seq]), c))):
        for r in range(c):
            built = build_document_layout(bounds, c, r) if layout == "document" else build_row_layout(seq, 1, c, r)
            assert np.array_equal(np.sort(built.local_index.numpy()), np.flatnonzero(owners == r)), (layout, r)


def measure(lengths: np.ndarray, seq: int, c: int, max_rows: int | None, strategy: str) -> dict:
    """Balance of the three layouts and the padding of g = 2c, on ``lengths`` packed into ``seq`` rows."""
    plain = build_rows(lengths, seq, 1, max_rows, strategy)
    padded = build_rows(lengths, seq, 2 * c, max_rows, strategy)
    check_owners_are_the_layouts(padded[0], c)
    real = split_documents(np.arange(len(lengths)), lengths, seq)[2]  # pieces of at most a row
    return {
        "contiguous": get_balance(plain, c, "contiguous"),
        "row": get_balance(plain, c, "row"),
        "document": get_balance(padded, c, "document"),
        "pads": float(round_up_lengths(real, 2 * c).sum() / real.sum() - 1),
        "rows": len(plain),
    }


def read_corpus_lengths(prefix: str) -> np.ndarray:
    lengths = IndexedDocuments(IndexedDataset(prefix)).lengths
    return lengths[lengths > 0]


def print_row(name: str, c: int, m: dict) -> bool:
    ok = m["document"] <= TARGET
    print(
        f"| {name:<34} | {c} | {m['contiguous']:.3f} | {m['row']:.3f} | {m['document']:.3f} "
        f"(+{100 * m['pads']:.2f}%) | {m['rows']} | {'PASS' if ok else 'FAIL'} |"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows-8k", type=int, default=256, help="micro-batches (rows) per 8k mix")
    parser.add_argument("--rows-128k", type=int, default=48, help="micro-batches (rows) per 128k mix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--packing-strategy", default="best_fit", choices=STRATEGIES)
    args = parser.parse_args()
    start = time.perf_counter()
    print(
        f"whole-layer work max/mean per CP rank (h = {H}; {args.packing_strategy} packs; target per-document "
        f"<= {TARGET}); pads: what g = 2c adds"
    )
    print("| row, document mix | c | contiguous | row head-tail | per-document (pads) | rows | |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for seq, median, sigma, sizes in MIXES:
        rows = args.rows_8k if seq <= 8192 else args.rows_128k
        mean = median * np.exp(sigma**2 / 2)
        rng = np.random.default_rng([args.seed, seq, median])
        lengths = np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, int(1.3 * rows * seq / mean))))
        for c in sizes:
            name = f"{seq // 1024}k, median {median}, sigma {sigma:g}"
            ok &= print_row(name, c, measure(lengths.astype(np.int64), seq, c, rows, args.packing_strategy))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    corpus = read_corpus_lengths(os.path.join(root, PREFIX))
    median, p90 = (int(np.percentile(corpus, q)) for q in (50, 90))
    for c in (2, 4, 8):
        name = f"8k, corpus (median {median}, p90 {p90}, max {int(corpus.max())})"
        ok &= print_row(name, c, measure(corpus, 8192, c, None, args.packing_strategy))
    print(
        f"{'PASS' if ok else 'FAIL'}: per-document head-tail <= {TARGET} everywhere ({time.perf_counter() - start:.1f} s)"
    )


if __name__ == "__main__":
    main()
