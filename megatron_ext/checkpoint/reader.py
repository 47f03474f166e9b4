"""Loading a checkpoint through megatron-core's ``torch_dist`` reader, every byte it uses checked.

Loads read with megatron-core's stock reader (torch's ``FileSystemReader``: ``torch.load`` of each
stored item, narrowed and copied into its destination). We had our own reader that read tensor
bytes straight into their destinations; measured against the stock one side by side
(``python -m bench.checkpoint --readers``, 2 ranks, 128 MiB-1 GiB per rank) it was 2.4-3.0x faster
from the page cache but 0.6-0.9x from disk, where the stock reader's sequential reads already run at
the disk's speed, so it was removed (issue 28: it had to be >= 1.3x in both). What stays is a thin
subclass, ``VerifyingFileSystemReader``, which megatron-core's load strategy is given in place of
its own (``VerifyingTorchDistLoadStrategy``; the hook is ``compat.py``'s "checkpoint-reader-hook").

Invariants, whatever the layout (same, or resharded at any TP/PP/DP):
- always (cheap, structural): every shard file a rank reads exists and is at least as long as the
  items the metadata places in it, else ``ChecksumMismatch`` (``DAMAGED``: missing / truncated);
- with the marker's checksum table (``--ckpt-verify``): every stored item the plan touches is hashed
  whole (``checksum.py``) before anything parses it, once however many requests share it, and compared
  with the digest the writer recorded; only a mismatch is damage (``DAMAGED``, file and byte range). A
  parse error is never taken as proof: the hash decides. Items read in part (a TP/DP reshard) are
  hashed whole: torch's reader ``torch.load``s the whole stored item anyway, so this costs hashing
  and no extra reading. Byte items (the RNG state, ``_extra_state``) are checked and counted too;
- a tensor item is read by torch's own code (``FileSystemReader.read_data``, per stored item, so an
  error names its file and byte range); a byte item is read once, checked with torch's weights-only
  unpickler, and only then handed to DCP's ``load_bytes`` (which unpickles with ``weights_only=False``
  and would run whatever the pickle calls). An item the weights-only unpickler refuses holds objects
  a checkpoint never holds: ``UnsafeCheckpointFile`` says the file may have been tampered with; nothing
  in it ran. Neither error suggests turning the safe loader off.

Cost: verification reads each item once more (from the page cache: the first read brought it there)
and hashes it; ``bench/checkpoint.py --readers`` prints it beside the load time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import mmap
import os
import pickle
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_ext.checkpoint.checksum import file_digest, is_available, new_hasher
from megatron_ext.checkpoint.directory import read_marker, resolve_load_path

DAMAGED = "damaged checkpoint file"
UNSAFE = "may have been tampered with"
UNREADABLE = "unreadable checkpoint item"
_HASH_CHUNK = 16 << 20  # bytes hashed per pread: bounded memory whatever the item's size


class ChecksumMismatch(RuntimeError):
    """Bytes read from a checkpoint differ from what was written, or a file is shorter than its
    items (named file and byte range); the message starts with ``DAMAGED``."""


class UnsafeCheckpointFile(RuntimeError):
    """A checkpoint file holds objects no checkpoint holds (torch's weights-only unpickler refused
    it; nothing in it ran); the message contains ``UNSAFE``."""


class UnreadableCheckpointItem(RuntimeError):
    """torch could not read a stored item whose bytes were not proven damaged (the message, which
    contains ``UNREADABLE``, names the file and byte range and says whether they were verified)."""


NAMED_ERRORS = (ChecksumMismatch, UnsafeCheckpointFile, UnreadableCheckpointItem)


def find_named_failure(err: BaseException) -> RuntimeError | None:
    """Our named error behind ``err``: itself, or one a rank raised inside torch DCP's
    ``CheckpointException`` (which carries every failing rank's exception to every rank), damage
    first; None for anything else."""
    if isinstance(err, NAMED_ERRORS):
        return err
    failures = getattr(err, "failures", None)
    found = [exc for exc, _ in failures.values() if isinstance(exc, NAMED_ERRORS)] if isinstance(failures, dict) else []
    found.sort(key=lambda exc: not isinstance(exc, ChecksumMismatch))
    return found[0] if found else None


@dataclasses.dataclass
class VerifyStats:
    """What a load checked: stored items hashed and matched (``byte_items`` of them byte items), and
    items the checkpoint records no checksum for."""

    verified: int = 0
    byte_items: int = 0
    unverified: int = 0


def describe_refusal(err: BaseException) -> str:
    """The reason torch's weights-only unpickler gave ("Unsupported global: GLOBAL posix.system"),
    without torch's advice to load with ``weights_only=False`` (its message words it two ways)."""
    text = str(err)
    for pattern in (
        r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\. Please use|\n|$)",
        r"(Trying to load unsupported GLOBAL [^\n]*?)\.?(?:\n|$)",
    ):
        found = re.search(pattern, text)
        if found:
            return found.group(1).strip()
    return "torch's weights-only unpickler refused it"


def describe_unsafe(where: str, err: BaseException, verified: bool) -> str:
    """The one message for a checkpoint file holding what a checkpoint never holds (``where``: the
    file, and the byte range when it is an item of a shard)."""
    if verified:
        how = "its checksum matches the one complete.json records, so the file and that checksum were replaced together"
    else:
        how = "it is damaged, or was replaced (--ckpt-verify compares every item with its recorded checksum)"
    return (
        f"unsafe checkpoint file: {where} holds objects a checkpoint never holds ({describe_refusal(err)}); "
        f"the file {UNSAFE}: {how}. It was not loaded and nothing in it ran; load a checkpoint you trust"
    )


def check_safe_pickle(data: bytes, where: str, verified: bool) -> None:
    """Raise ``UnsafeCheckpointFile`` unless torch's weights-only unpickler accepts ``data`` (a
    ``torch.save`` of tensors and plain containers, as every byte item we write is)."""
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(describe_unsafe(where, err, verified)) from None


def _pread_exact(fd: int, offset: int, length: int, path: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:  # the file shrank since _check_size
        raise ChecksumMismatch(f"{DAMAGED} (truncated): {path} ends before byte {offset + length}")
    return data


def hash_file_range(fd: int, offset: int, length: int, path: str, algorithm: str) -> int:
    """The digest of ``length`` bytes at ``offset`` of ``fd``, hashed where they lie: mapped, not copied
    (from the page cache this costs about the hash alone; ``bench/checkpoint.py --readers``), in
    slices of ``_HASH_CHUNK``; read with ``pread`` where the file cannot be mapped."""
    # checked just before mapping: touching a mapped page past the file's end is SIGBUS, not an error
    if os.fstat(fd).st_size < offset + length:
        raise ChecksumMismatch(f"{DAMAGED} (truncated): {path} ends before byte {offset + length}")
    h = new_hasher(algorithm)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, offset + length - start, prot=mmap.PROT_READ, offset=start) if length else None
    except (OSError, ValueError):
        mapped = None
    if mapped is None:
        return _hash_by_pread(fd, offset, length, path, h)
    try:
        with memoryview(mapped) as view:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            for at in range(offset - start, offset - start + length, _HASH_CHUNK):
                h.update(view[at : min(at + _HASH_CHUNK, offset - start + length)])
    finally:
        mapped.close()
    return h.intdigest()


def _hash_by_pread(fd: int, offset: int, length: int, path: str, h) -> int:
    view, done = memoryview(bytearray(min(length, _HASH_CHUNK))), 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(view), length - done)]], offset + done)
        if n <= 0:
            raise ChecksumMismatch(
                f"{DAMAGED} (truncated): {path} ends at byte {offset + done}, its items need {offset + length}"
            )
        h.update(view[:n])
        done += n
    return h.intdigest()


class VerifyingFileSystemReader(CachedMetadataFileSystemReader):
    """megatron-core's reader (torch's ``FileSystemReader`` with cached metadata), checking what it
    reads: sizes always, checksums when given (``checksums``: the marker's item table, relative path
    -> str(offset) -> [length, digest]; ``stats`` counts what was checked)."""

    def __init__(self, path, checksums: dict | None = None, algorithm: str = "crc32", stats: VerifyStats | None = None):
        super().__init__(path)
        self.checksums, self.algorithm = checksums, algorithm
        self.stats = stats if stats is not None else VerifyStats()

    def _check_size(self, relative_path: str, reqs: list[ReadItem]) -> None:
        """A file shorter than the items the metadata places in it is named (one stat), instead
        of failing inside torch's zip reader with a message that names no file."""
        path = os.path.join(str(self.path), relative_path)
        needed = max(
            self.storage_data[r.storage_index].offset + self.storage_data[r.storage_index].length for r in reqs
        )
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise ChecksumMismatch(
                f"{DAMAGED} (missing): {path} does not exist, its items need {needed} bytes"
            ) from None
        if size < needed:
            raise ChecksumMismatch(f"{DAMAGED} (truncated): {path} has {size} bytes, its items need {needed}")

    def _digest(self, fd: int, path: str, relative_path: str, index) -> int | None:
        """The digest of one stored item's bytes in the file, or None when there is nothing to compare
        it with (verification off, or no checksum recorded for it)."""
        md = self.storage_data[index]
        if self.checksums is None or str(md.offset) not in self.checksums.get(relative_path, {}):
            return None
        return hash_file_range(fd, md.offset, md.length, path, self.algorithm)

    def _verify(self, path: str, relative_path: str, md, digest: int | None) -> bool:
        """Compare one stored item's digest with the recorded one; False when none is recorded or
        verification is off."""
        expected = None if self.checksums is None else self.checksums.get(relative_path, {}).get(str(md.offset))
        if expected is None:
            self.stats.unverified += self.checksums is not None
            return False
        length, recorded = expected
        if length != md.length or digest != recorded:
            raise ChecksumMismatch(
                f"{DAMAGED} (checksum mismatch): {path} bytes {md.offset}..{md.offset + md.length} "
                f"({self.algorithm} {digest:x}, the checkpoint recorded {recorded:x}): the file was damaged "
                f"after it was written"
            )
        self.stats.verified += 1
        return True

    def _read_item(
        self, fd: int, path: str, reqs: list[ReadItem], plan: LoadPlan, planner: LoadPlanner, verified: bool
    ) -> None:
        """Load every request of one stored item (already verified when ``verified``): tensors by
        torch's own code, byte items after the weights-only check."""
        md = self.storage_data[reqs[0].storage_index]
        where = f"{path} bytes {md.offset}..{md.offset + md.length}"
        if reqs[0].type != LoadItemType.BYTE_IO:
            try:
                super().read_data(dataclasses.replace(plan, items=reqs), planner)
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointFile(describe_unsafe(where, err, verified)) from None
            except Exception as err:  # noqa: BLE001 - torch's zip reader and unpickler raise many kinds
                state = (
                    "its checksum matches" if verified else "not verified: --ckpt-verify tells whether it is damaged"
                )
                raise UnreadableCheckpointItem(
                    f"{UNREADABLE}: {where} ({state}): {type(err).__name__}: {' '.join(str(err).split())[:200]}"
                ) from None
            return
        self.stats.byte_items += verified
        data = _pread_exact(fd, md.offset, md.length, path)
        for req in reqs:
            stream = self.transforms.transform_load_stream(req, md.transform_descriptors or (), io.BytesIO(data))
            payload = stream.read()
            check_safe_pickle(payload, where, verified)
            planner.load_bytes(req, io.BytesIO(payload))

    def _read_file(self, relative_path: str, per_item: dict, plan: LoadPlan, planner: LoadPlanner) -> None:
        """One file's items in file order. With checksums, one thread hashes the next item while torch
        reads this one (from disk, the hashing's reads then overlap torch's work); an item is parsed
        only once its own digest matched."""
        path = os.path.join(str(self.path), relative_path)
        order = sorted(per_item, key=lambda i: self.storage_data[i].offset)
        fd = os.open(path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as pool:
                digest = functools.partial(self._digest, fd, path, relative_path)
                ahead = pool.submit(digest, order[0]) if self.checksums is not None else None
                for k, index in enumerate(order):
                    current = ahead
                    if self.checksums is not None and k + 1 < len(order):
                        ahead = pool.submit(digest, order[k + 1])
                    verified = self._verify(
                        path, relative_path, self.storage_data[index], current.result() if current is not None else None
                    )
                    self._read_item(fd, path, per_item[index], plan, planner, verified)
        finally:
            os.close(fd)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, dict] = {}
        for req in plan.items:
            item_md = self.storage_data[req.storage_index]
            per_file.setdefault(item_md.relative_path, {}).setdefault(req.storage_index, []).append(req)
        for relative_path, per_item in per_file.items():
            self._check_size(relative_path, [r for reqs in per_item.values() for r in reqs])
            self._read_file(relative_path, per_item, plan, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


# ----------------------------------------------------------------------------- the coordinator's files

COMMON_FILE = "common.pt"  # megatron-core's non-sharded state (its COMMON_STATE_FNAME)


def check_coordinator_files(ckpt_dir: str, checksums: dict) -> None:
    """Compare the files megatron-core's coordinator wrote (``common.pt``, ``metadata.json``,
    ``.metadata``) with the digests the marker records; ``ChecksumMismatch`` names the first that
    differs or cannot be read."""
    algorithm = checksums["algorithm"]
    for name, digest in checksums.get("files", {}).items():
        path = os.path.join(ckpt_dir, name)
        try:
            got, size = file_digest(path, algorithm), os.path.getsize(path)
        except OSError as err:
            raise ChecksumMismatch(f"{DAMAGED}: {path} cannot be read ({err.strerror})") from None
        if got != digest:
            raise ChecksumMismatch(
                f"{DAMAGED} (checksum mismatch): {path} bytes 0..{size} ({algorithm} {got:x}, "
                f"the checkpoint recorded {digest:x}): the file was damaged after it was written"
            )


def read_common(ckpt_dir: str, verified: bool = False) -> dict:
    """``common.pt`` (args, train state, scheduler, ...) through torch's weights-only unpickler, asked
    for explicitly (megatron-core relies on torch's default). ``verified``: its digest was checked."""
    path = os.path.join(ckpt_dir, COMMON_FILE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(describe_unsafe(path, err, verified)) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise ChecksumMismatch(f"{DAMAGED}: {path} cannot be read ({' '.join(str(err).split())[:160]})") from None


def read_resumed_position(load: str, step: int | None = None) -> tuple[int, int] | None:
    """(iteration, consumed samples) of the checkpoint ``--load load`` (``--ckpt-step step``) resumes,
    from its ``common.pt`` (a few KB through torch's weights-only unpickler), for checks made before
    any model is built; None when there is none or it cannot be read: the load itself reports that."""
    found = resolve_load_path(load, step)[0]
    try:
        state = read_common(found[1])["train_state"]
        return int(state["iteration"]), int(state["consumed_samples"])
    except Exception:  # noqa: BLE001 - none, damaged or foreign: the load names it
        return None


def open_checkpoint(ckpt_dir: str, warn=None) -> tuple[dict | None, dict]:
    """The marker's checksum record, when this machine has its algorithm (None: none usable; ``warn``
    is told why), and ``common.pt``, each coordinator file checked against it first. Raises
    ``ChecksumMismatch`` for a damaged marker or coordinator file, ``UnsafeCheckpointFile`` for a
    ``common.pt`` holding what a checkpoint never holds."""
    marker = read_marker(ckpt_dir)
    if not isinstance(marker, dict) or not isinstance(marker.get("iteration"), int):
        # every publish writes {"iteration": ..., ...}: an unreadable marker means a damaged
        # checkpoint, whose checksums (and so --ckpt-verify) are lost with it
        raise ChecksumMismatch(
            f"{DAMAGED}: {os.path.join(ckpt_dir, 'complete.json')} is not the marker a save "
            f"writes (unreadable, or no iteration in it)"
        )
    checksums = marker.get("checksums") or None
    if checksums is not None and not is_available(checksums["algorithm"]):
        if warn is not None:
            warn(
                f"{ckpt_dir} was checksummed with {checksums['algorithm']}, which this machine lacks "
                f"(pip install xxhash): loading it unverified"
            )
        checksums = None
    if checksums is not None:
        check_coordinator_files(ckpt_dir, checksums)
    return checksums, read_common(ckpt_dir, verified=checksums is not None)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _verifying_reader(checksums: dict | None, algorithm: str, stats: VerifyStats):
    """megatron-core's ``TorchDistLoadShardedStrategy.load`` builds its reader with the module function
    ``_get_filesystem_reader(dir, cache_metadata=True)``; answer ours during that call (a
    multi-storage-client checkpoint keeps its own reader)."""
    original = mcore_torch_strategy._get_filesystem_reader

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        reader = original(checkpoint_dir, cache_metadata=cache_metadata)
        if type(reader) is CachedMetadataFileSystemReader:
            return VerifyingFileSystemReader(checkpoint_dir, checksums, algorithm, stats)
        return reader

    with _PATCH_LOCK:
        mcore_torch_strategy._get_filesystem_reader = get_reader
        try:
            yield
        finally:
            mcore_torch_strategy._get_filesystem_reader = original


class VerifyingTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's ``torch_dist`` load strategy reading through ``VerifyingFileSystemReader``
    (``checksums``: the marker's item table and its ``algorithm``, or None to check sizes only;
    what was checked is counted in ``stats``)."""

    def __init__(self, checksums: dict | None = None, algorithm: str = "crc32"):
        super().__init__()
        self.checksums, self.algorithm = checksums, algorithm
        self.stats = VerifyStats()

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        with _verifying_reader(self.checksums, self.algorithm, self.stats):
            return super().load(sharded_state_dict, checkpoint_dir)
