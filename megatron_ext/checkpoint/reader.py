"""A ``torch_dist`` load strategy that reads tensor bytes straight into their destinations.

megatron-core 0.16.1 loads through torch's ``FileSystemReader``, whose ``read_data`` runs a full
``torch.load`` of every stored item into a fresh temporary tensor (the bytes arrive in ~200 KB
chunks through a Python file view), narrows it and ``copy_``'s it into the destination: every
byte is written twice and each item pays the weights-only unpickler. That made our load less
than half as fast as ``torch.load`` of the same bytes.

``DirectReadFileSystemReader`` changes only how the bytes of a tensor item reach the destination.
Each item is still the ``torch.save`` zip that ``_write_item`` wrote. We read the item's first
and last 4 KiB (one ``pread`` each; a small item whole), find its records in the zip's central
directory (``_locate_fast``; anything but the plain layout torch writes, e.g. the zip64 entries of
an item over 4 GiB, is read with torch's own ``PyTorchFileReader`` instead), unpickle its tiny
``data.pkl`` with a restricted unpickler that only accepts a plain ``_rebuild_tensor_v2`` of a
typed storage, and check that the data record holds exactly that storage. When the requested
region of the stored tensor (the same narrowing ``FileSystemReader`` applies) is one contiguous
run of bytes and the destination is a plain, contiguous CPU tensor of the same dtype and shape,
those bytes go straight into the destination's memory: ``os.preadv`` in pieces spread over a few
threads for large items, a copy from the bytes already read for small ones. Every other item
(byte items, stream transforms, another dtype, non-contiguous regions or destinations as after
some reshardings, tensor subclasses, another byte order, anything the restricted unpickler does
not recognise) goes through ``FileSystemReader.read_data`` unchanged. Metadata, validation and the
on-disk format are megatron-core's and torch's, so resharding and every other checkpoint keep
working.

Checksums: with the marker's checksum table (``directory.py``, ``checksum.py``), every item the reader reads whole
(its two edges plus its tensor bytes cover it: a same-layout load, most resharded ones) is checked
from the bytes just read, in memory (no second pass over the file); a mismatch raises
``ChecksumMismatch`` naming the file and byte offset. Items read in part (a resharded region) or
through torch's reader are counted as unverified.

``DirectReadTorchDistLoadStrategy`` is megatron-core's ``TorchDistLoadShardedStrategy`` with this
reader in place of its ``CachedMetadataFileSystemReader`` (which it extends), and with torch's
load planned locally (``load_locally_then_agree``): for loading, torch DCP's "global" planning
step is the identity on each rank's own plan, so the collectives around it (a gather and a
scatter of every rank's pickled plan, then an all-gather after the read) only carry exceptions;
one integer all-reduce carries that instead (none in a 1-rank group). Those round trips cost
~2-5 ms per load even in a 1-rank gloo world, a fifth to a third of loading a 32 MiB state.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import struct
import sys
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_ext.checkpoint.checksum import new_hasher
from megatron_ext.cpu_platform import get_collective_device

_BYTEORDER = sys.byteorder.encode()


DAMAGED = "damaged checkpoint file"


class ChecksumMismatch(RuntimeError):
    """Bytes read from a checkpoint differ from what was written, or a file is shorter than its
    items (named file and offset); the message starts with ``DAMAGED``."""


@dataclasses.dataclass
class VerifyStats:
    """What a load checked: items verified against the marker, and items it could not check."""

    verified: int = 0
    unverified: int = 0


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


def _load_stored(pickled: bytes) -> _StoredTensor:
    stored = _TensorPickleReader(io.BytesIO(pickled)).load()
    if not isinstance(stored, _StoredTensor):
        raise _Unsupported("not a tensor")
    return stored


def _locate(stream: io.IOBase) -> tuple[_StoredTensor, int]:
    """The stored tensor of a ``torch.save`` zip in ``stream`` and its data's offset in it, read
    with torch's own zip reader (any zip torch writes, zip64 included; ~15 small reads through a
    Python file view)."""
    zip_file = torch._C.PyTorchFileReader(stream)
    if not zip_file.has_record("byteorder") or zip_file.get_record("byteorder") != _BYTEORDER:
        raise _Unsupported("byte order")
    return _load_stored(zip_file.get_record("data.pkl")), zip_file.get_record_offset("data/0")


class _ZipLayout(_Unsupported):
    """Not the plain zip layout ``_locate_fast`` reads (zip64, a comment, compression): ask torch's
    zip reader."""


_EDGE = 4096  # bytes fetched at each end of an item: the zip directory and the small records
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")


class _ItemFile:
    """One stored item: ``length`` bytes at ``base`` in ``fd``. Its first and last ``_EDGE``
    bytes are read once, with one ``pread`` each (a small item: whole, with one); reads inside
    them cost no system call."""

    def __init__(self, fd: int, base: int, length: int):
        self.fd, self.base, self.length = fd, base, length
        self.head = self._pread(0, length if length <= 2 * _EDGE else _EDGE)
        self.tail_start = max(length - _EDGE, len(self.head))
        self.tail = self._pread(self.tail_start, length - self.tail_start)

    def _pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self.fd, n, self.base + offset) if n else b""
        if len(data) != n:
            raise _ZipLayout("item shorter than its metadata says")
        return data

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.length:
            raise _ZipLayout("record outside the item")
        if offset + n <= len(self.head):
            return self.head[offset:offset + n]
        if offset >= self.tail_start:
            return self.tail[offset - self.tail_start:offset - self.tail_start + n]
        return self._pread(offset, n)

    def read_into(self, buffer: memoryview, offset: int) -> None:
        if offset + len(buffer) <= len(self.head):  # small items: already in memory
            buffer[:] = self.head[offset:offset + len(buffer)]
        else:
            _pread_into(self.fd, buffer, self.base + offset)


def _zip_records(item: _ItemFile) -> dict[str, tuple[int, int]]:
    """record name -> (data offset, size) of the zip ``torch.save`` writes: stored (uncompressed)
    records named ``<archive>/<record>``, no comment, zip64 end records (torch writes them always)
    but no zip64 entries (records or offsets over 4 GiB); else ``_ZipLayout``."""
    end = item.length - _EOCD.size
    if end < 0:
        raise _ZipLayout("too short")
    sig, disk, cd_disk, n_disk, n, cd_size, cd_offset, comment = _EOCD.unpack(item.read(end, _EOCD.size))
    if sig != 0x06054B50 or disk or cd_disk or comment or n_disk != n:
        raise _ZipLayout("end of central directory")
    locator = end - _ZIP64_LOCATOR.size
    if locator >= 0 and item.read(locator, 4) == b"PK\x06\x07":  # torch always writes zip64 ends
        _, disk, zip64_end, _ = _ZIP64_LOCATOR.unpack(item.read(locator, _ZIP64_LOCATOR.size))
        (sig, _, _, _, disk64, cd_disk64, n_disk, n, cd_size, cd_offset) = _ZIP64_END.unpack(
            item.read(zip64_end, _ZIP64_END.size))
        if (sig != 0x06064B50 or disk or disk64 or cd_disk64 or n_disk != n
                or zip64_end + _ZIP64_END.size != locator):
            raise _ZipLayout("zip64 end of central directory")
        end = zip64_end
    if cd_offset + cd_size != end:
        raise _ZipLayout("central directory position")
    directory, pos, records = item.read(cd_offset, cd_size), 0, {}
    for _ in range(n):
        if pos + _CENTRAL.size > len(directory):
            raise _ZipLayout("central directory")
        (sig, _, _, _, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _,
         local) = _CENTRAL.unpack_from(directory, pos)
        if sig != 0x02014B50 or method != 0 or csize != usize or 0xFFFFFFFF in (csize, local):
            raise _ZipLayout("central directory entry")
        name = directory[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len].decode("utf-8")
        pos += _CENTRAL.size + name_len + extra_len + comment_len
        records[name.partition("/")[2]] = (local, csize)
    located = {}
    for name in ("byteorder", "data.pkl", "data/0"):
        if name not in records:
            raise _ZipLayout(f"no {name} record")
        local, size = records[name]
        sig, *_, name_len, extra_len = _LOCAL.unpack(item.read(local, _LOCAL.size))
        start = local + _LOCAL.size + name_len + extra_len
        if sig != 0x04034B50 or start + size > cd_offset:
            raise _ZipLayout("local header")
        located[name] = (start, size)
    return located


def _locate_fast(item: _ItemFile) -> tuple[_StoredTensor, int]:
    """``_locate`` for the plain zip layout, reading the item's two edges (no Python file view)."""
    records = _zip_records(item)
    if item.read(*records["byteorder"]) != _BYTEORDER:
        raise _Unsupported("byte order")
    stored = _load_stored(item.read(*records["data.pkl"]))
    data_offset, size = records["data/0"]
    if size != stored.storage_numel * stored.dtype.itemsize:
        raise _Unsupported("storage size")
    return stored, data_offset


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


@dataclasses.dataclass
class _DirectRead:
    req: ReadItem
    target: torch.Tensor  # keeps the destination memory alive until the read is committed
    item: _ItemFile
    buffer: memoryview  # the destination's bytes (the staging tensor's, for a device target)
    data_start: int  # of the requested bytes within the item
    staging: torch.Tensor | None = None  # host copy read (and checked) first when target is not on the CPU


# host memory a file's device-bound items are staged in at once (read, checked, copied, then the next)
_STAGING_MAX = 1 << 30


def _reads_in_place(target: torch.Tensor) -> bool:
    """Whether the file's bytes can be read straight into ``target``'s memory (host memory)."""
    return target.device.type == "cpu"


_PIECE_MIN = 1 << 20
_PARALLEL_MIN = 4 << 20  # total bytes below which threads cost more than they save
_POOL: tuple[int, int, ThreadPoolExecutor] | None = None


def default_read_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def _pool(threads: int) -> ThreadPoolExecutor:
    """A reading pool kept for the process (threads idle between loads); a forked child or
    another size gets a new one (a pool's threads do not survive fork)."""
    global _POOL
    if _POOL is None or _POOL[:2] != (os.getpid(), threads):
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="ckpt-read"))
    return _POOL[2]


def _read_all(reads: list[_DirectRead], threads: int) -> None:
    """Fill every destination: small items from the bytes already read, large ones with
    ``preadv`` in pieces spread over ``threads`` threads (``preadv`` releases the GIL; the pieces
    touch no torch API, so the thread-local platform mode does not matter)."""
    pieces = []
    for r in reads:
        if r.data_start + len(r.buffer) <= len(r.item.head):
            r.item.read_into(r.buffer, r.data_start)
        else:
            pieces.append((r.item.fd, r.buffer, r.item.base + r.data_start))
    total = sum(len(buffer) for _, buffer, _ in pieces)
    if threads <= 1 or total < _PARALLEL_MIN:
        for fd, buffer, offset in pieces:
            _pread_into(fd, buffer, offset)
        return
    size = max(_PIECE_MIN, -(-total // (8 * threads)))
    split = [(fd, buffer[o:o + size], offset + o)
             for fd, buffer, offset in pieces for o in range(0, len(buffer), size)]
    list(_pool(threads).map(lambda piece: _pread_into(*piece), split))


class DirectReadFileSystemReader(CachedMetadataFileSystemReader):
    """megatron-core's reader; plain contiguous tensor items are read into their destinations,
    with ``read_threads`` threads (default: up to 4, as many as this process may run on)."""

    def __init__(self, path, read_threads: int | None = None, checksums: dict | None = None,
                 stats: VerifyStats | None = None, algorithm: str = "crc32"):
        super().__init__(path)
        self.read_threads = read_threads or default_read_threads()
        self.checksums = checksums  # relative path -> str(offset) -> [length, digest]; None: no check
        self.algorithm = algorithm
        self.stats = stats if stats is not None else VerifyStats()

    def _check_size(self, relative_path: str, reqs: list[ReadItem]) -> None:
        """A file shorter than the items the metadata places in it is named (one stat), instead
        of failing inside torch's zip reader with a message that names no file."""
        path = os.path.join(str(self.path), relative_path)
        needed = max(self.storage_data[r.storage_index].offset + self.storage_data[r.storage_index].length
                     for r in reqs)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise ChecksumMismatch(f"{DAMAGED} (missing): {path} does not exist, its items need {needed} bytes") from None
        if size < needed:
            raise ChecksumMismatch(f"{DAMAGED} (truncated): {path} has {size} bytes, its items need {needed}")

    def _verify(self, relative_path: str, reads: list[_DirectRead]) -> None:
        """Check every item read whole against the marker (threads for large ones: zlib.crc32
        releases the GIL); count the partly read ones as unverified."""
        if self.checksums is None:
            return
        table = self.checksums.get(relative_path, {})
        jobs = []
        for r in reads:
            md = self.storage_data[r.req.storage_index]
            expected = table.get(str(md.offset))
            item, p0 = r.item, r.data_start
            p1 = p0 + len(r.buffer)
            whole = item.length <= len(item.head) or (p0 <= len(item.head) and p1 >= item.tail_start)
            if expected is None or not whole:
                self.stats.unverified += 1
                continue
            jobs.append((md, expected, r))

        def check(job) -> None:
            md, (length, digest), r = job
            item, h = r.item, new_hasher(self.algorithm)
            if item.length <= len(item.head):
                h.update(item.head)
            else:
                p0, p1 = r.data_start, r.data_start + len(r.buffer)
                h.update(item.head[:p0])
                h.update(r.buffer)
                h.update(item.tail[p1 - item.tail_start:])
            if length != md.length or h.intdigest() != digest:
                raise ChecksumMismatch(
                    f"{DAMAGED} (checksum mismatch): {os.path.join(str(self.path), relative_path)} bytes "
                    f"{md.offset}..{md.offset + md.length} ({self.algorithm} {h.intdigest():x}, the checkpoint "
                    f"recorded {digest:x}): the file was damaged after it was written")

        big = sum(len(r.buffer) for _, _, r in jobs)
        if self.read_threads > 1 and big >= _PARALLEL_MIN:
            list(_pool(self.read_threads).map(check, jobs))
        else:
            for job in jobs:
                check(job)
        self.stats.verified += len(jobs)

    def _plan_direct(self, stream, fd: int, req: ReadItem, planner: LoadPlanner) -> _DirectRead | None:
        item_md = self.storage_data[req.storage_index]
        if item_md.transform_descriptors:
            return None
        try:
            item = _ItemFile(fd, item_md.offset, item_md.length)
            try:
                stored, data_offset = _locate_fast(item)
            except _ZipLayout:
                stored, data_offset = _locate(self._slice_file(stream, item_md))
        except (_Unsupported, pickle.UnpicklingError, RuntimeError, ValueError, TypeError,
                EOFError, struct.error, UnicodeDecodeError, OSError):
            return None
        run = _contiguous_run(stored, req.storage_offsets, req.lengths)
        if run is None:
            return None
        start, shape = run
        lookup = getattr(planner, "lookup_tensor", None)
        if lookup is None or type(lookup(req.dest_index)) is not torch.Tensor:
            return None  # e.g. FP8: megatron-core's resolve_tensor keeps state for commit_tensor
        target = planner.resolve_tensor(req).detach()
        if (type(target) is not torch.Tensor or target.dtype != stored.dtype or tuple(target.shape) != shape
                or not target.is_contiguous()):
            return None  # resolve_tensor has no side effect for plain tensors
        # a GPU's tensors: read (and checked) in host memory, then one copy to the device
        staging = None if _reads_in_place(target) else torch.empty(shape, dtype=target.dtype, device="cpu")
        itemsize = target.element_size()
        nbytes = target.numel() * itemsize
        if start < 0 or start + target.numel() > stored.storage_numel:
            return None
        data_start = data_offset + start * itemsize
        if data_start + nbytes > item_md.length:
            return None
        host = target if staging is None else staging
        buffer = memoryview((ctypes.c_char * nbytes).from_address(host.data_ptr())).cast("B") \
            if nbytes else memoryview(b"")
        return _DirectRead(req, target, item, buffer, data_start, staging)

    def _finish(self, relative_path: str, reads: list[_DirectRead], planner: LoadPlanner) -> None:
        """Read, check and commit a batch of planned items (staged ones copied to their device)."""
        _read_all(reads, self.read_threads)
        self._verify(relative_path, reads)
        for read in reads:
            if read.staging is not None:
                read.target.copy_(read.staging)
                read.staging = None
            planner.commit_tensor(read.req, read.target)

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
            self._check_size(relative_path, reqs)
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                fd = stream.fileno() if hasattr(os, "preadv") else None
                direct, staged, fallback = [], 0, 0
                for req in tensor_reqs:
                    read = self._plan_direct(stream, fd, req, planner) if fd is not None else None
                    if read is None:
                        rest.append(req)
                        fallback += 1
                        continue
                    direct.append(read)
                    staged += len(read.buffer) if read.staging is not None else 0
                    if staged >= _STAGING_MAX:  # bounded host memory for a GPU's checkpoint
                        self._finish(relative_path, direct, planner)
                        direct, staged = [], 0
                self._finish(relative_path, direct, planner)
                if self.checksums is not None:
                    self.stats.unverified += fallback
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _global_plan_is_per_rank(planner: LoadPlanner | None, reader) -> bool:
    """True when torch DCP's global load-planning step maps each rank's plan to itself (torch's
    default planner and file-system reader, which megatron-core's load planner and ours keep), so
    planning without the other ranks' plans gives the same result."""
    planner_type = type(planner) if planner is not None else DefaultLoadPlanner
    return (planner_type.create_global_plan is DefaultLoadPlanner.create_global_plan
            and type(reader).prepare_global_plan is FileSystemReader.prepare_global_plan)


def _any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    if dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=get_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def load_locally_then_agree(state_dict: dict[str, Any], storage_reader, process_group=None,
                            coordinator_rank: int = 0, no_dist: bool = False,
                            planner: LoadPlanner | None = None) -> None:
    """``torch.distributed.checkpoint.load_state_dict`` (same signature) without DCP's planning
    round trips: each rank plans and reads on its own, then one all-reduce makes every rank raise
    if any rank failed (the failing rank raises its own error, the others name the failure).
    Anything whose global planning step is not per-rank goes through torch's collective path."""
    distributed = dist.is_available() and dist.is_initialized() and not no_dist
    if distributed and not _global_plan_is_per_rank(planner, storage_reader):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # load_state_dict is deprecated
            return dcp.load_state_dict(state_dict, storage_reader, process_group,
                                       coordinator_rank, no_dist, planner)
    error: BaseException | None = None
    try:
        with warnings.catch_warnings():  # "...assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)
    except BaseException as exc:  # torch's CheckpointException is a BaseException; every rank
        error = exc  # must learn of a failure before anyone raises
    if distributed and _any_rank(error is not None, process_group) and error is None:
        raise CheckpointingException(
            f"loading {storage_reader.checkpoint_id} failed on another rank (its error is in "
            "that rank's output); this rank's own part loaded")
    if error is not None:
        raise error


class _CheckpointModule:
    """Stands in for ``torch.distributed.checkpoint`` inside megatron-core's torch strategy during
    our load: ``load_state_dict`` is ``load_locally_then_agree``, everything else is torch's."""

    load_state_dict = staticmethod(load_locally_then_agree)

    def __getattr__(self, name: str) -> Any:
        return getattr(dcp, name)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _direct_reader(read_threads: int | None = None, checksums: dict | None = None, stats: VerifyStats | None = None,
                   algorithm: str = "crc32"):
    """megatron-core's ``TorchDistLoadShardedStrategy.load`` builds its reader with the module
    function ``_get_filesystem_reader(dir, cache_metadata=True)`` and loads with the module
    global ``checkpoint.load_state_dict``; answer ours for both during that call
    (multi-storage-client checkpoints keep their reader)."""
    original_reader = mcore_torch_strategy._get_filesystem_reader
    original_checkpoint = mcore_torch_strategy.checkpoint

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        reader = original_reader(checkpoint_dir, cache_metadata=cache_metadata)
        if type(reader) is CachedMetadataFileSystemReader:
            return DirectReadFileSystemReader(checkpoint_dir, read_threads, checksums, stats, algorithm)
        return reader

    with _PATCH_LOCK:
        mcore_torch_strategy._get_filesystem_reader = get_reader
        mcore_torch_strategy.checkpoint = _CheckpointModule()
        try:
            yield
        finally:
            mcore_torch_strategy._get_filesystem_reader = original_reader
            mcore_torch_strategy.checkpoint = original_checkpoint


class DirectReadTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's ``torch_dist`` load strategy reading through ``DirectReadFileSystemReader``
    (``read_threads`` as there; ``checksums``: the marker's item table and its ``algorithm``, checked
    as items are read, with the counts in ``stats``)."""

    def __init__(self, read_threads: int | None = None, checksums: dict | None = None, algorithm: str = "crc32"):
        super().__init__()
        self.read_threads, self.checksums, self.algorithm = read_threads, checksums, algorithm
        self.stats = VerifyStats()

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        with _direct_reader(self.read_threads, self.checksums, self.stats, self.algorithm):
            return super().load(sharded_state_dict, checkpoint_dir)
