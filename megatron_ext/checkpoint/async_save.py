"""``--async-save``: the shards are written in a background thread while training goes on.

megatron-core's own asynchronous path is not used (its results queue is a multiprocessing
Manager, which hung on CPU/gloo ranks; its persistent worker calls ``torch.cuda.set_device``; CPU
tensors are not copied, so a background write would save tensors the next step is changing).
Ours runs the phases of ``directory.py`` with phase 1's writing moved off the training thread:

1. the save step (``AsyncCheckpointSaver.start``, collective): megatron-core's plan and
   ``common.pt`` as in a synchronous save, then every tensor to be written is copied into host
   memory the save owns (``HostSnapshot``: a clone on CPU, a pinned device-to-host copy on CUDA,
   the buffers reused by the next save); a daemon thread writes and fsyncs the shards, computing
   their checksums, and runs no collective;
2. every following step: "still writing here" and "the write failed here" are two more bits of
   the exit decision's per-step all-reduce (``exit_policy.ExitDecider``: the one all-reduce it
   already makes with ``--exit-signal-handler`` or ``--exit-duration-in-mins``, made for every step
   while a save is in flight otherwise). The first step after which no rank is writing publishes
   the checkpoint on every rank (``publish_checkpoint_write``: marker, rename, pointer,
   retention), or, if a rank's write failed, removes the temporary directory and raises
   CheckpointWriteFailed everywhere. A third bit, "my weights were not finite at the save step"
   (``finite.py``; that rank writes nothing), refuses the save at the first step boundary after
   it started, without waiting for the agreement that no rank is writing: every rank waits for
   its own writer, the temporary directory goes and every rank raises NonFiniteCheckpoint;
3. at most one save is in flight: the next save, the last one of the run (written
   synchronously), an exit and the end of training first wait for it and publish it
   (``finish``). A training error while a save is in flight abandons it (``abandon``): the
   temporary directory is never published and the next save's retention removes it, so the last
   complete checkpoint is what a restart loads.

The snapshot costs host memory equal to this rank's share of the checkpoint (kept between saves).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import torch

from megatron_ext.checkpoint.directory import (
    NOT_FINITE,
    WRITE_FAILED,
    CheckpointWrite,
    begin_checkpoint_write,
    publish_checkpoint_write,
    write_shards,
)
from megatron_ext.checkpoint.exit_policy import ASYNC_SAVE_FAILED, ASYNC_SAVE_NOT_FINITE, ASYNC_SAVE_WRITING


class HostSnapshot:
    """Host copies of a save's tensors. Buffers are reused in order from one save to the next
    while shapes and dtypes match (a training run saves the same tensors each time); on CUDA they
    are pinned and filled by asynchronous device-to-host copies that ``wait`` completes."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._cursor = 0
        self._devices: set[torch.device] = set()
        self.bytes = 0

    def reset(self) -> None:
        self._cursor, self._devices, self.bytes = 0, set(), 0

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        pinned = like.device.type == "cuda"
        if self._cursor < len(self._buffers):
            buf = self._buffers[self._cursor]
            if buf.shape == like.shape and buf.dtype == like.dtype and buf.is_pinned() == pinned:
                self._cursor += 1
                return buf
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
        if self._cursor < len(self._buffers):
            self._buffers[self._cursor] = buf
        else:
            self._buffers.append(buf)
        self._cursor += 1
        return buf

    def copy(self, items: list[tuple[Any, torch.Tensor]]) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for item, tensor in items:
            tensor = tensor.detach()
            buf = self._take(tensor)
            buf.copy_(tensor, non_blocking=tensor.device.type == "cuda")
            if tensor.device.type == "cuda":
                self._devices.add(tensor.device)
            self.bytes += buf.numel() * buf.element_size()
            out.append((item, buf))
        return out

    def wait(self) -> None:
        """Every copy complete (the device-to-host ones are asynchronous)."""
        for device in self._devices:
            torch.cuda.synchronize(device)
        del self._buffers[self._cursor :]  # a smaller save than the last: free the rest


class PublishedSave(NamedTuple):
    iteration: int
    path: str
    seconds: float  # from the save's start to its publication

    def describe(self, after_iteration: int | None = None) -> str:
        when = f", published after iteration {after_iteration}" if after_iteration is not None else ""
        return (
            f"saved checkpoint at iteration {self.iteration:8d} to {self.path} (written in the background, "
            f"{self.seconds:.2f} s from its start{when})"
        )


class AsyncCheckpointSaver:
    """At most one save in flight; the same state on every rank (saves start and publish in the
    same steps everywhere)."""

    def __init__(self):
        self.snapshot = HostSnapshot()
        self.write: CheckpointWrite | None = None
        self.thread: threading.Thread | None = None
        self.started = 0.0

    @property
    def in_flight(self) -> bool:
        return self.write is not None

    def local_flags(self) -> int:
        """This rank's bits for the exit decision: still writing, the write failed, the weights
        were not finite at the save step (known from the start)."""
        if self.write is None:
            return 0
        flags = ASYNC_SAVE_NOT_FINITE if self.write.non_finite is not None else 0
        if not self.write.written:
            return flags | ASYNC_SAVE_WRITING
        return flags | (ASYNC_SAVE_FAILED if self.write.error is not None else 0)

    def start(
        self,
        state: dict[str, Any],
        root: str,
        iteration: int,
        keep_last: int | None,
        non_finite: str | None = None,
        record: dict[str, Any] | None = None,
    ) -> float:
        """Plan and snapshot the save (collective), start writing in the background; returns the
        seconds training was held. A save still in flight is finished first. ``non_finite``: this
        rank's weights are not finite (``finite.py``): it writes nothing and the save is refused.
        ``record``: more entries of its marker, as of now (``directory.publish_checkpoint``)."""
        self.finish()
        start = self.started = time.perf_counter()
        self.snapshot.reset()
        self.write = begin_checkpoint_write(
            state, root, iteration, keep_last, snapshot=self.snapshot, non_finite=non_finite, record=record
        )
        self.thread = threading.Thread(
            target=write_shards, args=(self.write,), daemon=True, name=f"checkpoint-writer-{iteration}"
        )
        self.thread.start()
        return time.perf_counter() - start

    def finish_if_agreed(self, agreed_flags: int) -> PublishedSave | None:
        """Publish the save in flight when the step's agreed flags say no rank is writing, or
        refuse it at once when they say some rank's weights were not finite (collective then, on
        every rank alike); None when nothing was published."""
        if self.write is None:
            return None
        if agreed_flags & ASYNC_SAVE_WRITING and not agreed_flags & ASYNC_SAVE_NOT_FINITE:
            return None
        outcome = (WRITE_FAILED if agreed_flags & ASYNC_SAVE_FAILED else 0) | (
            NOT_FINITE if agreed_flags & ASYNC_SAVE_NOT_FINITE else 0
        )
        return self._publish(outcome)

    def finish(self) -> PublishedSave | None:
        """Wait for the save in flight and publish it (collective, with one all-reduce for the
        write's success); None when there is none."""
        if self.write is None:
            return None
        return self._publish(None)

    def _publish(self, outcome: int | None) -> PublishedSave:
        """``outcome``: the agreed bits of ``publish_checkpoint_write`` (None: agree on them now)."""
        write, thread = self.write, self.thread
        self.write = self.thread = None  # also when the publication raises
        thread.join()  # after ``written``, only the thread's last instructions remain (or, when the
        # weights were not finite somewhere, this rank's whole write: the refusal waits for it)
        path = publish_checkpoint_write(write, outcome)
        return PublishedSave(write.iteration, path, time.perf_counter() - self.started)

    def abandon(self) -> int | None:
        """Training failed with a save in flight: never publish it (no collective); returns its
        iteration. The writer thread is a daemon: it may finish its files or die with the
        process; the temporary directory goes at the next save's retention, and the previous
        checkpoint stays the newest."""
        iteration = self.write.iteration if self.write is not None else None
        self.write, self.thread = None, None
        return iteration
