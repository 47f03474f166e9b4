"""Hang and orphan guards: no worker outlives its launcher, no two jobs write one --save, no
stalled step, evaluation or save waits silently for the collective timeout.

- ``apply_parent_death_signal``: the kernel sends SIGKILL to this worker when its parent (the
  torchrun agent) dies, even by kill -9 (Linux ``prctl(PR_SET_PDEATHSIG)``). torchrun starts its
  workers in a new session, so without this a killed agent leaves them training and saving into
  ``--save`` while a relaunch starts writing there too.
- ``lock_save_dir``: rank 0 holds an exclusive ``flock`` on ``--save/.megatron_ext.lock`` for the
  job's life; the kernel releases it when the process dies (kill -9 included), so a relaunch is
  never blocked by a dead job, and a second live job is refused at start-up. ``flock`` is reliable
  on local file systems and on NFSv4 and Lustre with locking enabled; where the file system ignores
  it (some NFSv3 mounts without lockd), the lock protects nothing: see docs/failures.md.
- ``StepWatchdog`` (``--step-timeout-minutes``, ``--save-timeout-minutes``): when a training step,
  an evaluation batch (both the step limit) or a checkpoint save (the save limit) lasts longer, the
  rank prints where it is (rank, pipeline stage, iteration, the micro-batch its forward step
  recorded), every rank whose progress stopped outside a communication, read from the ranks'
  heartbeats (``heartbeat.py``), and every thread's Python stack, then exits 1 so the launcher
  ends the job, instead of waiting for the collective timeout (``--distributed-timeout-minutes``)
  whose message names no peer.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from megatron_ext.config import ConfigError
from megatron_ext.heartbeat import HeartbeatBoard, StepProgress, describe_position

LOCK_NAME = ".megatron_ext.lock"
_PR_SET_PDEATHSIG = 1


def apply_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; returns whether it
    could (Linux only). Exits at once if the parent is already gone (the race before the call)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


def lock_save_dir(path: str | None) -> TextIO | None:
    """Hold an exclusive lock on ``path``'s lock file (keep the returned file open for the job's
    life); ConfigError naming --save when another live job holds it."""
    if not path:
        return None
    import fcntl

    os.makedirs(path, exist_ok=True)
    handle = open(os.path.join(path, LOCK_NAME), "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            [
                f"--save {path} is in use by a live job ({holder} holds {LOCK_NAME}): wait for it "
                f"to end, stop it, or give this job another --save"
            ]
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


# The flag that sets each watched phase's limit (an evaluation batch is timed like a step).
LIMIT_FLAGS = {"step": "--step-timeout-minutes", "eval": "--step-timeout-minutes", "save": "--save-timeout-minutes"}
_PHASE_TEXT = {"step": "a training step", "eval": "an evaluation batch", "save": "a checkpoint save"}


class StepWatchdog:
    """A daemon thread that ends a rank stalled in a watched phase with a report (see the module
    docstring). ``timeout_s`` limits a training step and an evaluation batch, ``save_timeout_s`` a
    save; None leaves that phase unwatched. ``heartbeats`` (None: this rank's view only) names the
    stopped ranks. The training thread arms it with ``begin``/``end`` or ``watch``: two attribute
    stores, no lock."""

    def __init__(
        self,
        timeout_s: float | None,
        describe: Callable[[], str],
        progress: StepProgress,
        on_timeout: Callable[[str], None] | None = None,
        out: TextIO | None = None,
        *,
        save_timeout_s: float | None = None,
        heartbeats: HeartbeatBoard | None = None,
    ):
        self.timeout_s, self.describe, self.progress, self.heartbeats = timeout_s, describe, progress, heartbeats
        self.limits = {"step": timeout_s, "eval": timeout_s, "save": save_timeout_s}
        self.on_timeout = on_timeout or (lambda report: os._exit(1))
        self.out = out or sys.stderr
        # (phase, its start on the monotonic clock, its limit) while a watched phase runs: one
        # attribute, so that the watchdog thread never reads a start with another phase's limit
        self._armed: tuple[str, float, float] | None = None
        self._poll_s = min(1.0, min(s for s in self.limits.values() if s) / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    @property
    def _started(self) -> float | None:
        return self._armed[1] if self._armed is not None else None

    def begin(self, phase: str, iteration: int, batch: int | None = None) -> None:
        """``phase`` (step, eval, save) starts; timed when its limit is set."""
        self.progress.enter(phase, iteration, batch)
        limit = self.limits.get(phase)
        self._armed = (phase, time.monotonic(), limit) if limit else None

    def end(self) -> None:
        self._armed = None
        self.progress.leave()

    @contextlib.contextmanager
    def watch(self, phase: str, iteration: int, batch: int | None = None) -> Iterator[None]:
        """Time ``phase`` for the block (disarmed when it raises too: left armed, the watchdog would
        report a stall of a phase no longer running)."""
        self.begin(phase, iteration, batch)
        try:
            yield
        finally:
            self.end()

    def step_started(self, iteration: int) -> None:
        self.begin("step", iteration)

    def step_finished(self) -> None:
        self.end()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.heartbeats is not None:
            self.heartbeats.close()

    def report(self, elapsed: float, phase: str = "step", limit: float | None = None) -> str:
        """The report block: this rank, then (with heartbeats) every rank's verdict."""
        p = self.progress
        limit = limit if limit is not None else self.limits.get(phase) or 0.0
        last = describe_position(p.phase, p.iteration, p.batch, p.microbatch, p.chunk)
        lines = [
            f"stall watchdog: {self.describe()} has spent {elapsed:.1f} s in {_PHASE_TEXT.get(phase, phase)} "
            f"(iteration {p.iteration}; {LIMIT_FLAGS.get(phase, '?')} {limit / 60:g}); last recorded: {last}."
        ]
        if self.heartbeats is not None:
            lines.append("Every rank, from its heartbeat:")
            lines += self.heartbeats.collect()
        lines.append("Python stacks of every thread of this rank follow; the other ranks' reports say where they wait")
        return "\n".join(lines)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > armed[2]:
                self._fire(*armed)
                return

    def _fire(self, phase: str, started: float, limit: float) -> None:
        report = self.report(time.monotonic() - started, phase, limit)
        print(report, file=self.out, flush=True)
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.flush()
        if self.heartbeats is not None and self.heartbeats.hosts_store:
            time.sleep(2 * self.heartbeats.read_gap_s + 1.0)  # the other ranks' reports read the store we host
        self.on_timeout(report)
