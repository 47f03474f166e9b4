# Copyright (c) 2022, NVIDIA CORPORATION. All rights reserved. (BSD-3-Clause, Megatron-LM's LICENSE)
"""Test reference only: Megatron-LM main's ``StepBatchsizeNumMicroBatchesCalculator``, copied from
NVIDIA/Megatron-LM ``megatron/core/num_microbatches_calculator.py`` at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22; megatron-core 0.16.1, installed here, predates
it). Unchanged but for formatting and its base class, which is megatron-core 0.16.1's (the same).
tests/unit/test_batch_schedule.py compares ``megatron_ext/data/batch_schedule.py`` with it."""

import logging

from megatron.core.num_microbatches_calculator import NumMicroBatchesCalculator

logger = logging.getLogger(__name__)


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Calculator of number of microbatches with arbitrary step-wise batch size schedule.

    Args:
        micro_batch_size (int): Micro batch size.
        data_parallel_size (int): Data parallel size.
        decrease_batch_size_if_needed (bool): Must be False. Step schedules do not support
            decreasing batch size for divisibility.
        rank (int): Rank for logging.
        schedule (str): Schedule string in format "THRESHOLD:BS THRESHOLD:BS ...".
            Thresholds support suffixes: K (1e3), M (1e6), B (1e9), T (1e12).
            Examples:
                "0:768 250B:1536 500B:3072 750B:6144" (thresholds in tokens)
                "0:768 61035156250:1536" (thresholds in samples)
        seq_length (int, optional): Sequence length for token-to-sample conversion.
            If provided, thresholds are interpreted as tokens and converted to samples.
            If None, thresholds are interpreted as samples directly.
    """

    def __init__(
        self,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        schedule: str,
        seq_length: int | None = None,
    ) -> None:
        super().__init__()

        if decrease_batch_size_if_needed:
            raise ValueError("Step batch size schedules do not support decrease_batch_size_if_needed")

        self.micro_batch_size = micro_batch_size
        self.data_parallel_size: int = data_parallel_size
        self.rank: int = rank
        self.seq_length: int | None = seq_length

        self.micro_batch_times_data_parallel_size: int = micro_batch_size * data_parallel_size
        assert self.micro_batch_times_data_parallel_size > 0

        # Parse schedule string
        self.schedule = self._parse_schedule(schedule, seq_length)

        # Validate schedule
        self._validate_schedule()

        self.global_batch_size: int = self.schedule[-1][1]
        self.current_global_batch_size = None

        if rank == 0:
            logger.info("> initializing step batch size schedule")
            logger.info(f'  raw schedule string: "{schedule}"')
            unit = "tokens" if seq_length else "samples"
            logger.info(f"  seq_length: {seq_length} (thresholds interpreted as {unit})")
            logger.info(f"  micro_batch_size: {micro_batch_size}")
            logger.info(f"  data_parallel_size: {data_parallel_size}")
            logger.info(f"step batch size schedule ({len(self.schedule)} steps):")
            for threshold, batch_size in self.schedule:
                num_microbatches = batch_size // self.micro_batch_times_data_parallel_size
                if seq_length:
                    tokens = threshold * seq_length
                    logger.info(
                        f"  >= {tokens:,} tokens ({threshold:,} samples)"
                        f" -> batch_size={batch_size},"
                        f" num_microbatches={num_microbatches}"
                    )
                else:
                    logger.info(
                        f"  >= {threshold:,} samples -> batch_size={batch_size}, num_microbatches={num_microbatches}"
                    )
        # Initialize
        self.update(0, consistency_check=False, verbose=True)

    @staticmethod
    def _parse_numeric_value(value_str: str) -> int:
        """Parse numeric value with optional suffix (K, M, B, T)."""
        value_str = value_str.strip().upper()

        multiplier = 1
        if value_str.endswith("T"):
            multiplier = 1_000_000_000_000
            value_str = value_str[:-1]
        elif value_str.endswith("B"):
            multiplier = 1_000_000_000
            value_str = value_str[:-1]
        elif value_str.endswith("M"):
            multiplier = 1_000_000
            value_str = value_str[:-1]
        elif value_str.endswith("K"):
            multiplier = 1_000
            value_str = value_str[:-1]

        return int(float(value_str) * multiplier)

    @classmethod
    def _parse_schedule(cls, schedule_str: str, seq_length: int | None) -> list[tuple[int, int]]:
        """Parse schedule string into list of (threshold_samples, batch_size) tuples.

        Args:
            schedule_str: Space-separated "THRESHOLD:BATCH_SIZE" pairs.
            seq_length: If provided, convert thresholds from tokens to samples.

        Returns:
            List of (threshold_samples, batch_size) tuples, sorted by threshold.
        """
        schedule = []
        entries = schedule_str.strip().replace(",", " ").split()

        for entry in entries:
            if ":" not in entry:
                raise ValueError(f'Invalid schedule entry "{entry}". Expected format: "THRESHOLD:BATCH_SIZE"')

            threshold_str, batch_size_str = entry.split(":", 1)
            threshold = cls._parse_numeric_value(threshold_str)
            batch_size = cls._parse_numeric_value(batch_size_str)

            # Convert tokens to samples if seq_length provided
            if seq_length is not None:
                threshold = threshold // seq_length

            schedule.append((threshold, batch_size))

        # Sort by threshold ascending
        schedule.sort(key=lambda x: x[0])

        return schedule

    def _validate_schedule(self) -> None:
        """Validate the parsed schedule."""
        assert len(self.schedule) > 0, "schedule must have at least one entry"
        assert self.schedule[0][0] == 0, f"first schedule entry must have threshold 0, got {self.schedule[0][0]}"

        # Check strictly increasing thresholds
        for i in range(1, len(self.schedule)):
            assert self.schedule[i][0] > self.schedule[i - 1][0], (
                f"schedule thresholds must be strictly increasing, "
                f"got {self.schedule[i - 1][0]} before {self.schedule[i][0]}"
            )

        # Validate batch sizes are positive.
        # NOTE: divisibility by micro_batch_size * data_parallel_size is NOT checked here
        # because early schedule entries may be smaller than the current GPU configuration
        # (e.g., after scaling up GPUs mid-training). Divisibility of the CURRENT batch size
        # is checked at runtime in update() when consistency_check=True (after checkpoint loading).
        for threshold, batch_size in self.schedule:  # noqa: B007
            assert batch_size > 0, f"batch size must be positive, got {batch_size}"

    def _get_batch_size_for_samples(self, consumed_samples: int) -> int:
        """Get the batch size for the given number of consumed samples."""
        batch_size = self.schedule[0][1]
        for threshold, bs in self.schedule:
            if consumed_samples >= threshold:
                batch_size = bs
            else:
                break
        return batch_size

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Update number of microbatches based on consumed samples.

        Args:
            consumed_samples (int): Number of samples consumed.
            consistency_check (bool): Check divisibility constraints.
            verbose (bool): Enable logging.
        """
        self.current_global_batch_size = self._get_batch_size_for_samples(consumed_samples)
        assert self.current_global_batch_size is not None

        # Consistency check
        if consistency_check:
            assert self.current_global_batch_size % self.micro_batch_times_data_parallel_size == 0, (
                f"current global batch size ({self.current_global_batch_size}) is not divisible by "
                f"micro_batch_size ({self.micro_batch_size}) * "
                f"data_parallel_size ({self.data_parallel_size})"
            )

        self.current_running_global_batch_size = self.current_global_batch_size
        assert self.current_running_global_batch_size is not None
        self.num_micro_batches = self.current_running_global_batch_size // self.micro_batch_times_data_parallel_size
