"""Per-rank heartbeats in the job's key-value store: where each rank stands and whether it still
makes progress, so that a rank whose watchdog fires names the rank that stopped, not the ones that
wait behind it.

What a rank publishes (``Heartbeat``: one small JSON value under ``megatron_ext/heartbeat/<rank>``):
its identity (rank, pipeline stage, TP and DP rank, host), where its training thread is (phase:
``step``, ``eval``, ``save`` or ``between``; iteration; evaluation batch; micro-batch and model
chunk), and

- ``seq``: publications so far. It moves as long as the process and its heartbeat thread live;
- ``progress``: the training thread's progress events (a phase entered, a micro-batch's forward
  step). It stops when the thread stops, whether it is stuck or waits for another rank;
- ``idle_s``: seconds since the last progress event, on this rank's own monotonic clock;
- ``waiting``: where the training thread waits for other ranks (inside torch.distributed's
  collective and P2P functions, megatron-core's pipeline P2P, or a communication handle's
  ``.wait()``), read from a sample of its Python stack; empty while it computes. A training thread
  waiting on a thread of its own (data prefetch, checkpoint writer) waits for other ranks when that
  thread does.

Invariants:
- The training thread only stores a few attributes of ``StepProgress`` (no lock, no store call, no
  collective, no device sync). A daemon thread publishes at most once per ``interval_s`` (and once
  more as the training thread leaves start-up, so that no heartbeat of a training rank says
  "start-up") on its own store connection (``store.clone()``), with a short timeout: the step never waits on the store,
  and store calls of other threads never queue behind it. It never raises and never delays exit.
- Verdicts compare each rank only with itself, across two reads ``1.5 x interval_s`` apart: no wall
  clock is compared across hosts, so clock skew between nodes does not matter (``classify``).

Verdicts: *missing* (no heartbeat at all: the rank died before its first or never started),
*closed* (it stopped publishing on purpose: training ended or is being torn down), *silent* (``seq``
did not move: process dead, frozen holding the GIL, or heartbeat thread gone), *progressing*
(``progress`` moved, or its last progress is recent), *waiting* (no progress, waits for other ranks)
and *stopped* (no progress and not waiting for another rank: computing, sleeping, reading a file,
holding a lock: the rank that holds the others up).

Where the store lives: under torchrun, in the agent (``TORCHELASTIC_USE_AGENT_STORE``); without it,
in rank 0's process. If that process is gone, every read fails and the report says so; the store
host lingers briefly after its own report so that the other ranks can still read theirs.

Limits: on GPUs a collective is asynchronous on the host, so a rank whose GPU waits in NCCL may be
sampled in a device synchronisation and look *stopped*; NCCL's flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``) says which collective each GPU waits in.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import linecache
import os
import sys
import threading
import time
from typing import Any

KEY_PREFIX = "megatron_ext/heartbeat/"
PHASES = {
    "starting": "start-up",
    "step": "the training step",
    "eval": "an evaluation batch",
    "save": "a checkpoint save",
    "between": "between steps",
    "closed": "closed",
}
# Files whose functions block on other ranks (their callers' frames are what we see otherwise).
COMMUNICATION_FILES = ("torch/distributed/distributed_c10d.py", "megatron/core/pipeline_parallel/p2p_communication.py")
# Code whose ``handle.wait()`` waits on a communication (overlapped schedules, DDP bucket reductions,
# our pipeline runtime's P2P receives and sends).
HANDLE_WAIT_ROOTS = ("/torch/", "/megatron/", "/megatron_ext/pipeline/p2p.py")
# A thread blocked here waits on another thread of its own process (queue, lock, join).
LOCAL_WAIT_FILES = ("/threading.py", "/queue.py")


@dataclasses.dataclass
class StepProgress:
    """Where the training thread is. Written by that thread only, with plain attribute stores; the
    heartbeat and watchdog threads read it without a lock (a torn read mixes two neighbouring
    events, which a report tolerates). ``count`` and ``at`` (monotonic seconds) change with every
    progress event."""

    iteration: int = 0
    microbatch: int | None = None
    chunk: int | None = None
    phase: str = "starting"
    batch: int | None = None  # the evaluation batch, in an evaluation
    count: int = 0
    at: float = dataclasses.field(default_factory=time.monotonic)

    def enter(self, phase: str, iteration: int, batch: int | None = None) -> None:
        """A new phase (one of ``PHASES``) begins: a progress event."""
        self.phase, self.iteration, self.batch = phase, iteration, batch
        self.microbatch = self.chunk = None
        self.count += 1
        self.at = time.monotonic()

    def leave(self) -> None:
        """The phase ended (a progress event); its last micro-batch stays recorded (reports omit it)."""
        self.phase = "between"
        self.count += 1
        self.at = time.monotonic()

    def record_microbatch(self, microbatch: int, chunk: int) -> None:
        """A micro-batch's forward step begins on a model chunk: a progress event (~0.3 us)."""
        self.microbatch, self.chunk = microbatch, chunk
        self.count += 1
        self.at = time.monotonic()


@dataclasses.dataclass
class Heartbeat:
    """One rank's published state (see the module docstring); unknown keys are ignored when read,
    so that a later reader (slow-rank detection) may add fields."""

    rank: int
    host: str = ""
    pp_rank: int = 0
    pp_size: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    cp_size: int = 1
    seq: int = 0
    phase: str = "starting"
    iteration: int = 0
    batch: int | None = None
    microbatch: int | None = None
    chunk: int | None = None
    progress: int = 0
    idle_s: float = 0.0
    waiting: str = ""
    at: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def describe_rank(self) -> str:
        cp = f", context-parallel rank {self.cp_rank}" if self.cp_size > 1 else ""
        return (
            f"rank {self.rank} (pipeline stage {self.pp_rank} of {self.pp_size}, tensor rank {self.tp_rank}{cp}, "
            f"data-parallel rank {self.dp_rank}, host {self.host})"
        )

    def describe_position(self) -> str:
        return describe_position(self.phase, self.iteration, self.batch, self.microbatch, self.chunk)


def describe_position(phase: str, iteration: int, batch: int | None, microbatch: int | None, chunk: int | None) -> str:
    """ "the training step of iteration 7, micro-batch 3 of model chunk 1" and the like."""
    if phase == "step":
        text = f"the training step of iteration {iteration}"
    elif phase == "eval":
        text = f"evaluation batch {batch} after iteration {iteration}"
    elif phase == "save":
        text = f"the checkpoint save after iteration {iteration}"
    elif phase == "between":
        text = f"between steps after iteration {iteration}"
    else:
        text = PHASES.get(phase, phase)
    if microbatch is not None and phase != "between":
        text += f", micro-batch {microbatch} of model chunk {chunk}"
    return text


# ----------------------------------------------------------------------------- stack samples


def describe_frame(frame: Any) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _path(frame: Any) -> str:
    return frame.f_code.co_filename.replace(os.sep, "/")


def get_wait(frame: Any) -> str:
    """Where a thread whose innermost Python frame is ``frame`` waits for other ranks, or ''."""
    path = _path(frame)
    if path.endswith(COMMUNICATION_FILES):
        return describe_frame(frame)
    if any(root in path for root in HANDLE_WAIT_ROOTS):
        if ".wait(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            return describe_frame(frame)
    return ""


def sample_thread(thread_id: int, ignore: tuple[int, ...] = ()) -> tuple[str, str]:
    """(waiting, at) of thread ``thread_id``: where it waits for other ranks ('' if it does not)
    and its innermost frame outside the threading/queue plumbing. A thread blocked on a thread of
    its own process waits for other ranks when one of its other threads (not ``ignore``) does."""
    frames = sys._current_frames()  # CPython's documented sampler: a dict, no thread is paused
    frame = frames.get(thread_id)
    if frame is None:
        return "", "(the thread has ended)"
    waiting = get_wait(frame)
    local_wait = _path(frame).endswith(LOCAL_WAIT_FILES)
    at = frame
    while at.f_back is not None and _path(at).endswith(LOCAL_WAIT_FILES):
        at = at.f_back
    if not waiting and local_wait:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, other in frames.items():
            if ident != thread_id and ident not in ignore and get_wait(other):
                waiting = f"{get_wait(other)} (thread {names.get(ident, ident)})"
                break
    return waiting, describe_frame(at)


# ----------------------------------------------------------------------------- the store


def get_store_host() -> tuple[str, bool]:
    """(who hosts the job's store, whether this process does). torchrun's agent hosts it when it
    says so (``TORCHELASTIC_USE_AGENT_STORE``); otherwise rank 0 does (torch's env:// and tcp://)."""
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"torchrun's agent at {address}", False
    return f"rank 0 at {address}", os.environ.get("RANK", "0") == "0"


def open_store_connection(timeout_s: float) -> Any:
    """A connection of its own to the job's store, whose calls give up after ``timeout_s``: the
    default process group's store cloned, else a new TCPStore client to MASTER_ADDR:MASTER_PORT
    (keys prefixed with torchrun's run id and attempt, as the process group's are). Raises when
    neither works. Call it while the store host is alive (at start-up): connecting retries for
    the process group's whole timeout."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    try:  # private in torch 2.11-2.13: compat.py "process-group-store"
        store = dist.distributed_c10d._get_default_store().clone()
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store = dist.PrefixStore(f"megatron_ext/{attempt}", client)
    store.set_timeout(timeout)
    return store


def read_heartbeats(store: Any, world_size: int) -> dict[int, Heartbeat]:
    """Every published heartbeat, by rank (ranks that never published are absent): one ``check``
    and one ``multi_get`` when every rank has published, one ``check`` per rank otherwise."""
    keys = [f"{KEY_PREFIX}{rank}" for rank in range(world_size)]
    present = keys if store.check(keys) else [key for key in keys if store.check([key])]
    values = store.multi_get(present) if present else []
    beats = (Heartbeat.from_json(value) for value in values)
    return {beat.rank: beat for beat in beats}


# ----------------------------------------------------------------------------- publishing


class HeartbeatPublisher:
    """A daemon thread that publishes this rank's ``Heartbeat`` every ``interval_s`` (after a
    failed publication, up to 8 x less often). ``identity``: rank, host, pp_rank, pp_size, tp_rank,
    dp_rank (cp_rank, cp_size under context parallelism). The thread that builds it is the training thread it samples. ``publishes`` and
    ``publish_s`` (their total cost in this thread) are kept for measurement."""

    START_POLL_S = 0.05  # how soon the end of start-up is published (an attribute read per poll)

    def __init__(self, store: Any, progress: StepProgress, identity: dict[str, Any], interval_s: float):
        self.store, self.progress, self.interval_s = store, progress, interval_s
        self.identity = identity
        self.key = f"{KEY_PREFIX}{identity['rank']}"
        self.training_thread = threading.get_ident()
        self.publishes, self.publish_s, self.failures = 0, 0.0, 0
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Publish once from this thread (so a rank that died later still has a heartbeat), then
        from the daemon thread."""
        self.publish()
        self._thread.start()

    def sample(self) -> Heartbeat:
        p = self.progress
        waiting, at = sample_thread(self.training_thread, ignore=(threading.get_ident(),))
        phase = "closed" if self._stop.is_set() else p.phase
        return Heartbeat(
            seq=self.publishes + 1,
            phase=phase,
            iteration=p.iteration,
            batch=p.batch,
            microbatch=p.microbatch,
            chunk=p.chunk,
            progress=p.count,
            idle_s=round(time.monotonic() - p.at, 3),
            waiting=waiting,
            at=at,
            **self.identity,
        )

    def publish(self) -> bool:
        """One publication; False (the error kept) when the store did not take it."""
        start = time.perf_counter()
        try:
            self.store.set(self.key, self.sample().to_json())
        except Exception as err:  # noqa: BLE001 - a store gone must never end the training thread
            self.failures += 1
            self.last_error = err
            return False
        finally:
            self.publish_s += time.perf_counter() - start
        self.publishes += 1
        return True

    def _run(self) -> None:
        self._wait_out_start_up()
        delay = self.interval_s
        while not self._stop.wait(delay):
            delay = self.interval_s if self.publish() else min(8 * delay, 8 * self.interval_s)
        self.publish()  # phase "closed": this rank stopped publishing on purpose, it did not die

    def _wait_out_start_up(self) -> None:
        """Publish on the interval while the training thread is in start-up, and once more as soon as
        it leaves it (polled every ``START_POLL_S``): a rank that froze or died in its first seconds of
        training is reported where it was, not "last seen in start-up" by a heartbeat published
        before training began (up to ``interval_s``, 10 s at long limits, before the first step)."""
        next_at = time.monotonic() + self.interval_s
        while self.progress.phase == "starting":
            if self._stop.wait(min(self.START_POLL_S, max(0.0, next_at - time.monotonic()))):
                return
            if time.monotonic() >= next_at:
                self.publish()
                next_at = time.monotonic() + self.interval_s
        self.publish()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop publishing (the thread's last publication says so); waits at most ``timeout_s`` (a
        publication in flight ends by the store's timeout; the thread is a daemon either way)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class RankVerdict:
    rank: int
    verdict: str  # missing | closed | silent | progressing | waiting | stopped
    heartbeat: Heartbeat | None


def classify(
    first: dict[int, Heartbeat], second: dict[int, Heartbeat], world_size: int, recent_s: float
) -> list[RankVerdict]:
    """Each rank's verdict from two reads of the heartbeats (``second`` at least one publication
    interval after ``first``); ``recent_s``: a last progress event younger than this counts as
    progress (a rank between two events of a normal step). Pure."""
    out = []
    for rank in range(world_size):
        beat, before = second.get(rank), first.get(rank)
        if beat is None:
            verdict = "missing"
        elif beat.phase == "closed":
            verdict = "closed"
        elif before is not None and beat.seq == before.seq:
            verdict = "silent"
        elif before is None or beat.progress != before.progress or beat.idle_s < recent_s:
            verdict = "progressing"
        else:
            verdict = "waiting" if beat.waiting else "stopped"
        out.append(RankVerdict(rank, verdict, beat))
    return out


def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {text}"


def format_verdicts(verdicts: list[RankVerdict]) -> list[str]:
    """The report's lines: each stopped and silent rank in full (the culprits), the ranks that wait
    or progress grouped by where they are."""
    by = {
        name: [v for v in verdicts if v.verdict == name]
        for name in ("stopped", "silent", "missing", "waiting", "progressing", "closed")
    }
    lines = []
    if by["stopped"]:
        lines.append("  STOPPED (no progress, not waiting for another rank): the ranks holding the others up:")
        lines += [
            f"    {v.heartbeat.describe_rank()}: {v.heartbeat.describe_position()}, no progress for "
            f"{v.heartbeat.idle_s:.1f} s, at {v.heartbeat.at}"
            for v in by["stopped"]
        ]
    if by["silent"] or by["missing"]:
        lines.append("  NO HEARTBEAT (process dead, or frozen holding the GIL):")
        lines += [
            f"    {v.heartbeat.describe_rank()}: last seen in {v.heartbeat.describe_position()}, at {v.heartbeat.at}"
            for v in by["silent"]
        ]
        if by["missing"]:
            lines.append(f"    {format_ranks([v.rank for v in by['missing']])}: never published one")
    for name, label in (("waiting", "waiting for other ranks"), ("progressing", "still progressing")):
        groups: dict[tuple[str, str], list[int]] = {}
        for v in by[name]:
            where = v.heartbeat.describe_position().split(", micro-batch")[0]
            groups.setdefault((where, v.heartbeat.waiting), []).append(v.rank)
        for (where, waiting), ranks in sorted(groups.items(), key=lambda item: item[1][0]):
            lines.append(f"  {label}: {format_ranks(ranks)}, in {where}" + (f", in {waiting}" if waiting else ""))
    if by["closed"]:
        lines.append(
            f"  closed their heartbeat (training ended, or shutting down): "
            f"{format_ranks([v.rank for v in by['closed']])}"
        )
    if not (by["stopped"] or by["silent"] or by["missing"]):
        lines.append(
            "  no rank stopped outside a communication: each one waits for another (a collective some "
            "rank never entered, or a network fault); see the ranks' stacks"
        )
    return lines


class HeartbeatBoard:
    """This rank's publisher, plus a reader connection of its own for reports.

    Every rank of a stalled job times out within about a second of the others. Up to
    ``ALL_COLLECT_WORLD`` ranks, each reads every heartbeat (two reads of ~300 bytes per rank); in a
    larger world only the first ``COLLECTORS`` ranks to time out do (one atomic ``add`` decides), so
    that the store host (torchrun's agent) is not asked for world_size^2 heartbeats at once."""

    ALL_COLLECT_WORLD = 64
    COLLECTORS = 4
    CLAIM_KEY = "megatron_ext/heartbeat_collectors"

    def __init__(self, publisher: HeartbeatPublisher, reader: Any, world_size: int, store_host: str, hosts_store: bool):
        self.publisher, self.reader, self.world_size = publisher, reader, world_size
        self.store_host, self.hosts_store = store_host, hosts_store

    @property
    def read_gap_s(self) -> float:
        """Between the two reads of a report: every live rank publishes at least once."""
        return 1.5 * self.publisher.interval_s

    def collect(self) -> list[str]:
        """The report's lines on every rank (two reads ``read_gap_s`` apart); one line saying why
        when the store does not answer."""
        try:
            if self.world_size > self.ALL_COLLECT_WORLD and self.reader.add(self.CLAIM_KEY, 1) > self.COLLECTORS:
                return [
                    f"  (in a world of {self.world_size} ranks the first {self.COLLECTORS} ranks to time out read "
                    f"every rank's heartbeat: their reports name the ranks that stopped)"
                ]
            first = read_heartbeats(self.reader, self.world_size)
            time.sleep(self.read_gap_s)
            second = read_heartbeats(self.reader, self.world_size)
        except Exception as err:  # noqa: BLE001 - the report goes on with what this rank knows
            return [
                f"  the other ranks' heartbeats are unavailable: the store ({self.store_host}) did not answer "
                f"({type(err).__name__}: {err}); if it is rank 0's process, rank 0 may have exited"
            ]
        return format_verdicts(classify(first, second, self.world_size, recent_s=2 * self.publisher.interval_s))

    def close(self) -> None:
        self.publisher.close()


def get_heartbeat_interval(limits_s: list[float]) -> float:
    """A twentieth of the shortest limit, within [0.1 s, 10 s]: fresh enough for a report (a rank
    reads two publications of every other), rare enough for one store serving thousands of ranks
    (at most 10 writes per rank per second, 0.1 at long limits)."""
    return min(10.0, max(0.1, min(limits_s) / 20))


def build_heartbeat_board(
    progress: StepProgress, identity: dict[str, Any], world_size: int, interval_s: float, store_timeout_s: float = 5.0
) -> HeartbeatBoard:
    """Open two store connections (publisher, reader), publish once and start publishing."""
    store_host, hosts_store = get_store_host()
    publisher = HeartbeatPublisher(open_store_connection(store_timeout_s), progress, identity, interval_s)
    board = HeartbeatBoard(publisher, open_store_connection(store_timeout_s), world_size, store_host, hosts_store)
    publisher.start()
    return board
