"""Stop-and-save decisions at step boundaries: SIGTERM (Slurm preemption), --exit-interval,
--exit-duration-in-mins.

Invariant: every rank of the world takes the same decision after the same step, so that all of
them save the same iteration and exit together. A signal reaches ranks at different moments (or
only some of them), and wall clocks differ, so the handler only sets a flag, and at each step
boundary one ``all_reduce(MAX)`` of a small int tensor over the world combines the ranks' flags: bit 0
"a signal arrived here", bit 1 "the time limit passed here"; with ``--async-save`` bits 3, 4 and 5
"my background write is still running", "my background write failed" and "my weights were not
finite at the save step" (``async_save.py``).
That all-reduce is the only per-step collective these features add, and it runs only with
--exit-signal-handler or --exit-duration-in-mins, or while an asynchronous save is in flight.
--exit-interval needs none: the iteration number is the same everywhere.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.config import JobConfig
from megatron_ext.cpu_platform import get_collective_device

SIGNAL_RECEIVED = 1
DURATION_EXCEEDED = 2
INTERVAL_REACHED = 4
ASYNC_SAVE_WRITING = 8
ASYNC_SAVE_FAILED = 16
ASYNC_SAVE_NOT_FINITE = 32
EXIT_FLAGS = SIGNAL_RECEIVED | DURATION_EXCEEDED | INTERVAL_REACHED
_AGREED_BITS = 6


class ExitSignalHandler:
    """Records that SIGTERM/SIGINT arrived; the handler does nothing else (no I/O, no collective)."""

    def __init__(self, signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signums}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def get_local_exit_flags(signal_received: bool, elapsed_minutes: float, duration_minutes: float | None) -> int:
    """This rank's view, before agreement (pure)."""
    flags = SIGNAL_RECEIVED if signal_received else 0
    if duration_minutes is not None and elapsed_minutes >= duration_minutes:
        flags |= DURATION_EXCEEDED
    return flags


def agree_on_flags(local_flags: int, group: Any = None, read: bool = True) -> int | torch.Tensor:
    """Bitwise OR of every rank's flags: one all-reduce MAX of a small int64 tensor, one bit each.
    ``read=False``: the reduced bits tensor, left on the collective's device for the caller to read
    with something else it copies to the host (``flags_from_bits``)."""
    bits = torch.tensor(
        [(local_flags >> i) & 1 for i in range(_AGREED_BITS)], dtype=torch.int64, device=get_collective_device(group)
    )
    dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
    return flags_from_bits(bits.tolist()) if read else bits


def flags_from_bits(bits: list[float] | list[int]) -> int:
    """The flags of ``agree_on_flags``'s bits read on the host."""
    return int(sum(int(b) << i for i, b in enumerate(bits)))


def get_interval_flag(iteration: int, exit_interval: int | None) -> int:
    return INTERVAL_REACHED if exit_interval and iteration % exit_interval == 0 else 0


def describe_exit(flags: int) -> str:
    reasons = [
        name
        for bit, name in (
            (SIGNAL_RECEIVED, "exit signal received"),
            (DURATION_EXCEEDED, "--exit-duration-in-mins reached"),
            (INTERVAL_REACHED, "--exit-interval reached"),
        )
        if flags & bit
    ]
    return ", ".join(reasons)


class ExitDecider:
    """Answers "stop after this step?" identically on every rank."""

    def __init__(
        self,
        exit_signal_handler: bool,
        exit_interval: int | None,
        exit_duration_in_mins: float | None,
        start_time: float | None = None,
    ):
        self.handler = ExitSignalHandler() if exit_signal_handler else None
        self.exit_interval = exit_interval
        self.duration = exit_duration_in_mins
        self.start_time = time.monotonic() if start_time is None else start_time

    def close(self) -> None:
        """Give SIGTERM/SIGINT their previous handlers back (the entry point, on every exit path):
        left installed, they only set a flag in a caller that returned or raised, and in anything
        it forks later."""
        if self.handler is not None:
            self.handler.restore()

    @property
    def needs_agreement(self) -> bool:
        return self.handler is not None or self.duration is not None

    def decide(self, iteration: int, save_flags: int | None = None, agreed_bits: list[float] | None = None) -> int:
        """Flags agreed by all ranks (``& EXIT_FLAGS`` == 0: keep training). ``save_flags``: this
        rank's asynchronous-save bits while a save is in flight (the same on every rank), else
        None. Collective when ``needs_agreement`` or a save is in flight, unless ``agreed_bits``
        brings the agreement ``start_agreement`` began inside the step, read with the step's one copy."""
        flags = get_interval_flag(iteration, self.exit_interval)
        if agreed_bits is not None:
            return flags | flags_from_bits(agreed_bits)
        if self.needs_agreement or save_flags is not None:
            flags |= agree_on_flags(self._local_flags(save_flags))
        return flags

    def start_agreement(self, save_flags: int | None = None) -> torch.Tensor | None:
        """The agreement of ``decide``, begun inside a step (collective when ``decide`` would be): every
        rank's flags as of now, all-reduced, not read (None when no agreement is needed). The training
        step copies it to the host with its loss and gradient norm (one sync for all three); a signal
        arriving after this point is agreed on after the next step."""
        if not (self.needs_agreement or save_flags is not None):
            return None
        return agree_on_flags(self._local_flags(save_flags), read=False)

    def _local_flags(self, save_flags: int | None) -> int:
        local = get_local_exit_flags(
            self.handler is not None and self.handler.received is not None,
            (time.monotonic() - self.start_time) / 60.0,
            self.duration,
        )
        return local | (save_flags or 0)


def build_exit_decider(cfg: JobConfig) -> ExitDecider:
    """The exit decider of a run, built first thing in the entry point so that a SIGTERM during
    start-up is recorded too, and --exit-duration-in-mins counts from the job's start."""
    c = cfg.checkpoint
    return ExitDecider(c.exit_signal_handler, c.exit_interval, c.exit_duration_in_mins)
