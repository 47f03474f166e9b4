"""Data: tokens/s of our packed-sample path vs megatron-core GPTDataset on the same files, and
the time a training step waits for its data.

    python -m bench.data [--part all|tokens|wait] [--rounds 9] [--warmup 2] [--tokens-per-block 262144]
        [--wait-steps 12]

Step wait (``--part wait``): the default job (configs/default.yaml: TP2 x PP2 x VPP2 x DP2, 8 gloo
processes, packed, negotiated padding), two runs side by side in the same processes (sharing their
process groups): P with the background prefetch thread (the default), S with --no-data-prefetch
(the step reads, packs, pads itself). Steps alternate P S P S ..., the first 2 of each dropped; per
step, the ``data`` timer (the time the step waited for its micro-batches) over the whole step.
Medians over steps, the worst rank shown. Target: P under 1% of the step.

Tokens/s (``--part tokens``):

Same files (``data/default/corpus_text_document`` .bin/.idx), ``--seq-length`` 2048, one thread,
CPU time (``time.process_time``); indices are built beforehand into a temporary cache folder
(nothing is written beside the data) and are not timed. What is timed is what a training step
does per sample, ``batches.fetch_step_samples``: ``normalize_sample(dataset[i])``.

- A  ours: ``PackedDocumentDataset.__getitem__`` (best_fit bins of whole documents, from
     ``packed_dataset.build_packed_datasets``) -> ``batches.normalize_sample``; tokens delivered =
     the bin's real tokens (its pad is added later, per step);
- B  megatron-core ``GPTDataset.__getitem__`` (``datasets.build_gpt_datasets`` exactly as
     ``pretrain_gpt.py`` calls it: ``create_attention_mask=False``) -> ``normalize_sample``;
     tokens delivered = 2048 per sample;
- A' ours with direct piece reads (``FastPacked`` below: one pointer-table lookup and one
     ``np.frombuffer`` per piece instead of megatron-core's ``IndexedDataset.get``), a prototype;
     same outputs (checked on 64 samples). The vectorised ``build_packed_sample`` this bench once
     prototyped is adopted, so A and A' share it.

Alternated A B A' A B A' ..., each block reads about ``--tokens-per-block`` tokens (the same number
for every side, consecutive sample indices continuing across rounds, so no side rereads a
sample), the first ``--warmup`` rounds dropped, medians of tokens per CPU-second. Target:
A / B >= 0.8. Also printed: a memmap copy of the same tokens (the physical limit) and, for A, where
the time goes (indexed reads vs build_packed_sample vs normalize_sample).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import numpy as np  # noqa: E402
import torch  # noqa: E402

PREFIX = "data/default/corpus_text_document"
TARGET = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens-per-block", type=int, default=262_144)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--data-path", default=PREFIX)
    p.add_argument("--tokenizer-model", default="data/default/tokenizer.model")
    p.add_argument("--part", choices=["all", "tokens", "wait"], default="all")
    p.add_argument("--wait-steps", type=int, default=12)
    args = p.parse_args(argv)
    if args.rounds - args.warmup < 5:
        p.error("need at least 5 measured rounds (--rounds - --warmup >= 5)")
    if args.wait_steps < 5:  # the first 2 are dropped, and a median wants at least 3
        p.error(f"--wait-steps {args.wait_steps}: need at least 5 (the first 2 steps are dropped)")
    return args


# The vectorised prototype measured here was adopted as packed_dataset.build_packed_sample.
from megatron_ext.data.microbatch import IGNORE_INDEX  # noqa: E402
from megatron_ext.data.packed_dataset import build_packed_sample as build_packed_sample_fast  # noqa: E402


class FastPacked:
    """``PackedDocumentDataset.__getitem__`` with direct piece reads (one pointer table lookup
    and one ``np.frombuffer`` per piece) and ``build_packed_sample_fast``."""

    def __init__(self, ds):
        self.ds = ds
        idx = ds.indexed.index
        self.pointers = np.asarray(idx.sequence_pointers, dtype=np.int64)
        self.dtype = idx.dtype
        self.itemsize = np.dtype(idx.dtype).itemsize
        self.buffer = ds.indexed.bin_reader._bin_buffer  # the mmap megatron-core reads from
        ix = ds.index
        self.doc, self.start, self.len, self.off = ix.piece_doc, ix.piece_start, ix.piece_len, ix.bin_offsets

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        b = self.ds._bin(i)
        lo, hi = int(self.off[b]), int(self.off[b + 1])
        ptr = self.pointers[self.doc[lo:hi]] + self.start[lo:hi] * self.itemsize
        # a piece cut from a longer document: one more token, its last label
        cut = (self.start[lo:hi] + self.len[lo:hi] < self.ds.doc_lengths[self.doc[lo:hi]]).tolist()
        reads = [
            np.frombuffer(self.buffer, dtype=self.dtype, count=int(n) + c, offset=int(p))
            for p, n, c in zip(ptr.tolist(), self.len[lo:hi].tolist(), cut)
        ]
        pieces = [r[: len(r) - c] for r, c in zip(reads, cut)]
        return build_packed_sample_fast(pieces, [int(r[-1]) if c else IGNORE_INDEX for r, c in zip(reads, cut)])


def read_block(ds, start: int, tokens: int) -> tuple[int, int]:
    """normalize_sample(ds[i]) for consecutive i from ``start`` until ``tokens`` are delivered."""
    from megatron_ext.data.microbatch import normalize_sample

    n, i, count = len(ds), start, 0
    while count < tokens:
        count += int(normalize_sample(ds[i % n])["tokens"].shape[0])
        i += 1
    return count, i


def build_sides(args, cache: str):
    """Our packed dataset and megatron-core's GPTDataset over the same files (indices built into
    ``cache``, timed), and the A' prototype over ours."""
    from megatron_ext.data.gpt_datasets import build_gpt_datasets
    from megatron_ext.data.packed_dataset import build_packed_datasets
    from megatron_ext.data.tokenizers import build_tokenizer

    s = args.seq_length
    num_samples = args.rounds * args.tokens_per_block // s + 16
    t0 = time.perf_counter()
    ours, _, _ = build_packed_datasets(args.data_path, [1.0], s, "best_fit", 1234, [num_samples, 0, 0], cache)
    t_ours = time.perf_counter() - t0
    tok = build_tokenizer("SentencePieceTokenizer", args.tokenizer_model)
    t0 = time.perf_counter()
    gpt, _, _ = build_gpt_datasets(
        tok,
        s,
        [num_samples, 0, 0],
        data_path=[args.data_path],
        split="100,0,0",
        random_seed=1234,
        path_to_cache=cache,
        create_attention_mask=False,
    )
    return ours, gpt, FastPacked(ours), t_ours, time.perf_counter() - t0


def median_rates(sides: dict, rounds: int, warmup: int, tokens_per_block: int) -> dict[str, float]:
    """Tokens per CPU-second of each side, blocks alternated side by side, warm-up dropped."""
    pos = {k: 0 for k in sides}
    rates = {k: [] for k in sides}
    for _ in range(rounds):
        for k, ds in sides.items():
            gc.collect()
            t0 = time.process_time()
            count, pos[k] = read_block(ds, pos[k], tokens_per_block)
            rates[k].append(count / (time.process_time() - t0))
    return {k: statistics.median(v[warmup:]) for k, v in rates.items()}


def memmap_copy_rate(ours, tokens: int) -> float:
    """The physical limit: a memmap copy of the same bytes, as one contiguous read."""
    buf = np.frombuffer(ours.indexed.bin_reader._bin_buffer, dtype=ours.indexed.index.dtype)
    n = min(len(buf), tokens)
    copies = []
    for _ in range(7):
        t0 = time.process_time()
        np.array(buf[:n], dtype=np.int64)
        copies.append(n / (time.process_time() - t0))
    return statistics.median(copies[2:])


def per_sample_breakdown(ours, gpt, samples: int = 300) -> dict[str, float]:
    """CPU seconds per sample of each phase of ours, and of GPTDataset.__getitem__."""
    from megatron_ext.data.microbatch import normalize_sample
    from megatron_ext.data.packed_dataset import build_packed_sample

    ix = ours.index
    t = {}
    t0 = time.process_time()
    pieces = []
    for i in range(samples):
        b = ours._bin(i)
        lo, hi = ix.bin_offsets[b], ix.bin_offsets[b + 1]
        pieces.append(
            [
                ours.indexed.get(int(d), offset=int(st), length=int(ln))
                for d, st, ln in zip(ix.piece_doc[lo:hi], ix.piece_start[lo:hi], ix.piece_len[lo:hi])
            ]
        )
    t["read"] = time.process_time() - t0
    t0 = time.process_time()
    built = [build_packed_sample(p) for p in pieces]
    t["build"] = time.process_time() - t0
    t0 = time.process_time()
    for x in built:
        normalize_sample(x)
    t["normalize"] = time.process_time() - t0
    t0 = time.process_time()
    for p in pieces:
        build_packed_sample_fast(p)
    t["build_fast"] = time.process_time() - t0
    t0 = time.process_time()
    for i in range(samples):
        gpt[i]
    t["gpt_get"] = time.process_time() - t0
    return {k: v / samples for k, v in t.items()}


WAIT_TARGET = 0.01


def _step_wait_world(rank: int, world_size: int, steps: int) -> dict:
    """Two default-job runs side by side (P: prefetch, S: synchronous), steps alternated; per
    step, the seconds waited for data and the step's seconds."""
    from megatron_ext.arguments import load_config_file
    from megatron_ext.config import build_job_config
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.run import build_training_run
    from megatron_ext.training.loop import LogWindow, run_training_iteration

    base = load_config_file("configs/default.yaml")
    base.update(save=None, save_interval=None, eval_interval=0, train_iters=steps + 1, timing_log_level=1)
    runs, ctx = {}, None
    for name, extra in (("P", {}), ("S", {"data_prefetch": False})):
        run = build_training_run(
            build_job_config(dict(base, **extra)),
            device=torch.device("cpu"),
            log=lambda s: None,
            metrics=False,
            ctx=ctx,
        )
        ctx = run.ctx
        runs[name] = run
    out = {name: [] for name in runs}
    for _ in range(steps):
        for name, run in runs.items():
            window = LogWindow()
            before = run.timers.totals.get("data", 0.0)
            run_training_iteration(run, window)
            out[name].append(((run.timers.totals["data"] - before) / 1000.0, window.seconds))
    for run in runs.values():
        if run.prefetcher is not None:
            run.prefetcher.close()
    destroy_parallel_context()
    return out


def report_step_wait(args) -> None:
    from megatron_ext.testing import run_ranks

    per_rank = run_ranks(_step_wait_world, 8, args.wait_steps, timeout=1800)
    print(
        f"step wait | default job (configs/default.yaml), 8 gloo ranks, {args.wait_steps} steps of each run "
        f"alternated, first 2 dropped, medians over steps"
    )
    worst = {}
    for name, label in (("P", "prefetch thread (default)"), ("S", "--no-data-prefetch")):
        fractions, waits, steps = [], [], []
        for r in per_rank:
            rows = r[name][2:]
            fractions.append(statistics.median(w / s for w, s in rows))
            waits.append(statistics.median(w for w, _ in rows))
            steps.append(statistics.median(s for _, s in rows))
        worst[name] = max(fractions)
        print(
            f"{name}  {label:28s} waited {1000 * max(waits):8.2f} ms of a {1000 * statistics.median(steps):8.1f} ms "
            f"step -> {100 * worst[name]:.3f}% (worst rank; best {100 * min(fractions):.3f}%)"
        )
    print(
        f"P under {100 * WAIT_TARGET:.0f}% of the step -> {'PASS' if worst['P'] < WAIT_TARGET else 'MISS'}   "
        f"(S/P wait ratio {worst['S'] / max(worst['P'], 1e-12):.1f}x)"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part in ("all", "wait"):
        report_step_wait(args)
    if args.part == "wait":
        return 0
    torch.set_num_threads(1)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: F401
    from megatron.core.datasets.gpt_dataset import GPTDataset  # noqa: F401
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: F401  (imports not timed)

    from megatron_ext.data.microbatch import normalize_sample

    s = args.seq_length
    with tempfile.TemporaryDirectory(prefix="bench_data_") as cache:
        ours, gpt, fast, t_ours, t_gpt = build_sides(args, cache)

    # same outputs: the prototype against build_packed_sample on the first bins
    for i in range(64):
        a, b = normalize_sample(ours[i]), normalize_sample(fast[i])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"prototype differs at {i}"

    print(
        f"data | {args.data_path}, seq {s}, {torch.get_num_threads()} thread, CPU time | ours: best_fit "
        f"{ours.index.num_bins} bins, {len(ours.index.piece_len) / ours.index.num_bins:.2f} pieces/bin, "
        f"efficiency {ours.index.efficiency(s):.4f} (index build {t_ours:.2f} s) | GPTDataset: "
        f"{len(gpt)} samples (index build {t_gpt:.2f} s), create_attention_mask=False"
    )
    print(
        f"{args.rounds} rounds of A B A' blocks of ~{args.tokens_per_block} tokens each, first "
        f"{args.warmup} dropped; prototype A' output == ours on 64 samples: yes"
    )

    med = median_rates({"A": ours, "B": gpt, "A'": fast}, args.rounds, args.warmup, args.tokens_per_block)
    limit = memmap_copy_rate(ours, args.tokens_per_block)
    t = per_sample_breakdown(ours, gpt)

    def m(key):
        return f"{t[key] * 1e6:6.1f} us"

    a2 = med["A'"]
    print(f"A  ours (PackedDocumentDataset + normalize_sample)      {med['A'] / 1e6:7.2f} M tokens/CPU-s")
    print(f"B  megatron-core GPTDataset + normalize_sample          {med['B'] / 1e6:7.2f} M tokens/CPU-s")
    print(f"A' ours with direct piece reads (prototype)             {a2 / 1e6:7.2f} M tokens/CPU-s")
    print(f"memmap copy of the same tokens (limit)                  {limit / 1e6:7.1f} M tokens/CPU-s")
    ratio = med["A"] / med["B"]
    print(
        f"ratio A/B = {ratio:.2f}   target >= {TARGET}  -> {'PASS' if ratio >= TARGET else 'MISS'}   "
        f"(A'/B = {a2 / med['B']:.2f}, A'/A = {a2 / med['A']:.2f})"
    )
    print(
        f"per sample, ours: indexed reads {m('read')} + build_packed_sample {m('build')} + normalize_sample "
        f"{m('normalize')} (build again, as A' calls it: {m('build_fast')}) | GPTDataset.__getitem__ {m('gpt_get')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
