"""--check-weight-hash-across-dp-replicas-interval in forked gloo worlds (``training/weight_hash.py``).

1. DP3, a check every 2 steps, a save every step under --keep-last 1: rank 1 flips the lowest mantissa
   bit of one weight after iteration 3. The check at iteration 4 stops every rank with one message
   naming the iteration, the parameter, rank 1 as the outlier against the two others, the last check
   that passed (2) and its checkpoint, iter_0000002, which --keep-last kept beside iteration 3 (it
   would have deleted it) and which the record for the restart names.
2. TP2 x PP2 x DP2 with VPP 2, --use-distributed-optimizer --overlap-param-gather, a check every
   step: no mismatch, while a naive hash of the same parameters at the same points (no gather
   completed first) finds most of them different; and the checks change nothing (losses and final
   parameters equal a run without them).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext.checkpoint.finite import get_named_parameters
from megatron_ext.checkpoint.listing import list_complete_checkpoints
from megatron_ext.checkpoint.replica_check import CHECKED_KEY, read_checked_iteration, read_pending_mismatch
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training import loop
from megatron_ext.training import weight_hash as wh

pytestmark = pytest.mark.distributed

FLIPPED = "decoder.layers.0.mlp.linear_fc1.weight"


def _drifting_replica(rank: int, world_size: int, root: str) -> dict:
    real = loop.run_training_iteration

    def flip_after_iteration_3(run, window):
        out = real(run, window)
        if run.state.iteration == 3 and rank == 1:
            weight = dict(get_named_parameters(run.model))[FLIPPED]
            weight.data.view(-1).view(torch.int32)[5] ^= 1  # the lowest mantissa bit of one element
        return out

    loop.run_training_iteration = flip_after_iteration_3
    values = tiny_values(
        num_layers=2,
        global_batch_size=6,
        micro_batch_size=1,
        train_iters=6,
        check_weight_hash_across_dp_replicas_interval=2,
        save=root,
        save_interval=1,
        keep_last=1,
    )
    run = build_tiny_run(values, MarkovDataset(32))
    lines: list[str] = []
    run.log = lines.append
    with pytest.raises(wh.WeightHashMismatch) as raised:
        loop.train(run)
    destroy_parallel_context()
    return {"error": raised.value, "lines": lines, "iteration": run.state.iteration}


def test_a_flipped_bit_on_one_replica_is_found_named_and_its_last_good_checkpoint_kept(tmp_path):
    root = str(tmp_path / "save")
    results = run_ranks(_drifting_replica, 3, root, timeout=300)
    messages = {str(r["error"]) for r in results}
    assert len(messages) == 1, messages  # one verdict, the same on every rank
    (message,) = messages
    good = os.path.join(root, "iter_0000002")
    assert message.startswith(
        "weight-hash mismatch at iteration 4: the data-parallel replicas' weights differ "
        "(--check-weight-hash-across-dp-replicas-interval 2; silent data corruption suspected"
    ), message
    assert (
        f"in 1 parameter tensor(s): {FLIPPED}: rank 1 (data-parallel rank 1) differs from the other 2 replicas, "
        "which agree: ranks 0, 2 (data-parallel ranks 0, 2)." in message
    ), message
    assert (
        f"The last check that passed was at iteration 2; the newest checkpoint at or before it is {good} "
        "(iteration 2), the last good one" in message
    ), message
    assert message.endswith(f"(exit code {wh.WEIGHT_HASH_EXIT_CODE})")
    error = results[0]["error"]
    assert (error.iteration, error.last_passed, error.checkpoint) == (4, 2, (2, good))
    assert [r["iteration"] for r in results] == [4, 4, 4]  # stopped before the save of iteration 4
    logged = [line for line in results[2]["lines"] if line.startswith("weight hashes match")]
    assert [line.split(" (")[0] for line in logged] == [
        "weight hashes match across the replicas at iteration 0",
        "weight hashes match across the replicas at iteration 2",
    ]
    # --keep-last 1 kept iteration 2, the last checked checkpoint, beside 3 (iteration 1 went)
    assert [it for it, _ in list_complete_checkpoints(root)] == [2, 3]
    assert read_checked_iteration(good) == 2 and read_checked_iteration(os.path.join(root, "iter_0000003")) == 2
    record = read_pending_mismatch(root)  # what a restart reads: resume from iteration 2
    assert (record.iteration, record.last_passed, record.checkpoint) == (4, 2, 2)


OVERLAPPED = dict(
    num_layers=4,
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    num_layers_per_virtual_pipeline_stage=1,
    use_distributed_optimizer=True,
    overlap_grad_reduce=True,
    overlap_param_gather=True,
    global_batch_size=4,
    micro_batch_size=1,
    train_iters=3,
)


def _overlapped(rank: int, world_size: int) -> dict:
    naive: list[tuple[int, int]] = []
    real = loop.maybe_check_weight_hash

    def with_a_naive_hash_first(run, before_first_step=False):
        if not before_first_step:  # the same digests, without completing the parameter gathers first
            tables = wh.build_digest_tables(run.ctx.device)
            digests = wh.compute_param_digests([p for _, p in get_named_parameters(run.model)], tables)
            parts = [torch.empty_like(digests) for _ in range(run.ctx.dp_size)]
            dist.all_gather(parts, digests, group=run.ctx.reduce_group)
            naive.append((run.state.iteration, len(wh.find_mismatches(torch.stack(parts)))))
        real(run, before_first_step)

    out = {}
    for name, interval in (("checked", 1), ("unchecked", None)):
        loop.maybe_check_weight_hash = with_a_naive_hash_first if interval else real
        values = tiny_values(**OVERLAPPED, check_weight_hash_across_dp_replicas_interval=interval)
        run = build_tiny_run(values, MarkovDataset(32))
        lines: list[str] = []
        run.log = lines.append
        loop.train(run)
        out[name] = {
            "losses": [r["loss"] for r in run.records],
            "params": {n: p.detach().clone() for n, p in get_named_parameters(run.model)},
            "passed": [line.split(" (")[0] for line in lines if line.startswith("weight hashes match")],
            "record": run.weight_hash.get_marker_record() if run.weight_hash else None,
        }
        destroy_parallel_context()
    loop.maybe_check_weight_hash = real
    out["naive"] = naive
    return out


@pytest.fixture(scope="module")
def overlapped():
    return run_ranks(_overlapped, 8, timeout=600)


def test_no_false_mismatch_with_the_distributed_optimizer_and_overlapped_param_gather(overlapped):
    for rank in overlapped:
        assert rank["checked"]["record"] == {CHECKED_KEY: 3}  # every check passed, the last at iteration 3
    assert overlapped[-1]["checked"]["passed"] == [
        f"weight hashes match across the replicas at iteration {it}" for it in range(4)
    ]
    # the parameters are mid-gather at each check: hashed as they are, most of them differ
    for rank in overlapped:
        assert [it for it, _ in rank["naive"]] == [1, 2, 3]
        assert all(count >= 20 for _, count in rank["naive"]), rank["naive"]


def test_the_checks_change_no_loss_and_no_weight(overlapped):
    for rank in overlapped:
        checked, unchecked = rank["checked"], rank["unchecked"]
        assert checked["losses"] == unchecked["losses"]
        assert checked["params"].keys() == unchecked["params"].keys()
        assert all(torch.equal(checked["params"][k], unchecked["params"][k]) for k in checked["params"])
    assert len(overlapped[-1]["checked"]["losses"]) == 3
