"""Data that never stalls a step: the next step's samples are read, padded (negotiated over the
pipeline replica on the prefetcher's own gloo group) and moved in a background thread, or read by
--num-workers worker processes; the training is exactly that of the synchronous path.

4 ranks, PP2 x VPP2 x DP2, packed samples of uneven lengths (negotiated padding): the same losses
and gradient norms with the prefetch thread (default), with --no-data-prefetch and with
--num-workers 2; the samples of steps 2.. were read in the prefetch thread or in worker processes.
"""

from __future__ import annotations

import os
import threading

import pytest

from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import PackedMarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

SEQ = 64
MODES = {
    "prefetch": {},
    "synchronous": dict(data_prefetch=False),
    "workers": dict(num_workers=2),
    "workers_in_step": dict(num_workers=2, data_prefetch=False),
}


class RecordingDataset(PackedMarkovDataset):
    """Remembers, per sample index, which thread of which process read it (written to a file by
    worker processes, which share nothing with the training process)."""

    def __init__(self, log_path: str):
        super().__init__(SEQ)
        self.log_path = log_path

    def __getitem__(self, i: int) -> dict:
        with open(self.log_path, "a") as f:
            f.write(f"{i} {os.getpid()} {threading.current_thread().name}\n")
        return super().__getitem__(i)


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for mode, flags in MODES.items():
        log_path = os.path.join(root, f"{mode}-{rank}.log")
        values = tiny_values(
            seq_length=SEQ,
            micro_batch_size=1,
            global_batch_size=8,
            packed_sequences=True,
            pad_to_multiple_of=16,
            train_iters=4,
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            **flags,
        )
        run = build_tiny_run(values, RecordingDataset(log_path))
        train(run)
        reads = {}
        with open(log_path) as f:
            for line in f:
                i, pid, thread = line.split(maxsplit=2)
                reads.setdefault(int(i), (int(pid), thread.strip()))
        first_steps = [
            [i for mb in get_microbatch_indices(s * 8, 8, 1, run.ctx.dp_rank, 2) for i in mb] for s in range(4)
        ]
        out[mode] = dict(
            records=[(r["loss"], r["grad_norm"]) for r in run.records],
            readers=[[reads[i] for i in step] for step in first_steps],
            pid=os.getpid(),
            waited=run.prefetcher.steps if run.prefetcher else 0,
        )
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return run_ranks(_world, 4, str(tmp_path_factory.mktemp("prefetch")), timeout=300)


def test_prefetch_and_workers_train_exactly_as_the_synchronous_path(worlds):
    last = worlds[-1]
    assert len(last["synchronous"]["records"]) == 4
    assert last["prefetch"]["records"] == last["synchronous"]["records"]
    assert last["workers"]["records"] == last["synchronous"]["records"]
    assert last["workers_in_step"]["records"] == last["synchronous"]["records"]


def test_samples_after_the_first_step_are_read_in_the_background(worlds):
    for r in worlds:
        main = r["prefetch"]["pid"]
        sync = {reader for step in r["synchronous"]["readers"] for reader in step}
        assert sync == {(main, "MainThread")}
        prefetch = r["prefetch"]["readers"]
        assert set(prefetch[0]) == {(main, "MainThread")}  # nothing to overlap with before step 1
        assert {reader for step in prefetch[1:] for reader in step} == {(main, "data-prefetch")}
        for mode in ("workers", "workers_in_step"):
            workers = {pid for step in r[mode]["readers"] for pid, _ in step}
            assert main not in workers and len(workers) == 2
        assert r["prefetch"]["waited"] == 4 and r["synchronous"]["waited"] == 0
