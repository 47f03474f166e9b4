"""Varlen: useful tokens per CPU-second of packed varlen attention vs padding vs a dense mask.

    python -m bench.varlen [--steps 6] [--warmup 1] [--bins-per-step 1] [--profile]

One megatron-core GPTModel built by ``megatron_ext.model.gpt.build_model_chunks`` (local spec, so core
attention is our ``VarlenDotProductAttention``) in a 1-rank gloo world, TP=PP=1. Pinned: hidden
256, 4 layers, 4 heads, GPT-2 style (LayerNorm, GELU, learned absolute positions), vocab 8192,
fp32, ``--seq-length`` 2048, one thread. Data: the embedded corpus's real documents
(``data/default/corpus_text_document``), split at ``--seq-length`` and packed with
``megatron_ext.data.packing`` best_fit; each step draws ``--bins-per-step`` random bins (the same bins
for every variant of that step) and runs one forward+backward (token-sum loss) of:

- (a)  packed varlen, our THD path: the bin padded as ``--sequence-padding negotiated`` pads it
       (``padding.collate_padded``, to a multiple of 64, the last document grows) and passed with
       ``PackedSeqParams`` (``training.get_packed_seq_params``); attention is
       ``document_causal_attention`` (SDPA per document, is_causal);
- (b)  one document (piece) per row, each row padded to ``--seq-length``, rows in micro-batches of
       ``--rows-per-microbatch``; megatron-core's own non-packed path (``DotProductAttention``:
       baddbmm, causal masked softmax, bmm; its default causal mask). Every (b) micro-batch has the
       same fixed shape [2, s] whatever its documents, so its cost does not depend on them: each
       round times ``--b-timed-microbatches`` of them (rotating over the step's rows) and scales
       to the step's row count (a full (b) step of a many-document bin costs ~100 s here);
- (c1) the packed bin padded to ``--seq-length``, no PackedSeqParams, an explicit block-diagonal
       causal mask [1, 1, s, s] into megatron-core's ``DotProductAttention`` (what megatron-core
       does with ``reset_attention_mask``-style masks); fixed shape, so like (b) each round times
       one bin (rotating) and scales to the step's bins;
- (c2) the same bin through our THD path but with the per-document loop replaced by ONE
       ``scaled_dot_product_attention`` over the whole pack with the dense block-diagonal causal
       bool mask (built once per micro-batch). The faster of c1/c2 is the dense-mask baseline (c).

A step is a fixed sample of ``--bins`` bins, stratified over the corpus's pieces-per-bin
distribution (BFD bins are skewed: median 4 pieces, p90 15, max 42), the same bins every round.
Same useful (real, non-pad) tokens in every variant; before timing, one small bin runs forward
through all four variants in full and their loss sums are printed: they agree to float rounding
(same work, same maths), so the ratios compare kernels. Variants alternate
a a' b c1 c2 a a' b c1 c2 ..., CPU time (``time.process_time``), the first ``--warmup`` rounds dropped,
medians. Useful tokens / median CPU-second per variant; ratios
(a)/(b), (a)/(c) printed beside their FLOP bound from the same bins:

    FLOPs = 3 x [ (24 h^2 L + 2 h V) x slots  +  4 h L x sum(n^2) ]

slots = tokens each variant computes (pad included), sum(n^2) over the attention blocks each
variant feeds its kernel (documents for (a), whole rows for (b), whole packs for (c)), the full
square for every variant (what (b) and (c) compute; a causal kernel could skip half, so this bound
favours no one); softmax, norms and element-wise work are not counted. Target: ratio >= 0.7 x
bound.

- (a') = (a) with the previous 3-D views (see ``document_causal_attention_3d``):
       the candidate fix, measured alongside.

Also reported: whether the exact alternative kernels exist here for training (flex_attention
with a document mask, nested jagged tensors with SDPA): both are probed for a backward on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import init_single_rank_world  # noqa: E402

PREFIX = "data/default/corpus_text_document"
NUM_LAYERS = 4
NUM_HEADS = 4
VOCAB = 8192
PAD_MULTIPLE = 64
TARGET = 0.7
SEED = 1234


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="rounds (a a' b c1 c2); first --warmup dropped")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bins", type=int, default=4, help="bins per step (stratified by pieces per bin)")
    p.add_argument("--rows-per-microbatch", type=int, default=2, help="(b): rows per micro-batch")
    p.add_argument("--b-timed-microbatches", type=int, default=1, help="(b): micro-batches timed per round")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--data-path", default=PREFIX)
    p.add_argument("--profile", action="store_true", help="also profile one (a) step (top ops)")
    args = p.parse_args(argv)
    if args.steps - args.warmup < 5:
        p.error("need at least 5 measured rounds (--steps - --warmup >= 5)")
    return args


def job_values(args) -> dict:
    return dict(
        num_layers=NUM_LAYERS,
        hidden_size=args.hidden_size,
        num_attention_heads=NUM_HEADS,
        seq_length=args.seq_length,
        micro_batch_size=1,
        global_batch_size=1,
        train_iters=10,
        lr=1e-4,
        min_lr=1e-4,
        lr_decay_style="constant",
        seed=SEED,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        data_path=[args.data_path],
        tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=128,
        packed_sequences=True,
        packing_strategy="best_fit",
        pad_to_multiple_of=PAD_MULTIPLE,
    )


# ---------------------------------------------------------------- data


def load_bins(prefix: str, seq_length: int):
    """(indexed dataset, best-fit packing index of all documents)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.packing import build_packing_index

    indexed = IndexedDataset(prefix)
    lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
    index = build_packing_index(np.arange(len(lengths)), lengths, seq_length, "best_fit")
    return indexed, lengths, index


def bin_pieces(indexed, index, b: int) -> list[np.ndarray]:
    lo, hi = index.bin_offsets[b], index.bin_offsets[b + 1]
    return [
        indexed.get(int(d), offset=int(s), length=int(n))
        for d, s, n in zip(index.piece_doc[lo:hi], index.piece_start[lo:hi], index.piece_len[lo:hi])
    ]


def make_step(pieces_per_bin: list[list[np.ndarray]], seq_length: int, rows_per_mb: int) -> dict:
    """The micro-batches of every variant for one step's bins, plus their FLOP-relevant shapes."""
    from megatron_ext.data.packed_dataset import build_packed_sample
    from megatron_ext.data.padding import collate_padded, round_up
    from megatron_ext.model.attention import block_diagonal_causal_mask

    a, c = [], []
    rows = []
    for pieces in pieces_per_bin:
        sample = build_packed_sample(pieces)
        n = int(sample["tokens"].shape[0])
        a.append(collate_padded([sample], round_up(n, PAD_MULTIPLE), 0))
        mb = collate_padded([sample], seq_length, 0)
        allowed = block_diagonal_causal_mask(list(mb.cu_seqlens_host), seq_length)
        c.append((mb, (~allowed).view(1, 1, seq_length, seq_length)))
        for p in pieces:
            s = build_packed_sample([p])
            s.pop("cu_seqlens")
            rows.append(s)
    b = [collate_padded(rows[i : i + rows_per_mb], seq_length, 0) for i in range(0, len(rows), rows_per_mb)]
    useful = sum(len(p) for pieces in pieces_per_bin for p in pieces)

    def docs_sq(mb) -> int:
        d = mb.cu_seqlens.diff().long()
        return int((d * d).sum())

    shapes = {
        "a": (sum(m.num_slots for m in a), sum(docs_sq(m) for m in a)),
        "b": (len(rows) * seq_length, len(rows) * seq_length**2),
        "c": (len(c) * seq_length, len(c) * seq_length**2),
    }
    return {"a": a, "b": b, "c": c, "useful": useful, "shapes": shapes, "rows": len(rows)}


def step_flops(slots: int, pairs: int, h: int, layers: int, vocab: int) -> float:
    return 3.0 * ((24 * h * h * layers + 2 * h * vocab) * slots + 4 * h * layers * pairs)


# ---------------------------------------------------------------- kernels and variants


def document_causal_attention_3d(query, key, value, cu_seqlens, scale, dropout_p=0.0):
    """(a'): the previous kernel, per-document SDPA on 3-D [heads, n, hn] views.

    torch's CPU flash kernel only takes 4-D inputs, so these views fall back to the math kernel
    (n x n scores materialised). Kept to show what the 4-D views of (a) bought."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        q = query[s:e].transpose(0, 1)  # [np, n, hn]
        k = key[s:e].transpose(0, 1)
        v = value[s:e].transpose(0, 1)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        outs.append(o.transpose(0, 1))
    out = torch.cat(outs, dim=0)
    return out.reshape(out.shape[0], -1)


def dense_mask_attention(query, key, value, cu_seqlens, scale, dropout_p=0.0):
    """Same contract as ``document_causal_attention``: one SDPA over the pack, dense bool mask."""
    t = query.shape[0]
    mask = _cached_mask(tuple(cu_seqlens), t)
    groups = query.shape[1] // key.shape[1]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
    return o.squeeze(0).transpose(0, 1).reshape(t, -1)


@functools.lru_cache(maxsize=4)
def _cached_mask(cu: tuple, t: int) -> torch.Tensor:
    from megatron_ext.model.attention import block_diagonal_causal_mask

    return block_diagonal_causal_mask(list(cu), t)


@contextlib.contextmanager
def thd_kernel(fn):
    """Swap the kernel our THD path calls (a module-global lookup) for the duration."""
    import megatron_ext.model.attention as va

    original = va.document_causal_attention
    va.document_causal_attention = fn
    try:
        yield
    finally:
        va.document_causal_attention = original


def forward_backward(model, mbs: list, packed: bool, dense_mask: bool = False, backward: bool = True) -> float:
    """Token-sum CE over valid labels, backward; returns the loss sum (float). ``mbs``: Microbatch
    objects, or (Microbatch, dense mask) pairs with ``dense_mask``."""
    from megatron_ext.training.step import get_packed_seq_params

    total = 0.0
    for item in mbs:
        mb, mask = item if isinstance(item, tuple) else (item, None)
        mask = mask if dense_mask else None
        labels = mb.labels
        per_token = model(
            input_ids=mb.tokens,
            position_ids=mb.position_ids,
            attention_mask=mask,
            labels=labels.clamp(min=0),
            packed_seq_params=get_packed_seq_params(mb, model) if packed else None,
        )
        loss = torch.where(mb.valid, per_token, torch.zeros_like(per_token)).sum()
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total


def make_variants(model, rows_per_mb: int, timed_mbs: int) -> dict:
    """name -> fn(step, round) returning (CPU seconds for the step, loss sum of what ran)."""

    def timed(fn):
        gc.collect()
        t0 = time.process_time()
        loss = fn()
        return time.process_time() - t0, loss

    def run_a(step, r):
        return timed(lambda: forward_backward(model, step["a"], packed=True))

    def run_a4(step, r):
        with thd_kernel(document_causal_attention_3d):
            return timed(lambda: forward_backward(model, step["a"], packed=True))

    def run_b(step, r):
        # fixed-shape micro-batches: time `timed_mbs` of them (rotating), scale to the step's rows
        n = len(step["b"])
        picked = [step["b"][(r * timed_mbs + i) % n] for i in range(min(timed_mbs, n))]
        dt, loss = timed(lambda: forward_backward(model, picked, packed=False))
        rows = sum(mb.tokens.shape[0] for mb in picked)
        return dt * step["rows"] / rows, loss

    def run_c1(step, r):
        # fixed shape [1, s] with a dense [s, s] mask: cost independent of the bin; time one bin
        # per round (rotating) and scale to the step's bins
        mb = step["c"][r % len(step["c"])]
        dt, loss = timed(lambda: forward_backward(model, [mb], packed=False, dense_mask=True))
        return dt * len(step["c"]), loss

    def run_c2(step, r):
        def go():
            _cached_mask.cache_clear()  # built once per micro-batch, inside the timed region
            with thd_kernel(dense_mask_attention):
                return forward_backward(model, step["c"], packed=True)

        return timed(go)

    return {"a": run_a, "a'": run_a4, "b": run_b, "c1": run_c1, "c2": run_c2}


def check_same_work(model, step) -> dict:
    """Forward-only loss sums of every variant on one step, in full (no scaling)."""
    out = {}
    with torch.no_grad():
        out["a"] = forward_backward(model, step["a"], packed=True, backward=False)
        with thd_kernel(document_causal_attention_3d):
            out["a'"] = forward_backward(model, step["a"], packed=True, backward=False)
        out["b"] = forward_backward(model, step["b"], packed=False, backward=False)
        out["c1"] = forward_backward(model, step["c"], packed=False, dense_mask=True, backward=False)
        _cached_mask.cache_clear()
        with thd_kernel(dense_mask_attention):
            out["c2"] = forward_backward(model, step["c"], packed=True, backward=False)
    return out


def stratified_bins(index, k: int) -> np.ndarray:
    """k non-empty bins at the (i + 0.5) / k quantiles of the pieces-per-bin distribution."""
    counts = np.diff(index.bin_offsets)
    order = np.argsort(counts, kind="stable")
    return order[((np.arange(k) + 0.5) / k * len(order)).astype(int)]


def probe_alternatives() -> list[str]:
    """Can flex_attention / nested-jagged SDPA train (forward + backward) on CPU here?"""
    out = []
    t, h, d = 64, 2, 16
    cu = torch.tensor([0, 20, 64])
    q, k, v = (torch.randn(1, h, t, d, requires_grad=True) for _ in range(3))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.zeros(t, dtype=torch.long)
        doc[20:] = 1

        def mask_mod(b, hh, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        bm = create_block_mask(mask_mod, None, None, t, t, device="cpu")
        flex_attention(q, k, v, block_mask=bm).sum().backward()
        out.append("flex_attention (document mask): forward+backward OK on CPU -> worth a variant")
    except Exception as exc:  # noqa: BLE001
        out.append(
            f"flex_attention (document mask): unusable for training here: {type(exc).__name__}: {str(exc)[:110]}"
        )
    logging.getLogger("torch.nested").setLevel(logging.ERROR)
    try:

        def njt(x):
            return torch.nested.nested_tensor_from_jagged(x[0].transpose(0, 1), offsets=cu).transpose(1, 2)

        o = F.scaled_dot_product_attention(njt(q), njt(k), njt(v), is_causal=True)
        o.values().sum().backward()
        out.append("nested jagged SDPA (is_causal): forward+backward OK on CPU -> worth a variant")
    except Exception as exc:  # noqa: BLE001
        out.append(f"nested jagged SDPA (is_causal): unusable here: {type(exc).__name__}: {str(exc)[:110]}")
    return out


def profile_a(model, step) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(model, step["a"], packed=True)
    model.zero_grad(set_to_none=True)
    print("profile of one (a) step, top ops by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from megatron_ext.config import build_job_config
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.parallel import build_parallel_context

    init_single_rank_world(timeout_minutes=5)
    cfg = build_job_config(job_values(args))
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    (model,) = build_model_chunks(cfg, resolve_config(cfg, ctx.world_size, VOCAB), ctx.placement, torch.device("cpu"))
    model.train()
    core = [type(m).__name__ for n, m in model.named_modules() if n.endswith("core_attention")]

    s, h = args.seq_length, args.hidden_size
    indexed, lengths, index = load_bins(args.data_path, s)
    counts = np.diff(index.bin_offsets)
    chosen = stratified_bins(index, args.bins)
    step = make_step([bin_pieces(indexed, index, int(b)) for b in chosen], s, args.rows_per_microbatch)
    small = int(np.flatnonzero(counts == 3)[0]) if np.any(counts == 3) else int(np.argmin(counts))
    check = make_step([bin_pieces(indexed, index, small)], s, args.rows_per_microbatch)

    print(
        f"varlen | hidden {h}, {NUM_LAYERS} layers, {NUM_HEADS} heads, seq {s}, vocab {VOCAB}, fp32, "
        f"{torch.get_num_threads()} thread | core attention: {core[0]} | TP=PP=1 (1-rank gloo)"
    )
    print(
        f"corpus {args.data_path}: {len(lengths)} documents, median {np.median(lengths):.0f}, "
        f"mean {lengths.mean():.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()} tokens "
        f"({int((lengths > s).sum())} longer than {s}, split) | best_fit: {index.num_bins} bins, "
        f"efficiency {index.efficiency(s):.4f}, pieces/bin mean {counts.mean():.2f} "
        f"(median {np.median(counts):.0f}, p90 {np.percentile(counts, 90):.0f}, max {counts.max()})"
    )
    print(
        f"step = {args.bins} bins stratified by pieces/bin: {counts[chosen].tolist()} pieces "
        f"(mean {counts[chosen].mean():.2f}), {step['useful']} useful tokens, {step['rows']} (b) rows; "
        f"{args.steps} rounds, first {args.warmup} dropped; (b) timed on {args.b_timed_microbatches} "
        f"micro-batch(es) of {args.rows_per_microbatch} x {s} per round, scaled to {step['rows']} rows"
    )
    for line in probe_alternatives():
        print("probe: " + line)
    same = check_same_work(model, check)
    rel = max(abs(v - same["a"]) / abs(same["a"]) for v in same.values())
    print(
        f"same-work check (bin of {counts[small]} pieces, forward, all variants in full): loss sums "
        + "  ".join(f"{k} {v:.4f}" for k, v in same.items())
        + f"  max rel diff {rel:.1e} -> {'same work' if rel < 1e-4 else 'CHECK: variants differ'}"
    )

    variants = make_variants(model, args.rows_per_microbatch, args.b_timed_microbatches)
    med = median_step_times(model, variants, step, args.steps, args.warmup)
    print_results(step, med, h)
    if args.profile:
        profile_a(model, step)

    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def median_step_times(model, variants: dict, step: dict, steps: int, warmup: int) -> dict[str, float]:
    """Seconds per step of each variant, alternated side by side each round, warm-up dropped."""
    times = {k: [] for k in variants}
    for r in range(steps):
        for name, fn in variants.items():
            dt, _ = fn(step, r)
            times[name].append(dt)
            model.zero_grad(set_to_none=True)
        print("  round: " + "  ".join(f"{k} {times[k][-1]:6.2f}s" for k in variants), flush=True)
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}


def print_results(step: dict, med: dict[str, float], h: int) -> None:
    """Useful tokens per CPU-second of each variant and the ratios of (a) and (a') against (b)
    and the faster dense-mask baseline, beside their FLOP bounds."""
    tps = {k: step["useful"] / med[k] for k in med}
    c_name = "c1" if tps["c1"] >= tps["c2"] else "c2"
    labels = {
        "a": "(a)  packed varlen, THD, SDPA per document",
        "a'": "(a') as (a) with 3-D views (math kernel; the previous kernel)",
        "b": "(b)  one document per row, padded to seq, megatron-core attention",
        "c1": "(c1) packed, dense block-diag mask, megatron-core DotProductAttention",
        "c2": "(c2) packed, dense block-diag mask, one SDPA with bool mask",
    }
    for k in med:
        print(f"{labels[k]:<74s} median {med[k]:7.3f} s/step  {tps[k]:7.0f} useful tokens/CPU-s")
    sh = step["shapes"]
    print(
        f"per step: useful tokens {step['useful']}; slots a {sh['a'][0]} b {sh['b'][0]} c {sh['c'][0]}; "
        f"sum n^2 a {sh['a'][1]:.3g} b {sh['b'][1]:.3g} c {sh['c'][1]:.3g}"
    )
    fa = step_flops(*sh["a"], h, NUM_LAYERS, VOCAB)
    for other, key in (("b", "b"), (c_name, "c")):
        r = tps["a"] / tps[other]
        bd = step_flops(*sh[key], h, NUM_LAYERS, VOCAB) / fa
        passed = r >= TARGET * bd
        print(
            f"ratio (a)/({other}) = {r:6.2f}   FLOP bound {bd:6.2f}   target >= {TARGET} x bound = "
            f"{TARGET * bd:5.2f}  ({r / bd:.2f} of bound)  -> {'PASS' if passed else 'MISS'}"
        )
    print(
        f"dense-mask baseline (c) = ({c_name}), the faster of c1/c2; (a)/(c1) = {tps['a'] / tps['c1']:.2f}, "
        f"(a)/(c2) = {tps['a'] / tps['c2']:.2f}"
    )
    for other, key in (("b", "b"), (c_name, "c")):
        r = tps["a'"] / tps[other]
        bd = step_flops(*sh[key], h, NUM_LAYERS, VOCAB) / fa
        print(
            f"previous kernel: ratio (a')/({other}) = {r:6.2f}   FLOP bound {bd:6.2f}   ({r / bd:.2f} of bound)  -> "
            f"{'PASS' if r >= TARGET * bd else 'MISS'}"
        )
    fix = tps["a"] / tps["a'"]
    print(f"(a)/(a') = {fix:.2f}  (speed-up of the 4-D views on the whole fwd+bwd)")


if __name__ == "__main__":
    sys.exit(main())
