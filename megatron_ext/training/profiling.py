"""Where a step's time goes: timers, the PyTorch profiler window, manual garbage collection.

- ``StepTimers`` (``--timing-log-level``): level 1 times the data (fetch, pad, move), the
  forward-backward schedule and the optimizer step; level 2 also megatron-core's
  ``finalize_model_grads`` (the DP gradient reduce, tied embeddings, token-count scaling) inside the
  schedule. Times are wall clock on this rank, averaged over the log interval; on CUDA each timer
  synchronises the device at its ends (as Megatron-LM's timers do), so leave it at 0 for throughput
  runs. With ``--log-straggler`` they also time ``compute`` (megatron-core's forward and backward
  steps, our runtime's weight steps: ``trace_compute``) for ``straggler.py``, and on CUDA they record
  events instead, read at the log step (one wait for the device there, none per step); on CPUs they
  also count the time the training thread waited for a core inside each timer (``queued``), and
  ``phase`` says which timer is open, for ``straggler.PauseMonitor``.
- ``ProfilerWindow`` (``--profile --use-pytorch-profiler``): ``torch.profiler`` records iterations
  ``--profile-step-start`` to ``--profile-step-end`` on the ``--profile-ranks`` and writes one
  trace per rank into ``--tensorboard-dir`` (TensorBoard's profiler plugin reads it), as
  Megatron-LM does.
- ``ManualGC`` (``--manual-gc``): Python's automatic collection is off during training and runs
  every ``--manual-gc-interval`` iterations on every rank at the same point, so no rank pauses for
  GC while the others wait for it in a collective.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_ext.straggler import BETWEEN_STEPS, IN_STEP, STARTING, ThreadClock

TIMER_NAMES = ("data", "forward-backward", "compute", "grad-reduce", "optimizer")
SCHEDULE_MODULE = "megatron.core.pipeline_parallel.schedules"
RUNTIME_MODULE = "megatron_ext.pipeline.runtime"


class StepTimers:
    """Accumulated milliseconds per timer since the last report (see the module docstring)."""

    def __init__(self, level: int, device: torch.device, compute: bool = False):
        """``compute``: also time the forward/backward steps (``trace_compute``), and on CUDA with
        events rather than synchronising (--log-straggler)."""
        self.level, self.device, self.compute = level, device, compute
        self.events = compute and device.type == "cuda"
        self.totals: dict[str, float] = {}
        self._pending: list[tuple[str, Any, Any]] = []  # (name, start event, end event), CUDA events only
        self.steps = 0
        # --log-straggler on CPUs: this (the training) thread's wait for a core, counted per timer
        self.clock = ThreadClock.open() if compute and device.type == "cpu" else None
        self.queued: dict[str, float] = {}
        self.queued_means: dict[str, float] = {}  # ms per step of ``queued``, set by ``report``
        self.reported_steps = 0  # the steps of the last report
        self.open: list[str] = []  # the timers open now, innermost last (--log-straggler)
        self.in_step = False  # from the opening of "data" to the closing of "optimizer"
        # (monotonic s, phase) at each change of ``phase`` (--log-straggler: the pause monitor reads it)
        self.transitions: collections.deque[tuple[float, str]] = collections.deque(maxlen=64)

    @property
    def phase(self) -> str:
        """The innermost open timer; ``IN_STEP`` between two timers of a step, ``BETWEEN_STEPS``
        between steps, ``STARTING`` before the first."""
        open_now = self.open[-1:]
        if open_now:
            return open_now[0]
        return IN_STEP if self.in_step else BETWEEN_STEPS if self.transitions else STARTING

    def get_phase_at(self, when: float) -> str:
        """The phase at monotonic time ``when``, from the last transitions ('' when they no longer
        reach back so far). Called from the pause monitor's thread: the deque is copied in one C
        call, under the GIL."""
        transitions = list(self.transitions)
        for at, phase in reversed(transitions):
            if at <= when:
                return phase
        return "" if len(transitions) == self.transitions.maxlen else STARTING

    def enabled(self, name: str) -> bool:
        if name == "compute":
            return self.compute
        return self.level >= (2 if name == "grad-reduce" else 1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time ``name`` when enabled; with ``compute`` (--log-straggler) also record the phase, timed or not."""
        if not self.compute:
            with self._time(name) if self.enabled(name) else contextlib.nullcontext():
                yield
            return
        self.in_step = self.in_step or name == "data"
        self.open.append(name)
        self.transitions.append((time.monotonic(), name))
        try:
            with self._time(name) if self.enabled(name) else contextlib.nullcontext():
                yield
        finally:
            self.open.pop()
            self.in_step = self.in_step and name != "optimizer"
            self.transitions.append((time.monotonic(), self.phase))

    @contextlib.contextmanager
    def _time(self, name: str) -> Iterator[None]:
        if self.events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
            return
        self._sync()
        queued = self.clock.read()[1] if self.clock is not None else 0.0
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] = self.totals.get(name, 0.0) + 1000.0 * (time.perf_counter() - start)
            if self.clock is not None:
                self.queued[name] = self.queued.get(name, 0.0) + 1000.0 * (self.clock.read()[1] - queued)

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed under ``name`` (for megatron-core's hooks, e.g. finalize_model_grads)."""

        def timed(*args: Any, **kwargs: Any):
            with self.time(name):
                return fn(*args, **kwargs)

        return timed

    @contextlib.contextmanager
    def trace_compute(self) -> Iterator[None]:
        """Around one training step: megatron-core's ``forward_step`` / ``backward_step`` and our
        runtime's ``weight_step`` timed under ``compute`` (module globals every schedule resolves at
        call time, restored on exit, as ``training/timeline.py`` does); nothing without ``compute``."""
        if not self.compute:
            yield
            return
        import importlib

        schedules = importlib.import_module(SCHEDULE_MODULE)
        runtime = importlib.import_module(RUNTIME_MODULE)
        originals = schedules.forward_step, schedules.backward_step, runtime.weight_step
        schedules.forward_step, schedules.backward_step = (self.wrap("compute", f) for f in originals[:2])
        runtime.weight_step = self.wrap("compute", originals[2])
        try:
            yield
        finally:
            schedules.forward_step, schedules.backward_step, runtime.weight_step = originals

    def report(self) -> dict[str, float]:
        """Mean milliseconds per step of each timer since the last report (and of the time waited
        for a core in each: ``queued_means``); resets."""
        if self._pending:
            self._pending[-1][2].synchronize()  # the log step's one wait for the device
            for name, start, end in self._pending:
                self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end)
            self._pending.clear()
        out = {k: v / max(self.steps, 1) for k, v in self.totals.items()}
        self.queued_means = {k: v / max(self.steps, 1) for k, v in self.queued.items()}
        self.reported_steps = self.steps
        self.totals, self.queued, self.steps = {}, {}, 0
        return out


def format_timers(means: dict[str, float]) -> str:
    return " | ".join(f"{name} {means[name]:.1f}" for name in TIMER_NAMES if name in means)


class ProfilerWindow:
    """``torch.profiler`` over iterations [start, end) of this rank (global iterations: a resumed run
    counts from its checkpoint's), with the iteration before as warm-up when there is one; traces into
    ``out_dir``. The profiler starts only when the window comes (``begin`` at the run's start,
    ``after_step`` after each iteration)."""

    def __init__(self, start: int, end: int, out_dir: str, device: torch.device):
        self.start, self.end, self.out_dir, self.device = start, end, out_dir, device
        self.profiler = None
        self.done = False

    def begin(self, iteration_done: int) -> str | None:
        """Before the run's first step (``iteration_done``: where it starts); a warning line when
        the window is already behind it."""
        if iteration_done + 1 >= self.end:
            self.done = True
            return (
                f"WARNING: --profile-step-start {self.start} --profile-step-end {self.end}: the run starts after "
                f"iteration {iteration_done}, past the window; nothing is profiled"
            )
        self._maybe_start(iteration_done)
        return None

    def _maybe_start(self, iteration_done: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        following = iteration_done + 1
        if self.profiler is not None or self.done or following < self.start - 1 or following >= self.end:
            return
        warmup = 1 if following < self.start else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.profiler = profile(
            activities=activities,
            record_shapes=True,
            with_stack=False,
            schedule=schedule(wait=0, warmup=warmup, active=self.end - following - warmup, repeat=1),
            on_trace_ready=tensorboard_trace_handler(self.out_dir),
        )
        self.profiler.start()

    def after_step(self, iteration: int) -> None:
        """After every iteration (once started, the profiler's own schedule decides what it records)."""
        if self.done:
            return
        if self.profiler is None:
            self._maybe_start(iteration)
        else:
            self.profiler.step()
            if iteration + 1 >= self.end:
                self.close()

    def close(self) -> None:
        if not self.done and self.profiler is not None:
            self.profiler.stop()
        self.done = True


class CudaProfilerRange:
    """``--profile`` without the PyTorch profiler: cudaProfilerStart/Stop around iterations
    [start, end), for ``nsys profile --capture-range=cudaProfilerApi`` (CUDA only)."""

    def __init__(self, start: int, end: int):
        self.start, self.end, self.active = start, end, False

    def begin(self, iteration_done: int) -> str | None:
        """Before the run's first step: open the range now when the window starts at or before it."""
        if self.start <= iteration_done < self.end:
            self._begin()
        return None

    def _begin(self) -> None:
        torch.cuda.cudart().cudaProfilerStart()
        self.active = True

    def after_step(self, iteration: int) -> None:
        if iteration == self.start:
            self._begin()
        elif iteration == self.end and self.active:
            self.close()

    def close(self) -> None:
        if self.active:
            torch.cuda.cudart().cudaProfilerStop()
            self.active = False


class ManualGC:
    """Automatic GC off; a full collection every ``interval`` iterations (0: never)."""

    def __init__(self, interval: int):
        self.interval = interval
        gc.disable()
        gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        gc.enable()
