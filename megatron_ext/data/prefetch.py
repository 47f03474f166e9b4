"""The next step's micro-batches, built in the background while the current step runs.

A step's data is what ``step_data.StepDataBuilder`` makes: its samples read (``dataset[i]``,
normalised, token ids checked; in the training process, or with ``--num-workers N`` in N worker
processes of a torch ``DataLoader``), padded as ``--sequence-padding`` says, and moved to the
device (pinned host memory, copied on a side CUDA stream). ``StepPrefetcher.request(first_sample)``
runs that builder for a step in one background thread; ``take(first_sample)`` returns it, waiting
only if it is not ready (the wait is what ``bench/data.py`` reports and the ``data`` timer shows).

Collectives: negotiated padding needs one all-reduce MAX over the replica (TP x CP x PP). The
background thread issues it on a gloo group of its own (``build_data_group``), so it never shares a
group, or a thread, with the model's collectives, and never waits on a GPU. Every rank requests the
same steps in the same order (the loop does), so those all-reduces match across ranks; a ``take``
of a step that was not requested first waits for the pending one, then builds synchronously.

Order and resume are those of ``microbatch.get_microbatch_indices``: step k's samples are a pure
function of ``first_sample``, wherever and whenever they are read, in this thread or a worker.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.data.microbatch import Microbatch, Sample, check_token_ids, normalize_sample
from megatron_ext.data.step_data import StepDataBuilder, StepDataSpec


def build_data_group(ctx) -> Any:
    """A gloo group per DP replica (the ranks sharing this rank's DP rank, which read the same samples:
    TP x CP x PP), for the background thread's padding negotiation; None when the replica is one
    rank. Collective: every rank of the world calls it."""
    if ctx.tp_size * ctx.pp_size * ctx.cp_size == 1 or not dist.is_initialized():
        return None
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, ctx.dp_rank)
    mine = None
    for dp in sorted(set(everyone)):
        group = dist.new_group([r for r, d in enumerate(everyone) if d == dp], backend="gloo")
        if dp == ctx.dp_rank:
            mine = group
    return mine


class _CheckedSamples(torch.utils.data.Dataset):
    """``dataset[i]`` normalised and checked, as a worker process returns it (a bad token id or a
    sample the CP layout cannot split comes back as a value and is raised in the training process,
    with its message intact)."""

    def __init__(self, dataset: Any, spec: StepDataSpec):
        self.dataset, self.vocab_size, self.check = dataset, spec.vocab_size, spec.get_sample_check()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        sample = normalize_sample(self.dataset[i])
        try:
            if self.vocab_size is not None:
                check_token_ids(sample, self.vocab_size, self.dataset, i)
            if self.check is not None:
                self.check(sample, self.dataset, i)
        except ValueError as exc:
            return exc
        return sample


class _StepBatches:
    """The micro-batch index lists of one DP rank, step after step from ``first_sample``, each step
    of the global batch ``spec`` gives it."""

    def __init__(self, first_sample: int, spec: StepDataSpec, num_samples: int):
        self.first_sample, self.spec, self.n = first_sample, spec, num_samples

    def __iter__(self):
        start = self.first_sample
        while True:
            for mb in self.spec.get_indices(start):
                yield [i % self.n for i in mb]
            start += self.spec.get_global_batch_size(start)


class WorkerSampleReader:
    """A step's samples read by ``num_workers`` worker processes (a torch ``DataLoader`` over the
    step's micro-batch index lists, in order, running ahead by ``prefetch_factor`` micro-batches per
    worker). Restarted when a step other than the next one is asked for."""

    def __init__(self, dataset: Any, spec: StepDataSpec, num_workers: int):
        self.samples = _CheckedSamples(dataset, spec)
        self.spec = spec
        self.num_workers = num_workers
        self._next: int | None = None
        self._loader: Any = None
        self._iter: Any = None

    def _start(self, first_sample: int) -> None:
        self.close()
        # Garbage with native threads (process groups of an earlier run in this process, a closed
        # DataLoader) must be finalised here, not by the first collection inside a forked worker,
        # where its threads do not exist: that killed workers with SIGSEGV (4-rank test world
        # running several jobs one after the other; the crash was in libc, in a worker thread).
        gc.collect()
        self._loader = torch.utils.data.DataLoader(
            self.samples,
            batch_sampler=_StepBatches(first_sample, self.spec, len(self.samples)),
            num_workers=self.num_workers,
            collate_fn=list,
            multiprocessing_context="fork",
            persistent_workers=False,
            prefetch_factor=2,
        )
        self._iter = iter(self._loader)
        self._next = first_sample

    def ready_for(self, first_sample: int) -> None:
        """(Re)start the workers so that the next step read is the one at ``first_sample``; called
        from the training thread (workers are forked there, never from the prefetch thread)."""
        if self._next != first_sample:
            self._start(first_sample)

    def fetch(self, first_sample: int) -> list[list[Sample]]:
        self.ready_for(first_sample)
        out = [next(self._iter) for _ in range(self.spec.get_num_microbatches(first_sample))]
        self._next = first_sample + self.spec.get_global_batch_size(first_sample)
        for mb in out:
            for s in mb:
                if isinstance(s, Exception):
                    raise s
        return out

    def close(self) -> None:
        self._iter = self._loader = self._next = None  # the DataLoader iterator stops its workers


class StepPrefetcher:
    """Runs ``builder`` (negotiating over its own group) for step k+1 in one background thread while
    step k runs (see the module docstring); samples come from ``dataset`` directly, or from
    ``WorkerSampleReader`` with ``num_workers`` > 0."""

    def __init__(self, builder: StepDataBuilder, dataset: Any, num_workers: int = 0, background: bool = True):
        self.builder, self.dataset, self.device = builder, dataset, builder.device
        self.background = background  # False (--no-data-prefetch with --num-workers): steps are built in take()
        self.reader = WorkerSampleReader(dataset, builder.spec, num_workers) if num_workers else None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: tuple[int, _Background] | None = None
        self.wait_seconds = 0.0  # time the training thread waited in take()
        self.steps = 0

    def _read(self, first_sample: int) -> list[list[Sample]]:
        if self.reader is not None:
            return self.reader.fetch(first_sample)
        return self.builder.read(self.dataset, first_sample)

    def _build(self, first_sample: int) -> tuple[list[Microbatch], int, Any]:
        microbatches, length = self.builder.collate(self._read(first_sample))
        moved, event = self.builder.to_device(microbatches, self.stream)
        return moved, length, event

    def request(self, first_sample: int) -> None:
        """Start building the step that begins at ``first_sample`` (one at a time)."""
        self._drain()
        if self.reader is not None:
            self.reader.ready_for(first_sample)
        self._pending = (first_sample, _Background(self._build, first_sample, self.device))

    def take(self, first_sample: int) -> tuple[list[Microbatch], int]:
        """The step's micro-batches on the device and its length: the requested build, or, when
        none was requested for ``first_sample``, one built now."""
        start = time.perf_counter()
        if self._pending is not None and self._pending[0] == first_sample:
            microbatches, length, event = self._pending[1].result()
            self._pending = None
        else:
            self._drain()
            if self.reader is not None:
                self.reader.ready_for(first_sample)
            microbatches, length, event = self._build(first_sample)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for mb in microbatches:
                layout = mb.cp_layout
                indices = (layout.local_index, layout.gather_index) if layout is not None else ()
                for t in (mb.tokens, mb.labels, mb.position_ids, mb.cu_seqlens, *indices):
                    if t is not None:
                        t.record_stream(current)
        self.wait_seconds += time.perf_counter() - start
        self.steps += 1
        return microbatches, length

    def _drain(self) -> None:
        """Wait for the pending build (its collective must finish on every rank alike)."""
        if self._pending is not None:
            pending, self._pending = self._pending[1], None
            pending.result()

    def close(self, wait: bool = True) -> None:
        """Finish (``wait``; an error of a step nobody takes is dropped: no step reads it) or
        abandon the pending build (a failing process: never wait on a collective); stop the worker
        processes. After a finished close the prefetcher stays usable."""
        pending, self._pending = self._pending, None
        if pending is not None and wait:
            pending[1].done.wait()
        if pending is not None and not pending[1].done.is_set():
            return  # abandoned mid-build (the process is failing): its thread still uses the reader
        if self.reader is not None:
            self.reader.close()


class _Background:
    """``fn(*args)`` in a daemon thread (an abandoned one never holds up the interpreter's exit)."""

    def __init__(self, fn: Callable, arg: Any, device: torch.device):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                self.value = fn(arg)
            except BaseException as exc:  # raised again by result(), in the training thread
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, name="data-prefetch", daemon=True).start()

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value
