"""--log-straggler in the real loop, 4 gloo ranks, PP2 x DP2, at the default threshold (0.2).

A slow rank: rank 1 (pipeline stage 0, DP rank 1) sleeps 0.15 s in each of its forward steps (2
micro-batches a step). Every other rank waits for it (its pipeline partner in P2P receives, its DP
peer in the gradient reduce), so their step times grow alike; its own work (compute) does not. The
logging rank's report names rank 1, from the second log line on (over the threshold in this interval
and one of the two before), and no other. With the flag off, nothing is gathered.

A stopped rank (SIGSTOP, ``bench.straggler.Stopper``): stopped while it waits in a P2P receive, or
in the gradient reduce, its own work does not grow, only everyone's waiting does; the rank's pause
monitor names it, in that phase, and no other rank is named (ef6451b named no one, or the wrong one).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch.distributed as dist

import megatron_ext.training.step as step
from bench.straggler import Stopper
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

SLOW_RANK, DELAY_S = 1, 0.15


def _train(rank: int, world_size: int, log_straggler: bool):
    values = tiny_values(
        num_layers=2,
        pipeline_model_parallel_size=2,
        global_batch_size=8,
        micro_batch_size=2,
        train_iters=6,
        log_interval=2,
        log_straggler=log_straggler,
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
    gathers = []  # (function, the file that called it): straggler.py's, and any other's

    def record(name: str) -> None:
        caller = sys._getframe(2).f_code.co_filename
        gathers.append(name if caller.endswith("megatron_ext/straggler.py") else (name, os.path.basename(caller)))

    real = {name: getattr(dist, name) for name in ("all_gather", "all_gather_object", "all_gather_into_tensor")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: (record(_name), _fn(*a, **k))[1])
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
    assert len(named) == 2, "\n".join(lines)  # iterations 4 and 6 (at 2, one interval is noise)
    for line in named:
        assert (
            line.startswith("  WARNING straggler: rank 1 (node ") and "pipeline stage 0, DP rank 1, TP rank 0)" in line
        ), line
        assert "of its stage" in line and "most in compute" in line, line
    slowest = [line for line in reports if line.startswith("  stragglers: own work")]
    assert len(slowest) == 3 and all("slowest rank 1 (" in line for line in slowest), reports
    # one all-gather per log step on every rank (and the hostnames once)
    for _, _, gathers in results:
        mine = [g for g in gathers if isinstance(g, str)]
        assert mine == ["all_gather_object", "all_gather", "all_gather", "all_gather"], gathers

    results = run_ranks(_train, 4, False, timeout=300)
    for _, lines, gathers in results:
        assert [g for g in gathers if isinstance(g, str)] == [], gathers
        assert not [line for line in lines if "straggler" in line], lines


STOP_S = 1.5
STOPS = {2: [(3, "P2P wait")], 1: [(6, "collective")]}  # rank: [(from iteration, phase)]


def _stopped(rank: int, world_size: int):
    values = tiny_values(
        num_layers=2,
        pipeline_model_parallel_size=2,
        global_batch_size=8,
        micro_batch_size=2,
        train_iters=9,
        log_straggler=True,
        data_prefetch=False,
    )
    run = build_tiny_run(values, MarkovDataset(32))
    lines: list[str] = []
    run.log = lines.append
    stopper = Stopper(STOPS[rank], STOP_S, lambda: run.state.iteration) if rank in STOPS else None
    train(run)
    if stopper is not None:
        stopper.close()
    return lines, stopper.done if stopper else []


def _warnings_by_iteration(lines: list[str]) -> dict[int, list[str]]:
    out, iteration = {}, None
    for line in lines:
        if "| consumed samples:" in line:
            iteration = int(line.split("iteration")[1].split("/")[0])
        elif line.startswith("  WARNING straggler:"):
            out.setdefault(iteration, []).append(line)
    return out


def test_a_rank_stopped_in_a_p2p_wait_or_the_gradient_reduce_is_named_and_no_other():
    results = run_ranks(_stopped, 4, timeout=300)
    lines = next(lines for lines, _ in results if any("| consumed samples:" in line for line in lines))
    warnings = _warnings_by_iteration(lines)
    expected = {
        "P2P wait": "in the schedule's P2P transfers",
        "collective": "in the gradient reduce (finalize_model_grads)",
    }
    for rank, (_, done) in enumerate(results):
        assert [phase for _, phase in done] == [phase for _, phase in STOPS.get(rank, [])], done
    stops = sorted((completed, rank, phase) for rank, (_, done) in enumerate(results) for completed, phase in done)
    for completed, rank, phase in stops:  # (ef6451b: the P2P stop's rank is not named, others are)
        # the log line of the stopped step (or of the next, when it came after that step's gather)
        named = warnings.pop(completed + 1, []) + warnings.pop(completed + 2, [])
        prefix = f"  WARNING straggler: rank {rank} (node "
        assert [w[: len(prefix)] for w in named] == [prefix], (phase, "\n".join(lines))
        assert ") stopped: it did not run for " in named[0] and expected[phase] in named[0], named[0]
        pause_ms = float(named[0].split("did not run for ")[1].split(" ms")[0])
        assert 0.8 * STOP_S * 1000 < pause_ms < 1.2 * STOP_S * 1000, named[0]
    assert warnings == {}, "\n".join(lines)  # no other rank named, at any other log step
