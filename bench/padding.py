"""Padding: useful tokens/s of negotiated vs static vs variable_seq_lengths, PP=4 simulated device;
and the collectives our code adds per training step.

    python -m bench.padding [--steps 7] [--warmup 1] [--us-per-token 15] [--skip-collectives]

Part 1, throughput. 4 forked gloo ranks (``megatron_ext.testing.run_ranks``), PP=4, DP=TP=1,
megatron-core's real 1F1B schedule (``get_forward_backward_func``) driven by OUR training path:
``data.step_data.StepDataBuilder`` (fetch, ``--sequence-padding`` mode, the negotiation all-reduce)
then ``training.run_forward_backward``. The model is a simulated device (``bench/simdevice.py``):
each stage is 2 layers whose forward sleeps ``--us-per-token`` x tokens and backward twice that,
tokens = the padded micro-batch's b x L, so the 2 cores are not the bottleneck and step time
follows the padded shapes and the schedule (with the default 15 us/token, a full 2048-token
micro-batch costs 61 ms forward per stage, far above a ~1.5 ms gloo hop). The activations are
[L, b, 64]; the TransformerConfig is ours (``model.build_transformer_config``), so ``variable`` mode
turns on megatron-core's ``variable_seq_lengths`` shape handshake. m = 8 micro-batches per step,
``--seq-length`` 2048, ``--pad-to-multiple-of`` 64.

- (a) unpacked skewed lengths: one document per row (``--one-document-per-row``), micro-batch
  size 1, lengths lognormal(median 300, sigma 1) clipped to [1, 2048];
- (b) full packed bins: the embedded corpus's documents packed best_fit into 2048-token bins
  (``PackedDocumentDataset``, real THD samples with cu_seqlens), micro-batch size 1.

Each step's samples are the same for the three modes; modes alternate static, negotiated,
variable per step (after a barrier), wall time per step = the slowest rank's, the first
``--warmup`` steps dropped. Ratios are paired per step (same samples, back to back: useful tokens
are equal, so the ratio of useful tokens/s is the inverse ratio of step times), and printed as
medians over steps beside the analytic computed-token ratio of the same steps (static slots /
mode slots: what step time proportional to tokens predicts) and the median of measured/analytic. Targets: (a) negotiated/static >= 0.9 x analytic; (b) negotiated step time
<= 1.01 x static. variable: ratio printed, no target (see bench/README.md).

Part 2, collectives. 4 forked ranks, PP=2 x DP=2, the tiny real GPTModel of
``megatron_ext.testing``'s tiny job on packed data, two steps of ``training.train`` with a log interval of
2 (step 1 is not a log step, step 2 is), once per mode. A wrapper around torch.distributed's
collectives (all_reduce, broadcast, all_gather*, reduce_scatter*, barrier, reduce, gather,
scatter, all_to_all*; not P2P) records each call and attributes it to megatron_ext or
megatron.core by the innermost calling frame from either package; printed per step and rank.
Expected from megatron_ext: one all_reduce MAX (the step length, over the pipeline's TP x PP
group) per step in negotiated mode only, plus the DP loss all-reduce on the last stage at log steps.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PREFIX = "data/default/corpus_text_document"
PP = 4
M = 8
SEQ = 2048
MULTIPLE = 64
HIDDEN = 64
LAYERS_PER_STAGE = 2
MODES = ("static", "negotiated", "variable")
TARGET_A = 0.9
TARGET_B = 1.01


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7, help="steps per mode and data set (first --warmup dropped)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--us-per-token", type=float, default=15.0, help="simulated forward us per token per layer")
    p.add_argument("--median", type=float, default=300.0, help="(a) lognormal median length")
    p.add_argument("--sigma", type=float, default=1.0, help="(a) lognormal sigma")
    p.add_argument("--data-path", default=PREFIX)
    p.add_argument("--skip-collectives", action="store_true")
    args = p.parse_args(argv)
    if args.steps - args.warmup < 5:
        p.error("need at least 5 measured steps (--steps - --warmup >= 5)")
    return args


# ---------------------------------------------------------------- data


class LognormalRows:
    """Unpacked rows (one document each, no boundaries); sample i is a pure function of (seed, i)."""

    def __init__(self, median: float, sigma: float, seq_length: int, seed: int = 0, n: int = 100_000):
        self.median, self.sigma, self.seq, self.seed, self.n = median, sigma, seq_length, seed, n

    def __len__(self) -> int:
        return self.n

    def length(self, i: int) -> int:
        rng = np.random.default_rng([self.seed, i])
        return int(min(self.seq, max(1, round(rng.lognormal(np.log(self.median), self.sigma)))))

    def __getitem__(self, i: int) -> dict:
        from megatron_ext.data.packed_dataset import build_packed_sample

        n = self.length(i)
        sample = build_packed_sample([np.random.default_rng([self.seed, i, 1]).integers(0, 8000, n)])
        del sample["cu_seqlens"]
        return sample


def corpus_bins(prefix: str, seq_length: int):
    """Our packed dataset over the corpus (best_fit, in memory: nothing written beside the data)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.packed_dataset import PackedDocumentDataset
    from megatron_ext.data.packing import build_packing_index

    indexed = IndexedDataset(prefix)
    lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
    index = build_packing_index(np.arange(len(lengths)), lengths, seq_length, "best_fit")
    return PackedDocumentDataset(indexed, index, seq_length, seed=1234, num_samples=index.num_bins)


# ---------------------------------------------------------------- simulated model through our path


def _bench_chunk(config, seconds_per_token: float, pre_process: bool):
    from bench.simdevice import SimChunk

    class BenchChunk(SimChunk):
        def zero_grad_buffer(self):  # what run_forward_backward calls on megatron-core DDP chunks
            self.zero_grad(set_to_none=True)

    return BenchChunk(config, LAYERS_PER_STAGE, seconds_per_token, pre_process)


def sim_forward_step(data_iterator, model):
    """forward_step_func: the padded micro-batch's shape drives the simulated cost."""
    mb = next(data_iterator)
    b, length = mb.tokens.shape
    x = torch.zeros(length, b, model.config.hidden_size) if model.pre_process else None
    out = model(x)
    valid = int(mb.valid.sum())

    def loss_func(output):
        loss = output.float().mean()
        return loss, torch.tensor(valid, dtype=torch.int), {"loss": loss.detach()}

    return out, loss_func


def _values(mode: str, kind: str, pp: int = PP) -> dict:
    v = dict(
        num_layers=LAYERS_PER_STAGE * pp,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        seq_length=SEQ,
        micro_batch_size=1,
        global_batch_size=M,
        train_iters=1000,
        lr=1e-4,
        min_lr=1e-4,
        lr_decay_style="constant",
        seed=1234,
        mock_data=True,
        tokenizer_type="NullTokenizer",
        vocab_size=127,
        make_vocab_size_divisible_by=32,
        pipeline_model_parallel_size=pp,
        sequence_padding=mode,
        pad_to_multiple_of=MULTIPLE,
    )
    v["packed_sequences" if kind == "packed" else "one_document_per_row"] = True
    return v


def throughput_rank(rank: int, world_size: int, kind: str, steps: int, us_per_token: float, data) -> dict:
    from megatron_ext.config import build_job_config
    from megatron_ext.data.step_data import StepDataBuilder, StepDataSpec
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_transformer_config
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
    from megatron_ext.training.step import run_forward_backward

    device = torch.device("cpu")
    cfgs = {mode: build_job_config(_values(mode, kind)) for mode in MODES}
    ctx = build_parallel_context(cfgs["static"], device)
    builders, models = {}, {}
    for mode in MODES:
        resolved = resolve_config(cfgs[mode], ctx.world_size, 128)
        # vocab_size None: no token-id check (the rows' ids are arbitrary, the simulated chunks never embed them)
        spec = StepDataSpec(
            M,
            1,
            ctx.dp_rank,
            ctx.dp_size,
            resolved.sequence_padding,
            MULTIPLE,
            resolved.max_microbatch_length,
            pad_id=0,
            vocab_size=None,
        )
        builders[mode] = StepDataBuilder(spec, device, ctx.mp_group)
        config = build_transformer_config(cfgs[mode], resolved, device)
        models[mode] = [_bench_chunk(config, us_per_token * 1e-6, pre_process=ctx.pp_rank == 0)]
    out = {mode: [] for mode in MODES}
    for step in range(steps):
        for mode in MODES:
            dist.barrier()
            t0 = time.perf_counter()
            mbs, length = builders[mode].build(data, step * M)
            run_forward_backward(models[mode], mbs, length, forward_step_func=sim_forward_step)
            dt = time.perf_counter() - t0
            out[mode].append(
                {
                    "seconds": dt,
                    "length": length,
                    "useful": sum(mb.num_real_tokens for mb in mbs),
                    "slots": sum(mb.num_slots for mb in mbs),
                    "lengths": [int(mb.tokens.shape[1]) for mb in mbs],
                }
            )
    destroy_parallel_context()
    return out


def hop_rank(rank: int, world_size: int, n: int) -> float:
    """Median one-way P2P hop (ping-pong / 2) of a [2048, 1, 64] fp32 tensor between ranks 0 and 1."""
    t = torch.zeros(SEQ, 1, HIDDEN)
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[2:])


def summarize(results: list[dict], warmup: int) -> dict:
    """Per mode and measured step: slowest-rank seconds, useful tokens, slots, lengths."""
    out = {}
    for mode in MODES:
        steps = len(results[0][mode])
        recs = results[0][mode][warmup:]
        out[mode] = {
            "secs": [max(r[mode][i]["seconds"] for r in results) for i in range(steps)][warmup:],
            "useful": [r["useful"] for r in recs],
            "slots": [r["slots"] for r in recs],
            "lengths": [r["length"] for r in recs],
            "mb_lengths": [r["lengths"] for r in recs],
        }
    return out


def paired(s: dict, num: str, den: str) -> tuple[float, float, float]:
    """Medians over steps of the per-step measured ratio (useful tokens/s of num over den: the same
    step's samples, run back to back), of the analytic ratio (den slots / num slots) and of
    measured / analytic."""
    r = [tn / tm for tn, tm in zip(s[den]["secs"], s[num]["secs"])]
    a = [sd / sn for sd, sn in zip(s[den]["slots"], s[num]["slots"])]
    return statistics.median(r), statistics.median(a), statistics.median(x / y for x, y in zip(r, a))


def print_throughput(kind: str, s: dict) -> bool:
    st, ng, vr = s["static"], s["negotiated"], s["variable"]
    if st["useful"] != ng["useful"] or st["useful"] != vr["useful"]:
        print(f"  CHECK: useful tokens differ between modes: {st['useful']} {ng['useful']} {vr['useful']}")
    print(
        f"  measured steps: useful tokens {sum(st['useful'])}; slots static {sum(st['slots'])}, "
        f"negotiated {sum(ng['slots'])}, variable {sum(vr['slots'])}"
    )
    print(f"  negotiated step lengths: {ng['lengths']}")
    if kind == "unpacked":
        print(f"  variable micro-batch lengths, first measured step: {vr['mb_lengths'][0]}")
    for mode in MODES:
        m = s[mode]
        print(
            f"  {mode:<11s} median step {statistics.median(m['secs']) * 1e3:8.1f} ms   "
            f"{sum(m['useful']) / sum(m['secs']):9.0f} useful tokens/s (total/total)"
        )
    r, a, f = paired(s, "negotiated", "static")
    if kind == "unpacked":
        ok = f >= TARGET_A
        print(
            f"  negotiated/static = {r:5.2f}   analytic computed-token ratio {a:5.2f}   measured/analytic "
            f"{f:.2f}   target >= {TARGET_A}  -> {'PASS' if ok else 'MISS'}"
        )
    else:
        t = statistics.median(n / m for n, m in zip(ng["secs"], st["secs"]))
        ok = t <= TARGET_B
        print(
            f"  negotiated/static step time = {t:.3f}   target <= {TARGET_B}  -> {'PASS' if ok else 'MISS'}   "
            f"(useful tokens/s ratio {r:.3f}, analytic {a:.3f})"
        )
    r, a, f = paired(s, "variable", "static")
    print(f"  variable/static   = {r:5.2f}   analytic {a:5.2f}   measured/analytic {f:.2f}")
    r, a, f = paired(s, "negotiated", "variable")
    print(
        f"  negotiated/variable = {r:5.3f}   analytic (variable slots / negotiated slots) {a:5.3f}   "
        f"measured/analytic {f:.2f}   (no target: see bench/README.md)"
    )
    return ok


# ---------------------------------------------------------------- collectives


COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_object",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
)


class CollectiveCounter:
    """Wraps torch.distributed collectives (and their distributed_c10d originals) in this process;
    records (origin, caller, op, group size, detail) for each outermost call."""

    def __init__(self):
        self.events: list = []
        self._depth = threading.local()
        self._saved = []

    def _origin(self) -> tuple[str, str]:
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename.replace("\\", "/")
            for pkg, marker in (("megatron_ext", "/megatron_ext/"), ("megatron.core", "/megatron/core/")):
                if marker in path:
                    mod = path.split(marker, 1)[1].rsplit(".", 1)[0].replace("/", ".")
                    return pkg, f"{mod}.{f.f_code.co_name}"
            f = f.f_back
        return "other", "?"

    def _wrap(self, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._depth, "n", 0)
            if depth == 0:
                pkg, where = counter._origin()
                group = kwargs.get("group")
                try:
                    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
                except Exception:  # noqa: BLE001
                    size = -1
                detail = ""
                if name.startswith("all_reduce") or name == "reduce":
                    op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
                    detail = str(op).split(".")[-1].replace("RedOpType", "")
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if t is not None:
                    detail += f" {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                counter.events.append((pkg, where, name, size, detail.strip()))
            counter._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.n = depth

        return wrapper

    def install(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        for mod in (dist, c10d):
            for name in COLLECTIVES:
                if hasattr(mod, name):
                    original = getattr(mod, name)
                    self._saved.append((mod, name, original))
                    setattr(mod, name, self._wrap(name, original))

    def remove(self) -> None:
        for mod, name, original in reversed(self._saved):
            setattr(mod, name, original)
        self._saved.clear()


def collectives_rank(rank: int, world_size: int) -> dict:
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import PackedMarkovDataset, build_tiny_run, tiny_values
    from megatron_ext.training.loop import train

    out = {}
    for mode in MODES:
        values = tiny_values(
            seq_length=64,
            micro_batch_size=1,
            global_batch_size=8,
            packed_sequences=True,
            pad_to_multiple_of=16,
            sequence_padding=mode,
            pipeline_model_parallel_size=2,
            train_iters=2,
            log_interval=2,
        )
        run = build_tiny_run(values, PackedMarkovDataset(64))
        counter = CollectiveCounter()
        steps: list[list] = []

        decide = run.exit_decider.decide

        def end_of_step(iteration: int) -> int:
            """The loop asks for an exit once per step, after logging: cut the events there."""
            steps.append(list(counter.events))
            counter.events.clear()
            return decide(iteration)

        run.exit_decider.decide = end_of_step
        counter.install()
        try:
            train(run)
        finally:
            counter.remove()
        out[mode] = {"steps": steps, "pp_rank": run.ctx.pp_rank, "dp_rank": run.ctx.dp_rank}
        destroy_parallel_context()
    return out


def print_collectives(results: list[dict]) -> bool:
    ok = True
    shown: set = set()  # megatron-core's own calls: listed in full once per distinct set
    for mode in MODES:
        print(f"  mode {mode}:")
        for step in range(2):
            tag = "log step" if step == 1 else "non-log step"
            for rank, res in enumerate(results):
                ev = res[mode]["steps"][step]
                ours = [f"{op}({d}) group={n} <- {w}" for pkg, w, op, n, d in ev if pkg == "megatron_ext"]
                mcore = collections.Counter(f"{op}[{n}] <- {w}" for pkg, w, op, n, d in ev if pkg == "megatron.core")
                other = [f"{op} <- {w}" for pkg, w, op, n, d in ev if pkg == "other"]
                print(
                    f"    step {step + 1} ({tag}) rank {rank} (pp {res[mode]['pp_rank']}, dp {res[mode]['dp_rank']}): "
                    f"megatron_ext {len(ours)}: {ours or '[]'}"
                )
                key = tuple(sorted(mcore.items()))
                detail = "same as listed above" if key in shown else dict(key)
                shown.add(key)
                print(f"        megatron.core {sum(mcore.values())}: {detail}" + (f"  other: {other}" if other else ""))
                # expectation: negotiation (MAX) once per step iff negotiated; DP loss reduce only
                # on a log step, only on the last stage.
                n_max = sum(
                    1 for pkg, w, op, n, d in ev if pkg == "megatron_ext" and op == "all_reduce" and d.startswith("MAX")
                )
                n_loss = sum(1 for pkg, w, op, n, d in ev if pkg == "megatron_ext" and "reduce_loss_over_dp" in w)
                n_rest = sum(1 for pkg, *_ in ev if pkg == "megatron_ext") - n_max - n_loss
                want_max = 1 if mode == "negotiated" else 0
                want_loss = 1 if (step == 1 and res[mode]["pp_rank"] == 1) else 0
                if (n_max, n_loss, n_rest) != (want_max, want_loss, 0):
                    ok = False
                    print(
                        f"        UNEXPECTED: MAX {n_max} (want {want_max}), DP loss {n_loss} (want {want_loss}), other {n_rest}"
                    )
    return ok


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)

    # Import once here: forked ranks then start in well under a second (a cold megatron-core
    # import costs ~10 s per process on this machine).
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.transformer import TransformerConfig  # noqa: F401

    import bench.simdevice  # noqa: F401
    import megatron_ext.model.gpt  # noqa: F401
    import megatron_ext.testing  # noqa: F401
    import megatron_ext.training.loop  # noqa: F401
    from megatron_ext.testing import run_ranks

    hop = run_ranks(hop_rank, 2, 30)[0]
    fwd_full = args.us_per_token * 1e-6 * SEQ * LAYERS_PER_STAGE
    print(
        f"padding | PP={PP} x 4 forked gloo ranks, megatron-core 1F1B via megatron_ext.training.loop "
        f"(StepDataBuilder.build -> run_forward_backward), m={M}, seq {SEQ}, pad multiple {MULTIPLE}"
    )
    print(
        f"simulated device: {LAYERS_PER_STAGE} layers/stage, {args.us_per_token:g} us/token/layer forward, "
        f"backward 2x; a full {SEQ}-token micro-batch = {fwd_full * 1e3:.0f} ms fwd + {2 * fwd_full * 1e3:.0f} ms bwd "
        f"per stage | measured P2P hop [{SEQ},1,{HIDDEN}] fp32: {hop * 1e3:.2f} ms"
    )
    print(
        f"{args.steps} steps per mode, modes alternated per step (static, negotiated, variable), "
        f"first {args.warmup} dropped, medians; step time = slowest rank's wall time"
    )
    ok = True
    t0 = time.time()
    rows = LognormalRows(args.median, args.sigma, SEQ)
    print(f"(a) unpacked rows, lognormal median {args.median:g} sigma {args.sigma:g}, micro-batch size 1:")
    res = run_ranks(throughput_rank, PP, "unpacked", args.steps, args.us_per_token, rows, timeout=900)
    ok &= print_throughput("unpacked", summarize(res, args.warmup))
    print(f"  ({time.time() - t0:.0f} s)")
    t0 = time.time()
    bins = corpus_bins(args.data_path, SEQ)
    print(
        f"(b) full packed bins: corpus best_fit, {bins.index.num_bins} bins, efficiency "
        f"{bins.index.efficiency(SEQ):.4f}, micro-batch size 1 (THD):"
    )
    res = run_ranks(throughput_rank, PP, "packed", args.steps, args.us_per_token, bins, timeout=900)
    ok &= print_throughput("packed", summarize(res, args.warmup))
    print(f"  ({time.time() - t0:.0f} s)")
    if not args.skip_collectives:
        print(
            "collectives per training step (PP=2 x DP=2, tiny GPTModel, packed, log interval 2), "
            "counted by a wrapper, attributed by innermost calling frame:"
        )
        cres = run_ranks(collectives_rank, 4, timeout=600)
        cok = print_collectives(cres)
        print(
            f"  megatron_ext adds exactly: 1 all_reduce MAX per step (negotiated only) + the DP loss all_reduce "
            f"on the last stage at log steps -> {'AS EXPECTED' if cok else 'UNEXPECTED (see above)'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
