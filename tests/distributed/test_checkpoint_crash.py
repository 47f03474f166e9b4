"""A crash in the middle of a save loses nothing, and --keep-last never deletes the newest.

Each case forks a 2-rank world (PP2, so both ranks hold different shards) that saves every 2
iterations; ``MEGATRON_EXT_CKPT_FAULT=<phase>:<rank>:4`` makes one rank SIGKILL itself during the
save of iteration 4 (also with --async-save: in the background writer, and at the publish a later
step makes). The parent notices the killed rank and kills the rest (they would block in
a collective until the gloo timeout). A fresh world then resumes from the same directory: it must
load the newest complete checkpoint (iteration 2, or 4 when only the pointer update was cut
short) and reproduce the uninterrupted run's losses exactly, without and with ``--ckpt-verify`` (the
crashed directory is copied, so both resume from the same state).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import time

import pytest

from megatron_ext.checkpoint.directory import FAULT_ENV, list_complete_checkpoints, read_tracker
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, _worker, build_tiny_run, get_free_port, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

ITERS = 6
VALUES = dict(num_layers=2, train_iters=ITERS, pipeline_model_parallel_size=2, global_batch_size=4)

# phase, killed rank, the checkpoint a restart must find, --async-save (the background writer
# killed mid-write while its rank trains on; the publish of an asynchronous save, at a later step)
CASES = [
    ("after_shards", 1, 2, False),
    ("before_publish", 0, 2, False),
    ("during_pointer_update", 0, 4, False),
    ("in_shard_writer", 1, 2, True),
    ("before_publish", 0, 2, True),
]


def _train(rank: int, world_size: int, root: str | None, verify: bool = False, async_save: bool = False) -> dict:
    values = tiny_values(
        **VALUES,
        **(dict(save=root, save_interval=2, keep_last=2, ckpt_verify=verify, async_save=async_save) if root else {}),
    )
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    loaded = load_checkpoint(run, root) if root else None
    train(run)
    destroy_parallel_context()
    return {"loaded": loaded, "records": run.records}


def run_until_killed(fn, world_size: int, *args, env: dict, timeout: float = 300) -> list[int]:
    """Fork ``world_size`` ranks; once one dies by a signal, kill the others (a survivor may
    also report the broken connection first). Exit codes by rank; raises if nobody was killed."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = get_free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, out, args, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    reports = []
    try:
        while time.monotonic() < deadline and not any(p.exitcode is not None and p.exitcode < 0 for p in procs):
            try:
                reports.append(out.get(timeout=0.2))
            except queue.Empty:
                pass
    finally:
        time.sleep(0.5)  # let a rank that is being killed finish dying before we look
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    codes = [p.exitcode for p in procs]
    if not any(c == -signal.SIGKILL for c in codes[:]):
        errors = [pickle.loads(payload) for _, status, payload in reports if status != "ok"]
        raise RuntimeError(f"no rank was killed (exit codes {codes}); errors: {errors}")
    return codes


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return run_ranks(_train, 2, None, timeout=300)[-1]["records"]


@pytest.mark.parametrize("phase,rank,expected,async_save", CASES)
def test_crash_during_save_keeps_last_complete_checkpoint(tmp_path, reference, phase, rank, expected, async_save):
    root = str(tmp_path / "ckpt")
    codes = run_until_killed(_train, 2, root, False, async_save, env={FAULT_ENV: f"{phase}:{rank}:4"})
    assert codes[rank] == -signal.SIGKILL, codes

    assert [it for it, _ in list_complete_checkpoints(root)] == sorted({2, expected})
    assert read_tracker(root) == 2  # the pointer still names the last fully published save
    if expected == 2:
        assert any(".tmp-" in name for name in os.listdir(root)), os.listdir(root)

    crashed = str(tmp_path / "crashed")
    shutil.copytree(root, crashed)
    for verify in (False, True):
        reader = f"--ckpt-verify {verify}"
        root = str(tmp_path / f"resume-{verify}")
        shutil.copytree(crashed, root)
        resumed = run_ranks(_train, 2, root, verify, timeout=300)
        assert [r["loaded"] for r in resumed] == [expected, expected], reader
        records = resumed[-1]["records"]
        assert [r["iteration"] for r in records] == list(range(expected + 1, ITERS + 1))
        assert [r["loss"] for r in records] == [r["loss"] for r in reference[expected:]], reader

        # --keep-last 2: the newest two remain, leftovers of the crashed save are gone
        assert [it for it, _ in list_complete_checkpoints(root)] == [4, 6]
        assert read_tracker(root) == ITERS
        assert not [n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n], os.listdir(root)
