"""--log-straggler in the real loop: 4 gloo ranks, PP2 x DP2, rank 1 (pipeline stage 0, DP rank 1)
sleeps 0.15 s in each of its forward steps (2 micro-batches a step). Every other rank waits for it
(its pipeline partner in P2P receives, its DP peer in the gradient reduce), so their step times grow
alike; its own work (compute) does not. The logging rank's report names rank 1 and no other.

The threshold is 1.0 here (a rank must take twice its peers' median), not the default 0.2: four
ranks share this machine's two cores, and their un-delayed compute differs by tens of percent from
one interval to the next; the injected delay is ~10x a tiny step's compute. With the flag off,
nothing is gathered: no all-gather at all during training.
"""

from __future__ import annotations

import time

import pytest

from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

SLOW_RANK, DELAY_S = 1, 0.15


def _train(rank: int, world_size: int, log_straggler: bool):
    import torch.distributed as dist

    import megatron_ext.training.step as step
    from megatron_ext.training.loop import train

    values = tiny_values(
        num_layers=2,
        pipeline_model_parallel_size=2,
        global_batch_size=8,
        micro_batch_size=2,
        train_iters=4,
        log_interval=2,
        log_straggler=log_straggler,
        straggler_threshold=1.0,
    )
    run = build_tiny_run(values, MarkovDataset(32))
    lines: list[str] = []
    run.log = lines.append
    if rank == SLOW_RANK:  # the schedule calls train_step's forward_step_func, built from step.forward_step
        original = step.forward_step

        def slow_forward_step(*args, **kwargs):
            time.sleep(DELAY_S)
            return original(*args, **kwargs)

        step.forward_step = slow_forward_step
    gathers = []
    real = {name: getattr(dist, name) for name in ("all_gather", "all_gather_object", "all_gather_into_tensor")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: (gathers.append(_name), _fn(*a, **k))[1])
    try:
        train(run)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    if run.prefetcher is not None:
        run.prefetcher.close()
    return run.ctx.is_logging_rank, lines, gathers


def test_a_delayed_rank_is_named_and_no_other_and_nothing_is_gathered_without_the_flag():
    results = run_ranks(_train, 4, True, timeout=300)
    (lines,) = [lines for logging, lines, _ in results if logging]
    reports = [line for line in lines if "straggler" in line]
    named = [line for line in reports if line.startswith("  WARNING straggler:")]
    assert len(named) == 2, "\n".join(lines)  # one per log step (iterations 2 and 4)
    for line in named:
        assert (
            line.startswith("  WARNING straggler: rank 1 (node ") and "pipeline stage 0, DP rank 1, TP rank 0)" in line
        ), line
        assert "of its stage" in line and "most in compute" in line, line
    slowest = [line for line in reports if line.startswith("  stragglers: own work")]
    assert len(slowest) == 2 and all("slowest rank 1 (" in line for line in slowest), reports
    # one all-gather per log step on every rank (and the hostnames once)
    for _, _, gathers in results:
        assert gathers == ["all_gather_object", "all_gather", "all_gather"], gathers

    results = run_ranks(_train, 4, False, timeout=300)
    for _, lines, gathers in results:
        assert gathers == [] and not [line for line in lines if "straggler" in line], (gathers, lines)
