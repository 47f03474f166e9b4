"""Train/valid/test GPT datasets from Megatron-LM style ``--data-path`` / ``--split`` flags.

A thin layer over megatron-core: flags are parsed and validated by pure helpers here (errors
name the flag), then ``BlendedMegatronDatasetBuilder`` builds ``GPTDataset`` (or, for
``--mock-data``, ``MockGPTDataset``) splits. The builder is distributed-aware: under
torch.distributed rank 0 builds (and caches) the indices first and the others load them after a
barrier; without a process group it simply builds. Each sample is a window of
``sequence_length + 1`` tokens, returned as ``tokens = window[:-1]`` and ``labels = window[1:]``.

Nothing in an index cache runs: megatron-core loads its caches (under ``--data-cache-path``, else
beside the data) with ``numpy.load(allow_pickle=True)``, which unpickles any file that is not a
NumPy array (a forged one runs its code). Its dataset modules see numpy with a ``load`` that
never unpickles (``apply_pickle_free_index_loads``, compat.py "pickle-free-index-caches"): its
caches are integer arrays, and a file holding Python objects is refused by name.
"""

import contextlib
import logging
import math
import os
import types
import warnings
from collections.abc import Callable, Sequence

import numpy

from megatron_ext.config import ConfigError
from megatron_ext.data import microbatch

Blend = tuple[list[str], list[float] | None]


def parse_data_path(data_path: Sequence[str]) -> Blend:
    """``["prefA"]``, ``["prefA", "prefB"]`` or ``["0.3", "prefA", "0.7", "prefB"]`` -> blend.

    Returns (prefixes, weights); weights is None when no weights were given (megatron-core then
    weights by dataset size). Weights must all be given or all be absent, and be positive.
    """
    items = [str(item).strip() for item in data_path]
    if not items or any(not item for item in items):
        raise ConfigError([f"--data-path needs one or more dataset prefixes, got {list(data_path)}"])

    def as_weight(item: str) -> float | None:
        try:
            return float(item)
        except ValueError:
            return None

    if all(as_weight(item) is None for item in items):
        return items, None
    if len(items) % 2 or any(as_weight(w) is None for w in items[0::2]):
        raise ConfigError(
            [
                f"--data-path {' '.join(items)} mixes weights and prefixes; give either prefixes only "
                f"(PREFIX [PREFIX ...]) or weight/prefix pairs (W1 PREFIX1 W2 PREFIX2 ...)"
            ]
        )
    weights = [as_weight(w) for w in items[0::2]]
    prefixes = items[1::2]
    if any(as_weight(p) is not None for p in prefixes):
        raise ConfigError(
            [
                f"--data-path {' '.join(items)}: a prefix looks like a number; "
                f"use weight/prefix pairs (W1 PREFIX1 W2 PREFIX2 ...)"
            ]
        )
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        raise ConfigError(
            [
                f"--data-path weights {weights} must be finite and > 0 (megatron-core's BlendedDataset "
                f"requires it): leave a prefix out rather than weighting it 0"
            ]
        )
    return prefixes, weights


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised [train, valid, test] fractions; missing parts are 0."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError as exc:
        raise ConfigError([f"--split {split!r} must be up to 3 comma-separated numbers, e.g. 969,30,1"]) from exc
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise ConfigError([f"--split {split!r} must be 1 to 3 non-negative numbers, e.g. 969,30,1"])
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise ConfigError([f"--split {split!r} must have a positive sum, e.g. 969,30,1"])
    return [v / sum(values) for v in values]


def get_missing_dataset_files(prefixes: Sequence[str]) -> list[str]:
    """The ``PREFIX.bin`` / ``PREFIX.idx`` paths that do not exist."""
    return [prefix + ext for prefix in prefixes for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]


def validate_data_prefixes(prefixes: Sequence[str]) -> None:
    """ConfigError naming ``--data-path`` and every missing file."""
    missing = get_missing_dataset_files(prefixes)
    if missing:
        raise ConfigError(
            [
                f"--data-path: missing {', '.join(missing)}. Each prefix needs PREFIX.bin and "
                f"PREFIX.idx (pass the prefix without extension, e.g. "
                f"data/default/corpus_text_document; "
                f"build them with tools/preprocess_data.py or tools/make_default_data.py)"
            ]
        )


def validate_num_samples(num_samples: Sequence[int | None], weights) -> list[int | None]:
    """[train, valid, test] sample counts; None only where megatron-core allows it."""
    num_samples = list(num_samples)
    if len(num_samples) != 3 or any(n is not None and n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be [train, valid, test] counts >= 0 (or None), got {num_samples}")
    if weights is not None and any(n is None for n in num_samples):
        raise ConfigError(
            [
                f"--data-path with weights needs a sample count for every split, "
                f"got num_samples={num_samples}; give counts or drop the weights"
            ]
        )
    return num_samples


@contextlib.contextmanager
def maybe_single_process_rank():
    """Without a process group, let ``torch.distributed.get_rank()`` answer 0 meanwhile.

    megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls ``get_rank()`` unguarded on a
    cache miss whenever ``path_to_cache`` is set, which raises in a single process (the other
    dataset classes check ``is_initialized()`` first). A single process is rank 0, so we say so,
    only for the duration of the build and only when no process group exists.
    """
    import torch.distributed

    if torch.distributed.is_initialized():
        yield
        return
    original = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = original


SPLIT_NAMES = ("train", "valid", "test")


def get_split_document_counts(num_docs: int, split_matrix) -> list[int | None]:
    """Documents of each split of one prefix, by megatron-core's rule (round(fraction x docs)
    at each end); None for a split that is not built."""
    return [None if s is None else int(round(s[1] * num_docs)) - int(round(s[0] * num_docs)) for s in split_matrix]


def check_splits_have_documents(prefixes: Sequence[str], split_matrix, split: str) -> None:
    """ConfigError naming --split and the counts when a split the run reads has no document in
    some prefix (megatron-core's GPTDataset would loop forever looking for its epochs)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    problems = []
    for prefix in prefixes:
        num_docs = len(IndexedDataset(prefix).sequence_lengths)
        counts = get_split_document_counts(num_docs, split_matrix)
        empty = [SPLIT_NAMES[i] for i, n in enumerate(counts) if n == 0]
        if empty:
            shown = ", ".join(f"{SPLIT_NAMES[i]} {n}" for i, n in enumerate(counts) if n is not None)
            problems.append(f"{prefix} ({num_docs} documents): {'/'.join(empty)} gets none ({shown})")
    if problems:
        raise ConfigError(
            [
                f"--split {split} leaves a split the run reads without documents: "
                f"{'; '.join(problems)}. Give it more weight, or --eval-interval 0 when it is "
                f"the validation split"
            ]
        )


def check_prefixes_have_documents(prefixes: Sequence[str]) -> None:
    """ConfigError naming the prefixes a per-split blend reads whole that hold no document
    (megatron-core's GPTDataset would loop forever counting their epochs)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    empty = [p for p in dict.fromkeys(prefixes) if not len(IndexedDataset(p).sequence_lengths)]
    if empty:
        raise ConfigError([f"--train/valid/test-data-path: {', '.join(empty)} has no documents; leave it out"])


def build_gpt_dataset_config(
    tokenizer,
    sequence_length: int,
    blend: Blend | None,
    split: str = "969,30,1",
    random_seed: int = 1234,
    path_to_cache: str | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    blend_per_split=None,
):
    """megatron-core ``GPTDatasetConfig``; ``blend=None`` (and no ``blend_per_split``) means mock
    data."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if sequence_length < 1:
        raise ConfigError([f"--seq-length must be >= 1, got {sequence_length}"])
    return GPTDatasetConfig(
        random_seed=random_seed,
        sequence_length=sequence_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend is None else split,
        path_to_cache=path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )


def build_gpt_datasets(
    tokenizer,
    sequence_length: int,
    num_samples: Sequence[int | None],
    data_path: Sequence[str] | None = None,
    split: str = "969,30,1",
    mock_data: bool = False,
    random_seed: int = 1234,
    path_to_cache: str | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    is_built_on_rank: Callable[[], bool] | None = None,
    unused_splits: Sequence[int] = (),
    blend: Blend | None = None,
    blend_per_split=None,
):
    """Build (train, valid, test) datasets; a split with zero weight comes back as None.

    Args:
        tokenizer: from ``megatron_ext.data.tokenizers.build_tokenizer`` (needs vocab_size, eod, pad).
        sequence_length: tokens per sample (each sample reads sequence_length + 1 tokens).
        num_samples: [train, valid, test] samples to draw (epochs repeat as needed).
        data_path: ``--data-path`` items (prefixes, or weight/prefix pairs); ignored if mock.
        split: ``--split`` weights for train/valid/test documents of each prefix.
        mock_data: ``--mock-data``: megatron-core's synthetic ``MockGPTDataset``.
        path_to_cache: where megatron-core caches its index arrays; None means megatron-core's
            default, a ``cache/`` folder next to the first prefix's files.
        is_built_on_rank: whether this rank builds datasets (default: every rank).
        unused_splits: split indices (0 train, 1 valid, 2 test) the run never reads: not built, so
            a split without documents cannot send megatron-core's epoch loop spinning; a used
            split without documents is a ConfigError naming --split and the document counts.
        blend: the parsed ``data_path`` (prefixes, weights), given instead of it.
        blend_per_split: [train, valid, test] blends (``--train-data-path`` ...; None where
            absent), each read whole, instead of ``data_path`` and ``split``.
    """
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    options = dict(
        random_seed=random_seed,
        path_to_cache=path_to_cache,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    if blend_per_split is not None:
        blend_per_split = _drop_unused_blends(blend_per_split, unused_splits)
        sizes = validate_num_samples(num_samples, None)
        config = build_gpt_dataset_config(
            tokenizer, sequence_length, None, split, blend_per_split=blend_per_split, **options
        )
        return _build_splits(GPTDataset, sizes, is_built_on_rank, config, path_to_cache)
    blend = None if mock_data else _resolve_blend(data_path, blend, split)
    sizes = validate_num_samples(num_samples, None if blend is None else blend[1])
    config = build_gpt_dataset_config(tokenizer, sequence_length, blend, split, **options)
    if blend is not None:
        config.split_matrix = [None if i in unused_splits else s for i, s in enumerate(config.split_matrix)]
        check_splits_have_documents(blend[0], config.split_matrix, split)
    dataset_cls = MockGPTDataset if mock_data else GPTDataset
    train, valid, test = _build_splits(dataset_cls, sizes, is_built_on_rank, config, path_to_cache)
    return train, valid, test


def _drop_unused_blends(blend_per_split, unused_splits: Sequence[int]):
    """``blend_per_split`` with None for the splits the run never reads; ConfigError where a prefix
    of the others is invalid or holds no document."""
    blend_per_split = [None if i in unused_splits else b for i, b in enumerate(blend_per_split)]
    validate_data_prefixes([p for b in blend_per_split if b for p in b[0]])
    check_prefixes_have_documents([p for b in blend_per_split if b for p in b[0]])
    return blend_per_split


def _resolve_blend(data_path: Sequence[str] | None, blend: Blend | None, split: str) -> Blend:
    """The blend ``--data-path`` gives (or ``blend``, already parsed), with it and ``--split`` checked."""
    if not data_path and blend is None:
        raise ConfigError(
            ["--data-path is required unless --mock-data is set (e.g. --data-path data/default/corpus_text_document)"]
        )
    blend = blend or parse_data_path(data_path)
    validate_data_prefixes(blend[0])
    parse_split(split)
    return blend


def load_index_cache(file, mmap_mode: str | None = None, allow_pickle: bool = False, **kwargs) -> numpy.ndarray:
    """``numpy.load`` for megatron-core's index caches, never unpickling whatever ``allow_pickle``
    says: a file holding Python objects (a pickle, an object array) is a ConfigError saying it may
    have been tampered with, a damaged one a ConfigError saying so; either is derived data that
    megatron-core rebuilds once deleted."""
    try:
        return numpy.load(file, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)
    except (ValueError, OSError, EOFError) as err:
        pickled = "pickle" in str(err) or "Python objects" in str(err) or "Object arrays" in str(err)
        what = (
            "holds Python objects, which megatron-core's index caches never hold: it may have been tampered with "
            "(nothing in it ran); check who can write there, then"
            if pickled
            else f"cannot be read ({type(err).__name__}: {err}): it is damaged;"
        )
        raise ConfigError(
            [f"the dataset index cache {file} {what} delete it (megatron-core rebuilds it from the data)"]
        ) from None


class _PickleFreeNumpy(types.ModuleType):
    """numpy as megatron-core's dataset modules see it, with ``load_index_cache`` as ``load``."""

    load = staticmethod(load_index_cache)

    def __getattr__(self, name: str):
        return getattr(numpy, name)


def apply_pickle_free_index_loads() -> None:
    """Make megatron-core's GPTDataset and BlendedDataset load their index caches with
    ``load_index_cache`` (module docstring); idempotent."""
    from megatron.core.datasets import blended_dataset, gpt_dataset

    for module in (gpt_dataset, blended_dataset):
        if not isinstance(module.numpy, _PickleFreeNumpy):
            module.numpy = _PickleFreeNumpy("numpy")


def _build_splits(dataset_cls, sizes, is_built_on_rank: Callable[[], bool] | None, config, path_to_cache: str | None):
    """megatron-core's builder run over ``config``: a process group's rank 0 first (see the module docstring)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    apply_pickle_free_index_loads()  # before any cache is read

    builder = BlendedMegatronDatasetBuilder(dataset_cls, sizes, is_built_on_rank or (lambda: True), config)
    with maybe_single_process_rank():
        return build_with_cache_check(builder, path_to_cache)


def build_with_cache_check(builder, path_to_cache: str | None):
    """``builder.build()``; megatron-core's failure to write its index cache (beside the data unless
    --data-cache-path: a read-only dataset directory) becomes one error naming the flag."""
    try:
        with _quiet_expected_messages(builder.config.tokenizer):
            return builder.build()
    except OSError as exc:  # one process: megatron-core's own OSError, unwrapped
        if str(exc.filename or "").endswith((".bin", ".idx")):
            raise
        cause = exc
    except Exception as exc:  # under torch.distributed megatron-core wraps it in a plain Exception
        if "Failed to write dataset materials to the data cache directory" not in str(exc):
            raise
        cause = exc.__cause__
    where = f"--data-cache-path {path_to_cache}" if path_to_cache else "the cache directory beside the data"
    raise ConfigError(
        [
            f"cannot write megatron-core's dataset index cache to {where} ({cause}): give "
            f"--data-cache-path a writable directory (e.g. on local disk)"
        ]
    ) from None


class _DropMockCacheNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to save MockGPTDataset indexes" not in record.getMessage()


@contextlib.contextmanager
def _quiet_expected_messages(tokenizer):
    """megatron-core's dataset build without two messages that are expected here, once per split
    and rank: ``MockGPTDataset`` has no index cache to save (--mock-data), and "the pad token id
    collides with another special token" when pad is EOD, which our tokenizers without a pad
    piece choose (megatron-core then masks no pad id, as wanted: EOD stays a trained token)."""
    dataset_logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    drop = _DropMockCacheNotice()
    dataset_logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            if getattr(tokenizer, "pad", None) is not None and tokenizer.pad == getattr(tokenizer, "eod", None):
                warnings.filterwarnings("ignore", message=".*pad token id in the tokenizer collides.*")
            yield
    finally:
        dataset_logger.removeFilter(drop)


class EodBoundaryDataset:
    """megatron-core GPTDataset windows with their EOD tokens as THD document boundaries.

    megatron-core computes the sample (its ``reset_position_ids`` restarts positions after each
    EOD, its ``eod_mask_loss`` masks the loss where the input is EOD); with
    ``reset_attention_mask`` it would build a dense [s, s] mask, which we never ask for: the window
    gets ``cu_seqlens`` instead, ending a document after each EOD (the EOD belongs to the document
    it closes, as in megatron-core's mask), so the packed attention path keeps documents apart.
    With ``reset_position_ids`` alone the window is one "document" (attention spans it) that
    carries its restarted positions to the rotary embedding.
    """

    def __init__(self, dataset, eod: int, reset_attention_mask: bool):
        self.dataset, self.eod, self.reset_attention_mask = dataset, int(eod), reset_attention_mask

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        import numpy as np

        sample = dict(self.dataset[index])
        tokens = np.asarray(sample["tokens"])
        n = len(tokens)
        ends = np.flatnonzero(tokens == self.eod) + 1 if self.reset_attention_mask else np.zeros(0, dtype=np.int64)
        sample["cu_seqlens"] = np.concatenate([[0], ends[ends < n], [n]]).astype(np.int32)
        return sample

    def describe_sample(self, index: int) -> str:
        return microbatch.describe_sample(self.dataset, index)

    def __getattr__(self, name: str):  # the builders read GPTDataset's attributes
        if name == "dataset":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)
