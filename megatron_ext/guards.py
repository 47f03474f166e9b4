"""Hang and orphan guards: no worker outlives its launcher, no two jobs write one --save, no
stalled step waits silently for the collective timeout.

- ``apply_parent_death_signal``: the kernel sends SIGKILL to this worker when its parent (the
  torchrun agent) dies, even by kill -9 (Linux ``prctl(PR_SET_PDEATHSIG)``). torchrun starts its
  workers in a new session, so without this a killed agent leaves them training and saving into
  ``--save`` while a relaunch starts writing there too.
- ``lock_save_dir``: rank 0 holds an exclusive ``flock`` on ``--save/.megatron_ext.lock`` for the
  job's life; the kernel releases it when the process dies (kill -9 included), so a relaunch is
  never blocked by a dead job, and a second live job is refused at start-up. ``flock`` is reliable
  on local file systems and on NFSv4 and Lustre with locking enabled; where the file system ignores
  it (some NFSv3 mounts without lockd), the lock protects nothing: see docs/failures.md.
- ``StepWatchdog`` (``--step-timeout-minutes``): when one training step takes longer, the rank
  prints where it is (rank, pipeline stage, iteration, the micro-batch its forward step recorded)
  and every thread's Python stack, then exits 1 so the launcher ends the job, instead of waiting
  for the collective timeout (``--distributed-timeout-minutes``) whose message names no peer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Callable, TextIO

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

    from megatron_ext.config import ConfigError

    os.makedirs(path, exist_ok=True)
    handle = open(os.path.join(path, LOCK_NAME), "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError([f"--save {path} is in use by a live job ({holder} holds {LOCK_NAME}): wait for it "
                           f"to end, stop it, or give this job another --save"]) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


@dataclasses.dataclass
class StepProgress:
    """Where a rank is in its step: written by the loop and by our forward step (cheap stores)."""

    iteration: int = 0
    microbatch: int | None = None
    chunk: int | None = None
    phase: str = "starting"


class StepWatchdog:
    """A daemon thread that ends a stalled rank with a report (see the module docstring)."""

    def __init__(self, timeout_s: float, describe: Callable[[], str], progress: StepProgress,
                 on_timeout: Callable[[str], None] | None = None, out: TextIO | None = None):
        self.timeout_s, self.describe, self.progress = timeout_s, describe, progress
        self.on_timeout = on_timeout or (lambda report: os._exit(1))
        self.out = out or sys.stderr
        self._started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, iteration: int) -> None:
        self.progress.iteration, self.progress.phase = iteration, "step"
        self._started = time.monotonic()

    def step_finished(self) -> None:
        self._started = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def report(self, elapsed: float) -> str:
        p = self.progress
        where = f"micro-batch {p.microbatch} of model chunk {p.chunk}" if p.microbatch is not None else p.phase
        return (f"step watchdog: {self.describe()} has spent {elapsed:.0f} s in iteration {p.iteration} "
                f"(--step-timeout-minutes {self.timeout_s / 60:g}); last recorded: {where}. Python stacks "
                f"of every thread follow; the other ranks' reports say where they wait")

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                report = self.report(time.monotonic() - started)
                print(report, file=self.out, flush=True)
                faulthandler.dump_traceback(file=self.out, all_threads=True)
                self.out.flush()
                self.on_timeout(report)
                return
