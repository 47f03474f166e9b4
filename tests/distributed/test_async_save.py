"""--async-save: training goes on while the shards are written, and the checkpoint is the one a
synchronous save writes.

A 4-rank world (PP2 x DP2, dropout 0.1 so the RNG states matter; Adam's moments are then whole
tensors that megatron-core's planner does not copy, unlike the distributed optimizer's) trains 6
iterations saving every 2, once synchronously and once with --async-save and
--exit-signal-handler, its background writer slowed by 0.5 s so that later steps change the
parameters and optimizer state while the write is pending. Then:

- every tensor of the asynchronous checkpoints 2 and 4 equals the synchronous one bit for bit
  (the save step's host snapshot: with it disabled, this check and the resume check fail);
- the log shows iteration 3 trained before the save of iteration 2 was published;
- the per-step agreement stays one all-reduce per step (the save's bits ride in the exit
  decision's);
- resuming from the asynchronous checkpoint of iteration 4 reproduces the losses exactly;
- a write that fails on one rank is reported on every rank with the same message naming that rank
  and its error (CheckpointWriteFailed at a step boundary after it ended), nothing is published, the
  temporary directory is removed and the checkpoint of iteration 2 stays the newest.

Crashes of a rank in the background writer and at the publish of an asynchronous save are in
test_checkpoint_crash.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from megatron_ext.checkpoint.directory import get_checkpoint_dir, list_complete_checkpoints, read_tracker
from megatron_ext.checkpoint.state import load_full_tensors
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

VALUES = dict(
    num_layers=2,
    train_iters=6,
    pipeline_model_parallel_size=2,
    global_batch_size=4,
    micro_batch_size=1,
    use_distributed_optimizer=False,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
SLOW_WRITE_S = 0.5


def _dataset():
    return MarkovDataset(32, mask_every=1)


def _patch_writer(rank: int, fail_at: int | None = None):
    """Slow every background write; with ``fail_at``, rank 1's write of that iteration fails."""
    import megatron_ext.checkpoint.async_save as async_save

    original = async_save.write_shards

    def write_shards(write):
        time.sleep(SLOW_WRITE_S)
        if write.iteration == fail_at and rank == 1:  # the disk fills under the real shard writer
            import errno

            import megatron_ext.checkpoint.writer as writer_module

            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            real, writer_module._write_item = writer_module._write_item, full
            try:
                return original(write)
            finally:
                writer_module._write_item = real
        original(write)

    async_save.write_shards = write_shards


def _count_agreements() -> list[int]:
    import megatron_ext.checkpoint.exit_policy as exit_policy

    calls, original = [], exit_policy.agree_on_flags  # (begun inside the step or at its end)

    def agree(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    exit_policy.agree_on_flags = agree
    return calls


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    run = build_tiny_run(tiny_values(**VALUES, save=f"{root}/sync", save_interval=2), _dataset())
    train(run)
    out["sync"] = [r["loss"] for r in run.records]
    destroy_parallel_context()

    _patch_writer(rank)
    agreements = _count_agreements()
    lines: list[str] = []
    run = build_tiny_run(
        tiny_values(**VALUES, save=f"{root}/async", save_interval=2, async_save=True, exit_signal_handler=True),
        _dataset(),
    )
    run.log = lines.append
    train(run)
    out["async"] = {"losses": [r["loss"] for r in run.records], "lines": lines, "agreements": len(agreements)}
    run.exit_decider.handler.restore()
    destroy_parallel_context()

    run = build_tiny_run(tiny_values(**VALUES, load=f"{root}/async", ckpt_step=4), _dataset())
    load_checkpoint(run, f"{root}/async", step=4)
    train(run)
    out["resumed"] = [r["loss"] for r in run.records]
    destroy_parallel_context()

    _patch_writer(rank, fail_at=4)
    run = build_tiny_run(tiny_values(**VALUES, save=f"{root}/failing", save_interval=2, async_save=True), _dataset())
    try:
        train(run)
        out["failure"] = None
    except Exception as exc:  # noqa: BLE001 - the test checks its type and message
        out["failure"] = (type(exc).__name__, str(exc), run.state.iteration)
    destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async"))
    return root, run_ranks(_world, 4, root, timeout=600)


def test_async_training_is_the_synchronous_training(world):
    _, results = world
    assert results[-1]["async"]["losses"] == results[-1]["sync"]
    assert len(results[-1]["sync"]) == 6


@pytest.mark.parametrize("iteration", [2, 4, 6])
def test_async_checkpoint_equals_the_synchronous_one_bit_for_bit(world, iteration):
    root, _ = world
    sync = load_full_tensors(get_checkpoint_dir(f"{root}/sync", iteration))
    got = load_full_tensors(get_checkpoint_dir(f"{root}/async", iteration))
    assert got.keys() == sync.keys() and any(k.startswith("optimizer") for k in sync)
    for key in sync:
        assert torch.equal(got[key], sync[key]), key


def test_training_went_on_while_the_save_was_written(world):
    root, results = world
    lines = next(r["async"]["lines"] for r in results if r["async"]["lines"])  # the logging rank's
    started = next(i for i, line in enumerate(lines) if "started asynchronous save of iteration        2" in line)
    published = next(i for i, line in enumerate(lines) if "saved checkpoint at iteration        2" in line)
    trained = next(i for i, line in enumerate(lines) if "iteration        3/" in line)
    assert started < trained < published, lines
    assert "written in the background" in lines[published]
    assert read_tracker(f"{root}/async") == 6


def test_the_save_rides_in_the_one_per_step_agreement(world):
    _, results = world
    for rank in results:
        assert rank["async"]["agreements"] == 6  # one per step, the exit decision's


def test_resume_from_an_async_checkpoint_is_exact(world):
    _, results = world
    assert results[-1]["resumed"] == results[-1]["sync"][4:]


def test_a_failed_background_write_stops_every_rank_and_publishes_nothing(world):
    root, results = world
    for rank in results:
        name, message, iteration = rank["failure"]
        # raised where the ranks learn it: a step boundary after the write ended, or the final save
        assert name == "CheckpointWriteFailed" and iteration in (5, 6), rank["failure"]
        assert "checkpoint of iteration 4 not saved" in message and "previous checkpoint is untouched" in message
    # one message, printed once by the entry point (not one per rank)
    assert results[0]["failure"][1] == results[1]["failure"][1]
    assert "the write failed on rank 1: OSError(28, 'No space left on device (injected)')" in results[0]["failure"][1]
    failing = f"{root}/failing"
    assert [it for it, _ in list_complete_checkpoints(failing)] == [2]
    assert read_tracker(failing) == 2
    assert not [n for n in os.listdir(failing) if ".tmp-" in n], os.listdir(failing)
