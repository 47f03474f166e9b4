"""A step's data, built in one room: read -> pad (negotiated) -> micro-batches -> device.

``StepDataBuilder.build(dataset, first_sample)`` makes this rank's micro-batches of the step that
starts at global sample ``first_sample``, in three stages that the background prefetcher
(``prefetch.StepPrefetcher``) runs too, in its own thread:

1. ``read``: the samples of this DP rank's micro-batches (``microbatch.get_microbatch_indices``),
   normalised, their token ids checked against the tokenizer's vocabulary;
2. ``collate``: padded as ``--sequence-padding`` says (``padding.collate_step``; ``negotiated``
   issues one all-reduce MAX over ``group``), giving the micro-batches and the schedule's
   ``seq_length``; packed documents padded to g and, under context parallelism, each micro-batch
   cut to this CP rank's share (``context_split.py``: host index work, no device read);
3. ``to_device``: moved to the device (pinned host memory; on CUDA, optionally on a side stream).

Invariants: step k's samples are a pure function of ``first_sample`` and the layout, wherever and
whenever they are read (exact resume): a training step reads the global batch its batch schedule
gives at ``first_sample`` (``batch_schedule.py``: a ramp-up is a function of the consumed samples),
evaluation passes its own (the settled global batch); every rank of a pipeline replica pads micro-batch i to the
same length (``padding.py``). The builder holds no state between steps, so the synchronous path
(evaluation, ``--no-data-prefetch``) and the prefetcher build the same step identically; they differ
only in the process group the negotiation runs on (the replica's TP x CP x PP group in the training
thread, a gloo group of the prefetcher's own over the same ranks in the background).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_ext.data.batch_schedule import BatchSchedule
from megatron_ext.data.context_split import NO_SPLIT, ContextSplit, check_sample
from megatron_ext.data.microbatch import Microbatch, Sample, fetch_step_samples, get_microbatch_indices
from megatron_ext.data.padding import collate_step


@dataclasses.dataclass(frozen=True)
class StepDataSpec:
    """How one rank's micro-batches of a step are made; fixed for a run (``run.build_training_run``
    fills it from the resolved config, the rank's place and the tokenizer)."""

    global_batch_size: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    sequence_padding: str  # static, negotiated or variable (padding.MODES)
    pad_to_multiple_of: int
    max_microbatch_length: int  # --seq-length, or b x --seq-length with document boundaries
    pad_id: int
    vocab_size: int | None  # the tokenizer's: every token id must lie below it (None: unchecked)
    pad_length_bucket: str = "multiple"  # how padded lengths round up (padding.get_step_length)
    # training steps' global batch per consumed samples (None: global_batch_size every step)
    batch_schedule: BatchSchedule | None = None
    # this rank's CP share and the packed documents' pad multiple g (``context_split.build_context_split``)
    context_split: ContextSplit = NO_SPLIT

    def __post_init__(self) -> None:
        c = self.context_split.cp_size
        if c == 1:
            return
        if self.sequence_padding == "variable":
            raise ValueError(f"--sequence-padding variable is not supported with --context-parallel-size {c}")
        lengths = {"--seq-length (x --micro-batch-size when joined)": self.max_microbatch_length}
        if self.sequence_padding == "negotiated":
            lengths["--pad-to-multiple-of"] = self.pad_to_multiple_of
        for flag, n in lengths.items():
            if n % (2 * c):
                raise ValueError(
                    f"{flag} {n} is not a multiple of 2 x --context-parallel-size {c}: every padded micro-batch "
                    f"splits into 2c chunks; use a multiple of {2 * c}"
                )

    def check_sample(self, sample: Sample, dataset: Any, index: int) -> None:
        """ValueError naming the sample when its documents cannot be padded or split as ``context_split``
        says (``context_split.check_sample``); a pack's longest is --seq-length."""
        check_sample(sample, self.context_split, self.max_microbatch_length // self.micro_batch_size, dataset, index)

    def get_sample_check(self):
        """``check_sample`` when samples need it (padded or split), else None."""
        return self.check_sample if self.context_split.checks_samples else None

    def get_global_batch_size(self, first_sample: int) -> int:
        """The global batch of the training step at ``first_sample``."""
        if self.batch_schedule is None:
            return self.global_batch_size
        return self.batch_schedule.get_global_batch_size(first_sample)

    def get_num_microbatches(self, first_sample: int) -> int:
        """This rank's micro-batches in the training step at ``first_sample``."""
        return self.get_global_batch_size(first_sample) // (self.micro_batch_size * self.dp_size)

    def get_indices(self, first_sample: int, global_batch_size: int | None = None) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches of the step at ``first_sample`` of
        ``global_batch_size`` samples (None: the training step's, from the batch schedule)."""
        g = global_batch_size or self.get_global_batch_size(first_sample)
        return get_microbatch_indices(first_sample, g, self.micro_batch_size, self.dp_rank, self.dp_size)


class StepDataBuilder:
    """Builds a step's micro-batches for one rank (see the module docstring); ``group`` is the
    process group the negotiated padding's all-reduce runs on (None: this rank alone)."""

    def __init__(self, spec: StepDataSpec, device: torch.device, group: Any = None):
        self.spec, self.device, self.group = spec, device, group

    def with_group(self, group: Any) -> StepDataBuilder:
        """The same builder negotiating over ``group`` (the prefetcher's own)."""
        return StepDataBuilder(self.spec, self.device, group)

    def read(self, dataset: Any, first_sample: int, global_batch_size: int | None = None) -> list[list[Sample]]:
        """The step's samples, unpadded, grouped by micro-batch (token ids checked); the global
        batch as ``StepDataSpec.get_indices`` takes it."""
        indices = self.spec.get_indices(first_sample, global_batch_size)
        return fetch_step_samples(dataset, indices, self.spec.vocab_size, self.spec.get_sample_check())

    def collate(self, raw: list[list[Sample]]) -> tuple[list[Microbatch], int]:
        """The step's raw samples padded as ``--sequence-padding`` says (collective over ``group``
        when negotiated); returns the micro-batches and the schedule's seq_length."""
        s = self.spec
        return collate_step(
            raw,
            s.sequence_padding,
            self.group,
            s.pad_to_multiple_of,
            s.max_microbatch_length,
            s.pad_id,
            s.pad_length_bucket,
            s.context_split,
        )

    def to_device(self, microbatches: list[Microbatch], stream: Any = None) -> tuple[list[Microbatch], Any]:
        """The micro-batches on the device, and the CUDA event that marks their copy on ``stream``
        (None without a stream: the copy is ordered on the current stream)."""
        if stream is None:
            return [mb.to(self.device) for mb in microbatches], None
        with torch.cuda.stream(stream):
            moved = [mb.to(self.device) for mb in microbatches]
            event = torch.cuda.Event()
            event.record(stream)
        return moved, event

    def build(
        self, dataset: Any, first_sample: int, global_batch_size: int | None = None
    ) -> tuple[list[Microbatch], int]:
        """This rank's micro-batches of the step at ``first_sample`` (of ``global_batch_size``
        samples; None: the training step's) on the device, built now in this thread, and the
        schedule's seq_length."""
        microbatches, length = self.collate(self.read(dataset, first_sample, global_batch_size))
        return self.to_device(microbatches)[0], length
