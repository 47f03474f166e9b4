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
- nothing in a checkpoint runs: every pickle a load reads goes through an allowlist
  (``unpickler.py``). ``.metadata`` through ``MetadataUnpickler`` (torch reads it with plain
  ``pickle.load``: ``install_allowlisted_unpickling`` replaces torch's ``read_metadata`` and
  megatron-core's ``load_common`` process-wide, on importing this module, so every reader built on
  them is covered; ``compat.py``'s "checkpoint-allowlisted-unpickling"); ``common.pt`` and every
  stored item through torch's weights-only unpickler with torch's own globals only
  (``torch_allowlist_only``: the 30 classes megatron-core and torch register process-wide are set
  aside for the read). A refused file is ``UnsafeCheckpointFile`` (``UNSAFE``: it may have been
  tampered with; nothing in it ran);
- always (cheap, structural): every shard file a rank reads exists and is at least as long as the
  items the metadata places in it, else ``ChecksumMismatch`` (``DAMAGED``: missing / truncated);
- with the marker's checksum table (``--ckpt-verify``): every stored item the plan touches is hashed
  whole (``checksum.py``) before anything parses it, once however many requests share it, and compared
  with the digest the writer recorded; a mismatch is damage (``DAMAGED``, file and byte range). Items
  read in part (a TP/DP reshard) are hashed whole: torch's reader ``torch.load``s the whole stored
  item anyway, so this costs hashing and no extra reading. Byte items (the RNG state,
  ``_extra_state``) are checked and counted too;
- an item or ``common.pt`` torch fails to load is told apart by its own structure
  (``name_unloadable``): a broken zip archive (its signature, its directory, a member failing its
  CRC-32) is damage unless a matching checksum says the bytes are those written; a pickle the
  allowlist refuses is ``UNSAFE``; anything else is ``UnreadableCheckpointItem``. Damage is what
  ``--ckpt-fallback-on-corruption`` falls back from; the others stop the run;
- a tensor item is read by torch's own code (``FileSystemReader.read_data``, per stored item, so an
  error names its file and byte range); a byte item is read once, checked through the allowlist, and
  only then handed to DCP's ``load_bytes`` (which unpickles with ``weights_only=False`` and would run
  whatever the pickle calls); an ``_extra_state`` holding a byte tensor (Transformer Engine's format,
  which its ``set_extra_state`` unpickles with ``pickle.loads``) has the pickle inside it read by
  ``unpickler.PlainUnpickler`` (no globals at all) too. No error suggests turning the safe loader off.

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
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_ext.checkpoint.checksum import file_digest, is_available, new_hasher
from megatron_ext.checkpoint.directory import read_marker, resolve_load_path
from megatron_ext.checkpoint.unpickler import (
    ZIP_SIGNATURE,
    PlainUnpickler,
    RefusedGlobal,
    describe_zip_damage,
    load_metadata_pickle,
    names_a_global,
    torch_allowlist_only,
)

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
    """The reason torch's weights-only unpickler (or ours, ``unpickler.py``) gave ("Unsupported global:
    GLOBAL posix.system"), without torch's advice to load with ``weights_only=False`` (its message
    words it two ways, the reason sometimes on a line of its own after a blank one)."""
    text = str(err)
    for pattern in (
        r"WeightsUnpickler error:\s*(.*?)(?: was not an allowed global|\. Please use|\n|$)",
        r"(Trying to load unsupported GLOBAL [^\n]*?)\.?(?:\n|$)",
    ):
        found = re.search(pattern, text)
        if found and found.group(1).strip():
            return found.group(1).strip()
    if text and "weights_only" not in text and "\n" not in text:
        return text
    return f"torch's weights-only unpickler refused it ({type(err).__name__})"


def describe_unsafe(where: str, err: BaseException, verified: bool | None) -> str:
    """The one message for a checkpoint file holding what a checkpoint never holds (``where``: the
    file, and the byte range when it is an item of a shard; ``verified``: its checksum was compared
    and matched, None when the reader cannot know)."""
    if verified:
        how = "its checksum matches the one complete.json records, so the file and that checksum were replaced together"
    elif verified is None:
        how = "it was replaced (together with its checksum in complete.json, when that records one), or damaged"
    else:
        how = "it is damaged, or was replaced (--ckpt-verify compares every item with its recorded checksum)"
    return (
        f"unsafe checkpoint file: {where} holds objects a checkpoint never holds ({describe_refusal(err)}); "
        f"the file {UNSAFE}: {how}. It was not loaded and nothing in it ran; load a checkpoint you trust"
    )


def name_unloadable(data: bytes, err: BaseException, where: str, verified: bool | None) -> RuntimeError:
    """The named error for a ``torch.save`` archive (``data``, at ``where``) torch failed to load with
    ``err``. Damage (``ChecksumMismatch``) when its zip structure says its bytes changed after torch
    wrote them (``unpickler.describe_zip_damage``) and no matching checksum says they did not; a
    refusal (``UnsafeCheckpointFile``) when the unpickler refused what a sound archive holds, or what
    a pickle that is no archive at all names (someone wrote that); else ``UnreadableCheckpointItem``."""
    damage = None if verified else describe_zip_damage(data)
    written = not data.startswith(ZIP_SIGNATURE) and names_a_global(err)
    if damage is not None and not written:
        return ChecksumMismatch(f"{DAMAGED} ({damage}): {where}: the file was damaged after it was written")
    if isinstance(err, pickle.UnpicklingError):
        return UnsafeCheckpointFile(describe_unsafe(where, err, verified))
    state = "its checksum matches" if verified else "not verified: --ckpt-verify tells whether it is damaged"
    return UnreadableCheckpointItem(
        f"{UNREADABLE}: {where} ({state}): {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    )


def load_torch_archive(data: bytes, where: str, verified: bool | None):
    """What the ``torch.save`` archive ``data`` holds, read by torch's weights-only unpickler allowing
    torch's own globals only (``unpickler.torch_allowlist_only``); ``name_unloadable``'s error when
    torch cannot or will not load it."""
    try:
        with torch_allowlist_only():
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch's zip reader and unpickler raise many kinds
        raise name_unloadable(data, err, where, verified) from None


def read_metadata_file(stream, where: str, verified: bool | None) -> Metadata:
    """torch DCP's ``Metadata`` from a ``.metadata`` stream, through ``unpickler.MetadataUnpickler``.
    ``UnsafeCheckpointFile`` for a global outside its allowlist (nothing resolved, nothing ran) or
    another object; damage (``ChecksumMismatch``) for bytes that are no pickle, unless its checksum
    matched (``verified``): then ``UnreadableCheckpointItem``."""
    try:
        metadata = load_metadata_pickle(stream)
    except RefusedGlobal as err:
        raise UnsafeCheckpointFile(describe_unsafe(where, err, verified)) from None
    except Exception as err:  # noqa: BLE001 - pickle raises many kinds for bytes that are not one
        reason = f"not a pickle torch DCP writes: {type(err).__name__}: {' '.join(str(err).split())[:160]}"
        if verified:
            raise UnreadableCheckpointItem(f"{UNREADABLE}: {where} (its checksum matches): {reason}") from None
        raise ChecksumMismatch(f"{DAMAGED} ({reason}): {where}: the file was damaged after it was written") from None
    if not isinstance(metadata, Metadata):
        got = pickle.UnpicklingError(f"a {type(metadata).__name__}, not torch DCP's Metadata")
        raise UnsafeCheckpointFile(describe_unsafe(where, got, verified))
    return metadata


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
    reads: ``.metadata`` when made (named errors: ``read_metadata_file``), then sizes always, checksums
    when given (``checksums``: the marker's item table, relative path -> str(offset) -> [length,
    digest]; ``stats`` counts what was checked)."""

    def __init__(self, path, checksums: dict | None = None, algorithm: str = "crc32", stats: VerifyStats | None = None):
        super().__init__(path)
        self.checksums, self.algorithm = checksums, algorithm
        self.stats = stats if stats is not None else VerifyStats()
        # read (through the allowlist) and cached now: inside torch DCP's planning a failed
        # read_metadata becomes the text of an AssertionError, losing which named error it was
        self.read_metadata()

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
            except Exception as err:  # noqa: BLE001 - torch's zip reader and unpickler raise many kinds
                # the error path only: read the item again to tell damage from a refusal
                raise name_unloadable(_pread_exact(fd, md.offset, md.length, path), err, where, verified) from None
            return
        self.stats.byte_items += verified
        data = _pread_exact(fd, md.offset, md.length, path)
        for req in reqs:
            stream = self.transforms.transform_load_stream(req, md.transform_descriptors or (), io.BytesIO(data))
            payload = stream.read()
            # what load_bytes will unpickle (and TE after it), read through the allowlists first
            check_extra_state(req.storage_index.fqn, load_torch_archive(payload, where, verified), where, verified)
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
        with torch_allowlist_only():  # torch's reader loads tensor items with the weights-only unpickler
            for relative_path, per_item in per_file.items():
                self._check_size(relative_path, [r for reqs in per_item.values() for r in reqs])
                self._read_file(relative_path, per_item, plan, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def check_extra_state(fqn: str, value, where: str, verified: bool | None) -> None:
    """Raise ``UnsafeCheckpointFile`` unless a loaded ``_extra_state`` byte item (``value``) that is a
    non-empty byte tensor holds a pickle of plain values: Transformer Engine's ``set_extra_state`` (GPU
    runs on its layer spec) unpickles such a tensor with ``pickle.loads``. Bytes that are no pickle
    pass: TE's unpickling of them fails the same way, having resolved nothing."""
    if "_extra_state" not in fqn or not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        return
    try:
        PlainUnpickler(io.BytesIO(value.numpy().tobytes())).load()
    except RefusedGlobal as err:
        what = f"{where} (the {fqn} Transformer Engine unpickles)"
        raise UnsafeCheckpointFile(describe_unsafe(what, err, verified)) from None
    except Exception:  # noqa: BLE001 - no pickle: nothing to run
        pass


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


def read_common(ckpt_dir: str, verified: bool | None = False) -> dict:
    """``common.pt`` (args, train state, scheduler, ...) through torch's weights-only unpickler allowing
    torch's own globals only (``load_torch_archive``; megatron-core relies on torch's default, which
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into the full unpickler). ``verified``: its digest was
    checked (None: not known here)."""
    path = os.path.join(ckpt_dir, COMMON_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ChecksumMismatch(f"{DAMAGED}: {path} cannot be read ({err.strerror})") from None
    return load_torch_archive(data, path, verified)


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


# ----------------------------------------------------------------------------- every reader, process-wide


def _read_metadata_allowlisted(self: FileSystemReader, *args, **kwargs) -> Metadata:
    """torch 2.13's ``FileSystemReader.read_metadata``, line for line, but reading ``.metadata`` through
    ``read_metadata_file`` where torch calls ``pickle.load`` (and naming the file as 2.13's private
    ``_get_metadata_path`` does: rank-local metadata, which torch DCP tries when ``.metadata`` fails, is
    ``__<rank>.metadata``)."""
    rank = kwargs.get("rank")
    path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
    with self.fs.create_stream(path, "rb") as stream:
        metadata = read_metadata_file(stream, str(path), None)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_common_allowlisted(self: TorchCommonLoadStrategy, checkpoint_dir) -> dict:
    """megatron-core's ``TorchCommonLoadStrategy.load_common`` (``common.pt``, local files) through
    ``read_common``, not ``torch.load``'s default."""
    return read_common(str(checkpoint_dir), verified=None)


def install_allowlisted_unpickling() -> None:
    """Process-wide (done on importing this module; repeating it changes nothing): torch's
    ``FileSystemReader.read_metadata`` reads ``.metadata`` through the allowlist, and megatron-core's
    ``load_common`` reads ``common.pt`` through ``read_common``. So every reader torch or megatron-core
    builds reads them so, not only ours during a load: the cached-metadata reader, megatron-core's
    ``load_tensors_metadata``, ``load_sharded_metadata``, ``load_common_state_dict`` and
    ``load_content_metadata``."""
    FileSystemReader.read_metadata = _read_metadata_allowlisted
    TorchCommonLoadStrategy.load_common = _load_common_allowlisted


install_allowlisted_unpickling()


def read_full_tensors(reader: VerifyingFileSystemReader, keep) -> dict[str, torch.Tensor]:
    """{checkpoint key: full unsharded tensor} of every stored tensor whose key ``keep(key)`` accepts,
    read through ``reader`` in this process without a process group (tools and tests); a damaged or
    unsafe file raises this module's named error, not torch's ``CheckpointException`` around it."""
    from torch.distributed import checkpoint as dcp

    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in reader.read_metadata().state_dict_metadata.items()
        if hasattr(md, "size") and keep(key)
    }
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except BaseException as err:  # torch's CheckpointException (a BaseException) wraps the reader's
        found = find_named_failure(err)
        if found is None:
            raise
        raise found from None
    return state
