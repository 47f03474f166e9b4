"""Samples that know their documents, over megatron-core's ``IndexedDataset``.

Storage stays megatron-core's ``.bin/.idx``; the sample index is ours (``packing.py``), cached
beside the data (or under ``--data-cache-path``), since ``GPTDataset``'s fixed windows do not know
document boundaries. A sample is one bin of whole documents (or pieces of over-long ones):

- ``tokens``  [L]  the documents' tokens, concatenated, L <= seq_length (unpadded);
- ``labels``  [L]  the next token of the same document; the last position of each document
  predicts nothing (IGNORE_INDEX): no document learns to predict the next one's first token;
- ``position_ids`` [L] (restarting at 0 for each document);
- ``cu_seqlens`` [n_docs + 1] int32: document boundaries (0, ..., L).

With ``--document-pad-multiple g`` > 1 the packer counts every piece padded to a multiple of g (the
index and its cache key depend on g; g = 1 keeps both exactly as they were), and the step-data
collate pads the documents (``data/context_split.py``): samples stay unpadded here.

With ``one_per_row`` each sample is one document (pieces of at most ``seq_length`` tokens), for
batches of variable-length rows (SFT-like), without ``cu_seqlens``: a row is one causal sequence,
its padding at the end.
Samples beyond one epoch wrap around with a new shuffle per epoch (seeded).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import time
import zipfile
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatron_ext.checkpoint.directory import fsync_path
from megatron_ext.config import ConfigError
from megatron_ext.data.blends import get_blend_weights
from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packing import PackingIndex, build_packing_index, split_documents


class IndexedDocuments:
    """The documents of a megatron-core ``IndexedDataset`` (its ``document_indices``), each read as
    one run of tokens. A document is usually one sequence; a dataset preprocessed with Megatron-LM's
    ``--split-sentences`` stores each sentence as a sequence of its document, and packing those
    as documents would cut attention, restart positions and drop a label at every sentence. A
    document's sequences lie back to back in the ``.bin`` (megatron-core's builder writes them so;
    checked here), so one ``get`` from its first sequence reads any span of it. Everything else
    (``path_prefix``, ``index``, ``bin_reader``) is the indexed dataset's."""

    def __init__(self, indexed):
        self.indexed = indexed
        seq_lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
        bounds = np.asarray(indexed.document_indices, dtype=np.int64)
        n = len(seq_lengths)
        if len(bounds) == n + 1 and np.array_equal(bounds, np.arange(n + 1)):
            self.first_sequence, self.lengths = np.arange(n, dtype=np.int64), seq_lengths
            return
        ends = np.concatenate([[0], np.cumsum(seq_lengths)])
        self.lengths = ends[bounds[1:]] - ends[bounds[:-1]]
        self.first_sequence = bounds[:-1]
        pointers = np.asarray(indexed.index.sequence_pointers, dtype=np.int64)
        itemsize = np.dtype(indexed.index.dtype).itemsize
        follows = pointers[1:] == pointers[:-1] + seq_lengths[:-1] * itemsize  # sequence i + 1 right after i
        starts = np.zeros(n + 1, dtype=bool)
        starts[bounds] = True
        if not np.all(follows | starts[1:n]):
            raise ConfigError(
                [
                    f"{indexed.path_prefix}: the sequences of a document are not stored back to back "
                    f"in the .bin (not written by megatron-core's IndexedDatasetBuilder?); "
                    f"--packed-sequences needs them so: preprocess it again with tools/preprocess_data.py"
                ]
            )

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.lengths[doc]) - offset
        return self.indexed.get(int(self.first_sequence[doc]), offset=offset, length=length)

    def __getattr__(self, name: str):
        if name == "indexed":
            raise AttributeError(name)
        return getattr(self.indexed, name)


def get_split_ranges(num_docs: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges for train/valid/test from split weights (Megatron-style)."""
    w = np.asarray(list(weights) + [0.0] * (3 - len(weights)), dtype=np.float64)[:3]
    w = w / w.sum()
    bounds = np.concatenate([[0], np.round(np.cumsum(w) * num_docs)]).astype(np.int64)
    bounds[-1] = num_docs
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def _cache_path(prefix: str, cache_dir: str | None, key: dict, kind: str = "packed") -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    base = os.path.join(cache_dir, os.path.basename(prefix)) if cache_dir else prefix
    return f"{base}_{kind}_{digest}.npz"


# how long the other ranks wait for rank 0 to build an index: a large corpus may take longer than
# --distributed-timeout-minutes (the limit of the run's own collectives)
BUILD_WAIT = datetime.timedelta(hours=2)


def _build_and_write(path: str, build: Callable[[], dict[str, np.ndarray]], what: str) -> dict[str, np.ndarray]:
    start = time.monotonic()
    print(f"> building {what} ...", flush=True)
    arrays = build()
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    try:
        os.makedirs(directory, exist_ok=True)
        np.savez(tmp, **arrays)
        fsync_path(tmp)  # a power loss after the rename must not leave an empty cache under its final name
        os.replace(tmp, path)
        fsync_path(directory)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError(
            [
                f"cannot write {path} ({exc.strerror}): index caches are written beside the data "
                f"unless --data-cache-path names a writable directory; give one (e.g. on local disk)"
            ]
        ) from None
    print(f"> built {what} in {time.monotonic() - start:.1f} s: {path}", flush=True)
    return arrays


def load_or_build_arrays(
    path: str, build: Callable[[], dict[str, np.ndarray]], what: str = "an index"
) -> dict[str, np.ndarray]:
    """Arrays cached at ``path`` (.npz), built by ``build`` on a miss and written atomically.

    Under torch.distributed, global rank 0 builds and writes them first while the others wait (up to
    ``BUILD_WAIT``, on a gloo group of their own), then everyone reads them; a rank that does not see
    the file (a node-local --data-cache-path) builds its own. A failure on rank 0 fails every rank.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    failed = 0
    if (not distributed or dist.get_rank() == 0) and not os.path.exists(path):
        if not distributed:
            return _build_and_write(path, build, what)
        try:
            _build_and_write(path, build, what)
        except BaseException:
            failed = 1
            raise
        finally:
            _agree_built(failed)
    elif distributed:
        _agree_built(0)
    if not os.path.exists(path):  # rank 0 wrote it where this node cannot see it
        return _build_and_write(path, build, what)
    return read_cached_arrays(path)


def read_cached_arrays(path: str) -> dict[str, np.ndarray]:
    """The arrays of a cache file; one that cannot be read (cut short by a crash of an older
    version, or damaged since) is named, with the fix: it is derived data, deleting it rebuilds it."""
    try:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(
            [
                f"the index cache {path} cannot be read ({type(exc).__name__}: {exc}): it is a cache of "
                f"indices derived from the data; delete it and start again to rebuild it"
            ]
        ) from None


def _agree_built(failed: int) -> None:
    """Every rank waits here for rank 0's build (which may outlast the run's collective timeout);
    raises on the others when rank 0 failed (its own error is in its output)."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=BUILD_WAIT)
    flag = torch.tensor([failed], dtype=torch.int32)
    dist.all_reduce(flag, group=group)
    dist.destroy_process_group(group)
    if flag.item() and not failed:
        raise ConfigError(["rank 0 failed to build a data index (its error is in its output)"])


def load_or_build_index(
    prefix: str,
    doc_lengths: np.ndarray,
    doc_range: tuple[int, int],
    seq_length: int,
    strategy: str,
    cache_dir: str | None,
    digest: str,
    pad_multiple: int = 1,
) -> PackingIndex:
    """The packing index of documents ``doc_range`` (``digest``: ``lengths_digest`` of their lengths),
    pieces counted padded to a multiple of ``pad_multiple``; cached on disk (``load_or_build_arrays``)."""
    # the index is a function of the documents' lengths: keyed on them, a dataset preprocessed again
    # into the same prefix gets a new index (a stale one read a shorter corpus without a word)
    key = {
        "prefix": os.path.abspath(prefix),
        "num_docs": int(len(doc_lengths)),
        "range": list(doc_range),
        "seq": seq_length,
        "strategy": strategy,
        "v": 1,
        "lengths": digest,
    } | get_pad_key(pad_multiple)
    path = _cache_path(prefix, cache_dir, key)

    def build() -> dict[str, np.ndarray]:
        ids = np.arange(*doc_range, dtype=np.int64)
        index = _build(ids, doc_lengths[doc_range[0] : doc_range[1]], seq_length, strategy, pad_multiple)
        return {k: getattr(index, k) for k in ("piece_doc", "piece_start", "piece_len", "bin_offsets")}

    what = (
        f"the {strategy} packing index of {prefix} (documents {doc_range[0]}..{doc_range[1]}, "
        f"--seq-length {seq_length}{f', --document-pad-multiple {pad_multiple}' if pad_multiple > 1 else ''})"
    )
    z = load_or_build_arrays(path, build, what)
    index = PackingIndex(z["piece_doc"], z["piece_start"], z["piece_len"], z["bin_offsets"])
    check_index_matches_documents(index, doc_lengths, path)
    return index


def get_pad_key(pad_multiple: int) -> dict[str, int]:
    """The cache keys' entry for g: none at g = 1, so that an index built before g existed is still read."""
    return {"g": pad_multiple} if pad_multiple > 1 else {}


def lengths_digest(lengths: np.ndarray) -> str:
    """A short content hash of document lengths (~0.2 s per 20M documents)."""
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def _build(ids: np.ndarray, lengths: np.ndarray, seq_length: int, strategy: str, pad_multiple: int) -> PackingIndex:
    if strategy == "one_per_row":
        piece_doc, piece_start, piece_len = split_documents(ids, lengths, seq_length)
        return PackingIndex(piece_doc, piece_start, piece_len, np.arange(len(piece_doc) + 1, dtype=np.int64))
    return build_packing_index(ids, lengths, seq_length, strategy, pad_multiple)


def check_index_matches_documents(index: PackingIndex, doc_lengths: np.ndarray, path: str) -> None:
    """A cached index must describe these documents: ids in range, pieces inside each document."""
    if len(index.piece_doc) and (index.piece_doc.max() >= len(doc_lengths) or index.piece_doc.min() < 0):
        raise ConfigError([f"packing index {path} names documents the dataset does not have: delete it"])
    if np.any(index.piece_start + index.piece_len > doc_lengths[index.piece_doc]):
        raise ConfigError([f"packing index {path} does not match the dataset's documents: delete it"])


class PackedDocumentDataset:
    """Packed (or one-document-per-row) samples of one split of an indexed dataset."""

    def __init__(
        self,
        indexed,
        index: PackingIndex,
        seq_length: int,
        seed: int,
        num_samples: int,
        one_per_row: bool = False,
        cache_key: str = "",
    ):
        self.indexed = indexed
        self.cache_key = cache_key  # what identifies its sample order (blend caches key on it)
        self.one_per_row = one_per_row
        self.index = index
        self.seq_length = seq_length
        self.seed = seed
        self.samples_read = num_samples  # what the run asked for (the log's epochs)
        self.num_samples = max(num_samples, index.num_bins)
        # documents' lengths: a piece ending before its document's end is followed by a token to predict
        lengths = getattr(indexed, "lengths", None)  # IndexedDocuments' (a bare IndexedDataset: its sequences')
        self.doc_lengths = np.asarray(indexed.sequence_lengths if lengths is None else lengths, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _bin(self, i: int) -> int:
        epoch, j = divmod(i, self.index.num_bins)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.index.num_bins)
            # keep the epochs in use (a step may straddle two), not every one
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1} | {epoch: perm}
        return int(perm[j])

    def describe_sample(self, i: int) -> str:
        """The file and documents of sample ``i`` (for error messages)."""
        b = self._bin(i)
        docs = sorted({int(d) for d in self.index.piece_doc[self.index.bin_offsets[b] : self.index.bin_offsets[b + 1]]})
        return f"{self.indexed.path_prefix}.bin, document{'s' if len(docs) > 1 else ''} {', '.join(map(str, docs))}"

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        b = self._bin(i)
        lo, hi = self.index.bin_offsets[b], self.index.bin_offsets[b + 1]
        pieces, next_tokens = [], []
        for d, s, n in zip(
            self.index.piece_doc[lo:hi].tolist(),
            self.index.piece_start[lo:hi].tolist(),
            self.index.piece_len[lo:hi].tolist(),
        ):
            cut = s + n < self.doc_lengths[d]  # a piece of an over-long document: one more token, its last label
            tokens = self.indexed.get(d, offset=s, length=n + cut)
            pieces.append(tokens[:n])
            next_tokens.append(int(tokens[n]) if cut else IGNORE_INDEX)
        sample = build_packed_sample(pieces, next_tokens)
        if self.one_per_row:
            del sample["cu_seqlens"]
        return sample


def build_packed_sample(pieces: list[np.ndarray], next_tokens: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Concatenate documents into one sample with per-document labels, positions, boundaries.

    ``next_tokens[k]``: the label of piece k's last token: the token after it in its document when
    the piece is cut from an over-long one (the document goes on in another sample), else
    IGNORE_INDEX (the default for every piece: a document's last token predicts nothing).

    Vectorised (no per-document Python loop): ~40 us per 2048-token sample (bench/data.py).
    """
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.concatenate(pieces).astype(np.int64)
    cu = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    labels = np.empty_like(tokens)
    labels[:-1] = tokens[1:]
    labels[cu[1:] - 1] = IGNORE_INDEX if next_tokens is None else next_tokens  # a document's last predicts nothing
    position_ids = np.arange(len(tokens), dtype=np.int64) - np.repeat(cu[:-1], lengths)
    return {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
    }


def build_packed_datasets(
    prefix: str,
    split: Sequence[float],
    seq_length: int,
    strategy: str,
    seed: int,
    num_samples: Sequence[int],
    cache_dir: str | None,
    unused_splits: Sequence[int] = (),
    split_flag: str | None = None,
    pad_multiple: int = 1,
):
    """(train, valid, test) packed datasets of one indexed dataset (documents counted padded to a
    multiple of ``pad_multiple``); None for a split that is empty or in ``unused_splits``. A split
    the run reads without tokens is a ConfigError naming --split and the document counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    indexed = IndexedDocuments(IndexedDataset(prefix))
    doc_lengths = indexed.lengths
    ranges = get_split_ranges(len(doc_lengths), split)
    # tokens, not documents, make bins: a range of empty documents (no --append-eod) packs into none
    tokens = [int(doc_lengths[a:b].sum()) for a, b in ranges]
    # a split with weight but no tokens (a zero weight means "no such split")
    empty = [
        name
        for k, (name, n, w) in enumerate(zip(("train", "valid", "test"), tokens, list(split) + [0.0] * 3))
        if k not in unused_splits and n == 0 and w > 0
    ]
    if empty:
        counts = ", ".join(
            f"{name} {r[1] - r[0]} ({n} tokens)" for name, r, n in zip(("train", "valid", "test"), ranges, tokens)
        )
        raise ConfigError(
            [
                f"--split {split_flag or list(split)} leaves {'/'.join(empty)} of {prefix} "
                f"({len(doc_lengths)} documents) without tokens (documents: {counts}). Give it more "
                f"weight, or --eval-interval 0 when it is the validation split"
            ]
        )
    out = []
    for k, doc_range in enumerate(ranges):
        if tokens[k] == 0 or k in unused_splits:
            out.append(None)
            continue
        out.append(
            _build_split(
                indexed,
                doc_lengths,
                doc_range,
                prefix,
                (seq_length, strategy, pad_multiple),
                seed + k,
                num_samples[k],
                cache_dir,
            )
        )
    return tuple(out)


def _build_split(indexed, doc_lengths, doc_range, prefix, packing, seed, num_samples, cache_dir):
    """One split's dataset; ``packing``: (seq_length, strategy, pad multiple g)."""
    seq_length, strategy, pad_multiple = packing
    digest = lengths_digest(doc_lengths[doc_range[0] : doc_range[1]])  # keys the index and the sample order
    index = load_or_build_index(prefix, doc_lengths, doc_range, seq_length, strategy, cache_dir, digest, pad_multiple)
    key = json.dumps(
        {
            "prefix": os.path.abspath(prefix),
            "range": list(doc_range),
            "seq": seq_length,
            "strategy": strategy,
            "seed": seed,
            "bins": index.num_bins,
            "lengths": digest,
        }
        | get_pad_key(pad_multiple)
    )
    return PackedDocumentDataset(
        indexed, index, seq_length, seed, num_samples, one_per_row=strategy == "one_per_row", cache_key=key
    )


# ----------------------------------------------------------------------------- blends


class BlendedPackedDataset:
    """Packed samples of several indexed datasets, in megatron-core ``BlendedDataset``'s order:
    sample i is sample ``dataset_sample_index[i]`` of component ``dataset_index[i]``, both from
    megatron-core's own ``helpers.build_blending_indices`` (each next sample goes to the component
    furthest below its weight), so the realised shares follow the weights within one sample at
    every prefix of the run. Components wrap their epochs themselves (a new shuffle each), so no
    surplus is needed. A pure function of the seed and the data: a resume at any sample is exact."""

    def __init__(self, datasets: list, weights: list[float], size: int, cache_dir: str | None, anchor: str):
        self.datasets, self.weights, self.size = datasets, weights, size
        key = {"datasets": [d.cache_key for d in datasets], "weights": weights, "size": size, "v": 1}
        path = _cache_path(anchor, cache_dir, key, kind="blend")

        def build() -> dict[str, np.ndarray]:
            from megatron.core.datasets import helpers

            dataset_index = np.zeros(size, dtype=np.int16)
            dataset_sample_index = np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(datasets), size, False)
            return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

        z = load_or_build_arrays(path, build, f"the blend index of {len(datasets)} datasets ({size} samples)")
        self.dataset_index, self.dataset_sample_index = z["dataset_index"], z["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def describe_sample(self, i: int) -> str:
        return self.datasets[int(self.dataset_index[i])].describe_sample(int(self.dataset_sample_index[i]))


def get_blend_sizes(weights: list[float] | None, target: int) -> list[int] | None:
    """Samples each component contributes to ``target``: megatron-core's rule without its surplus,
    ceil(target x weight); None without weights."""
    if weights is None:
        return None
    return [int(math.ceil(target * w)) for w in weights]


def blend_packed_datasets(
    components: list, weights: list[float] | None, target: int, cache_dir: str | None, anchor: str
):
    """One component alone without weights stays itself; otherwise a ``BlendedPackedDataset``.
    Without weights, components are weighted by their packed samples per epoch (megatron-core
    blends unweighted prefixes by their dataset sizes)."""
    if len(components) == 1 and weights is None:
        return components[0]
    if weights is None:
        bins = [d.index.num_bins for d in components]
        weights, size = [b / sum(bins) for b in bins], target
    else:
        size = sum(get_blend_sizes(weights, target))
    return BlendedPackedDataset(components, [float(w) for w in weights], max(size, 1), cache_dir, anchor)


def build_blended_packed_datasets(
    blends,
    split: Sequence[float],
    seq_length: int,
    strategy: str,
    seed: int,
    num_samples: Sequence[int],
    cache_dir: str | None,
    unused_splits: Sequence[int] = (),
    split_flag: str | None = None,
    pad_multiple: int = 1,
):
    """(train, valid, test) packed datasets of a ``DataBlends`` (data/blends.py): with one blend,
    each prefix divided by --split and the splits blended; with a blend per split, each prefix read
    whole. None for a split not read or without data. Documents counted padded to a multiple of
    ``pad_multiple`` (g) when packed."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out: list = [None, None, None]
    if blends.blend is not None:
        prefixes = blends.blend[0]
        weights = get_blend_weights(blends.blend)
        per_prefix = []
        for j, prefix in enumerate(prefixes):
            sizes = [n if weights is None else get_blend_sizes([weights[j]], n)[0] for n in num_samples]
            per_prefix.append(
                build_packed_datasets(
                    prefix,
                    split,
                    seq_length,
                    strategy,
                    seed,
                    sizes,
                    cache_dir,
                    unused_splits=unused_splits,
                    split_flag=split_flag,
                    pad_multiple=pad_multiple,
                )
            )
        for k in range(3):
            parts = [p[k] for p in per_prefix]
            if any(p is None for p in parts):
                continue
            out[k] = blend_packed_datasets(parts, weights, num_samples[k], cache_dir, prefixes[0])
        return tuple(out)
    for k, blend in enumerate(blends.per_split):
        if blend is None or k in unused_splits:
            continue
        prefixes, weights = blend[0], get_blend_weights(blend)
        parts = []
        for j, prefix in enumerate(prefixes):
            indexed = IndexedDocuments(IndexedDataset(prefix))
            doc_lengths = indexed.lengths
            if not len(doc_lengths):
                raise ConfigError([f"{blends.source} {prefix} has no documents"])
            n = num_samples[k] if weights is None else get_blend_sizes([weights[j]], num_samples[k])[0]
            packing = (seq_length, strategy, pad_multiple)
            parts.append(
                _build_split(indexed, doc_lengths, (0, len(doc_lengths)), prefix, packing, seed + k, n, cache_dir)
            )
        out[k] = blend_packed_datasets(parts, weights, num_samples[k], cache_dir, prefixes[0])
    return tuple(out)


class EodLossMask:
    """``--eod-mask-loss`` on packed samples: a position whose input is EOD predicts nothing. A
    document's trailing EOD predicts nothing already; this also covers EOD tokens inside a stored
    document (corpora concatenated before preprocessing)."""

    def __init__(self, dataset, eod: int):
        self.dataset, self.eod = dataset, int(eod)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = dict(self.dataset[i])
        sample["labels"] = sample["labels"].masked_fill(sample["tokens"] == self.eod, IGNORE_INDEX)
        return sample

    def describe_sample(self, i: int) -> str:
        return self.dataset.describe_sample(i)

    def __getattr__(self, name: str):
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
