"""Every file of a checkpoint is on disk before its marker says it is complete.

A crash test cannot see a missing fsync: a killed process leaves its writes in the page cache,
which a power loss or a kernel crash would lose. So a real save (one gloo rank, the real
``write_checkpoint``, and ``--async-save``'s background writer) runs with ``os.fsync`` recorded:
each call notes the path its descriptor names and whether ``complete.json`` existed then in that
directory. Every shard file (``*.distcp``, fsynced by its writer), the coordinator's files, the
temporary directory (whose entries name the files) and the marker itself must be fsynced before
the marker exists; the save directory after the rename (which publishes it).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.checkpoint.directory import COMPLETE_MARKER, get_checkpoint_dir

pytestmark = pytest.mark.distributed

pytest.importorskip("megatron.core")


def record_fsyncs() -> list[tuple[str, bool]]:
    """Wrap ``os.fsync`` (every caller looks it up in ``os`` at call time, threads included):
    (the path of the descriptor, whether ``complete.json`` existed beside it) per call."""
    calls, real = [], os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        calls.append((path, os.path.exists(os.path.join(folder, COMPLETE_MARKER))))
        real(fd)

    os.fsync = fsync
    return calls


def _state() -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    tensors = {f"layer{i}.weight": torch.randn(64, 32) for i in range(3)}
    state = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in tensors.items()}
    return {**state, "iteration": 2}


def _save(rank: int, world_size: int, root: str, async_save: bool) -> list[tuple[str, bool]]:
    from megatron_ext.checkpoint.async_save import AsyncCheckpointSaver
    from megatron_ext.checkpoint.directory import write_checkpoint
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    calls = record_fsyncs()
    if async_save:
        saver = AsyncCheckpointSaver()
        saver.start(_state(), root, 2, keep_last=1)
        saver.finish()
    else:
        write_checkpoint(_state(), root, 2, keep_last=1)
    return calls


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_file_and_directory_entry_is_fsynced_before_the_marker(tmp_path, async_save):
    from megatron_ext.testing import run_ranks

    root = str(tmp_path / "ckpt")
    (calls,) = run_ranks(_save, 1, root, async_save, timeout=300)
    final = get_checkpoint_dir(root, 2)
    files = sorted(os.listdir(final))
    assert any(name.endswith(".distcp") for name in files) and COMPLETE_MARKER in files, files
    # a file's path at its fsync is in the temporary directory, renamed since: compare names
    before_marker = {os.path.basename(path) for path, marker_existed in calls if not marker_existed}
    missing = [name for name in files if name != COMPLETE_MARKER and name not in before_marker]
    assert not missing, f"not fsynced before {COMPLETE_MARKER} existed: {missing}; fsyncs: {calls}"
    tmp_dirs = [
        path
        for path, marker_existed in calls
        if not marker_existed and os.path.basename(path).startswith("iter_0000002.tmp-")
    ]
    assert tmp_dirs, f"the temporary directory's entries were not fsynced before the marker: {calls}"
    assert COMPLETE_MARKER in {os.path.basename(path) for path, _ in calls}, calls
    # the rename that publishes it is made durable (the only fsyncs of the save directory follow it)
    assert os.path.realpath(root) in {os.path.realpath(path) for path, _ in calls}, calls
