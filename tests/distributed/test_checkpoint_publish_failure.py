"""A save whose publication fails on rank 0 (the disk fills, a rename is refused) is one clear
error on every rank, and loses nothing.

Phases 3-5 of ``directory.py`` (marker, rename, pointer, retention) run on rank 0 alone while the
other ranks wait in the save's last collective. A 2-rank world saves a small sharded state at
iteration 2, then at iteration 4 rank 0's step fails (an OSError injected into the real code):
every rank must raise CheckpointWriteFailed naming the save directory and rank 0's error (not
rank 0 an OSError and the others gloo's "Connection closed by peer" once rank 0 has died), with
iteration 2 still the newest complete checkpoint and the pointer's, and no temporary directory
left. A failure after the rename says the checkpoint was saved. A later save then succeeds.
The same holds when rank 0 cannot create the save's temporary directory (--save turned read-only).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from megatron_ext.checkpoint import directory
from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed


def _state(rank: int, world_size: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(4, dtype=torch.float32) + 10 * rank
    return {"w": ShardedTensor.from_rank_offsets("w", weight, (0, rank, world_size)), "note": "x"}


def _fail_on_rank0(what: str) -> None:
    """Make rank 0's ``what`` step of the publication raise, as a full disk or a refused rename."""
    if what == "marker":  # writing complete.json into the full disk
        real_write = directory._write_file_durably

        def write(path: str, text: str) -> None:
            if path.endswith(directory.COMPLETE_MARKER):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            real_write(path, text)

        directory._write_file_durably = write
    elif what == "rename":  # the temporary directory to iter_0000004
        real_rename = os.rename

        def rename(src, dst):
            if os.path.basename(dst) == "iter_0000004":
                raise PermissionError(errno.EACCES, "Permission denied (injected)", src)
            real_rename(src, dst)

        os.rename = rename
    elif what == "pointer":
        real_write = directory._write_file_durably

        def write(path: str, text: str) -> None:
            if directory.TRACKER_FILE in path:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            real_write(path, text)

        directory._write_file_durably = write


def _save_twice(rank: int, world_size: int, root: str, what: str) -> dict:
    """Iteration 2 saved, then iteration 4 with rank 0's ``what`` failing; the world ends there
    (without the fix, the other ranks learn of rank 0's failure only when its process is gone)."""
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    directory.write_checkpoint(_state(rank, world_size), root, 2)
    if rank == 0:
        _fail_on_rank0(what)
    try:
        directory.write_checkpoint(_state(rank, world_size), root, 4)
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test checks its type and message
        return {"error": (type(exc).__name__, str(exc))}


def _save_again(rank: int, world_size: int, root: str) -> None:
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    directory.write_checkpoint(_state(rank, world_size), root, 6, keep_last=1)


@pytest.mark.parametrize("what", ["marker", "rename", "pointer"])
def test_a_failed_publication_is_one_error_on_every_rank_and_loses_nothing(tmp_path, what):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_save_twice, 2, root, what, timeout=120)
    for rank, result in enumerate(results):
        assert result["error"] is not None, rank
        name, message = result["error"]
        assert name == "CheckpointWriteFailed", (rank, result)
        assert "checkpoint of iteration 4" in message and root in message and "rank 0" in message, message
        assert "(injected)" in message, message
        if what == "pointer":
            assert "was saved to" in message and directory.TRACKER_FILE in message, message
        else:
            assert "not saved" in message and "the previous checkpoint is untouched" in message, message
    assert [it for it, _ in directory.list_complete_checkpoints(root)] == ([2, 4] if what == "pointer" else [2])
    assert directory.read_tracker(root) == 2
    assert not [n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n], os.listdir(root)

    run_ranks(_save_again, 2, root, timeout=120)  # the next job's save works and clears up
    assert [it for it, _ in directory.list_complete_checkpoints(root)] == [6]
    assert directory.read_tracker(root) == 6


def _save_into_read_only(rank: int, world_size: int, root: str) -> dict:
    """Iteration 2 saved, then --save turns read-only (a file system remounted read-only after
    errors) before rank 0 creates iteration 4's temporary directory."""
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    directory.write_checkpoint(_state(rank, world_size), root, 2)
    if rank == 0:

        def makedirs(path, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system (injected)", path)

        directory.os.makedirs = makedirs
    try:
        directory.write_checkpoint(_state(rank, world_size), root, 4)
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test checks its type and message
        return {"error": (type(exc).__name__, str(exc))}


def test_a_save_directory_turned_read_only_is_one_error_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_save_into_read_only, 2, root, timeout=120)
    for rank, result in enumerate(results):
        assert result["error"] is not None, rank
        name, message = result["error"]
        assert name == "CheckpointWriteFailed", (rank, result)
        assert "checkpoint of iteration 4 not saved" in message and root in message, message
        assert "Read-only file system (injected)" in message and "--save" in message, message
    assert [it for it, _ in directory.list_complete_checkpoints(root)] == [2]
    assert directory.read_tracker(root) == 2
