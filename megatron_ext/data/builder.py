"""The run's train and validation datasets, from the data flags.

Invariant: every rank builds the same datasets (rank 0 builds and caches indices first, the
others read them), so sample ``i`` is the same sample everywhere; which ranks read which samples
is decided later, per step (``microbatch.get_microbatch_indices``).

Variable-length samples (``--packed-sequences``, ``--one-document-per-row``) come from our
document-aware index (``packed_dataset.py``); fixed windows from megatron-core's ``GPTDataset``
(``gpt_datasets.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_ext.config import DataConfig, JobConfig, TrainingConfig
from megatron_ext.data.batch_schedule import BatchSchedule, get_planned_samples
from megatron_ext.data.blends import DataBlends, get_data_blends
from megatron_ext.data.context_split import get_document_padding
from megatron_ext.data.gpt_datasets import EodBoundaryDataset, build_gpt_datasets, parse_split
from megatron_ext.data.packed_dataset import EodLossMask, build_blended_packed_datasets
from megatron_ext.data.validation_sets import ValidationSet
from megatron_ext.derived import uses_document_boundaries, uses_variable_lengths


def get_num_samples(
    t: TrainingConfig, global_batch_size: int, schedule: BatchSchedule | None = None
) -> list[int | None]:
    """[train, valid, test] samples the run will read: the training steps' (of ``schedule``'s
    batches; None: ``global_batch_size`` each), the evaluations' (each batch the settled global
    batch; None under --full-validation: one epoch of the split, as Megatron-LM builds it). Under
    --decrease-batch-size-if-needed the train split is sized for the flags' batches (as Megatron-LM
    sizes it), never less than the rounded-down steps read: the same split, and so the same sample
    stream, on whatever data-parallel size the run is resumed."""
    num_evals = -(-t.train_iters // t.eval_interval) if t.eval_interval else 0  # and one at the end
    if schedule is not None and schedule.decreases:
        scheduled = schedule.as_scheduled()
        train = (
            get_planned_samples(schedule, t.train_samples)
            if t.train_samples is not None
            else scheduled.get_consumed_samples(t.train_iters)
        )
    else:
        train = schedule.get_consumed_samples(t.train_iters) if schedule else t.train_iters * global_batch_size
    valid = None if t.full_validation else max(num_evals * t.eval_iters * global_batch_size, 1)
    return [train, valid, 1]


def get_unused_splits(t: TrainingConfig) -> tuple[int, ...]:
    """The test split always (nothing reads it), the validation split without --eval-interval."""
    return (2,) if t.eval_interval else (1, 2)


def build_train_valid_datasets(
    cfg: JobConfig,
    tokenizer: Any,
    global_batch_size: int,
    log: Callable[[str], None] | None = None,
    schedule: BatchSchedule | None = None,
) -> tuple[Any, Any]:
    """(train, valid) datasets of the run's flags: how many samples each split gives (the run's
    length, each step's batch from ``schedule``, and evaluations) and which builder the data flags
    choose; ``log`` (the logging rank's) receives a summary line per dataset."""
    d, t = cfg.data, cfg.training
    blends = None if d.mock_data else get_data_blends(d)
    num_samples, unused = get_num_samples(t, global_batch_size, schedule), get_unused_splits(t)
    if uses_variable_lengths(d):
        g = get_document_padding(d, cfg.parallel.context_parallel_size)
        return build_document_datasets(d, blends, tokenizer, cfg.model.seq_length, t.seed, num_samples, unused, log, g)
    if t.multiple_validation_sets and 1 not in unused:
        train_ds, _ = build_window_datasets(
            d, blends, tokenizer, cfg.model.seq_length, t.seed, num_samples, (1, 2), log
        )
        return train_ds, build_validation_sets(d, blends, tokenizer, cfg.model.seq_length, t.seed, log)
    return build_window_datasets(d, blends, tokenizer, cfg.model.seq_length, t.seed, num_samples, unused, log)


def build_validation_sets(
    d: DataConfig,
    blends: DataBlends,
    tokenizer: Any,
    seq_length: int,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> list[ValidationSet]:
    """``--multiple-validation-sets``: one set per prefix of the validation blend, each one epoch of
    megatron-core GPTDataset windows of that prefix alone (Megatron-LM's builder does the same)."""
    sets = []
    for k, prefix in enumerate(blends.per_split[1][0]):
        one = DataBlends(per_split=(None, ([prefix], None), None), source=blends.source)
        _, ds = build_window_datasets(d, one, tokenizer, seq_length, seed, [0, None, 0], (0, 2))
        sets.append(ValidationSet(prefix, ds))
        if log is not None:
            log(f"> validation set {k}: {prefix}, {len(ds)} samples of {seq_length} tokens")
    return sets


def build_document_datasets(
    d: DataConfig,
    blends: DataBlends,
    tokenizer: Any,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    unused_splits: Sequence[int],
    log: Callable[[str], None] | None = None,
    pad_multiple: int = 1,
) -> tuple[Any, Any]:
    """(train, valid) samples of whole documents (``--packed-sequences``, or
    ``--one-document-per-row``) from our document-aware index (``packed_dataset.py``), packed with
    every document counted padded to a multiple of ``pad_multiple`` (g, --document-pad-multiple)."""
    strategy = d.packing_strategy if d.packed_sequences else "one_per_row"
    train_ds, valid_ds, _ = build_blended_packed_datasets(
        blends,
        parse_split(d.split) if blends.blend else [1.0],
        seq_length,
        strategy,
        seed,
        num_samples,
        d.data_cache_path,
        unused_splits=unused_splits,
        split_flag=d.split,
        pad_multiple=pad_multiple,
    )
    if d.eod_mask_loss:
        train_ds, valid_ds = (None if ds is None else EodLossMask(ds, tokenizer.eod) for ds in (train_ds, valid_ds))
    if log is not None:
        for part in getattr(train_ds, "datasets", [train_ds]):
            index = part.index
            log(
                f"> {strategy} samples of {part.indexed.path_prefix}: {index.num_bins} of <= "
                f"{seq_length} tokens from {len(index.piece_len)} document pieces | packing "
                f"efficiency (real tokens / slots at --seq-length): {index.efficiency(seq_length):.3f}"
                f"{describe_document_padding(index, pad_multiple)} | this run reads {part.samples_read} of them, "
                f"{part.samples_read / max(index.num_bins, 1):.2f} epochs"
            )
    return train_ds, valid_ds


def describe_document_padding(index: Any, pad_multiple: int) -> str:
    """' | documents padded to a multiple of g: +x% tokens' (empty at g = 1)."""
    if pad_multiple == 1:
        return ""
    real = max(int(index.piece_len.sum()), 1)
    extra = int(index.padded_bin_lengths(pad_multiple).sum()) - real
    return f" | documents padded to a multiple of --document-pad-multiple {pad_multiple}: +{100 * extra / real:.2f}% tokens"


def build_window_datasets(
    d: DataConfig,
    blends: DataBlends | None,
    tokenizer: Any,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    unused_splits: Sequence[int],
    log: Callable[[str], None] | None = None,
) -> tuple[Any, Any]:
    """(train, valid) windows of ``seq_length`` + 1 tokens from megatron-core's ``GPTDataset``
    (``gpt_datasets.py``; None blends: ``--mock-data``), split at EOD into documents with
    ``--reset-attention-mask`` / ``--reset-position-ids``."""
    train_ds, valid_ds, _ = build_gpt_datasets(
        tokenizer,
        seq_length,
        num_samples,
        split=d.split,
        mock_data=d.mock_data,
        random_seed=seed,
        path_to_cache=d.data_cache_path,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,
        unused_splits=unused_splits,
        blend=blends and blends.blend,
        blend_per_split=blends and blends.per_split,
    )
    if log is not None and train_ds is not None:
        for part in getattr(train_ds, "datasets", [train_ds]):
            log(describe_windows(part, seq_length))
    if uses_document_boundaries(d):
        train_ds, valid_ds = (
            EodBoundaryDataset(ds, tokenizer.eod, d.reset_attention_mask) if ds is not None else None
            for ds in (train_ds, valid_ds)
        )
    return train_ds, valid_ds


def describe_windows(ds: Any, seq_length: int) -> str:
    """One line on a megatron-core GPTDataset's training windows: how many, over how much data, and
    how many passes over it this run makes (megatron-core logs this only at INFO level)."""
    lengths = getattr(getattr(ds, "dataset", None), "sequence_lengths", None)
    indices = getattr(ds, "indices", None)
    prefix = getattr(getattr(ds, "dataset", None), "path_prefix", None)
    if lengths is None or indices is None or not len(indices) or prefix is None:  # e.g. --mock-data
        return f"> {type(ds).__name__}: {len(ds)} samples of {seq_length} tokens"
    tokens = int(lengths[indices].sum())
    line = (
        f"> windows of {prefix} ({ds.index_split.name}): {len(ds)} samples of {seq_length} "
        f"tokens over {len(indices)} documents ({tokens:,} tokens)"
    )
    if ds.num_samples is None:  # a prefix of an unweighted blend: megatron-core builds one epoch, no count
        return line + " | one epoch of them (a blend without weights draws each prefix by its size)"
    epochs = ds.num_samples * seq_length / max(tokens, 1)
    return line + f" | this run reads {ds.num_samples} samples, {epochs:.2f} epochs"
