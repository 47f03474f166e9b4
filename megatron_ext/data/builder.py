"""The run's train and validation datasets, from the data flags.

Invariant: every rank builds the same datasets (rank 0 builds and caches indices first, the
others read them), so sample ``i`` is the same sample everywhere; which ranks read which samples
is decided later, per step (``microbatch.get_microbatch_indices``).

Variable-length samples (``--packed-sequences``, ``--one-document-per-row``) come from our
document-aware index (``packed_dataset.py``); fixed windows from megatron-core's ``GPTDataset``
(``gpt_datasets.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_ext.config import JobConfig, get_data_blends, uses_document_boundaries, uses_variable_lengths
from megatron_ext.data.gpt_datasets import EodBoundaryDataset, build_gpt_datasets, parse_split
from megatron_ext.data.packed_dataset import EodLossMask, build_blended_packed_datasets


def get_num_samples(cfg: JobConfig, global_batch_size: int) -> list[int]:
    """[train, valid, test] samples the run will read."""
    t = cfg.training
    num_evals = -(-t.train_iters // t.eval_interval) if t.eval_interval else 0  # and one at the end
    return [t.train_iters * global_batch_size, max(num_evals * t.eval_iters * global_batch_size, 1), 1]


def build_train_valid_datasets(
    cfg: JobConfig, tokenizer: Any, global_batch_size: int, log: Callable[[str], None] | None = None,
) -> tuple[Any, Any]:
    """(train, valid) datasets; ``log`` (the logging rank's) receives the packing summary."""
    num_samples = get_num_samples(cfg, global_batch_size)
    d, t = cfg.data, cfg.training
    blends = None if d.mock_data else get_data_blends(cfg)
    if uses_variable_lengths(cfg):
        strategy = d.packing_strategy if d.packed_sequences else "one_per_row"
        train_ds, valid_ds, _ = build_blended_packed_datasets(
            blends, parse_split(d.split) if blends.blend else [1.0], cfg.model.seq_length, strategy, t.seed,
            num_samples, d.data_cache_path, unused_splits=get_unused_splits(cfg), split_flag=d.split,
        )
        if d.eod_mask_loss:
            train_ds, valid_ds = (None if ds is None else EodLossMask(ds, tokenizer.eod) for ds in (train_ds, valid_ds))
        if log is not None:
            for part in getattr(train_ds, "datasets", [train_ds]):
                index = part.index
                log(
                    f"> {strategy} samples of {part.indexed.path_prefix}: {index.num_bins} of <= "
                    f"{cfg.model.seq_length} tokens from {len(index.piece_len)} document pieces | packing "
                    f"efficiency (real tokens / slots at --seq-length): {index.efficiency(cfg.model.seq_length):.3f}"
                    f" | this run reads {part.samples_read} of them, {part.samples_read / max(index.num_bins, 1):.2f} epochs"
                )
        return train_ds, valid_ds
    train_ds, valid_ds, _ = build_gpt_datasets(
        tokenizer, cfg.model.seq_length, num_samples, split=d.split, mock_data=d.mock_data, random_seed=t.seed,
        path_to_cache=d.data_cache_path, reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss, create_attention_mask=False,
        unused_splits=get_unused_splits(cfg), blend=blends and blends.blend, blend_per_split=blends and blends.per_split,
    )
    if log is not None and train_ds is not None:
        for part in getattr(train_ds, "datasets", [train_ds]):
            log(describe_windows(part, cfg.model.seq_length))
    if uses_document_boundaries(cfg):
        train_ds, valid_ds = (EodBoundaryDataset(ds, tokenizer.eod, d.reset_attention_mask) if ds is not None else None
                              for ds in (train_ds, valid_ds))
    return train_ds, valid_ds


def get_unused_splits(cfg: JobConfig) -> tuple[int, ...]:
    """The test split always (nothing reads it), the validation split without --eval-interval."""
    return (2,) if cfg.training.eval_interval else (1, 2)


def describe_windows(ds: Any, seq_length: int) -> str:
    """One line on a megatron-core GPTDataset's training windows: how many, over how much data, and
    how many passes over it this run makes (megatron-core logs this only at INFO level)."""
    lengths = getattr(getattr(ds, "dataset", None), "sequence_lengths", None)
    indices = getattr(ds, "indices", None)
    prefix = getattr(getattr(ds, "dataset", None), "path_prefix", None)
    if lengths is None or indices is None or not len(indices) or prefix is None:  # e.g. --mock-data
        return f"> {type(ds).__name__}: {len(ds)} samples of {seq_length} tokens"
    tokens = int(lengths[indices].sum())
    line = (f"> windows of {prefix} ({ds.index_split.name}): {len(ds)} samples of {seq_length} "
            f"tokens over {len(indices)} documents ({tokens:,} tokens)")
    if ds.num_samples is None:  # a prefix of an unweighted blend: megatron-core builds one epoch, no count
        return line + " | one epoch of them (a blend without weights draws each prefix by its size)"
    epochs = ds.num_samples * seq_length / max(tokens, 1)
    return line + f" | this run reads {ds.num_samples} samples, {epochs:.2f} epochs"
