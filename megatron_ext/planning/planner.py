"""The layout planner: every layout of a model on a cluster, checked by the project's own
validation, priced by the memory model (``predict.py``) and the time model (``step_time.py``),
ranked by predicted step time among those that fit.

Enumerated: TP dividing the GPUs of a node (TP never spans nodes), CP (context parallelism: 1, 2,
4, ... up to ``MAX_CP``, dividing the GPUs and splitting a row into 2c chunks; a CP group may span
nodes, its K/V traffic then priced at the inter-node bandwidth), PP dividing the layers and the GPUs,
schedule (1F1B, ZBH1; Interleaved1F1B and InterleavedZeroBubble for every VPP that divides a rank's
layers, up to ``MAX_VPP``; ZBVZeroBubble), micro-batch size 1, 2, 4, recompute none / selective /
full (uniform, 1 layer), the distributed optimizer on when DP x CP > 1 (it shards over DP x CP);
sequence parallelism on with TP > 1; beside each even pipeline split (schedules other than the V
placement's, which refuse it), the uneven one (--decoder-first/last-pipeline-num-layers) that best
balances the ranks' compute with the output layer on the last (``get_balanced_split``), where one is
better; and splits whose first rank holds fewer layers than the even share
(``get_lighter_first_splits``), kept where they lower the fullest GPU's memory below the even split's
(under 1F1B-family schedules rank 0 holds the most micro-batches in flight: p of them, the last rank
1). Constraints (``--fix tp=8``) pin any of tp, cp, pp, vpp, schedule, mbs, recompute.

When CP beats more TP or PP: each of the three divides a rank's activations by its size. TP also
divides the weights, but all-reduces [s, b, h] four times a layer and stops at a node; PP divides the
weights, but adds the bubble and keeps p micro-batches in flight on its first rank; CP keeps the whole
weights (the distributed optimizer shards their state over DP x CP) and moves only K and V, 2 ng / TP x
hn per token against TP's h (a half for Llama 3 8B and 70B's 8 groups of 128 at TP 1), in two
collectives a layer (three with recompute) against TP's four. So CP wins where activations, not weights, fill the GPU: long
sequences (docs/planning.md has the planner's figures).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from megatron_ext.config import ConfigError, JobConfig
from megatron_ext.context_parallel.rules import check_cp_comm_type, check_not_under_cp
from megatron_ext.derived import (
    get_data_parallel_size,
    get_num_microbatches,
    get_padded_vocab_size,
    get_virtual_pipeline_size,
)
from megatron_ext.planning.memory import GIB, RankMemory, get_recompute_kind, get_shape
from megatron_ext.planning.predict import count_parts, get_schedule, get_stage_layers, predict_memory
from megatron_ext.planning.step_time import Cluster, CPTraffic, StepTime, get_stage_costs, predict_step_time
from megatron_ext.training.metrics import num_floating_point_operations
from megatron_ext.validation import validate

MAX_VPP = 8
MAX_CP = 16
# The least of a row a CP rank is left with, searched by default: the NeMo / Megatron-LM tables' CP
# layouts leave 4,096 (Llama 3 8B and 405B at 8,192 with CP 2), Llama 3's 128K phase 8,192 (CP 16);
# below it the K/V traffic and the per-chunk kernel launches outgrow what CP saves.
MIN_CP_TOKENS = 4096
MICRO_BATCHES = (1, 2, 4)
RECOMPUTE = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
    "selective": dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int  # chunks per rank (1: none)
    schedule: str | None  # None: no pipelining
    micro_batch: int
    recompute: str
    distributed_optimizer: bool
    first_layers: int | None = None  # --decoder-first-pipeline-num-layers (None: even)
    last_layers: int | None = None  # --decoder-last-pipeline-num-layers
    cp: int = 1  # --context-parallel-size
    # offered for memory (``get_lighter_first_splits``), not time: ``plan`` keeps it only where it lowers
    # the fullest GPU below the even split's (not part of the layout's identity)
    lighter_first: bool = dataclasses.field(default=False, compare=False)

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags that select this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        out += ["--context-parallel-size", str(self.cp)]
        out += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp) if self.vpp > 1 else "0"]
        if self.schedule:
            out += ["--pipeline-schedule", self.schedule]
        if self.first_layers is not None:
            out += ["--decoder-first-pipeline-num-layers", str(self.first_layers)]
        if self.last_layers is not None:
            out += ["--decoder-last-pipeline-num-layers", str(self.last_layers)]
        out += ["--micro-batch-size", str(self.micro_batch)]
        # (no --no-* spelling exists for these two: over a config that sets them, a layout without them
        # needs them removed from the config, which ``get_settings_to_remove`` says)
        out += ["--sequence-parallel"] if self.tp > 1 else []
        out += ["--use-distributed-optimizer"] if self.distributed_optimizer else []
        r = RECOMPUTE[self.recompute]
        if r["recompute_granularity"]:
            out += ["--recompute-granularity", r["recompute_granularity"]]
        if r["recompute_method"]:
            out += [
                "--recompute-method",
                r["recompute_method"],
                "--recompute-num-layers",
                str(r["recompute_num_layers"]),
            ]
        return out

    def get_settings_to_remove(self, cfg: JobConfig) -> list[str]:
        """The flags set in ``cfg`` that this layout turns off and ``flags()`` cannot (they have no
        ``--no-*`` spelling): remove them from the config, or the printed flags run another layout
        (the distributed optimizer, recompute) or are refused (an uneven split with
        --account-for-*-in-pipeline-split). (--sequence-parallel needs nothing: at TP 1 it is turned
        off as Megatron-LM turns it off.)"""
        p, m = cfg.parallel, cfg.model
        uneven = self.first_layers is not None or self.last_layers is not None
        on = {
            "--use-distributed-optimizer": p.use_distributed_optimizer and not self.distributed_optimizer,
            "--recompute-activations": m.recompute_activations,
            "--recompute-granularity": m.recompute_granularity is not None and self.recompute == "none",
            "--recompute-method": m.recompute_method is not None and self.recompute != "full",
            "--recompute-num-layers": m.recompute_num_layers is not None and self.recompute != "full",
            "--account-for-embedding-in-pipeline-split": p.account_for_embedding_in_pipeline_split and uneven,
            "--account-for-loss-in-pipeline-split": p.account_for_loss_in_pipeline_split and uneven,
            "--decoder-first-pipeline-num-layers": p.decoder_first_pipeline_num_layers is not None
            and self.first_layers is None,
            "--decoder-last-pipeline-num-layers": p.decoder_last_pipeline_num_layers is not None
            and self.last_layers is None,
        }
        return [flag for flag, set_here in on.items() if set_here]

    def describe(self) -> str:
        pipe = (
            f"PP {self.pp}"
            + (f" x VPP {self.vpp}" if self.vpp > 1 else "")
            + (f" {self.schedule}" if self.schedule else "")
            + (f", first stage {self.first_layers} layers" if self.first_layers is not None else "")
            + (f", last stage {self.last_layers} layers" if self.last_layers is not None else "")
        )
        return (
            f"TP {self.tp}{f' x CP {self.cp}' if self.cp > 1 else ''} x {pipe}, micro-batch {self.micro_batch}, "
            f"recompute {self.recompute}"
            f"{', distributed optimizer' if self.distributed_optimizer else ''}"
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    dp: int
    num_microbatches: int | None  # per DP rank and step; None when the layout is invalid
    memory: RankMemory | None  # the worst pipeline rank; None when the layout is invalid
    time: StepTime | None
    problems: tuple[str, ...]  # why it does not fit or is not valid (empty: it fits)
    even_memory: float | None = None  # a lighter first stage's: the fullest GPU's bytes with the even split


def apply_layout(cfg: JobConfig, layout: Layout) -> JobConfig:
    uneven = layout.first_layers is not None or layout.last_layers is not None
    p = dataclasses.replace(
        cfg.parallel,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        num_virtual_stages_per_pipeline_rank=layout.vpp if layout.vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        pipeline_schedule=layout.schedule,
        decoder_first_pipeline_num_layers=layout.first_layers,
        decoder_last_pipeline_num_layers=layout.last_layers,
        **(
            dict(account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
            if uneven
            else {}
        ),
        sequence_parallel=layout.tp > 1,
        use_distributed_optimizer=layout.distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather and layout.distributed_optimizer,
    )
    m = dataclasses.replace(cfg.model, recompute_activations=False, recompute_modules=[], **RECOMPUTE[layout.recompute])
    t = dataclasses.replace(cfg.training, micro_batch_size=layout.micro_batch)
    return dataclasses.replace(cfg, parallel=p, model=m, training=t)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def get_head_layers(cfg: JobConfig, vocab_size: int, tp: int) -> float:
    """The output layer's FLOPs in transformer layers (Megatron-LM's count: 6 h V per token against a
    layer's, attention over the whole sequence included), with the vocabulary padded for ``tp``."""
    m = cfg.model
    job = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp))
    vocab = get_padded_vocab_size(vocab_size, job)
    total = num_floating_point_operations(m, vocab, m.seq_length, m.seq_length**2)
    head = 6.0 * m.hidden_size * vocab * m.seq_length
    return round(head / ((total - head) / m.num_layers), 2)  # TPs' paddings share one simulation


@functools.cache
def get_balanced_split(layers: int, pp: int, vpp: int, head_layers: float) -> tuple[int | None, int | None] | None:
    """(first, last) pipeline rank's layers (--decoder-first/last-pipeline-num-layers; None: that rank
    even) minimizing the busiest rank's compute, the last rank's output layer counted as ``head_layers``
    layers; None when the even split (if the layers divide) is as good. Each count a positive multiple
    of ``vpp``, the middle ranks' layers split evenly into whole chunks (megatron-core's rules)."""

    def busiest(first: int | None, last: int | None) -> float | None:
        middle_layers = layers - (first or 0) - (last or 0)
        middle_ranks = pp - (first is not None) - (last is not None)
        if middle_ranks == 0:
            per = 0
            if middle_layers or vpp > 1:
                return None
        elif middle_layers <= 0 or middle_layers % middle_ranks or (middle_layers // middle_ranks) % vpp:
            return None
        else:
            per = middle_layers // middle_ranks
        inner = [per] if pp > 2 else []  # the ranks between the first and the last
        return max([per if first is None else first, (per if last is None else last) + head_layers, *inner])

    sizes = [None, *range(vpp, layers, vpp)]
    options = [(busiest(f, la), (f is not None) + (la is not None), f, la) for f in sizes for la in sizes]
    options = sorted((o for o in options if o[0] is not None), key=lambda o: o[:2])
    if not options or options[0][1] == 0:
        return None
    even = next((o for o in options if o[1] == 0), None)
    best = options[0]
    return (best[2], best[3]) if even is None or best[0] < even[0] - 1e-9 else None


@functools.cache
def get_lighter_first_splits(layers: int, pp: int, vpp: int) -> tuple[tuple[int, int | None], ...]:
    """(first, last) pipeline rank's layers (--decoder-first/last-pipeline-num-layers; None: that rank
    as the middle ones) with the first rank ``k`` chunks of ``vpp`` layers below the even share, for
    k = 1 up to e / ((p + 1) vpp) rounded up (e the even share: under 1F1B rank 0 holds p micro-batches
    in flight and rank 1 p - 1, so past about e / (p + 1) layers moved rank 1 holds more than rank 0
    did). The k chunks go to the other ranks, within megatron-core's rules (each count a positive
    multiple of ``vpp``, the middle ranks even): spread over all of them where they divide (no
    --decoder-last-pipeline-num-layers); else the middle ranks take d = k // (p - 2) or d + 1 chunks
    each and the last rank the rest (the last holds one micro-batch in flight but also the output
    layer: the lower d for memory, the higher for time; the ranking chooses). At PP 2 the second rank
    takes them all (giving both ranks' layers is refused with VPP: megatron-core 0.16.1 needs a middle
    stage). Needs an even split (``layers`` a multiple of ``pp`` x ``vpp``) and ``pp`` > 1."""
    if pp < 2 or layers % (pp * vpp):
        return ()
    even = layers // pp
    out: list[tuple[int, int | None]] = []
    for k in range(1, max(1, -(-even // ((pp + 1) * vpp))) + 1):
        first = even - k * vpp
        if first <= 0:
            break
        if k % (pp - 1) == 0:  # k chunks over the p - 1 other ranks: the last rank is one of them
            out.append((first, None))
        if pp == 2:
            continue
        for d in sorted({k // (pp - 2), -(-k // (pp - 2))}):
            last = even + (k - (pp - 2) * d) * vpp
            if last > 0 and last != even + d * vpp:  # (equal to the middle ranks': the case above)
                out.append((first, last))
    return tuple(out)


def get_lighter_first_pipes(pipes: list[tuple], layers: int, pp: int) -> list[tuple]:
    """(vpp, schedule, (first, last)) for each even split's schedule in ``pipes`` but the V
    placement's (which refuses --decoder-first/last-pipeline-num-layers): its lighter first stages
    (``get_lighter_first_splits``) but the one already there as the time-balanced split."""
    out = []
    for vpp, schedule, split in pipes:
        if split is None and schedule != "ZBVZeroBubble":
            there = {x[2] for x in pipes if x[:2] == (vpp, schedule)}
            out += [(vpp, schedule, x) for x in get_lighter_first_splits(layers, pp, vpp) if x not in there]
    return out


def get_cp_sizes(cfg: JobConfig, gpus: int, fixed: str | None = None) -> tuple[list[int], list[str]]:
    """(the CP sizes to search, why CP is not searched): powers of two up to ``MAX_CP`` that divide the
    GPUs, split a --seq-length row into 2c chunks and leave each rank at least ``MIN_CP_TOKENS`` of it
    (``fixed``, a --fix cp=N, lifts that floor); only 1 when the config sets something context
    parallelism refuses whatever the layout (``context_parallel.rules``: attention dropout,
    --no-calculate-per-token-loss, ...), which would make every CP layout invalid."""
    seq = cfg.model.seq_length
    sizes = [c for c in (2**k for k in range(MAX_CP.bit_length())) if gpus % c == 0 and seq % (2 * c) == 0]
    if fixed is not None:
        sizes = [c for c in sizes if str(c) == fixed]
    else:
        sizes = [c for c in sizes if c == 1 or seq // c >= MIN_CP_TOKENS]
    at_two = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=2))
    refused = check_not_under_cp(at_two) + check_cp_comm_type(at_two)
    if refused:
        return [1], [p.replace("--context-parallel-size 2", "context parallelism") for p in refused]
    return sizes, []


def get_pipes(layers: int, pp: int, head_layers: float) -> list[tuple]:
    """(vpp, schedule, (first, last) or None) of every pipeline choice at ``pp`` (module docstring),
    the lighter first stages excluded (``get_lighter_first_pipes``)."""
    if pp == 1:
        return [(1, None, None)]
    split = get_balanced_split(layers, pp, 1, head_layers)
    pipes = [(1, "1F1B", None), (1, "ZBH1", None), (2, "ZBVZeroBubble", None)]
    pipes += [(1, s, split) for s in ("1F1B", "ZBH1") if split]
    for v in _divisors(layers // pp)[1:]:
        if v <= MAX_VPP:
            split = get_balanced_split(layers, pp, v, head_layers)
            for s in ("Interleaved1F1B", "InterleavedZeroBubble"):
                pipes += [(v, s, None)] + ([(v, s, split)] if split else [])
    return pipes


def enumerate_layouts(cfg: JobConfig, cluster: Cluster, fixed: dict[str, str], vocab_size: int) -> list[Layout]:
    layers = cfg.model.num_layers
    out = []
    cp_sizes = get_cp_sizes(cfg, cluster.gpus, fixed.get("cp"))[0]
    for tp, cp in itertools.product(_divisors(cluster.gpus_per_node), cp_sizes):
        head_layers = get_head_layers(cfg, vocab_size, tp)
        for pp in _divisors(layers):
            if cluster.gpus % (tp * cp * pp):
                continue
            dp = cluster.gpus // (tp * cp * pp)
            pipes = get_pipes(layers, pp, head_layers)
            offered = [(pipe, False) for pipe in pipes] + [
                (pipe, True) for pipe in get_lighter_first_pipes(pipes, layers, pp)
            ]
            for ((vpp, schedule, split), lighter), mbs, recompute in itertools.product(
                offered, MICRO_BATCHES, RECOMPUTE
            ):
                first, last = split or (None, None)
                layout = Layout(tp, pp, vpp, schedule, mbs, recompute, dp * cp > 1, first, last, cp, lighter)
                if all(
                    str(getattr(layout, k if k != "mbs" else "micro_batch")).lower() == v.lower()
                    for k, v in fixed.items()
                ):
                    out.append(layout)
    return out


def check_job(job: JobConfig, world_size: int, cuda: bool = True) -> tuple[str, ...]:
    """``validation.validate(job, world_size, cuda)``'s problems, returned rather than raised (empty:
    valid): the planning tools weigh many layouts and keep each one's reasons."""
    try:
        validate(job, world_size, cuda=cuda)
    except ConfigError as err:
        return tuple(err.problems)
    return ()


def price_job(
    job: JobConfig, cluster: Cluster, vocab_size: int, head_layers: float
) -> tuple[int, list[RankMemory], StepTime]:
    """(micro-batches per DP rank and step, each pipeline rank's predicted memory, the predicted step
    time) of a valid ``job`` on ``cluster``; ``head_layers``: ``get_head_layers`` at the job's TP."""
    p, mc, t = job.parallel, job.model, job.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp, m = get_data_parallel_size(job, cluster.gpus), get_num_microbatches(job, cluster.gpus)
    ranks = predict_memory(job, cluster.gpus, vocab_size, count_parts(job, vocab_size, tp))
    micro_batch = t.micro_batch_size * mc.seq_length
    tokens = m * dp * micro_batch
    flops = num_floating_point_operations(mc, get_padded_vocab_size(vocab_size, job), tokens, tokens * mc.seq_length)
    recompute = get_recompute_kind(job)
    if recompute == "full":
        flops *= 4 / 3
    dtype_bytes = 2 if (t.bf16 or t.fp16) else 4
    traffic = None
    if cp > 1:
        kv = get_shape(job, get_padded_vocab_size(vocab_size, job)).kv_width * dtype_bytes
        traffic = CPTraffic(cp, kv, recompute != "none", cluster.gpus_per_node % (tp * cp) != 0)
    time = predict_step_time(
        cluster,
        flops,
        micro_batch,
        mc.hidden_size,
        mc.num_layers,
        tp,
        pp,
        get_virtual_pipeline_size(job) or 1,
        dp,
        m,
        get_schedule(job) if pp > 1 else None,
        p.sequence_parallel,
        dtype_bytes,
        max(r.state.gradients for r in ranks),
        p.overlap_grad_reduce,
        get_stage_costs(get_stage_layers(job), head_layers) if pp > 1 else None,
        traffic,
    )
    return m, ranks, time


def get_memory_problems(ranks: list[RankMemory], cluster: Cluster) -> tuple[str, ...]:
    worst = max(r.total for r in ranks)
    if worst > cluster.gpu_memory_gib * GIB:
        return (f"needs {worst / GIB:.1f} GiB on its fullest GPU, {cluster.gpu_memory_gib:g} GiB available",)
    return ()


def evaluate(cfg: JobConfig, layout: Layout, cluster: Cluster, vocab_size: int, cache: dict | None = None) -> Candidate:
    """``cache``: validation results by layout without its recompute (the planner's recompute
    settings are valid for every layout: full recompute of 1 layer in uniform groups), and the output
    layer's FLOPs in layers by TP."""
    job = apply_layout(cfg, layout)
    dp = cluster.gpus // (layout.tp * layout.cp * layout.pp)
    key = dataclasses.replace(layout, recompute="none")
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = check_job(job, cluster.gpus)
    if cache[key]:
        return Candidate(layout, dp, None, None, None, cache[key])
    if ("head", layout.tp) not in cache:
        cache[("head", layout.tp)] = get_head_layers(cfg, vocab_size, layout.tp)
    m, ranks, time = price_job(job, cluster, vocab_size, cache[("head", layout.tp)])
    worst = max(ranks, key=lambda r: r.total)
    return Candidate(layout, dp, m, worst, time, get_memory_problems(ranks, cluster))


def plan(cfg: JobConfig, cluster: Cluster, vocab_size: int, fixed: dict[str, str]) -> list[Candidate]:
    """Every enumerated layout evaluated; those that fit first, by predicted step time, then by memory on
    the fullest GPU (of two equally fast layouts, the one with more headroom: recompute none and selective
    often tie in time). A lighter first stage (``Layout.lighter_first``) is evaluated only where its even
    split is valid, and kept only where it lowers the fullest GPU below the even split's, whose bytes it
    carries (``Candidate.even_memory``)."""
    cache: dict = {}
    layouts = enumerate_layouts(cfg, cluster, fixed, vocab_size)
    candidates = [evaluate(cfg, x, cluster, vocab_size, cache) for x in layouts if not x.lighter_first]
    even = {
        c.layout: c for c in candidates if c.memory is not None and not (c.layout.first_layers or c.layout.last_layers)
    }
    for layout in (x for x in layouts if x.lighter_first):
        ref = even.get(dataclasses.replace(layout, first_layers=None, last_layers=None))
        if ref is not None:  # (its even split valid: the same batch, so the same validation but for the split)
            c = evaluate(cfg, layout, cluster, vocab_size, cache)
            if c.memory is not None and c.memory.total < ref.memory.total:
                candidates.append(dataclasses.replace(c, even_memory=ref.memory.total))
    return sorted(
        candidates,
        key=lambda c: (
            bool(c.problems),
            c.time.total if c.time else float("inf"),
            c.memory.total if c.memory else float("inf"),
        ),
    )
