"""The global batch of each step as a pure function of the samples consumed before it.

Three schedules, with Megatron-LM's meanings:

- constant: ``--global-batch-size`` every step;
- ``--rampup-batch-size START INCREMENT SAMPLES`` (megatron-core 0.16.1's
  ``RampupBatchsizeNumMicroBatchesCalculator``): from START, the batch grows by INCREMENT every
  SAMPLES / ((G - START) / INCREMENT) consumed samples (a float, as there), and is G, the
  ``--global-batch-size``, once more than SAMPLES samples are consumed;
- ``--step-batch-size-schedule "THRESHOLD:BATCH ..."`` (Megatron-LM main's
  ``StepBatchsizeNumMicroBatchesCalculator``, which replaced the ramp-up there): the batch of the
  last entry whose threshold is at most the consumed count; thresholds are tokens (Megatron-LM main
  always passes ``--seq-length``, so a threshold is converted to ``tokens // seq_length`` samples)
  and take the suffixes K, M, B, T (1e3 ... 1e12).

``--decrease-batch-size-if-needed`` (megatron-core 0.16.1's ``decrease_batch_size_if_needed``): a
step runs the largest multiple of micro-batch x DP (``running_multiple``) at most the schedule's
batch, megatron-core's "current running global batch size" (--global-batch-size 10 at micro-batch 1,
DP 4: 8 samples, 2 micro-batches per rank); a ramp's batch is still the schedule's batch of the
consumed samples, then rounded down. A --train-samples run then trains until the samples the flags
plan (those the undecreased steps would read: what the train split is sized for, whatever the
layout) would be passed, so it ends within one batch of them, its sample-based LR schedule run
through (Megatron-LM counts its steps with the undecreased batch and stops short).

Invariant: step k starts at sample ``consumed_k`` and reads ``get_global_batch_size(consumed_k)``
samples (the running batch), so ``consumed_{k+1} = consumed_k + get_global_batch_size(consumed_k)``:
the whole sample stream, and so a resume mid-ramp or on another data-parallel size, follows from the
consumed count alone. Nothing here needs a
process group; the parsers raise ValueError, which ``validation.py`` reports with the flag's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

_SUFFIXES = {"T": 10**12, "B": 10**9, "M": 10**6, "K": 10**3}


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """The global batch per step. ``global_batch_size``: the flags' batch once the schedule has
    settled (after the ramp, the last entry); ``rampup``: (start, increment, samples); ``steps``:
    ((threshold in samples, batch), ...) sorted, the first threshold 0; ``running_multiple``: with
    --decrease-batch-size-if-needed, micro-batch x DP, which each step's batch is rounded down to a
    multiple of (1: the schedule's batch as it is)."""

    global_batch_size: int
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None
    running_multiple: int = 1

    @property
    def is_constant(self) -> bool:
        return self.rampup is None and self.steps is None

    @property
    def decreases(self) -> bool:
        """--decrease-batch-size-if-needed may round a batch down (micro-batch x DP above 1)."""
        return self.running_multiple > 1

    @property
    def running_global_batch_size(self) -> int:
        """The settled batch a step runs: ``global_batch_size`` rounded down to ``running_multiple``."""
        return self.global_batch_size // self.running_multiple * self.running_multiple

    def as_scheduled(self) -> BatchSchedule:
        """This schedule without the rounding down: the batches the flags give."""
        return dataclasses.replace(self, running_multiple=1)

    @property
    def settles_at(self) -> int:
        """The consumed count from which every step's batch is ``global_batch_size``."""
        if self.rampup is not None:
            return self.rampup[2] + 1
        if self.steps is not None:
            return self.steps[-1][0]
        return 0

    def get_global_batch_size(self, consumed_samples: int) -> int:
        """The global batch the step that starts after ``consumed_samples`` samples runs (reads and
        counts): the schedule's, rounded down to ``running_multiple`` (megatron-core's running batch)."""
        batch = self.get_scheduled_batch_size(consumed_samples)
        return batch // self.running_multiple * self.running_multiple

    def get_scheduled_batch_size(self, consumed_samples: int) -> int:
        """The flags' global batch at ``consumed_samples`` (megatron-core's current global batch)."""
        if self.rampup is not None:
            start, increment, samples = self.rampup
            if consumed_samples > samples:
                return self.global_batch_size
            per_increment = samples / ((self.global_batch_size - start) // increment)  # float, as megatron-core
            return start + int(consumed_samples / per_increment) * increment
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed_samples < threshold:
                    break
                batch = size
            return batch
        return self.global_batch_size

    def iter_steps(self, first_sample: int = 0) -> Iterator[tuple[int, int]]:
        """(first sample, global batch) of each step from the one at ``first_sample``, endlessly."""
        consumed = first_sample
        while True:
            batch = self.get_global_batch_size(consumed)
            yield consumed, batch
            consumed += batch

    def get_consumed_samples(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` steps."""
        for k, (consumed, _) in enumerate(self.iter_steps()):
            if k == iterations:
                return consumed
        raise AssertionError("unreachable: iter_steps is endless")

    def get_batch_sizes(self, iterations: int, first_sample: int = 0) -> list[int]:
        """The distinct global batches, as the flags give them (before any rounding down), of
        ``iterations`` steps from the one at ``first_sample`` (0: the run's first; a resumed run's
        consumed samples) and the settled batch (what evaluation reads), in the order they first
        appear."""
        sizes: dict[int, None] = {}
        for k, (consumed, _) in enumerate(self.iter_steps(first_sample)):
            if k == iterations or consumed >= self.settles_at:
                break
            sizes[self.get_scheduled_batch_size(consumed)] = None
        sizes[self.global_batch_size] = None
        return list(sizes)


def get_train_iters(schedule: BatchSchedule, train_samples: int, first_sample: int = 0) -> int:
    """Steps of a ``--train-samples`` run, counted as Megatron-LM's ``update_train_iters`` counts
    them: constant, ``train_samples // G``; ramp-up (core_v0.16.1), the ramp's steps while at most
    the ramp's and the run's samples are consumed, then whole settled batches of what is left;
    step schedule (main), steps until ``train_samples`` are consumed (the last may pass it). A
    schedule that ``decreases``: the steps from the one at ``first_sample`` (a resumed run's consumed
    samples; the others count from 0) that stay within ``get_planned_samples``."""
    if schedule.decreases:
        planned, consumed, iterations = get_planned_samples(schedule, train_samples), first_sample, 0
        batch = schedule.get_global_batch_size(consumed)
        while 0 < batch and consumed + batch <= planned:  # (a batch rounded to 0: refused by validation)
            consumed, iterations = consumed + batch, iterations + 1
            batch = schedule.get_global_batch_size(consumed)
        return iterations
    if schedule.rampup is not None:
        iterations = consumed = 0
        while consumed <= schedule.rampup[2] and consumed <= train_samples:
            consumed += schedule.get_global_batch_size(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // schedule.global_batch_size
        return iterations
    if schedule.steps is not None:
        iterations = consumed = 0
        while consumed < train_samples:
            consumed += schedule.get_global_batch_size(consumed)
            iterations += 1
        return iterations
    return train_samples // schedule.global_batch_size


def get_planned_samples(schedule: BatchSchedule, train_samples: int) -> int:
    """The samples the steps of a ``--train-samples`` run read without rounding down: what its train
    split is sized for, on any layout (a running batch never exceeds the schedule's)."""
    scheduled = schedule.as_scheduled()
    return scheduled.get_consumed_samples(get_train_iters(scheduled, train_samples))


def parse_rampup(values: list[str], global_batch_size: int) -> tuple[int, int, int]:
    """``--rampup-batch-size START INCREMENT SAMPLES`` checked as megatron-core 0.16.1 checks it,
    and the two values on which it divides by zero (START = G: no ramp; SAMPLES = 0)."""
    if len(values) != 3:
        raise ValueError(f"takes 3 values <start batch> <batch increment> <ramp-up samples>, got {len(values)}")
    try:
        start, increment, samples = (int(v) for v in values)
    except ValueError:
        raise ValueError("takes 3 integers <start batch> <batch increment> <ramp-up samples>") from None
    if start <= 0 or increment <= 0 or samples <= 0:
        raise ValueError("the start batch, the increment and the ramp-up samples must be positive")
    if start >= global_batch_size:
        raise ValueError(
            f"starts at {start}, not below --global-batch-size {global_batch_size}: ramp up from a smaller "
            f"batch, or drop the flag for a constant batch"
        )
    if (global_batch_size - start) % increment:
        raise ValueError(
            f"--global-batch-size {global_batch_size} - start {start} = {global_batch_size - start} is not "
            f"divisible by the increment {increment} (megatron-core's rule): change the start or the increment"
        )
    return start, increment, samples


def parse_threshold(text: str) -> int:
    """A number with an optional K/M/B/T suffix, parsed as Megatron-LM main does (through float)."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    if multiplier != 1:
        value = value[:-1]
    return int(float(value) * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """``--step-batch-size-schedule`` as Megatron-LM main parses it: entries THRESHOLD:BATCH split
    at spaces or commas, thresholds in tokens (converted to samples: // seq_length), sorted, the
    first 0, strictly increasing, batches positive."""
    entries = text.strip().replace(",", " ").split()
    if not entries:
        raise ValueError('is empty: give entries "THRESHOLD:BATCH ..." (e.g. "0:16 2.4B:320")')
    out = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f'entry "{entry}" is not THRESHOLD:BATCH')
        threshold, batch = entry.split(":", 1)
        try:
            out.append((parse_threshold(threshold) // seq_length, parse_threshold(batch)))
        except ValueError:
            raise ValueError(f'entry "{entry}": THRESHOLD and BATCH must be numbers (suffixes K, M, B, T)') from None
    out.sort(key=lambda e: e[0])
    if out[0][0] != 0:
        raise ValueError(f"the first entry's threshold must be 0 (samples), got {out[0][0]}")
    for (a, _), (b, _) in zip(out, out[1:]):
        if b <= a:
            raise ValueError(
                f"thresholds must be strictly increasing in samples (tokens // --seq-length {seq_length}), "
                f"got {a} and {b}"
            )
    if any(batch <= 0 for _, batch in out):
        raise ValueError("every batch must be positive")
    return tuple(out)
