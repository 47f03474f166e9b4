"""Slow and stopped ranks (``--log-straggler``): the rank the others waited for, named at log steps.

One slow or stopped rank holds a whole synchronous job: its pipeline neighbours wait in P2P
receives and its data-parallel peers in the gradient reduce, so every rank's step time grows alike
and the step time names no one. The rank everyone waited for is the one whose late arrival ended
their waits. Each rank measures two things of itself, and a rank is named when either held the
others up by more than ``--straggler-threshold`` (0.2) of the median step:

- **slow**: its *own work* per step, i.e. ``compute`` (megatron-core's forward and backward steps,
  our runtime's weight-gradient steps; tensor-parallel collectives inside a layer are part of it),
  the ``optimizer`` step and the ``data`` wait, exceeds the median of its *peers* (the other ranks
  of its pipeline stage, which do the same work; all other ranks when it is alone in its stage), in
  this log interval and in one of the two before (noise lasts one interval, slowness does not). On
  CPUs the time its training thread waited for a core (Linux's per-thread run delay) is not own
  work: four ranks sharing two cores would otherwise name whichever the scheduler delayed.
- **stopped**: its process did not run (SIGSTOP, a frozen or swapping host, another thread holding
  the GIL), at once or in total per step. A rank stopped while it waits in a P2P receive or a
  collective does no more own work than its peers: its wait grows exactly as theirs do, and no timer
  tells the two apart (PP2: the stopped rank waited in its receive as long as its partner waited
  for its reply). What differs is that its process did not run: ``PauseMonitor``'s thread wakes
  every 50 ms and sees a wake-up come late by the time the process was stopped (less what the
  kernel says explains it: waiting for a core, the training thread running). The step timers log
  their phase transitions, none of which can fall inside a pause, so the pause is placed in its
  phase (compute, the schedule's P2P transfers, the gradient reduce, data, optimizer, between steps).

Invariant: a rank is named only from what it measured of itself; no clock is compared across ranks.

Cost: per log step, one all-gather of 12 numbers per rank over the world (and once, the hostnames);
no synchronisation per step (the timers are the step timers, on CUDA events read once per log
step). The monitor thread wakes 20 times a second and reads two /proc files (about 1 ms of CPU per
second; no device call). Nothing runs with the flag off. Megatron-LM's own detector
(``--log-straggler`` there) times each rank's own CUDA kernels, so it cannot see a rank stopped in
a wait either. What it sees and what it does not: docs/failures.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.cpu_platform import get_collective_device

# ms per step of each rank, in this order: what a rank does itself, then what it waits for
OWN_PHASES = ("compute", "optimizer", "data")
ROW = (
    "rank",
    "pp_rank",
    "tp_rank",
    "dp_rank",
    "compute",
    "optimizer",
    "data",
    "forward-backward",
    "queued",  # ms per step of the own phases spent waiting for a core (CPUs)
    "paused",  # ms per step the process did not run, within steps
    "longest_pause",  # ms, the longest single pause
    "pause_phase",  # index in PAUSE_PHASES
)
# the step timers' phase outside their timers: within a step, between two steps, before the first
IN_STEP, BETWEEN_STEPS, STARTING = "step", "between", "starting"
# where a pause fell: the open step timer (training/profiling.StepTimers.phase)
PAUSE_PHASES = {
    "": "a step",
    "data": "the data wait",
    "forward-backward": "the schedule's P2P transfers (forward-backward, outside compute and the gradient reduce)",
    "compute": "compute (a forward or backward step)",
    "grad-reduce": "the gradient reduce (finalize_model_grads)",
    "optimizer": "the optimizer step (its collectives included)",
    IN_STEP: "the training step, between its timed parts",
    BETWEEN_STEPS: "between steps (logging, evaluation, the exit decision)",
}
# consecutive log intervals over the threshold that name a rank slow: this one and one of the 2 before
SLOW_WINDOW = 3


# ----------------------------------------------------------------------------- time off a core


class ThreadClock:
    """Seconds a thread of this process has run on a core, and waited for one (runnable, not
    running), since it started: the first two fields of Linux's ``/proc/self/task/<tid>/schedstat``
    (kernels with schedstats, which common distributions build). A stopped thread, or one blocked
    (on a lock, the GIL, a socket), does neither."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, native_id: int | None = None) -> ThreadClock | None:
        """The clock of thread ``native_id`` (default: the calling one); None where unavailable."""
        tid = threading.get_native_id() if native_id is None else native_id
        try:
            fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            return None
        clock = cls(fd)
        try:
            clock.read()
        except (OSError, ValueError, IndexError):
            clock.close()
            return None
        return clock

    def read(self) -> tuple[float, float]:
        """(seconds run, seconds waited for a core); ~1 us."""
        running, queued = os.pread(self.fd, 128, 0).split()[:2]
        return int(running) * 1e-9, int(queued) * 1e-9

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


# ----------------------------------------------------------------------------- the pause monitor


class PauseMonitor:
    """A daemon thread that measures how long this process did not run, within the training.

    It sleeps ``period_s`` at a time; a wake-up late by L was a pause of L - A, where A is the time
    it waited for a core and the training thread ran or waited for a core (``_accounted``; the
    training thread may hold the GIL: that is its own work): the process was stopped or swapped
    out, or the training thread was blocked by another thread holding the GIL. The pause fell in
    the training thread's phase at the middle of the late wake-up (``get_phase_at``: the step
    timers' phase at a monotonic time, from their log of transitions, none of which can fall inside
    a pause). Pauses of at least ``floor_s`` (a GIL hand-over takes up to 5 ms) count, except before
    the first step and during ``not_counted`` (a checkpoint save: its pickling holds the GIL for
    seconds); the longest is kept with its phase. Built on the training thread."""

    def __init__(self, get_phase_at: Callable[[float], str], period_s: float = 0.05, floor_s: float = 0.02):
        self.get_phase_at, self.period_s, self.floor_s = get_phase_at, period_s, floor_s
        self.training_clock = ThreadClock.open()
        self._lock = threading.Lock()
        self.total, self.longest, self.phase = 0.0, 0.0, ""  # since the last take
        self.saves: collections.deque[list[float]] = collections.deque(maxlen=4)  # [start, end] of recent saves
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        """Start the thread (again after ``close``)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pause-monitor", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        mine = ThreadClock.open()
        accounted, due = self._accounted(mine), time.monotonic() + self.period_s
        while not self._stop.is_set():
            time.sleep(max(0.0, due - time.monotonic()))  # (time.sleep: the cheapest wake-up, ~15 us)
            now = time.monotonic()
            accounted, before = self._accounted(mine), accounted
            paused = now - due - (accounted - before)
            if paused >= self.floor_s:
                self._record(paused, due, now)
            due = time.monotonic() + self.period_s

    def _accounted(self, mine: ThreadClock | None) -> float:
        """Seconds that explain a late wake-up other than a pause: this thread's wait for a core,
        and the training thread's time on a core or waiting for one (it may hold the GIL: its own
        work). 0 where the clocks are unavailable."""
        out = mine.read()[1] if mine is not None else 0.0
        return out + sum(self.training_clock.read()) if self.training_clock is not None else out

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """Pauses overlapping this are not counted (a checkpoint save)."""
        span = [time.monotonic(), float("inf")]
        self.saves.append(span)
        try:
            yield
        finally:
            span[1] = time.monotonic()

    def _record(self, paused_s: float, due: float, now: float) -> None:
        """One pause, between the wake-up due at ``due`` and the one at ``now``. The middle of the
        two was inside it unless the GIL hand-over before it, or the wake-up after it, took half
        of it (a few ms against at least ``floor_s``): the training thread's phase then is where
        it fell (the transitions after it came after ``now`` - a few ms)."""
        if any(start <= now and due <= end for start, end in list(self.saves)):
            return
        phase = self.get_phase_at((due + now) / 2)
        if phase == STARTING:
            return
        with self._lock:
            self.total += paused_s
            if paused_s > self.longest:
                self.longest, self.phase = paused_s, phase

    def take(self) -> tuple[float, float, str]:
        """(seconds paused in all, the longest pause, its phase) since the last take; resets."""
        with self._lock:
            out = self.total, self.longest, self.phase
            self.total, self.longest, self.phase = 0.0, 0.0, ""
        return out

    def close(self, timeout_s: float = 0.2) -> None:
        """Stop the thread (at its next wake-up; it is a daemon either way)."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)


# ----------------------------------------------------------------------------- the verdicts (pure)


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
    queued: float = 0.0  # of compute + optimizer + data, waiting for a core
    paused: float = 0.0  # ms per step not running
    longest_pause: float = 0.0  # ms
    pause_phase: str = ""  # a key of PAUSE_PHASES

    @property
    def own(self) -> float:
        """Milliseconds of its own work per step (compute + optimizer + data, less waiting for a core)."""
        return max(self.compute + self.optimizer + self.data - self.queued, 0.0)

    @property
    def wait(self) -> float:
        """Milliseconds per step inside the schedule outside compute: P2P and gradient-reduce waits."""
        return max(self.forward_backward - self.compute, 0.0)

    @property
    def step(self) -> float:
        """Milliseconds per step: data, forward-backward and optimizer."""
        return self.data + self.forward_backward + self.optimizer

    def where(self) -> str:
        return f"rank {self.rank} (node {self.node}, pipeline stage {self.pp_rank}, DP rank {self.dp_rank}, TP rank {self.tp_rank})"

    def pause_where(self) -> str:
        return PAUSE_PHASES.get(self.pause_phase, self.pause_phase)


@dataclasses.dataclass(frozen=True)
class SlowRank:
    timing: RankTiming
    reference: float  # the median own work of its peers, ms per step
    peers: str  # "its stage" or "all ranks"
    phase: str  # the phase of OWN_PHASES furthest above its peers' median
    phase_excess: float  # by how many ms per step
    step: float  # the median step of all ranks, ms

    def describe(self) -> str:
        t, ref = self.timing, self.reference
        return (
            f"{t.where()}: {t.own:.1f} ms of own work per step vs a median {ref:.1f} of {self.peers} "
            f"(+{100.0 * (t.own / ref - 1.0):.0f}%, {100.0 * (t.own - ref) / self.step:.0f}% of the median step "
            f"{self.step:.1f}; compute {t.compute:.1f}, optimizer {t.optimizer:.1f}, data {t.data:.1f}"
            + (f", waiting for a core {t.queued:.1f} (not counted)" if t.queued else "")
            + f"; most in {self.phase}, +{self.phase_excess:.1f} ms)"
        )


@dataclasses.dataclass(frozen=True)
class StoppedRank:
    timing: RankTiming
    reference: float  # the median step of all ranks, ms

    def describe(self) -> str:
        t, ref = self.timing, self.reference
        return (
            f"{t.where()} stopped: it did not run for {t.longest_pause:.0f} ms at once ({t.paused:.0f} ms per "
            f"step in all; {100.0 * t.longest_pause / ref:.0f}% of the median step, {ref:.0f} ms) in "
            f"{t.pause_where()}; the ranks exchanging with it waited for it (SIGSTOP, a frozen or "
            f"swapping host, or another of its threads holding the GIL)"
        )


def find_slow_ranks(timings: list[RankTiming], threshold: float, before: set[int] | None = None) -> list[SlowRank]:
    """The ranks whose own work per step exceeds their peers' median by more than ``threshold``
    times the median step of all ranks (0.2: a fifth of a step), slowest first (pure). Peers: the
    other ranks of the same pipeline stage, or every other rank when the stage has no other; a
    world of one rank has no peers. ``before``: when given, only the ranks in it (those over the
    threshold in a recent interval). Own work is part of the step, so such a rank's own work also
    exceeds its peers' by more than ``threshold`` of theirs."""
    if not timings:
        return []
    step = statistics.median(t.step for t in timings)
    slow = []
    for t in timings:
        same_stage = [o for o in timings if o.pp_rank == t.pp_rank and o.rank != t.rank]
        others, peers = (
            (same_stage, "its stage") if same_stage else ([o for o in timings if o.rank != t.rank], "all ranks")
        )
        if not others or (before is not None and t.rank not in before):
            continue
        reference = statistics.median(o.own for o in others)
        if t.own - reference > threshold * step:
            excess = {p: getattr(t, p) - statistics.median(getattr(o, p) for o in others) for p in OWN_PHASES}
            phase = max(OWN_PHASES, key=lambda p: excess[p])
            slow.append(SlowRank(t, reference, peers, phase, excess[phase], step))
    return sorted(slow, key=lambda s: s.timing.own / max(s.reference, 1e-9), reverse=True)


def find_stopped_ranks(timings: list[RankTiming], threshold: float) -> list[StoppedRank]:
    """The ranks that did not run, within steps, for more than ``threshold`` times the median step
    of all ranks, at once or in total per step; longest first (pure)."""
    if not timings:
        return []
    reference = statistics.median(t.step for t in timings)
    limit = threshold * reference
    stopped = [StoppedRank(t, reference) for t in timings if max(t.longest_pause, t.paused) > limit > 0.0]
    return sorted(stopped, key=lambda s: s.timing.longest_pause, reverse=True)


def get_extremes(timings: list[RankTiming], count: int) -> tuple[list[RankTiming], list[RankTiming]]:
    """The ``count`` slowest and ``count`` fastest ranks by own work per step (pure;
    Megatron-LM's --straggler-minmax-count)."""
    slowest = sorted(timings, key=lambda t: (-t.own, t.rank))[:count]
    return slowest, sorted(timings, key=lambda t: (t.own, t.rank))[:count]


def format_straggler_report(
    timings: list[RankTiming], threshold: float, minmax_count: int, before: set[int] | None = None
) -> list[str]:
    """The log lines of one log step (pure); ``before`` as ``find_slow_ranks``'s."""
    slowest, fastest = get_extremes(timings, minmax_count)

    def brief(ts: list[RankTiming]) -> str:
        return ", ".join(f"rank {t.rank} (node {t.node}, stage {t.pp_rank}, DP {t.dp_rank}) {t.own:.1f}" for t in ts)

    lines = [
        f"  stragglers: own work (compute + optimizer + data) in ms per step: slowest {brief(slowest)}; "
        f"fastest {brief(fastest)}"
    ]
    stopped = find_stopped_ranks(timings, threshold)
    named = {s.timing.rank for s in stopped}
    slow = [s for s in find_slow_ranks(timings, threshold, before) if s.timing.rank not in named]
    lines += [f"  WARNING straggler: {s.describe()}" for s in stopped]
    lines += [f"  WARNING straggler: {s.describe()}" for s in slow]
    if not (slow or stopped):
        lines.append(f"  stragglers: no rank held the others up by more than {100.0 * threshold:.0f}% of a step")
    return lines


# ----------------------------------------------------------------------------- the collective half


class StragglerDetector:
    """Gathers every rank's timings at a log step (all ranks call ``report`` at the same steps) and
    formats the report; owns this rank's ``PauseMonitor``. ``timers``: the run's step timers (their
    phase places each pause; their per-step counts of waiting for a core, ``queued_means``)."""

    def __init__(self, ctx: Any, threshold: float, minmax_count: int, timers: Any = None):  # profiling.StepTimers
        self.ctx, self.threshold, self.minmax_count, self.timers = ctx, threshold, minmax_count, timers
        self.nodes: list[str] | None = None  # hostnames, gathered at the first report
        self.recent: collections.deque[set[int]] = collections.deque(maxlen=SLOW_WINDOW - 1)
        self.monitor = PauseMonitor(timers.get_phase_at if timers is not None else lambda t: IN_STEP)

    def gather(self, means: dict[str, float]) -> list[RankTiming]:
        """Every rank's timings from this rank's ``means`` (ms per step of the step timers: compute,
        optimizer, data, forward-backward) and its pauses: one all-gather over the world."""
        ctx = self.ctx
        if self.nodes is None:
            self.nodes = [""] * ctx.world_size
            dist.all_gather_object(self.nodes, os.uname().nodename)
        timers = self.timers
        steps = max(timers.reported_steps, 1) if timers is not None else 1
        queued = timers.queued_means if timers is not None else {}
        total_s, longest_s, phase = self.monitor.take()
        row = [ctx.rank, ctx.pp_rank, ctx.tp_rank, ctx.dp_rank] + [means.get(p, 0.0) for p in ROW[4:8]]
        row += [sum(queued.get(p, 0.0) for p in OWN_PHASES), 1000.0 * total_s / steps, 1000.0 * longest_s]
        row.append(list(PAUSE_PHASES).index(phase) if phase in PAUSE_PHASES else 0)
        mine = torch.tensor(row, dtype=torch.float64, device=get_collective_device(None))
        rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu().tolist()  # the log step's one copy to the host
        return [build_rank_timing(r, self.nodes[int(r[0])]) for r in table]

    def report(self, means: dict[str, float]) -> list[str]:
        """Collective: the report lines (on every rank; the caller logs them on one)."""
        self.monitor.start()  # (again, when the run is trained again after ``close``)
        timings = self.gather(means)
        over = {s.timing.rank for s in find_slow_ranks(timings, self.threshold)}
        before = set().union(*self.recent)
        self.recent.append(over - {s.timing.rank for s in find_stopped_ranks(timings, self.threshold)})
        return format_straggler_report(timings, self.threshold, self.minmax_count, before)

    def close(self) -> None:
        self.monitor.close()


def build_rank_timing(row: list[float], node: str) -> RankTiming:
    """A gathered row (``ROW``'s order) as a RankTiming."""
    ints = [int(x) for x in row[:4]]
    phase = list(PAUSE_PHASES)[int(row[11])] if 0 <= int(row[11]) < len(PAUSE_PHASES) else ""
    return RankTiming(*ints, *row[4:8], node, *row[8:11], phase)
