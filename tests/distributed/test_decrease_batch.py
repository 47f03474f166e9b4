"""--decrease-batch-size-if-needed on forked gloo ranks: an indivisible global batch runs the largest
multiple of micro-batch x DP, and a checkpoint saved at one batch resumes on fewer ranks.

DP 2 with --global-batch-size 5 (micro-batch 1) runs 4 samples per step, 2 micro-batches per rank,
as megatron-core's ConstantNumMicroBatchesCalculator(decrease_batch_size_if_needed=True) has it; its
consumed samples advance by 4 and it trains as one process with --global-batch-size 4 does, step by
step (the same samples, and the same learning rates: the LR decay counts 4 samples per step).

A --train-samples 90 run at --global-batch-size 9 on DP 3 (no flag: 9 divides) saves after step 4
(36 samples); resumed on DP 2 with the flag it runs 8 per step from sample 36 on: 6 steps, to 84
samples (one more would pass the 90 the flags planned; counting from sample 0, 90 // 8 = 11 steps
would have read 92), every sample of each step read once over the ranks.
"""

from __future__ import annotations

import math

import pytest
from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

import megatron_ext.training.loop as loop
from megatron_ext.data.step_data import StepDataSpec
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

BASE = dict(num_layers=2, micro_batch_size=1, lr=3e-3, min_lr=3e-4, lr_decay_style="cosine", lr_warmup_iters=1)
DECREASED = dict(BASE, global_batch_size=5, train_iters=6, decrease_batch_size_if_needed=True)
REFERENCE = dict(BASE, global_batch_size=4, train_iters=6)  # one process: the batch DP 2 runs
LONG = dict(BASE, global_batch_size=9, train_iters=None, train_samples=90, lr_warmup_iters=0, lr_warmup_samples=9)


def _train(values: dict, load: str | None = None, step: int | None = None) -> dict:
    """Train (after loading ``load`` at ``step``); each step's (first sample, global batch,
    micro-batches on this rank, this rank's sample indices), the logs, the consumed samples."""
    steps, reads = [], []
    original_step, original_indices = loop.train_step, StepDataSpec.get_indices

    def spy(model, optimizer, scheduler, microbatches, length, global_batch_size, *args, **kwargs):
        steps.append((run.state.consumed_samples, global_batch_size, len(microbatches)))
        return original_step(model, optimizer, scheduler, microbatches, length, global_batch_size, *args, **kwargs)

    def indices(spec, first_sample, global_batch_size=None):
        out = original_indices(spec, first_sample, global_batch_size)
        reads.append((first_sample, sorted(i for mb in out for i in mb)))
        return out

    loop.train_step, StepDataSpec.get_indices = spy, indices
    try:
        run = build_tiny_run(tiny_values(**values), MarkovDataset(32, mask_every=1))
        if load is not None:
            load_checkpoint(run, load, step=step)
        train(run)
    finally:
        loop.train_step, StepDataSpec.get_indices = original_step, original_indices
    out = dict(
        steps=steps,
        reads=dict(reads),
        records=[(r["iteration"], r["loss"], r["grad_norm"], r["lr"]) for r in run.records],
        consumed=run.state.consumed_samples,
        train_iters=run.cfg.training.train_iters,
        global_batch_size=run.global_batch_size,
    )
    destroy_parallel_context()
    return out


def _one(rank: int, world_size: int) -> dict:
    return _train(REFERENCE)


def _save(rank: int, world_size: int, root: str) -> dict:
    return _train(dict(LONG, save=root, save_interval=4))


def _two(rank: int, world_size: int, root: str) -> dict:
    return {
        "decreased": _train(DECREASED),
        "resumed": _train(dict(LONG, load=root, decrease_batch_size_if_needed=True), load=root, step=4),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("decrease") / "ckpt")
    (one,) = run_ranks(_one, 1, timeout=300)
    saved = run_ranks(_save, 3, root, timeout=600)
    two = run_ranks(_two, 2, root, timeout=600)
    return one, saved, two


def test_dp2_runs_megatron_cores_running_batch_and_counts_it(runs):
    one, _, two = runs
    ref = ConstantNumMicroBatchesCalculator(5, 1, 2, True, 0)
    running, per_rank = ref.get_current_running_global_batch_size(), ref.get()
    assert (running, per_rank) == (4, 2)
    for rank_out in two:
        got = rank_out["decreased"]
        assert got["steps"] == [(k * running, running, per_rank) for k in range(6)]
        assert got["consumed"] == 6 * running and got["global_batch_size"] == running
    for k in range(6):  # each step's samples, once over the ranks
        first = k * running
        assert sorted(two[0]["decreased"]["reads"][first] + two[1]["decreased"]["reads"][first]) == list(
            range(first, first + running)
        )


def test_dp2_with_the_flag_trains_as_one_process_at_the_running_batch(runs):
    one, _, two = runs
    records = two[0]["decreased"]["records"]
    assert [r[0] for r in records] == list(range(1, 7))
    for got, want in zip(records, one["records"]):
        assert got[1:] == pytest.approx(want[1:], rel=1e-5)
    lrs = [r[3] for r in records]
    assert lrs[-1] < lrs[1]  # the decay runs (over 6 x 4 samples): the learning rates above are compared
    assert one["consumed"] == two[0]["decreased"]["consumed"]


def test_resume_on_fewer_ranks_continues_the_sample_stream(runs):
    _, saved, two = runs
    assert [s[:2] for s in saved[0]["steps"]] == [(9 * k, 9) for k in range(10)]
    for rank_out in two:
        resumed = rank_out["resumed"]
        assert resumed["steps"] == [(36 + 8 * k, 8, 4) for k in range(6)]
        assert resumed["consumed"] == 84 and resumed["train_iters"] == 10
    for k in range(6):
        first = 36 + 8 * k
        assert sorted(two[0]["resumed"]["reads"][first] + two[1]["resumed"]["reads"][first]) == list(
            range(first, first + 8)
        )
    records = two[0]["resumed"]["records"]
    assert [r[0] for r in records] == list(range(5, 11))
    # the scheduler counts the running batch: after step 5 + k it stands at 44 + 8k samples of the
    # cosine decay from 9 warm-up samples to 90 (megatron-core's formula), where the saved run's step 5
    # stood at 45
    for k, record in enumerate(records):
        assert record[3] == pytest.approx(cosine_lr(44 + 8 * k), rel=1e-9)
    assert {r[0]: r[3] for r in saved[-1]["records"]}[5] == pytest.approx(cosine_lr(45), rel=1e-9)


def cosine_lr(samples: int) -> float:
    """--lr 3e-3 decayed to --min-lr 3e-4 over samples 9..90 (LONG): megatron-core's cosine."""
    return 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * (samples - 9) / (90 - 9)))
