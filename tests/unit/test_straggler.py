"""The pure half of --log-straggler (megatron_ext/straggler.py): which ranks are slow or stopped given
every rank's timings, and the report's lines; the pause monitor and the step timers' phases in one
process; the flags' checks. The gather, the loop and real stops: tests/distributed/test_straggler.py."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.straggler import (
    STARTING,
    PauseMonitor,
    RankTiming,
    ThreadClock,
    find_slow_ranks,
    find_stopped_ranks,
    format_straggler_report,
    get_extremes,
)
from megatron_ext.training.profiling import StepTimers
from megatron_ext.validation import validate


def _timings(own: dict[int, float], pp: int = 2, dp: int = 2, stage_cost: tuple[float, ...] = ()) -> list[RankTiming]:
    """PP x DP ranks (megatron-core's order at TP 1: rank = pp_rank * DP + dp_rank) whose compute is
    ``own[rank]`` (default 10 ms, plus ``stage_cost[pp_rank]``), 1 ms of optimizer and of data."""
    out = []
    for rank in range(pp * dp):
        p = rank // dp
        extra = stage_cost[p] if stage_cost else 0.0
        compute = own.get(rank, 10.0) + extra
        out.append(RankTiming(rank, p, 0, rank % dp, compute, 1.0, 1.0, compute + 5.0, node=f"n{rank // 2}"))
    return out


def test_the_slow_rank_is_named_and_no_other():
    (slow,) = find_slow_ranks(_timings({1: 20.0}), threshold=0.2)
    assert slow.timing.rank == 1 and slow.peers == "its stage" and slow.reference == 12.0
    text = slow.describe()
    assert "rank 1 (node n0, pipeline stage 0, DP rank 1, TP rank 0)" in text and "+83%" in text, text
    assert "most in compute, +10.0 ms" in text


def test_below_the_threshold_nobody_is_named():
    assert find_slow_ranks(_timings({1: 12.0}), threshold=0.2) == []  # 14 vs 12: +17%
    assert [s.timing.rank for s in find_slow_ranks(_timings({1: 12.0}), threshold=0.1)] == [1]


def test_stages_are_compared_with_their_own_peers_only():
    # the last stage holds the output layer: 3x the work of stage 0, on every one of its ranks
    timings = _timings({}, pp=2, dp=3, stage_cost=(0.0, 20.0))
    assert find_slow_ranks(timings, threshold=0.2) == []
    # a slow rank of the light stage, still faster than the heavy stage's ranks, is named
    (slow,) = find_slow_ranks(_timings({2: 18.0}, pp=2, dp=3, stage_cost=(0.0, 20.0)), threshold=0.2)
    assert slow.timing.rank == 2


def test_alone_in_its_stage_a_rank_is_compared_with_all_others():
    (slow,) = find_slow_ranks(_timings({3: 40.0}, pp=4, dp=1), threshold=0.2)
    assert slow.timing.rank == 3 and slow.peers == "all ranks"
    assert find_slow_ranks(_timings({}, pp=1, dp=1), threshold=0.2) == []  # one rank: no peers


def test_waiting_is_not_slowness():
    # rank 0 waits for its slow peer in the gradient reduce: a long forward-backward, short compute
    timings = _timings({1: 30.0})
    timings[0] = RankTiming(0, 0, 0, 0, 10.0, 1.0, 1.0, 60.0)
    assert timings[0].wait == 50.0
    assert [s.timing.rank for s in find_slow_ranks(timings, 0.2)] == [1]


def test_slow_data_and_optimizer_count_too():
    timings = _timings({})
    timings[2] = RankTiming(2, 1, 0, 0, 10.0, 1.0, 9.0, 15.0)  # a slow file system on one rank
    (slow,) = find_slow_ranks(timings, 0.2)
    assert slow.timing.rank == 2 and "most in data, +8.0 ms" in slow.describe(), slow.describe()


def test_extremes_and_report_lines():
    timings = _timings({1: 20.0, 3: 5.0})
    slowest, fastest = get_extremes(timings, 2)
    assert [t.rank for t in slowest] == [1, 0] and [t.rank for t in fastest] == [3, 0]
    assert [t.rank for t in get_extremes(timings, 9)[0]] == [1, 0, 2, 3]  # capped at the world
    lines = format_straggler_report(timings, 0.2, 1)
    assert lines[0].startswith("  stragglers: own work") and "slowest rank 1 (node n0, stage 0, DP 1) 22.0" in lines[0]
    assert "fastest rank 3 (node n1, stage 1, DP 1) 7.0" in lines[0]
    # rank 1 against rank 0 (its stage); rank 2 against rank 3 (12 vs 7: +71%) is slow too
    assert [line.split(":")[1].strip().split(" (")[0] for line in lines[1:]] == ["rank 1", "rank 2"]
    quiet = format_straggler_report(_timings({}), 0.2, 1)
    assert quiet[1] == "  stragglers: no rank held the others up by more than 20% of a step"


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(straggler_minmax_count=0), "--straggler-minmax-count must be a positive integer, got 0"),
        (dict(straggler_threshold=0.0), "--straggler-threshold must be a fraction > 0"),
        (dict(straggler_threshold=float("nan")), "--straggler-threshold must be a fraction > 0"),
    ],
)
def test_bad_straggler_flags_are_one_error_each(values, needle):
    cfg = build_job_config(
        dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=127, log_straggler=True, **values)
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert len(err.value.problems) == 1 and needle in err.value.problems[0], err.value.problems


def test_the_threshold_is_a_fraction_of_the_step():
    # rank 1's own work is 50% over its peer's (15 vs 10 ms) but the step is 100 ms, mostly waiting:
    # 5 ms is 5% of a step; 25 ms more is 25%
    timings = [RankTiming(r, r // 2, 0, r % 2, 10.0, 0.0, 0.0, 100.0) for r in range(4)]
    timings[1] = RankTiming(1, 0, 0, 1, 15.0, 0.0, 0.0, 100.0)
    assert find_slow_ranks(timings, 0.2) == []
    timings[1] = RankTiming(1, 0, 0, 1, 35.0, 0.0, 0.0, 100.0)
    assert [s.timing.rank for s in find_slow_ranks(timings, 0.2)] == [1]
    assert "25% of the median step 100.0" in find_slow_ranks(timings, 0.2)[0].describe()


def test_waiting_for_a_core_is_not_own_work():
    timings = _timings({1: 20.0})
    timings[1] = RankTiming(1, 0, 0, 1, 20.0, 1.0, 1.0, 25.0, queued=10.0)  # 10 ms of 20 in the run queue
    assert timings[1].own == 12.0 and find_slow_ranks(timings, 0.2) == []


def test_only_ranks_over_in_a_recent_interval_too_are_named_slow():
    timings = _timings({1: 20.0, 2: 20.0})
    assert [s.timing.rank for s in find_slow_ranks(timings, 0.2, before={2, 3})] == [2]
    lines = format_straggler_report(timings, 0.2, 1, before=set())
    assert lines[1] == "  stragglers: no rank held the others up by more than 20% of a step"


def _paused(rank: int, longest: float, total: float, phase: str = "forward-backward") -> RankTiming:
    return RankTiming(
        rank, rank // 2, 0, rank % 2, 10.0, 1.0, 1.0, 100.0, paused=total, longest_pause=longest, pause_phase=phase
    )


def test_a_rank_that_did_not_run_is_named_stopped_with_its_phase():
    timings = [_paused(r, 0.0, 0.0) for r in range(4)]
    timings[2] = _paused(2, 5000.0, 5000.0)  # its stop made everyone's step ~5 s
    timings = [dataclasses.replace(t, forward_backward=5100.0) for t in timings]
    (stopped,) = find_stopped_ranks(timings, 0.2)
    text = stopped.describe()
    assert stopped.timing.rank == 2 and text.startswith(
        "rank 2 (node ?, pipeline stage 1, DP rank 0, TP rank 0) stopped:"
    )
    assert "did not run for 5000 ms at once" in text and "in the schedule's P2P transfers" in text, text
    # named once, as stopped, though its own work is not over its peers'
    lines = format_straggler_report(timings, 0.2, 1)
    assert [line[:40] for line in lines[1:]] == ["  WARNING straggler: rank 2 (node ?, pip"], lines


def test_short_pauses_are_not_named_but_many_add_up():
    timings = [_paused(r, 0.0, 0.0) for r in range(4)]
    timings[0] = _paused(0, 19.0, 19.0)  # 19 ms of a 102 ms step
    assert find_stopped_ranks(timings, 0.2) == []
    timings[0] = _paused(0, 19.0, 30.0, phase="compute")  # 30 ms per step in all
    (stopped,) = find_stopped_ranks(timings, 0.2)
    assert stopped.timing.rank == 0 and "30 ms per step in all" in stopped.describe()


def _stop_for(seconds: float) -> None:
    """Stop this whole process (SIGSTOP), continued by a shell ``seconds`` later."""
    subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def _monitored_stops(out) -> None:
    """In a forked process: stops under a pause monitor whose training thread is this one."""
    phase = ["compute"]
    monitor = PauseMonitor(lambda when: phase[0], period_s=0.01)
    time.sleep(0.1)
    monitor.take()
    _stop_for(0.4)
    time.sleep(0.05)
    measured = [monitor.take()]
    start = time.thread_time()
    sum(range(1_000_000))
    n = int(1_000_000 * 0.3 / max(time.thread_time() - start, 1e-6))
    sum(range(n))  # ~0.3 s holding the GIL: this (the training) thread's own work
    time.sleep(0.05)
    measured.append(monitor.take())
    with monitor.not_counted():  # a checkpoint save
        _stop_for(0.3)
    phase[0] = STARTING  # before the first step
    _stop_for(0.3)
    time.sleep(0.05)
    measured.append(monitor.take())
    monitor.close()
    out.put(measured)


def test_the_pause_monitor_measures_a_stop_and_where_it_fell():
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_monitored_stops, args=(out,))
    child.start()
    stopped, own_work, not_counted = out.get(timeout=60)
    child.join(10)
    total, longest, where = stopped
    assert 0.3 < longest <= total < 0.45 and where == "compute", stopped
    if ThreadClock.open() is not None:  # (without the clocks, a thread holding the GIL looks stopped)
        assert own_work[1] < 0.1, own_work
    assert not_counted == (0.0, 0.0, ""), not_counted


def test_the_step_timers_phases_at_a_time():
    timers = StepTimers(1, torch.device("cpu"), compute=True)
    assert timers.get_phase_at(time.monotonic()) == STARTING
    with timers.time("data"):
        in_data = time.monotonic()
    with timers.time("forward-backward"):
        with timers.time("compute"):
            in_compute = time.monotonic()
        between = time.monotonic()
        with timers.time("grad-reduce"):  # not timed at level 1, but a phase
            in_reduce = time.monotonic()
    with timers.time("optimizer"):
        pass
    after = time.monotonic()
    assert [timers.get_phase_at(t) for t in (in_data, in_compute, between, in_reduce, after)] == [
        "data",
        "compute",
        "forward-backward",
        "grad-reduce",
        "between",
    ]
    timers.steps = 1
    means = timers.report()
    assert "grad-reduce" not in means and set(means) == {"data", "forward-backward", "compute", "optimizer"}
    if ThreadClock.open() is not None:  # Linux: what the thread waited for a core, per timer
        assert set(timers.queued_means) == set(means) and timers.reported_steps == 1


def test_the_thread_clock_reads_this_thread():
    clock = ThreadClock.open()
    if clock is None:
        pytest.skip("no /proc/self/task/<tid>/schedstat here")
    before = clock.read()
    sum(range(3_000_000))
    after = clock.read()
    assert after[0] > before[0] and after[1] >= before[1] >= 0.0
    other = []
    worker = threading.Thread(target=lambda: other.append(ThreadClock.open()))
    worker.start()
    worker.join()
    assert other[0] is not None and other[0].fd != clock.fd
