"""The checkpoint directory protocol: a crash at any moment never loses the last good checkpoint.

Invariant: under ``--save DIR`` a directory named ``iter_<7 digits>`` always holds a complete
checkpoint. Every save goes through these phases (``write_checkpoint``; ``--async-save`` runs the
same phases with phase 1's writing in a background thread, ``async_save.py``):

1. all ranks plan together (``begin_checkpoint_write``: the temporary directory, megatron-core's
   ``common.pt`` and global save plan), then each writes its shards into
   ``DIR/iter_XXXXXXX.tmp-<nonce>/`` (``write_shards``: megatron-core's ``dist_checkpointing`` in
   ``torch_dist`` format, written in-process by ``writer.py``; no collective);
2. all ranks agree that every write succeeded and that every rank's weights were finite
   (``finite.py``: a rank whose weights are not finite writes no shard), in one all-reduce; else
   nothing is published, retention does not run, and every rank raises the same
   CheckpointWriteFailed or NonFiniteCheckpoint; then a barrier, and megatron-core's coordinator
   writes ``.metadata``;
3. rank 0 fsyncs the files megatron-core's coordinator wrote unsynced (``common.pt``,
   ``metadata.json``) and the directory, writes ``complete.json`` into it, fsyncs that, renames
   the directory to ``iter_XXXXXXX`` and fsyncs ``DIR``;
4. rank 0 replaces ``latest_checkpointed_iteration.txt`` atomically (temp file + ``os.replace``);
5. rank 0 applies ``--keep-last N`` (older complete checkpoints only, never the one just saved,
   nor those of later iterations a --ckpt-step resume rolled back from, nor the newest one at or
   before the last iteration whose weight check passed; each renamed aside before it is deleted)
   and removes leftovers of interrupted saves; all ranks barrier.

The marker records every stored item's checksum (``checksums``: the algorithm of ``checksum.py``,
file -> offset -> [length, digest], computed by each rank's writer as it writes, gathered with one
collective) and those of the files megatron-core's coordinator writes (``files``); a load checks
what it reads against them. With --check-weight-hash-across-dp-replicas-interval it also records
the last iteration whose check passed (``replica_check.py``).

A crash in any phase leaves the previous complete checkpoint untouched. Loading takes the newest
directory that carries ``complete.json`` (a ``.tmp-`` directory never counts), so a crash between
phases 3 and 4 loses nothing either. An iteration saved again (a resumed run reaching it once more)
moves the earlier copy to ``iter_XXXXXXX.replaced-<nonce>`` for the rename of the new one: killed
between the two renames, that copy is still found as iteration XXXXXXX and the next retention renames
it back. ``MEGATRON_EXT_CKPT_FAULT=<phase>:<rank>`` makes that rank
SIGKILL itself at a named phase (optionally ``:<iteration>``: ``in_shard_writer`` (in the thread
that writes the shards, a background one with ``--async-save``), ``after_shards``,
``before_publish``, ``during_pointer_update``, ``before_retention``), for the crash tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.checkpoint.checksum import DEFAULT_ALGORITHM, file_digest
from megatron_ext.checkpoint.listing import (  # noqa: F401  (re-exported: importers find them here too)
    COMPLETE_MARKER,
    REPLACED_DIR,
    TRACKER_FILE,
    find_last_published_checkpoint,
    find_latest_checkpoint,
    get_checkpoint_dir,
    list_complete_checkpoints,
    list_megatron_lm_entries,
    read_marker,
    read_tracker,
    resolve_load_path,
)
from megatron_ext.checkpoint.replica_check import read_checked_iteration, select_checked
from megatron_ext.checkpoint.writer import InProcessTorchDistSaveStrategy
from megatron_ext.config import ConfigError
from megatron_ext.cpu_platform import get_collective_device

FAULT_ENV = "MEGATRON_EXT_CKPT_FAULT"
FAULT_PHASES = ("in_shard_writer", "after_shards", "before_publish", "during_pointer_update", "before_retention")
FORMAT_VERSION = 1


def probe_save_dir(path: str | None, flag: str = "--save") -> None:
    """Create ``--save`` (or another directory the job writes to, named by ``flag``) and write a
    file in it, at start-up: an unwritable directory is a named error now, not after
    --save-interval steps of work. Every rank probes (its shards go there)."""
    if not path:
        return
    probe = os.path.join(path, f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(probe)  # a full disk fails the write after the file was created
        raise ConfigError([describe_unwritable_dir(path, flag, err)]) from None


def describe_unwritable_dir(path: str, flag: str, err: OSError) -> str:
    """The start-up error of ``probe_save_dir``: a file in the directory's place said so (its
    strerror, "File exists", did not), the free space only when the disk or quota is full."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path} is a file, not a directory: give a directory this job can create and write"
    where = f": {err.filename}" if err.filename else ""
    space = describe_free_space(path) if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"{flag} {path} is not a writable directory ({err.strerror}{where}{space}): give a directory this job can create and write"


def select_checkpoints_to_delete(iterations: list[int], keep_last: int | None) -> list[int]:
    """Iterations to delete so that the newest ``keep_last`` remain; never the newest one."""
    if not keep_last or keep_last < 1:
        return []
    ordered = sorted(iterations)
    return ordered[: max(len(ordered) - keep_last, 0)]


def fsync_path(path: str) -> None:
    """A file's data, or a directory's entries, on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def should_inject_fault(spec: str | None, phase: str, rank: int, iteration: int) -> bool:
    """Whether ``spec`` = ``<phase>:<rank>[:<iteration>]`` names this point (pure)."""
    if not spec:
        return False
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in FAULT_PHASES:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected <phase>:<rank>[:<iteration>] with phase one of {FAULT_PHASES}"
        )
    return parts[0] == phase and int(parts[1]) == rank and (len(parts) == 2 or int(parts[2]) == iteration)


def maybe_inject_fault(phase: str, rank: int, iteration: int) -> None:
    """SIGKILL this process at a named save phase when ``MEGATRON_EXT_CKPT_FAULT`` says so."""
    if should_inject_fault(os.environ.get(FAULT_ENV), phase, rank, iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_coordinator_files(tmp_dir: str) -> None:
    """Make the files megatron-core's coordinator wrote durable (``common.pt`` and
    ``metadata.json`` are written without fsync; torch's ``.metadata`` is fsynced already, which
    makes a second fsync nearly free), and the directory's entries. Every rank's ``*.distcp``
    shards were fsynced by their writer (``writer.py``) and are not reopened here: on a
    shared file system that would be one open per rank file."""
    for name in os.listdir(tmp_dir):
        path = os.path.join(tmp_dir, name)
        if name.endswith(".distcp") or not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_path(tmp_dir)


def build_checksum_record(tmp_dir: str, item_checksums: list[dict]) -> dict[str, Any]:
    """The marker's ``checksums`` entry: every rank's items, and the coordinator's small files
    (``common.pt``, ``metadata.json``, ``.metadata``: read once here, a few KiB)."""
    items: dict[str, dict[str, list[int]]] = {}
    for per_rank in item_checksums:
        for (relative_path, offset), (length, crc) in per_rank.items():
            items.setdefault(relative_path, {})[str(offset)] = [length, crc]
    files = {
        name: file_digest(os.path.join(tmp_dir, name))
        for name in sorted(os.listdir(tmp_dir))
        if not name.endswith(".distcp") and os.path.isfile(os.path.join(tmp_dir, name))
    }
    return {"algorithm": DEFAULT_ALGORITHM, "items": items, "files": files}


def publish_checkpoint(
    tmp_dir: str,
    final_dir: str,
    root: str,
    iteration: int,
    rank: int,
    checksums: dict[str, Any] | None = None,
    record: dict[str, Any] | None = None,
) -> None:
    """Rank 0, after every rank wrote its shards: marker, rename, pointer (phases 3-4). Before
    the marker, everything in the directory is durable, so a power loss after the publish cannot
    leave a marked checkpoint with a missing or torn file. ``record``: more marker entries (the
    weight check's, ``replica_check.py``)."""
    maybe_inject_fault("before_publish", rank, iteration)
    _fsync_coordinator_files(tmp_dir)
    marker = {**(record or {}), "iteration": iteration, "format_version": FORMAT_VERSION, "time": time.time()}
    if checksums is not None:
        marker["checksums"] = checksums
    _write_file_durably(os.path.join(tmp_dir, COMPLETE_MARKER), json.dumps(marker))
    if os.path.exists(final_dir) and not os.path.isfile(os.path.join(final_dir, COMPLETE_MARKER)):
        # Megatron-LM's (a save beside its checkpoints reaching one of its iterations), or damaged
        raise FileExistsError(
            f"{final_dir} is not a checkpoint of ours (Megatron-LM's, or one without its {COMPLETE_MARKER}): "
            f"it is never replaced; move it away or give another --save"
        )
    if os.path.exists(final_dir):  # the same iteration saved again (e.g. after a resume)
        # not ``.old-``, which retention deletes: killed before the next rename, this is the only
        # copy of the iteration (loads find it; the next retention renames it back)
        stale = f"{final_dir}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final_dir, stale)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            os.rename(stale, final_dir)  # the checkpoint it was to replace stays, under its name
            raise
        # out of the ``.replaced-`` names first: once iter_XXXXXXX is retired, loads would find a
        # delete cut short there as this iteration
        aside = _retire_checkpoint(stale)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp_dir, final_dir)
    fsync_path(root)
    if list_megatron_lm_entries(root):
        return  # the tracker is Megatron-LM's, which cannot resume ours: left naming its own (we need none)
    tracker_tmp = os.path.join(root, f".{TRACKER_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    _write_file_durably(tracker_tmp, str(iteration))
    maybe_inject_fault("during_pointer_update", rank, iteration)
    os.replace(tracker_tmp, os.path.join(root, TRACKER_FILE))
    fsync_path(root)


def apply_retention(root: str, keep_last: int | None, keep_dir: str) -> list[str]:
    """Delete old complete checkpoints beyond ``keep_last`` (renamed to ``*.old-*`` first) and
    leftovers of interrupted saves and deletes (``*.tmp-*``, ``*.old-*``, stale pointer temp
    files), after a re-save's earlier copy left aside by a kill is renamed back
    (``restore_replaced_checkpoints``); returns the deleted paths. ``keep_dir``, the checkpoint
    just published, stays; checkpoints of later iterations than it (left by the run a --ckpt-step
    resume rolled back from) are neither counted nor deleted: counted, they would push this run's
    own older checkpoints out, leaving it one to fall back to. Nor is the newest checkpoint at or
    before the last iteration whose weight check passed, as ``keep_dir``'s marker records it
    (``replica_check.py``): the one a weight-hash mismatch resumes from."""
    restore_replaced_checkpoints(root)
    complete = list_complete_checkpoints(root)
    newest_own = max((it for it, path in complete if path == keep_dir), default=None)
    own = [(it, path) for it, path in complete if newest_own is None or it <= newest_own]
    doomed = set(select_checkpoints_to_delete([it for it, _ in own], keep_last))
    checked = select_checked(own, read_checked_iteration(keep_dir))
    for it, path in own:
        if it in doomed and path != keep_dir and (it, path) != checked:
            _retire_checkpoint(path)
    loadable = {path for _, path in list_complete_checkpoints(root)}  # a .replaced- one not renamed back
    leftover = (".tmp-", ".old-", ".replaced-")
    deleted = [
        os.path.join(root, name)
        for name in os.listdir(root)
        if any(m in name for m in leftover) and os.path.join(root, name) not in loadable
    ]
    for path in deleted:
        if REPLACED_DIR.match(os.path.basename(path)):  # a complete copy: renamed aside first
            path = _retire_checkpoint(path)
        if path is not None and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # a pointer temp file may already be gone
                os.remove(path)
    return deleted


def restore_replaced_checkpoints(root: str) -> list[str]:
    """Rank 0, at retention: each complete ``iter_XXXXXXX.replaced-<nonce>`` with no
    ``iter_XXXXXXX`` beside it (a re-save killed between ``publish_checkpoint``'s two renames)
    renamed back to ``iter_XXXXXXX``; returns the restored paths. One that cannot be renamed stays
    (and is still found by ``list_complete_checkpoints``)."""
    restored = []
    for it, path in list_complete_checkpoints(root):
        final = get_checkpoint_dir(root, it)
        if path != final and not os.path.lexists(final):
            with contextlib.suppress(OSError):
                os.rename(path, final)
                restored.append(final)
    return restored


def _retire_checkpoint(path: str) -> str | None:
    """Rename a complete checkpoint out of the ``iter_XXXXXXX`` (and ``.replaced-``) names before it
    is deleted: rmtree removes its files one at a time, and a delete cut short (a kill, a file it
    cannot remove) must not leave a directory that still carries its marker without all its shards.
    The ``.old-`` directory is never loaded and goes with the leftovers (now, or at the next
    retention); returns it. A checkpoint that cannot be renamed stays, whole (None)."""
    aside = f"{path}.old-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, aside)
    except OSError:
        return None
    return aside


class CheckpointWriteFailed(RuntimeError):
    """A save failed on some rank, raised on every rank with the same message: nothing was published
    and the previous checkpoint stays (or, when only the pointer or --keep-last failed, the message
    says it was saved)."""


class NonFiniteCheckpoint(RuntimeError):
    """A save found non-finite weights on some rank, raised on every rank with the same message:
    those ranks wrote nothing, nothing was published, retention did not run. ``newest`` is the
    newest complete checkpoint under ``root`` ((iteration, path), or None): the last good one."""

    def __init__(self, message: str, iteration: int, root: str, newest: tuple[int, str] | None):
        super().__init__(message)
        self.iteration, self.root, self.newest = iteration, root, newest

    def __reduce__(self):  # to a test's parent process with its fields
        return type(self), (str(self), self.iteration, self.root, self.newest)


@dataclasses.dataclass
class CheckpointWrite:
    """One save between its phases: planned and started (``begin_checkpoint_write``, collective),
    this rank's shards written (``write_shards``, no collective: may run in a background thread),
    then published (``publish_checkpoint_write``, collective)."""

    root: str
    iteration: int
    keep_last: int | None
    tmp_dir: str
    final_dir: str
    strategy: Any
    request: Any  # megatron-core's AsyncRequest: write function, finalize functions
    error: BaseException | None = None
    written: bool = False
    non_finite: str | None = None  # this rank's weights are not finite (what is): it writes no shard
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # more marker entries (publish_checkpoint)


def begin_checkpoint_write(
    state: dict[str, Any],
    root: str,
    iteration: int,
    keep_last: int | None = None,
    snapshot: Any = None,
    non_finite: str | None = None,
    record: dict[str, Any] | None = None,
) -> CheckpointWrite:
    """Phase 1's collective part: the temporary directory, megatron-core's ``common.pt`` and save
    plan (replica de-duplication, the global plan). ``snapshot`` (``async_save.HostSnapshot``)
    copies every tensor to be written into host memory owned by the save, so training may change
    the originals while the shards are written; without it the shards must be written before
    anything changes them. ``non_finite``: this rank's weights are not finite (``finite.py``): the
    plan is made with every rank, this rank writes nothing and the publication refuses the save.
    ``record``: more entries of the marker (``publish_checkpoint``)."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final_dir = get_checkpoint_dir(root, iteration)
    made = [None]  # rank 0's (temporary directory, None or the error every rank raises)
    if rank == 0:
        tmp_dir = f"{final_dir}.tmp-{uuid.uuid4().hex[:8]}"
        made = [(tmp_dir, _make_tmp_dir(tmp_dir, root, iteration))]
    dist.broadcast_object_list(made, src=0)  # one collective: the name, and the barrier before anyone writes
    tmp_dir, failure = made[0]
    if failure is not None:
        raise CheckpointWriteFailed(failure)
    strategy = InProcessTorchDistSaveStrategy(snapshot=snapshot)
    request = dist_checkpointing.save(state, tmp_dir, sharded_strategy=strategy, async_sharded_save=True)
    return CheckpointWrite(
        root,
        iteration,
        keep_last,
        tmp_dir,
        final_dir,
        strategy,
        request,
        non_finite=non_finite,
        record=dict(record or {}),
    )


def _make_tmp_dir(tmp_dir: str, root: str, iteration: int) -> str | None:
    """Rank 0 creates the save's temporary directory; None, or the message every rank raises (a
    --save that turned read-only or full since start-up would otherwise fail rank 0 alone, the
    others waiting in the barrier that follows)."""
    try:
        os.makedirs(tmp_dir)
        return None
    except OSError as err:
        return (
            f"checkpoint of iteration {iteration} not saved to {root}: rank 0 cannot create {tmp_dir} "
            f"({err.strerror}{describe_free_space(root)}); the previous checkpoint is untouched: make "
            f"--save writable, or free space in it"
        )


def write_shards(write: CheckpointWrite) -> None:
    """This rank's shard files, each fsync'ed; no collective. Errors are kept in ``write.error``
    for ``publish_checkpoint_write`` (a background thread must not raise them alone). A rank whose
    weights are not finite writes nothing: the save will be refused."""
    if write.non_finite is not None:
        write.written = True
        return
    try:
        if write.request.async_fn is not None:
            write.request.async_fn(*write.request.async_fn_args)
        maybe_inject_fault("in_shard_writer", dist.get_rank(), write.iteration)
        writer = write.strategy.writer
        error = writer.write_error() if writer is not None and writer.write_buckets else None
        if error is not None:
            raise error
    except Exception as exc:  # noqa: BLE001 - reported on every rank by publish_checkpoint_write
        write.error = exc
    write.written = True


def describe_free_space(path: str) -> str:
    """ ", its file system has N MiB free" (a full disk fails torch's zip writer with a message that
    does not say so), or nothing when that cannot be asked."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f" ({path} has {free / 2**20:.1f} MiB free{': the disk is full?' if free < 64 * 2**20 else ''})"


WRITE_FAILED, NOT_FINITE = 1, 2  # the bits of a save's outcome, agreed by every rank


def agree_save_outcome(write: CheckpointWrite) -> int:
    """Every rank's outcome bits OR-ed (one all-reduce MAX of two ints over the world): 0 when every
    rank wrote its shards and found its weights finite."""
    bits = torch.tensor(
        [write.error is not None, write.non_finite is not None], dtype=torch.int64, device=get_collective_device(None)
    )
    dist.all_reduce(bits, op=dist.ReduceOp.MAX)
    failed, not_finite = bits.tolist()
    return (WRITE_FAILED if failed else 0) | (NOT_FINITE if not_finite else 0)


def publish_checkpoint_write(write: CheckpointWrite, outcome: int | None = None) -> str:
    """Phases 2-5 once every rank's shards are written: megatron-core's finalisation (``.metadata``,
    ``metadata.json``), the checksums gathered into the marker, rename, pointer, retention;
    collective over the world. ``outcome``: the agreed WRITE_FAILED / NOT_FINITE bits, when the
    ranks agreed on them already (else one all-reduce here). When a bit is set nothing is published
    and ``refuse_checkpoint_write`` raises on every rank."""
    assert write.written, "publish_checkpoint_write before write_shards finished"
    rank = dist.get_rank()
    if outcome is None:
        outcome = agree_save_outcome(write)
    if outcome:
        refuse_checkpoint_write(write, outcome)
    assert write.non_finite is None and write.error is None, "agreed outcome lost this rank's failure bit"
    maybe_inject_fault("after_shards", rank, write.iteration)
    dist.barrier()  # as megatron-core's synchronous save: every rank's shards are on disk
    for finalize in write.request.finalize_fns:
        finalize()
    writer = write.strategy.writer
    mine = writer.checksums if writer is not None else {}
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    failure = [_publish_on_rank0(write, gathered) if rank == 0 else None]
    dist.broadcast_object_list(failure, src=0)  # the barrier that ends the save, carrying rank 0's error
    if failure[0] is not None:
        raise CheckpointWriteFailed(failure[0])
    return write.final_dir


def refuse_checkpoint_write(write: CheckpointWrite, outcome: int) -> None:
    """A save some rank could not write, or whose weights some rank found non-finite: the temporary
    directory goes, retention does not run, and every rank raises the same error (printed once by
    the entry point), naming each rank's problem: NonFiniteCheckpoint when weights were not finite
    (the run must stop whatever the writes did), else CheckpointWriteFailed. Collective (a gather
    and a broadcast, on this path only); every rank's writing is over when it calls this."""
    rank = dist.get_rank()
    mine = (f"{write.error!r}" if write.error is not None else None, write.non_finite)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)  # also the barrier before rank 0 removes the directory
    verdict = [None]
    if rank == 0:
        shutil.rmtree(write.tmp_dir, ignore_errors=True)
        newest = find_latest_checkpoint(write.root)
        verdict = [(describe_refused_write(write, outcome, gathered, newest), newest)]
    dist.broadcast_object_list(verdict, src=0)
    message, newest = verdict[0]
    if outcome & NOT_FINITE:
        raise NonFiniteCheckpoint(message, write.iteration, write.root, newest)
    raise CheckpointWriteFailed(message) from write.error


def group_ranks(per_rank: list[str | None]) -> str:
    """ "ranks 0, 1: A; rank 3: B" for the ranks with something to say, identical texts grouped."""
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(per_rank):
        if text is not None:
            groups.setdefault(text, []).append(rank)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}" for text, ranks in groups.items()
    )


def describe_refused_write(
    write: CheckpointWrite, outcome: int, gathered: list[tuple[str | None, str | None]], newest: tuple[int, str] | None
) -> str:
    """The one message of a refused save, from every rank's (write error, non-finite weights)."""
    head = f"checkpoint of iteration {write.iteration} not saved to {write.root}"
    kept = (
        f"the previous checkpoint is untouched: the newest complete one is {newest[1]} (iteration {newest[0]})"
        if newest
        else f"{write.root} holds no complete checkpoint yet"
    )
    if outcome & NOT_FINITE:
        where = group_ranks([non_finite for _, non_finite in gathered])
        return (
            f"{head}: the weights are not finite ({where}); nothing was published, --keep-last deleted nothing; {kept}"
        )
    where = group_ranks([error for error, _ in gathered])
    return f"{head}: the write failed on {where}{describe_free_space(write.root)}; {kept}"


def _publish_on_rank0(write: CheckpointWrite, gathered: list[dict]) -> str | None:
    """Rank 0's phases 3-5 (marker, rename, pointer, retention); None, or the message every rank
    raises: the other ranks wait in a collective meanwhile, and an error rank 0 raised alone would
    reach them as gloo's "Connection closed by peer" once its process died (or never). Before the
    rename nothing is published and the temporary directory goes; after it, the checkpoint is whole
    and a --load finds it."""
    try:
        publish_checkpoint(
            write.tmp_dir,
            write.final_dir,
            write.root,
            write.iteration,
            0,
            build_checksum_record(write.tmp_dir, gathered),
            write.record,
        )
        maybe_inject_fault("before_retention", 0, write.iteration)
        apply_retention(write.root, write.keep_last, write.final_dir)
        return None
    except Exception as exc:  # noqa: BLE001 - raised on every rank by publish_checkpoint_write
        error = f"{exc!r}{describe_free_space(write.root)}"
    if os.path.isdir(write.tmp_dir):
        shutil.rmtree(write.tmp_dir, ignore_errors=True)
        return (
            f"checkpoint of iteration {write.iteration} not saved to {write.root}: publishing it failed on "
            f"rank 0: {error}; the previous checkpoint is untouched"
        )
    return (
        f"checkpoint of iteration {write.iteration} was saved to {write.final_dir}, but updating "
        f"{os.path.join(write.root, TRACKER_FILE)} or applying --keep-last failed on rank 0: {error}; "
        f"--load {write.root} loads it (the newest complete checkpoint)"
    )


def write_checkpoint(
    state: dict[str, Any],
    root: str,
    iteration: int,
    keep_last: int | None = None,
    non_finite: str | None = None,
    record: dict[str, Any] | None = None,
) -> str:
    """Write a sharded state dict as ``root/iter_<iteration>`` through the phases of the module
    docstring, synchronously; collective over the world. Returns the published directory.
    ``non_finite``: this rank's weights are not finite (``finite.py``): the save is refused
    everywhere (NonFiniteCheckpoint). ``record``: more entries of the marker (``publish_checkpoint``)."""
    write = begin_checkpoint_write(state, root, iteration, keep_last, non_finite=non_finite, record=record)
    write_shards(write)
    return publish_checkpoint_write(write)
