"""Slow-rank detection (``--log-straggler``): which ranks hold the others back, named at log steps.

One slow GPU (thermal throttling, a bad link, a noisy neighbour) slows a whole synchronous job: its
pipeline neighbours wait in P2P receives and its data-parallel peers in the gradient reduce, so
every rank's step time grows alike and the step time names no one. What differs is each rank's
*own work*: ``compute`` (the time inside megatron-core's forward and backward steps, and our
runtime's weight-gradient steps; collectives of tensor parallelism inside a layer are part of it),
the ``optimizer`` step and the ``data`` wait; the rest of the forward-backward schedule (``wait``:
P2P receives, the DP gradient reduce) is time spent waiting for others.

Invariant: a rank is named slow when its own work per step exceeds the median of its *peers* (the
other ranks of the same pipeline stage, which do the same work; all other ranks when its stage has
no other rank) by more than ``--straggler-threshold`` (0.2: 20% slower). Ranks of a stage compute
the same layers on the same shapes; ranks of different stages do not (the last stage holds the
output layer and loss), so they are not compared unless nothing else is there to compare with.

Cost: the timers are the step timers (``training/profiling.StepTimers``; on CUDA, events read once
per log step, no synchronisation per step); per log step, one all-gather of 8 numbers per rank over
the world (and once, the hostnames). Nothing runs with the flag off. Megatron-LM's own detector
(``--log-straggler`` there) reads CUDA events of its forward step and needs CUDA; this one runs on
CPUs too.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from megatron_ext.cpu_platform import get_collective_device

# ms per step of each rank, in this order: what a rank does itself, then what it waits for
OWN_PHASES = ("compute", "optimizer", "data")
ROW = ("rank", "pp_rank", "tp_rank", "dp_rank", "compute", "optimizer", "data", "forward-backward")


@dataclasses.dataclass(frozen=True)
class RankTiming:
    """One rank's place and its mean milliseconds per step over a log interval."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    compute: float
    optimizer: float
    data: float
    forward_backward: float
    node: str = "?"

    @property
    def own(self) -> float:
        """Milliseconds of its own work per step (compute + optimizer + data)."""
        return self.compute + self.optimizer + self.data

    @property
    def wait(self) -> float:
        """Milliseconds per step inside the schedule outside compute: P2P and gradient-reduce waits."""
        return max(self.forward_backward - self.compute, 0.0)

    def where(self) -> str:
        return f"rank {self.rank} (node {self.node}, pipeline stage {self.pp_rank}, DP rank {self.dp_rank}, TP rank {self.tp_rank})"


@dataclasses.dataclass(frozen=True)
class SlowRank:
    timing: RankTiming
    reference: float  # the median own work of its peers, ms per step
    peers: str  # "its stage" or "all ranks"
    phase: str  # the phase of OWN_PHASES furthest above its peers' median
    phase_excess: float  # by how many ms per step

    def describe(self) -> str:
        t, ref = self.timing, self.reference
        return (
            f"{t.where()}: {t.own:.1f} ms of own work per step vs a median {ref:.1f} of {self.peers} "
            f"(+{100.0 * (t.own / ref - 1.0):.0f}%; compute {t.compute:.1f}, optimizer {t.optimizer:.1f}, "
            f"data {t.data:.1f}; most in {self.phase}, +{self.phase_excess:.1f} ms)"
        )


def find_slow_ranks(timings: list[RankTiming], threshold: float) -> list[SlowRank]:
    """The ranks whose own work per step exceeds their peers' median by more than ``threshold``
    (a fraction: 0.2 = 20%), slowest first (pure). Peers: the other ranks of the same pipeline
    stage, or every other rank when the stage has no other; a world of one rank has no peers."""
    slow = []
    for t in timings:
        same_stage = [o for o in timings if o.pp_rank == t.pp_rank and o.rank != t.rank]
        others, peers = (
            (same_stage, "its stage") if same_stage else ([o for o in timings if o.rank != t.rank], "all ranks")
        )
        if not others:
            continue
        reference = statistics.median(o.own for o in others)
        if t.own > (1.0 + threshold) * reference:
            excess = {p: getattr(t, p) - statistics.median(getattr(o, p) for o in others) for p in OWN_PHASES}
            phase = max(OWN_PHASES, key=lambda p: excess[p])
            slow.append(SlowRank(t, reference, peers, phase, excess[phase]))
    return sorted(slow, key=lambda s: s.timing.own / max(s.reference, 1e-9), reverse=True)


def get_extremes(timings: list[RankTiming], count: int) -> tuple[list[RankTiming], list[RankTiming]]:
    """The ``count`` slowest and ``count`` fastest ranks by own work per step (pure;
    Megatron-LM's --straggler-minmax-count)."""
    slowest = sorted(timings, key=lambda t: (-t.own, t.rank))[:count]
    return slowest, sorted(timings, key=lambda t: (t.own, t.rank))[:count]


def format_straggler_report(timings: list[RankTiming], threshold: float, minmax_count: int) -> list[str]:
    """The log lines of one log step (pure)."""
    slowest, fastest = get_extremes(timings, minmax_count)

    def brief(ts: list[RankTiming]) -> str:
        return ", ".join(f"rank {t.rank} (node {t.node}, stage {t.pp_rank}, DP {t.dp_rank}) {t.own:.1f}" for t in ts)

    lines = [
        f"  stragglers: own work (compute + optimizer + data) in ms per step: slowest {brief(slowest)}; "
        f"fastest {brief(fastest)}"
    ]
    slow = find_slow_ranks(timings, threshold)
    lines += [f"  WARNING straggler: {s.describe()}" for s in slow]
    if not slow:
        lines.append(f"  stragglers: no rank more than {100.0 * threshold:.0f}% slower than its peers' median")
    return lines


class StragglerDetector:
    """The collective half: gathers every rank's timings at a log step (all ranks call ``gather``
    at the same steps) and formats the report on the logging rank."""

    def __init__(self, ctx, threshold: float, minmax_count: int):
        self.ctx, self.threshold, self.minmax_count = ctx, threshold, minmax_count
        self.nodes: list[str] | None = None  # hostnames, gathered at the first report

    def gather(self, means: dict[str, float]) -> list[RankTiming]:
        """Every rank's timings from this rank's ``means`` (ms per step of the step timers: compute,
        optimizer, data, forward-backward): one all-gather over the world."""
        ctx = self.ctx
        if self.nodes is None:
            self.nodes = [""] * ctx.world_size
            dist.all_gather_object(self.nodes, os.uname().nodename)
        row = [ctx.rank, ctx.pp_rank, ctx.tp_rank, ctx.dp_rank] + [means.get(p, 0.0) for p in ROW[4:]]
        mine = torch.tensor(row, dtype=torch.float64, device=get_collective_device(None))
        rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu().tolist()  # the log step's one copy to the host
        return [
            RankTiming(
                rank=int(r[0]),
                pp_rank=int(r[1]),
                tp_rank=int(r[2]),
                dp_rank=int(r[3]),
                compute=r[4],
                optimizer=r[5],
                data=r[6],
                forward_backward=r[7],
                node=self.nodes[int(r[0])],
            )
            for r in table
        ]

    def report(self, means: dict[str, float]) -> list[str]:
        """Collective: the report lines (on every rank; the caller logs them on one)."""
        return format_straggler_report(self.gather(means), self.threshold, self.minmax_count)
