"""A ``torch_dist`` load strategy that reads tensor bytes straight into their destinations.

megatron-core 0.16.1 loads through torch's ``FileSystemReader``, whose ``read_data`` runs a full
``torch.load`` of every stored item into a fresh temporary tensor (the bytes arrive in ~200 KB
chunks through a Python file view), narrows it and ``copy_``'s it into the destination: every
byte is written twice and each item pays the weights-only unpickler. That made our load less
than half as fast as ``torch.load`` of the same bytes.

``DirectReadFileSystemReader`` changes only how the bytes of a tensor item reach the destination.
Each item is still the ``torch.save`` zip that ``_write_item`` wrote; we open its zip directory
(``torch._C.PyTorchFileReader``, a few small reads), unpickle its tiny ``data.pkl`` with a
restricted unpickler that only accepts a plain ``_rebuild_tensor_v2`` of a typed storage, and
locate the record with ``get_record_offset``. When the requested region of the stored tensor
(the same narrowing ``FileSystemReader`` applies) is one contiguous run of bytes and the
destination is a plain, contiguous CPU tensor of the same dtype and shape, those bytes are read
with ``os.preadv`` directly into the destination's memory. Every other item (byte items, stream
transforms, another dtype, non-contiguous regions or destinations as after some reshardings,
tensor subclasses, another byte order, anything the restricted unpickler does not recognise) goes
through ``FileSystemReader.read_data`` unchanged. Planning, metadata, validation and the on-disk
format are megatron-core's and torch's, so resharding and every other checkpoint keep working.

``DirectReadTorchDistLoadStrategy`` is megatron-core's ``TorchDistLoadShardedStrategy`` with this
reader in place of its ``CachedMetadataFileSystemReader`` (which it extends).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import sys
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_BYTEORDER = sys.byteorder.encode()


class _Unsupported(Exception):
    """The item is not a plain tensor ``torch.save``: use torch's own path."""


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None) -> _StoredTensor:
    if backward_hooks or metadata or not isinstance(storage, tuple):
        raise _Unsupported("tensor with hooks or metadata")
    dtype, numel = storage
    return _StoredTensor(dtype, int(numel), int(storage_offset), tuple(map(int, size)),
                         tuple(map(int, stride)))


@functools.lru_cache(maxsize=None)
def _storage_dtype(name: str) -> torch.dtype | None:
    """dtype of a legacy typed storage class (``torch.FloatStorage``), as torch.save pickles it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "TypedStorage is deprecated"
        dtype = getattr(getattr(torch, name, None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


class _TensorPickleReader(pickle.Unpickler):
    """Reads the ``data.pkl`` of ``torch.save(tensor)`` without loading data; accepts nothing else
    (no other global can be resolved, so nothing is executed)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            dtype = _storage_dtype(name)
            if dtype is not None:
                return _StorageType(dtype)
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, saved_id: Any) -> Any:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"
                and isinstance(saved_id[1], _StorageType) and saved_id[2] == "0"):
            raise _Unsupported("storage")
        return saved_id[1].dtype, saved_id[4]


def _locate(stream: io.IOBase) -> tuple[_StoredTensor, int]:
    """The stored tensor of a ``torch.save`` zip in ``stream`` and its data's offset in it."""
    zip_file = torch._C.PyTorchFileReader(stream)
    if not zip_file.has_record("byteorder") or zip_file.get_record("byteorder") != _BYTEORDER:
        raise _Unsupported("byte order")
    stored = _TensorPickleReader(io.BytesIO(zip_file.get_record("data.pkl"))).load()
    if not isinstance(stored, _StoredTensor):
        raise _Unsupported("not a tensor")
    return stored, zip_file.get_record_offset("data/0")


def _contiguous_run(stored: _StoredTensor, offsets, lengths) -> tuple[int, tuple[int, ...]] | None:
    """(first element, shape) of ``narrow_tensor_by_index(stored, offsets, lengths)`` when that
    region is contiguous in the storage, else None."""
    if len(offsets) != len(stored.size) or len(lengths) != len(stored.size):
        return None
    start, shape = stored.storage_offset, []
    for dim, (off, length) in enumerate(zip(offsets, lengths)):
        if length < stored.size[dim]:  # the same rule as narrow_tensor_by_index
            start += off * stored.stride[dim]
            shape.append(length)
        else:
            shape.append(stored.size[dim])
    expected = 1
    for length, stride in zip(reversed(shape), reversed(stored.stride)):
        if length != 1 and stride != expected:
            return None
        expected *= length
    return start, tuple(shape)


def _pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of checkpoint file at byte {offset + done}")
        done += n


class DirectReadFileSystemReader(CachedMetadataFileSystemReader):
    """megatron-core's reader; plain contiguous tensor items are read into their destinations."""

    def _read_direct(self, stream, fd: int, req: ReadItem, planner: LoadPlanner) -> bool:
        item_md = self.storage_data[req.storage_index]
        if item_md.transform_descriptors:
            return False
        try:
            stored, data_offset = _locate(self._slice_file(stream, item_md))
        except (_Unsupported, pickle.UnpicklingError, RuntimeError, ValueError, TypeError,
                EOFError):
            return False
        run = _contiguous_run(stored, req.storage_offsets, req.lengths)
        if run is None:
            return False
        start, shape = run
        lookup = getattr(planner, "lookup_tensor", None)
        if lookup is None or type(lookup(req.dest_index)) is not torch.Tensor:
            return False  # e.g. FP8: megatron-core's resolve_tensor keeps state for commit_tensor
        target = planner.resolve_tensor(req).detach()
        if (type(target) is not torch.Tensor or target.device.type != "cpu"
                or target.dtype != stored.dtype or tuple(target.shape) != shape
                or not target.is_contiguous()):
            return False  # resolve_tensor has no side effect for plain tensors
        itemsize = target.element_size()
        nbytes = target.numel() * itemsize
        if start < 0 or start + target.numel() > stored.storage_numel:
            return False
        file_offset = item_md.offset + data_offset + start * itemsize
        if data_offset + (start + target.numel()) * itemsize > item_md.length:
            return False
        if nbytes:
            buffer = (ctypes.c_char * nbytes).from_address(target.data_ptr())
            _pread_into(fd, memoryview(buffer).cast("B"), file_offset)
        planner.commit_tensor(req, target)
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for read_item in plan.items:
            path = self.storage_data[read_item.storage_index].relative_path
            per_file.setdefault(path, []).append(read_item)

        rest: list[ReadItem] = []
        for relative_path, reqs in per_file.items():
            tensor_reqs = [r for r in reqs if r.type != LoadItemType.BYTE_IO]
            rest.extend(r for r in reqs if r.type == LoadItemType.BYTE_IO)
            if not tensor_reqs:
                continue
            tensor_reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                fd = stream.fileno() if hasattr(os, "preadv") else None
                for req in tensor_reqs:
                    if fd is None or not self._read_direct(stream, fd, req, planner):
                        rest.append(req)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _direct_reader():
    """megatron-core's ``TorchDistLoadShardedStrategy.load`` builds its reader with the module
    function ``_get_filesystem_reader(dir, cache_metadata=True)``; answer ours for that call
    (multi-storage-client checkpoints keep theirs)."""
    original = mcore_torch_strategy._get_filesystem_reader

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        reader = original(checkpoint_dir, cache_metadata=cache_metadata)
        if type(reader) is CachedMetadataFileSystemReader:
            return DirectReadFileSystemReader(checkpoint_dir)
        return reader

    with _PATCH_LOCK:
        mcore_torch_strategy._get_filesystem_reader = get_reader
        try:
            yield
        finally:
            mcore_torch_strategy._get_filesystem_reader = original


class DirectReadTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's ``torch_dist`` load strategy reading through ``DirectReadFileSystemReader``."""

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        with _direct_reader():
            return super().load(sharded_state_dict, checkpoint_dir)
