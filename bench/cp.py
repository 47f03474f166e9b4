"""Context parallelism on a simulated device: step(CP c)/step(CP 1) beside its prediction, per-rank
balance of the layouts on packed lognormal mixes, CP collectives per layer, saved bytes per rank.

    python -m bench.cp [--rounds 11] [--warmup 1] [--layers 2] [--seq-length 16384] [--time-scale 12]

About 2.5 minutes. 4 forked gloo ranks (``megatron_ext.testing.run_ranks``); each step runs on one CP
group, ranks 0 .. c-1 (rank 0 alone at CP 1), the others waiting at the next barrier: fewer processes
contend for this host's 2 cores, and no step is the slowest of independent replicas.

The simulated layer (``bench/simdevice.py``'s idea: sleep instead of compute, so that 4 ranks on 2
shared cores behave like 4 accelerators) is Llama-3 8B's (h 4096, 32 query heads, 8 key/value groups
of 128, SwiGLU 14336) on one H100-class GPU, slowed down ``--time-scale`` times:

- linear work: 2 x 218.1 M parameters = 436.2 MFLOP per local token (the QKV projection, 11.5% of
  it, before the all-gather; O and the MLP after);
- attention work: 4 x 32 x 128 = 16,384 FLOP per (query, key) pair of the rank's local query rows,
  causal within each document (``ContextParallelLayout.attention_pairs()`` of the real layout);
- both at 400 TFLOP/s achieved bf16 (40% of the H100 SXM's 989 dense peak; Megatron-Core reaches
  41-48% MFU on H100: docs/benchmarks.md); backward 2x forward. At T = 16,384 one layer's forward
  is 17.9 ms of linear + 5.5 ms of attention = 23.4 ms on the GPU; x 12 = 280 ms at CP 1, 70 ms a
  rank at CP 4, and >= 53.6 ms (the linear part alone) at CP 4 on any packed row: every simulated
  layer sleeps >= 50 ms (printed);
- the link: per layer and micro-batch the CP all-gather of the local [K;V] forward and the
  reduce-scatter of d[K;V] backward, each (c - 1)/c x T x 2 x 8 x 128 x 2 bytes (bf16) per rank
  over the bus bandwidth (x the time scale), with the project's real collective
  (``context_parallel.collectives.gather_keys_values``: all-gather forward, reduce-scatter in its
  backward) on gloo inside it for the ordering. Exposed, not overlapped, as in Llama 3's all-gather
  CP. Stated bandwidths: InfiniBand NDR 400 Gb/s = 50 GB/s a GPU, 45 GB/s bus bandwidth achieved (a
  CP group across nodes, as Llama 3's with TP 8 inside the node; the targets are judged here);
  NVLink 4, 450 GB/s a direction a GPU, 360 GB/s all-gather / reduce-scatter bus bandwidth (a CP
  group inside one node, as configs/llama3-8b-cp2.yaml).

The device (``SimDevice``): each rank's kernels (sleeps) run back to back on its own timeline, the
host issuing the next one while the current runs, as a GPU's host runs ahead of its stream; so this
host's stalls (late wake-ups and descheduled processes of 5-100 ms at load 10-35 on 2 cores,
measured) cost a step only where they exceed the kernel running meanwhile. A collective ends
``link`` after the later of the device and the host being ready, or when the gloo call returns if
that is later: the gloo call's loopback time (0.4-9 ms here, printed) lies inside the link's time
rather than being added to it (adding it would count the transfer twice), and a peer that arrives
late holds every rank, as on a real link. Step = the last rank's device end - the first rank's start
after a barrier (one host clock). What the device cannot hide is a stall longer than the kernel
running meanwhile, or one inside a collective: at load 10-30 here 4-rank gloo calls take 3-11 ms at
p50-p90 but 120-180 ms at p99, and up to half of a CP step's samples can be hit; every step is
printed, with the count of those over 1.05 x the modelled step, beside the medians.

Cases, their variants alternated A B C ... per round, ``--warmup`` rounds dropped, medians: one
document of T tokens (compute exactly 1/c on every rank under head-tail), and ``--mix-rows`` packed
rows of a lognormal mix (median 2000, sigma 1, every document padded to g = 8: the same packs at
every c; rows spread over the packing) under per-document head-tail at c = 2, 4 and row head-tail at
c = 4. Prediction: the slowest rank's modelled compute(c) / compute(1) + link(c) / step(1) measured,
i.e. 1/c + link / step(1) for the one document. Targets (issue 42), judged on the per-document rows
at the stated bandwidth (IB): measured within 5% of the prediction, <= 0.55 (c = 2) and <= 0.30
(c = 4). Beside it, the "gloo floor" prediction takes each collective as the larger of its link time
and gloo's measured loopback time: at NVLink's 1.1-1.7 ms a direction (x 12) this host's gloo calls
(0.4-9 ms) are the slower, so the NVLink rows measure this host's floor, not NVLink (printed).

Balance (no timing): per-rank attention work (pairs) and whole-layer work (the costs above)
max/mean, summed over all packs of ``--balance-tokens`` tokens of each mix, of contiguous slices,
row head-tail (unpadded packs) and per-document head-tail (every document padded to 2c, as
--document-pad-multiple's default), and the tokens that padding adds. Target: per-document <= 1.01.

Collectives and memory (zero-cost layers, exact): CP collectives per layer and micro-batch, counted
by a wrapper around ``torch.distributed`` (both spellings), without and with core attention
recomputed; bytes saved for backward per rank after the forward (``bench.simdevice.SavedTensorMeter``)
against CP 1, and the peak over forward and backward. The stand-in tensors carry Llama-3 8B's saved
bytes per token scaled 1 : 2048 (one fp32 element = 2 KiB, bf16 activations, flash attention): the
rest of the layer 62 (the norms', QKV's, O's and fc1's inputs, fc1's output, fc2's input: 124 KiB),
q 4, the attention output 4, K and V 1 each (gathered: T rows, not T/c); recomputed core attention
keeps q, k, v local only. Targets (issue 42): recomputed <= 1.05 x CP1/c; kept, <= CP1/c +
(2c + 1)/(2c) x L x T x K/V bytes. The real model's bytes: tests/distributed/test_cp_model.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from typing import NamedTuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.cp_balance import build_rows  # noqa: E402
from bench.simdevice import SavedTensorMeter, busy_wait  # noqa: E402
from megatron_ext.context_parallel.collectives import ALL_GATHER, REDUCE_SCATTER, gather_keys_values  # noqa: E402
from megatron_ext.context_parallel.layout import build_document_layout, build_row_layout, get_owners  # noqa: E402
from megatron_ext.data.packing import round_up_lengths, split_documents  # noqa: E402
from megatron_ext.testing import run_ranks  # noqa: E402

WORLD = 4
CP_SIZES = (2, 4)

# ---- Llama-3 8B, one layer, on an H100-class GPU ----
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
QKV_PARAMS = HIDDEN * (HEADS + 2 * GROUPS) * HEAD_DIM
LAYER_PARAMS = QKV_PARAMS + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN
LINEAR_FLOP_PER_TOKEN = 2 * LAYER_PARAMS  # 436.2 M
PRE_FRACTION = QKV_PARAMS / LAYER_PARAMS  # the QKV projection, before the all-gather
ATTENTION_FLOP_PER_PAIR = 4 * HEADS * HEAD_DIM  # q.k and p.v, forward
ACHIEVED_FLOPS = 400e12  # bf16, 40% of the H100 SXM's 989 TFLOP/s dense peak
KV_BYTES_PER_TOKEN = 2 * GROUPS * HEAD_DIM * 2  # K and V, bf16
LINKS = {  # bus bandwidth, bytes/s
    "IB": (45e9, "InfiniBand NDR 400 Gb/s (50 GB/s) a GPU, 45 GB/s bus: a CP group across nodes"),
    "NVLink": (360e9, "NVLink 4, 450 GB/s a direction a GPU, 360 GB/s all-gather bus: a CP group in a node"),
}
STATED_LINK = "IB"


# ---- stand-in tensors: widths per token (fp32 elements) ----
class Widths(NamedTuple):
    rest: int  # the activation passed between layers, saved by PreLinear (norm, QKV, O, fc1 inputs, ...)
    q: int  # q, and the attention output
    kv: int  # k, and v (each)


# Llama-3 8B's saved bytes per token, one fp32 element = 2 KiB: the rest of the layer 124 KiB, q 8 KiB,
# the output 8 KiB, k and v 2 KiB each (bf16)
MEMORY_WIDTHS = Widths(62, 4, 1)
TIMING_WIDTHS = Widths(3, 1, 1)  # timed steps: as small as the layer allows (the host's work stays ~0)

# ---- the packed mix that is timed, and the ones whose balance is printed ----
TIMED_MIX = (2000, 1.0)  # median, sigma of the document lengths (rows of --seq-length)
TIMED_MIX_G = 8  # the packs' document pad multiple: valid for c = 2 and 4
BALANCE_MIXES = ((16384, 2000, 1.0), (16384, 8000, 1.2), (131072, 8000, 1.2))
BALANCE_CP = (2, 4, 8)

TARGET_PREDICTION = 0.05  # |measured / predicted - 1|
TARGET_RATIO = {2: 0.55, 4: 0.30}
TARGET_BALANCE = 1.01
TARGET_RECOMPUTED_BYTES = 1.05  # x CP1 / c
MIN_LAYER_MS = 50.0


@dataclasses.dataclass(frozen=True)
class Costs:
    """Simulated seconds: per local token of linear work, per attention pair, per K/V byte on the link."""

    token: float
    pair: float
    time_scale: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Costs:
        return cls(
            token=args.time_scale * LINEAR_FLOP_PER_TOKEN / ACHIEVED_FLOPS,
            pair=args.time_scale * ATTENTION_FLOP_PER_PAIR / ACHIEVED_FLOPS,
            time_scale=args.time_scale,
        )

    def link_seconds(self, num_tokens: int, cp_size: int, bandwidth: float) -> float:
        """One all-gather (or reduce-scatter) of [K;V]: (c - 1)/c x T x K/V bytes / bus bandwidth."""
        if cp_size == 1 or bandwidth == float("inf"):
            return 0.0
        return self.time_scale * (cp_size - 1) / cp_size * num_tokens * KV_BYTES_PER_TOKEN / bandwidth


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's micro-batch: its local tokens, its attention pairs, and what each part sleeps."""

    num_tokens: int  # T
    num_local: int  # T / c
    pairs: int
    pre: float
    attention: float
    post: float
    link: float  # each direction
    widths: Widths = TIMING_WIDTHS

    @property
    def forward(self) -> float:
        return self.pre + self.attention + self.post


def make_plan(num_tokens: int, cp_size: int, pairs: int, costs: Costs, bandwidth: float) -> RankPlan:
    linear = costs.token * (num_tokens // cp_size)
    return RankPlan(
        num_tokens=num_tokens,
        num_local=num_tokens // cp_size,
        pairs=pairs,
        pre=PRE_FRACTION * linear,
        attention=costs.pair * pairs,
        post=(1 - PRE_FRACTION) * linear,
        link=costs.link_seconds(num_tokens, cp_size, bandwidth),
    )


def get_rank_pairs(bounds: np.ndarray, cp_size: int, layout: str) -> list[int]:
    """[c] attention pairs of each rank's local query rows, from the layouts context_parallel builds."""
    if cp_size == 1:
        return [build_document_layout(bounds, 1, 0).attention_pairs()]
    seq = int(bounds[-1])
    if layout == "document":
        return [build_document_layout(bounds, cp_size, r).attention_pairs() for r in range(cp_size)]
    return [build_row_layout(seq, 1, cp_size, r, cu_seqlens=bounds).attention_pairs() for r in range(cp_size)]


# ---- the simulated device and layer ----


def wait_until(deadline: float) -> None:
    busy_wait(deadline - time.perf_counter())


class SimDevice:
    """A rank's simulated accelerator: a timeline of kernels (sleeps) run back to back.

    The host issues each kernel as if while the previous one ran (one kernel queued, as a GPU's host
    runs ahead of its stream), then waits for it: a late wake-up, Python work or a descheduled
    process (tens of ms on this shared host) costs the step only where it exceeds the kernel running
    meanwhile. A collective (a host-blocking gloo call) starts when the device and the host are both
    ready and ends ``link`` seconds later, or when the call returns if that is later: the gloo call's
    own loopback time is part of the link's, not added to it, and a peer that arrives late delays
    every rank, as on a real link. ``end`` is the device's time when its last kernel ends."""

    def __init__(self):
        self.end = 0.0
        self.running = 0.0  # the duration of the kernel that runs while the host issues the next

    def start(self) -> float:
        self.end, self.running = time.perf_counter(), 0.0
        return self.end

    def _issue(self) -> float:
        return max(self.end, time.perf_counter() - self.running)

    def run(self, seconds: float) -> None:
        self.end, self.running = self._issue() + seconds, seconds
        wait_until(self.end)

    def begin_collective(self) -> float:
        return self._issue()

    def end_collective(self, start: float, link: float) -> None:
        self.end = max(start + link, time.perf_counter())
        self.running = self.end - start
        wait_until(self.end)


DEVICE = SimDevice()  # this process's


class PreLinear(torch.autograd.Function):
    """Norm and QKV projection: x [n, 1, rest] -> q [n, 1, wq], k and v [n, 1, 1, wkv]; saves x."""

    @staticmethod
    def forward(ctx, x, weight, seconds, widths):
        DEVICE.run(seconds)
        ctx.save_for_backward(x)
        ctx.weight, ctx.seconds, ctx.widths = weight.detach(), seconds, widths
        n, wq, wkv = x.shape[0], widths.q, widths.kv
        q = x[..., :wq] * ctx.weight
        k = (x[..., wq : wq + wkv] * ctx.weight).reshape(n, 1, 1, wkv)
        v = (x[..., wq + wkv : wq + 2 * wkv] * ctx.weight).reshape(n, 1, 1, wkv)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        DEVICE.run(2 * ctx.seconds)
        (x,) = ctx.saved_tensors
        wq, wkv = ctx.widths.q, ctx.widths.kv
        dx = torch.zeros_like(x)
        dx[..., :wq] = dq * ctx.weight
        dx[..., wq : wq + wkv] = dk.reshape(x.shape[0], 1, -1) * ctx.weight
        dx[..., wq + wkv : wq + 2 * wkv] = dv.reshape(x.shape[0], 1, -1) * ctx.weight
        dw = (dq * x[..., :wq]).sum().reshape(())
        return dx, dw, None, None


class CoreAttention(torch.autograd.Function):
    """q [n, 1, wq] against the gathered [K;V] [T, 1, 2, wkv]: sleeps its pairs' time (2x backward);
    saves q, [K;V] and its output, as the CP attention saves q, K/V, output (and the logsumexp)."""

    @staticmethod
    def forward(ctx, q, kv, seconds):
        DEVICE.run(seconds)
        out = q * 1.0
        ctx.save_for_backward(q, kv, out)
        ctx.seconds = seconds
        return out

    @staticmethod
    def backward(ctx, grad):
        DEVICE.run(2 * ctx.seconds)
        _, kv, _ = ctx.saved_tensors
        return grad, torch.full_like(kv, 1e-3), None


class PostLinear(torch.autograd.Function):
    """O projection and the MLP: y [n, 1, rest] = x w + attention output; saves nothing (its inputs'
    bytes are counted in PreLinear's x)."""

    @staticmethod
    def forward(ctx, x, out, weight, seconds):
        DEVICE.run(seconds)
        ctx.weight, ctx.seconds, ctx.wq = weight.detach(), seconds, out.shape[-1]
        y = x * ctx.weight
        y[..., : ctx.wq] += out
        return y

    @staticmethod
    def backward(ctx, grad):
        DEVICE.run(2 * ctx.seconds)
        return grad * ctx.weight, grad[..., : ctx.wq], grad.sum().reshape(()) * 1e-3, None


class _Stamp:
    """Where the device stood when the reduce-scatter of one layer's d[K;V] began (a hook on the
    gathered [K;V] records it, just before the collective's backward runs)."""

    __slots__ = ("start",)

    def __init__(self):
        self.start = 0.0

    def record(self, grad: torch.Tensor) -> None:
        self.start = DEVICE.begin_collective()


class _LinkBackward(torch.autograd.Function):
    """Identity on the local k, v; backward (right after the reduce-scatter of their gradient) ends
    that collective on the device: ``link`` seconds after it began, or when the gloo call returned."""

    @staticmethod
    def forward(ctx, k, v, link, stamp):
        ctx.link, ctx.stamp = link, stamp
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        DEVICE.end_collective(ctx.stamp.start, ctx.link)
        return dk, dv, None, None


def gather_over_link(k, v, plan: RankPlan, group) -> torch.Tensor:
    """The project's CP collective (``gather_keys_values``: all-gather of [K;V] forward, reduce-scatter
    of its gradient backward, real gloo calls) over a link of ``plan.link`` seconds a direction."""
    stamp = _Stamp()
    k, v = _LinkBackward.apply(k, v, plan.link, stamp)
    start = DEVICE.begin_collective()
    kv = gather_keys_values(k, v, group)
    DEVICE.end_collective(start, plan.link)
    if kv.requires_grad:
        kv.register_hook(stamp.record)
    return kv


def core_attention(q, k, v, plan: RankPlan, group) -> torch.Tensor:
    kv = torch.cat((k, v), dim=2) if group is None else gather_over_link(k, v, plan, group)
    return CoreAttention.apply(q, kv, plan.attention)


class RecomputedCoreAttention(torch.autograd.Function):
    """Core attention recomputed (``--recompute-granularity selective``): keeps q, k, v local only and
    re-gathers K/V in backward (one more all-gather per layer)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group):
        with torch.no_grad():
            out = core_attention(q, k, v, plan, group)
        ctx.save_for_backward(q, k, v)
        ctx.plan, ctx.group = plan, group
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = core_attention(q, k, v, ctx.plan, ctx.group)
        torch.autograd.backward(out, grad)
        return q.grad, k.grad, v.grad, None, None


def forward_micro_batch(weights: list, plan: RankPlan, group, recompute: bool = False) -> torch.Tensor:
    """One micro-batch's forward through the layers: the loss."""
    y = torch.ones(plan.num_local, 1, plan.widths.rest, requires_grad=True)
    for w_pre, w_post in weights:
        q, k, v = PreLinear.apply(y, w_pre, plan.pre, plan.widths)
        if recompute:
            out = RecomputedCoreAttention.apply(q, k, v, plan, group)
        else:
            out = core_attention(q, k, v, plan, group)
        y = PostLinear.apply(y, out, w_post, plan.post)
    return y.sum()


def run_micro_batch(weights: list, plan: RankPlan, group) -> None:
    forward_micro_batch(weights, plan, group).backward()


# ---- cases and variants ----


@dataclasses.dataclass(frozen=True)
class Variant:
    case: str
    cp_size: int
    layout: str  # "document" (per-document head-tail; for one document also the row's) or "row"
    link: str  # a LINKS key, or "-" at CP 1

    @property
    def name(self) -> str:
        if self.cp_size == 1:
            return f"{self.case} CP1"
        return f"{self.case} CP{self.cp_size} {self.layout} {self.link}"


def sample_lengths(seq: int, median: float, sigma: float, tokens: int, seed: int) -> np.ndarray:
    """Lognormal document lengths, about ``tokens`` of them in all."""
    rng = np.random.default_rng([seed, seq, int(median)])
    mean = median * np.exp(sigma**2 / 2)
    return np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, int(tokens / mean) + 8))).astype(np.int64)


def get_cases(args: argparse.Namespace) -> dict[str, list[np.ndarray]]:
    """{case: the rows (document boundaries) of one step}: one long document; ``--mix-rows`` rows of the
    packed mix, spread evenly over its packs (best-fit decreasing puts the longest pieces first)."""
    seq = args.seq_length
    lengths = sample_lengths(seq, *TIMED_MIX, 32 * seq, args.seed)
    rows = build_rows(lengths, seq, TIMED_MIX_G, None, "best_fit")
    picked = [rows[int((i + 0.5) * len(rows) / args.mix_rows)] for i in range(args.mix_rows)]
    return {
        "doc": [np.array([0, seq])],
        "mix": [np.concatenate([[0], np.cumsum(spans)]) for spans in picked],
    }


def get_variants() -> list[Variant]:
    variants = [Variant("doc", 1, "document", "-")]
    variants += [Variant("doc", c, "document", link) for link in LINKS for c in CP_SIZES]
    variants += [Variant("mix", 1, "document", "-")]
    variants += [Variant("mix", c, "document", STATED_LINK) for c in CP_SIZES]
    variants += [Variant("mix", 4, "row", STATED_LINK)]
    return variants


def get_plans(variant: Variant, rows: list[np.ndarray], costs: Costs) -> list[list[RankPlan]]:
    """[micro-batch][CP rank] the plans of one step."""
    bandwidth = LINKS[variant.link][0] if variant.cp_size > 1 else float("inf")
    return [
        [
            make_plan(int(bounds[-1]), variant.cp_size, pairs, costs, bandwidth)
            for pairs in get_rank_pairs(bounds, variant.cp_size, variant.layout)
        ]
        for bounds in rows
    ]


def predict_step(plans: list[list[RankPlan]], num_layers: int) -> float:
    """The modelled step: per micro-batch and layer the slowest CP rank's compute (forward + 2x
    backward; the all-gather and the reduce-scatter wait for it) and the link both ways."""
    return sum(num_layers * (3 * max(p.forward for p in ranks) + 2 * ranks[0].link) for ranks in plans)


def get_link_total(plans: list[list[RankPlan]], num_layers: int, floor: tuple[float, float] = (0.0, 0.0)) -> float:
    """The link's time in a step: an all-gather and a reduce-scatter per layer and micro-batch, each at
    least its ``floor`` (seconds: gloo's own time for each)."""
    return sum(num_layers * (max(ranks[0].link, floor[0]) + max(ranks[0].link, floor[1])) for ranks in plans)


# ---- the rank worker ----


class CollectiveCounter:
    """Counts torch.distributed's all-gather / reduce-scatter calls (both spellings) while installed."""

    def __init__(self):
        self.counts = {"all-gather": 0, "reduce-scatter": 0}
        self.saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for kind, names in (("all-gather", ALL_GATHER), ("reduce-scatter", REDUCE_SCATTER)):
            for name in names:
                fn = getattr(dist, name, None)
                if fn is None:
                    continue
                self.saved[name] = fn

                def counted(*a, _fn=fn, _kind=kind, **kw):
                    self.counts[_kind] += 1
                    return _fn(*a, **kw)

                setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def make_groups(rank: int) -> dict[int, object]:
    """{c: the CP group of ranks 0 .. c-1 (None on the others and at c = 1)}."""
    groups: dict[int, object] = {1: None}
    for c in CP_SIZES:
        group = dist.new_group(list(range(c)))  # every rank takes part in making every group
        groups[c] = group if rank < c else None
    return groups


def measure_gloo(rank: int, groups: dict, num_tokens: int, iters: int) -> dict[int, tuple[float, float]]:
    """{c: (all-gather, reduce-scatter) seconds, median} of the real call on this bench's [K;V] payload."""
    out = {}
    for c in CP_SIZES:
        fwd, bwd = [], []
        for i in range(iters + 2):
            local = torch.ones(num_tokens // c, 1, 1, TIMING_WIDTHS.kv, requires_grad=True)
            dist.barrier()
            if rank >= c:
                continue
            t0 = time.perf_counter()
            kv = gather_keys_values(local, local, groups[c])
            t1 = time.perf_counter()
            kv.backward(torch.ones_like(kv))
            t2 = time.perf_counter()
            if i >= 2:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        if fwd:
            out[c] = (statistics.median(fwd), statistics.median(bwd))
    return out


def measure_memory_and_collectives(rank: int, groups: dict, bounds: np.ndarray, num_layers: int) -> dict:
    """{(c, recompute): (bytes saved after the forward, peak over forward and backward, all-gathers,
    reduce-scatters)} of one micro-batch of ``bounds`` on the ranks of each CP group, zero-cost layers."""
    zero = Costs(0.0, 0.0, 0.0)
    weights = [(torch.nn.Parameter(torch.ones(())), torch.nn.Parameter(torch.ones(()))) for _ in range(num_layers)]
    out = {}
    for recompute in (False, True):
        for c in (1, *CP_SIZES):
            (ranks,) = get_plans(Variant("doc", c, "document", STATED_LINK if c > 1 else "-"), [bounds], zero)
            ranks = [dataclasses.replace(p, widths=MEMORY_WIDTHS) for p in ranks]
            meter = SavedTensorMeter()
            dist.barrier()
            if rank >= c:
                continue
            with CollectiveCounter() as counter, meter.track():
                loss = forward_micro_batch(weights, ranks[rank], groups[c], recompute)
                after_forward = meter.live
                loss.backward()
            counts = counter.counts
            out[(c, recompute)] = (after_forward, meter.peak, counts["all-gather"], counts["reduce-scatter"])
    return out


def bench_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(rank)
    groups = make_groups(rank)
    costs = Costs.from_args(args)
    cases = get_cases(args)
    variants = get_variants()
    plans = {v: get_plans(v, cases[v.case], costs) for v in variants}
    weights = [(torch.nn.Parameter(torch.ones(())), torch.nn.Parameter(torch.ones(()))) for _ in range(args.layers)]
    gloo = measure_gloo(rank, groups, args.seq_length, args.gloo_iters)
    spans: dict[str, list[tuple[float, float]]] = {v.name: [] for v in variants}
    for it in range(args.warmup + args.rounds):
        for v in variants:
            dist.barrier()
            if rank >= v.cp_size:
                continue  # one CP group steps; the other ranks wait at the next barrier
            start = DEVICE.start()
            for ranks in plans[v]:
                run_micro_batch(weights, ranks[rank], groups[v.cp_size])
            if it >= args.warmup:
                spans[v.name].append((start, DEVICE.end))
    memory = measure_memory_and_collectives(rank, groups, cases["doc"][0], args.layers)
    return {"spans": spans, "gloo": gloo, "memory": memory}


# ---- balance of the layouts (host only) ----


def get_token_pairs(spans: np.ndarray) -> np.ndarray:
    """[T] keys each token's query sees: its offset in its document + 1."""
    bounds = np.concatenate([[0], np.cumsum(spans)])
    return np.arange(int(bounds[-1])) - np.repeat(bounds[:-1], spans) + 1


def get_rank_work(spans: np.ndarray, c: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """([c] attention pairs, [c] local tokens) of each rank on one row."""
    pairs = get_token_pairs(spans)
    seq = len(pairs)
    if layout == "contiguous":
        return pairs.reshape(c, -1).sum(1), np.full(c, seq // c)
    bounds = np.concatenate([[0], np.cumsum(spans)]) if layout == "document" else np.array([0, seq])
    owners = get_owners(bounds, c)
    return np.bincount(owners, weights=pairs, minlength=c), np.bincount(owners, minlength=c)


def get_balance(rows: list[np.ndarray], c: int, layout: str, costs: Costs) -> tuple[float, float]:
    """(attention, whole layer) sum over rows of the slowest rank's work / sum of the mean."""
    attn_max = attn_mean = layer_max = layer_mean = 0.0
    for spans in rows:
        pairs, tokens = get_rank_work(spans, c, layout)
        layer = costs.token * tokens + costs.pair * pairs
        attn_max, attn_mean = attn_max + pairs.max(), attn_mean + pairs.mean()
        layer_max, layer_mean = layer_max + layer.max(), layer_mean + layer.mean()
    return attn_max / attn_mean, layer_max / layer_mean


def check_pairs_are_the_layouts(spans: np.ndarray, c: int) -> None:
    """The numpy pairs above are the layouts' own ``attention_pairs`` (one row, both layouts)."""
    bounds = np.concatenate([[0], np.cumsum(spans)])
    for layout in ("document", "row"):
        expected = get_rank_pairs(bounds, c, layout)
        assert get_rank_work(spans, c, layout)[0].tolist() == expected, (layout, c)


def measure_balance(args: argparse.Namespace, costs: Costs) -> list[dict]:
    """Every pack of about ``--balance-tokens`` tokens of each mix, under each layout."""
    results = []
    for seq, median, sigma in BALANCE_MIXES:
        lengths = sample_lengths(seq, median, sigma, args.balance_tokens, args.seed)
        plain = build_rows(lengths, seq, 1, None, "best_fit")
        real = split_documents(np.arange(len(lengths)), lengths, seq)[2]
        for c in BALANCE_CP:
            padded = build_rows(lengths, seq, 2 * c, None, "best_fit")
            check_pairs_are_the_layouts(padded[len(padded) // 2], c)
            results.append(
                {
                    "mix": f"{seq // 1024}k, median {median}, sigma {sigma:g}",
                    "c": c,
                    "rows": len(plain),
                    "contiguous": get_balance(plain, c, "contiguous", costs),
                    "row": get_balance(plain, c, "row", costs),
                    "document": get_balance(padded, c, "document", costs),
                    "pads": float(round_up_lengths(real, 2 * c).sum() / real.sum() - 1),
                }
            )
    return results


# ---- report ----


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _median_step(per_rank: list[dict], name: str) -> tuple[float, list[float]]:
    group = [r["spans"][name] for r in per_rank if r["spans"][name]]  # the ranks of the group that stepped
    steps = [max(e for _, e in st) - min(s for s, _ in st) for st in zip(*group)]
    return statistics.median(steps), steps


def report_timing(per_rank: list[dict], args: argparse.Namespace, costs: Costs, cases: dict) -> bool:
    variants = get_variants()
    plans = {v: get_plans(v, cases[v.case], costs) for v in variants}
    measured = {v: _median_step(per_rank, v.name) for v in variants}
    smallest = min(p.forward for ps in plans.values() for ranks in ps for p in ranks)
    print(
        f"\nsimulated Llama-3 8B layer (h {HIDDEN}, {HEADS}/{GROUPS} heads of {HEAD_DIM}, SwiGLU {FFN}) at "
        f"{ACHIEVED_FLOPS / 1e12:.0f} TFLOP/s, x{args.time_scale:g} slower: {costs.token * 1e6:.2f} us per local "
        f"token, {costs.pair * 1e9:.4f} ns per attention pair, backward 2x; {args.layers} layers; smallest "
        f"layer forward on a rank {smallest * 1e3:.1f} ms (>= {MIN_LAYER_MS:.0f}: "
        f"{_verdict(smallest * 1e3 >= MIN_LAYER_MS)})"
    )
    for name, (bandwidth, what) in LINKS.items():
        stated = " (the stated bandwidth)" if name == STATED_LINK else ""
        print(f"link {name}: {bandwidth / 1e9:.0f} GB/s bus{stated}: {what}")
    gloo = {
        c: [statistics.median(r["gloo"][c][i] for r in per_rank if c in r["gloo"]) for i in (0, 1)] for c in CP_SIZES
    }
    for c in CP_SIZES:
        links = ", ".join(
            f"{name} {costs.link_seconds(args.seq_length, c, bandwidth) * 1e3:.2f} ms"
            for name, (bandwidth, _) in LINKS.items()
        )
        print(
            f"c = {c}: gloo loopback on this bench's [K;V] stand-in ({args.seq_length // c} x {2 * TIMING_WIDTHS.kv} "
            f"fp32 a rank): all-gather {gloo[c][0] * 1e3:.2f} ms, reduce-scatter (in autograd) {gloo[c][1] * 1e3:.2f} "
            f"ms, inside the link's time a direction: {links}"
        )
    mix_docs = [len(b) - 1 for b in cases["mix"]]
    print(
        f"cases: doc = one document of {args.seq_length} tokens; mix = {len(cases['mix'])} packed rows of "
        f"{args.seq_length} (lognormal median {TIMED_MIX[0]}, sigma {TIMED_MIX[1]:g}, g = {TIMED_MIX_G}; "
        f"{mix_docs} documents), one micro-batch a row"
    )
    print(f"{args.rounds} rounds after {args.warmup} warm-up, variants alternated in the order below, medians\n")
    print(
        "prediction = compute part + link / step(1); gloo floor: the same with each collective's time the larger "
        "of the link's and gloo's measured loopback time (what this host can emulate)"
    )
    print(
        "| variant | step ms | modelled ms | step(c)/step(1) | prediction | measured/pred | compute part | "
        "link / step(1) | gloo floor pred | measured/floor | target | result |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for case in cases:
        base = next(v for v in variants if v.case == case and v.cp_size == 1)
        step1 = measured[base][0]
        compute1 = predict_step(plans[base], args.layers)
        for v in (v for v in variants if v.case == case):
            step = measured[v][0]
            modelled = predict_step(plans[v], args.layers)
            link = get_link_total(plans[v], args.layers)
            if v.cp_size == 1:
                print(f"| {v.name} | {step * 1e3:.1f} | {modelled * 1e3:.1f} | 1 | | | | | | | | |")
                continue
            compute = (modelled - link) / compute1
            prediction = compute + link / step1
            floor = compute + get_link_total(plans[v], args.layers, gloo[v.cp_size]) / step1
            ratio = step / step1
            close = abs(ratio / prediction - 1) <= TARGET_PREDICTION
            bound = TARGET_RATIO[v.cp_size]
            judged = v.layout == "document" and v.link == STATED_LINK
            good = close and ratio <= bound
            target = f"+-5%, <= {bound}" if judged else "(printed)"
            verdict = _verdict(good) if judged else ("within 5%" if close else "off")
            if judged:
                ok &= good
            print(
                f"| {v.name} | {step * 1e3:.1f} | {modelled * 1e3:.1f} | {ratio:.4f} | {prediction:.4f} | "
                f"{ratio / prediction:.4f} | {compute:.4f} | {link / step1:.4f} | {floor:.4f} | {ratio / floor:.4f} | "
                f"{target} | {verdict} |"
            )
    print("\nall steps ms, per variant (stalled: steps over 1.05 x the modelled step with the gloo floor)")
    for v in variants:
        steps = measured[v][1]
        floor = predict_step(plans[v], args.layers) - get_link_total(plans[v], args.layers)
        floor += get_link_total(plans[v], args.layers, gloo[v.cp_size] if v.cp_size > 1 else (0.0, 0.0))
        stalled = sum(step > 1.05 * floor for step in steps)
        print(f"  {v.name:<24} {' '.join(f'{s * 1e3:.0f}' for s in steps)}  (stalled {stalled} of {len(steps)})")
    return ok


def report_balance(results: list[dict]) -> bool:
    print(
        "\nper-rank work max/mean, attention pairs / whole layer (Llama-3 8B costs above), summed over rows; "
        "contiguous and row head-tail on unpadded packs, per-document on packs with every document padded to 2c"
    )
    print("| row, document mix | c | rows | contiguous | row head-tail | per-document | pads | |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for r in results:
        good = max(r["document"]) <= TARGET_BALANCE
        ok &= good
        cells = " | ".join(f"{r[k][0]:.3f} / {r[k][1]:.3f}" for k in ("contiguous", "row", "document"))
        print(f"| {r['mix']} | {r['c']} | {r['rows']} | {cells} | +{100 * r['pads']:.2f}% | {_verdict(good)} |")
    return ok


def report_memory(per_rank: list[dict], args: argparse.Namespace) -> bool:
    seq, layers = args.seq_length, args.layers
    kv_bytes = layers * seq * 2 * MEMORY_WIDTHS.kv * 4  # the stand-ins' K/V of every layer
    print(
        f"\nCP collectives per layer and micro-batch (counted), and bytes saved for backward per rank after the "
        f"forward, max over ranks (doc case, {layers} layers, zero-cost layers; stand-ins 1 : 2048 of Llama-3 8B's "
        f"bytes); the peak over forward and backward beside them"
    )
    print("| core attention | c | all-gathers | reduce-scatters | bytes | / CP1 | 1/c | target | | peak / CP1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for recompute in (False, True):
        measured = {c: [r["memory"][(c, recompute)] for r in per_rank[:c]] for c in (1, *CP_SIZES)}
        base, base_peak = (max(m[i] for m in measured[1]) for i in (0, 1))
        for c, per in measured.items():
            saved, peak = max(m[0] for m in per), max(m[1] for m in per)
            gathers, scatters = ({m[i] / layers for m in per} for i in (2, 3))
            want = (0, 0) if c == 1 else ((2 if recompute else 1), 1)
            counts_ok = gathers == {want[0]} and scatters == {want[1]}
            if recompute:
                bound, what = TARGET_RECOMPUTED_BYTES * base / c, f"<= {TARGET_RECOMPUTED_BYTES} x CP1/c"
            else:
                bound = base / c + (2 * c + 1) / (2 * c) * kv_bytes
                what = f"<= CP1/c + (2c+1)/2c K/V = {bound / base:.4f}"
            good = counts_ok and saved <= bound
            ok &= good
            print(
                f"| {'recomputed' if recompute else 'kept'} | {c} | {'/'.join(f'{g:g}' for g in sorted(gathers))} | "
                f"{'/'.join(f'{s:g}' for s in sorted(scatters))} | {saved} | {saved / base:.4f} | {1 / c:.4f} | "
                f"{what} | {_verdict(good)} | {peak / base_peak:.4f} |"
            )
    return ok


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11, help="measured rounds (one step of every variant each)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds dropped first")
    parser.add_argument("--layers", type=int, default=2, help="simulated layers")
    parser.add_argument("--seq-length", type=int, default=16384, help="T: tokens of a micro-batch (a multiple of 8)")
    parser.add_argument("--mix-rows", type=int, default=2, help="packed rows (micro-batches) of the timed mix")
    parser.add_argument(
        "--time-scale", type=float, default=12.0, help="simulated seconds per H100 second (keeps layers >= 50 ms)"
    )
    parser.add_argument("--balance-tokens", type=int, default=1 << 22, help="tokens per mix of the balance table")
    parser.add_argument("--gloo-iters", type=int, default=10, help="timed gloo calls per CP size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seq_length % (2 * TIMED_MIX_G):
        parser.error(f"--seq-length {args.seq_length}: use a multiple of {2 * TIMED_MIX_G}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    costs = Costs.from_args(args)
    cases = get_cases(args)
    print(
        f"bench.cp | 4 forked gloo ranks, torch {torch.__version__}; load average at start {load:.1f} "
        f"({os.cpu_count()} cores)"
    )
    per_rank = run_ranks(bench_worker, WORLD, args, timeout=1200)
    ok = report_timing(per_rank, args, costs, cases)
    ok &= report_balance(measure_balance(args, costs))
    ok &= report_memory(per_rank, args)
    print(
        f"\n{_verdict(ok)}: every target above; load average at end {os.getloadavg()[0]:.1f}; "
        f"total {time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
