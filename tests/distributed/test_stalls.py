"""Stalls named: a rank stalled in a training step, an evaluation or a save is caught by the
watchdog (--step-timeout-minutes, --save-timeout-minutes), and every rank's report names the rank
that stopped (from the heartbeats in the job's store), not the ranks waiting behind it. A normal run
with the watchdog and its heartbeats on trains exactly as without them.

The stall is injected on one rank (a forward hook, or the save's shard writer) and lasts until every
rank has reported (each rank's ``on_timeout`` writes its report instead of exiting), so the run then
finishes and the forked ranks return their reports. Limits are 0.05 min = 3 s."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest

from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed


def _stall(report_dir: str, rank: int, world_size: int) -> None:
    """Stop here (not in a communication) until this rank has reported, then until every rank has
    or 5 s more have passed."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not os.path.exists(os.path.join(report_dir, f"report{rank}.txt")):
        time.sleep(0.05)
    deadline = min(deadline, time.monotonic() + 5)
    while time.monotonic() < deadline and len(glob.glob(os.path.join(report_dir, "report*.txt"))) < world_size:
        time.sleep(0.05)


def _inject(run, kind: str, report_dir: str, rank: int, world_size: int) -> None:
    """The stall on this rank: in the forward of micro-batch 1 of the second training step, in the
    first evaluation forward, or before this rank writes its checkpoint shards."""
    from megatron_ext.training.step import unwrap_model

    if kind == "save":
        from megatron_ext.checkpoint import directory

        original = directory.write_shards

        def stalled_write(write):
            _stall(report_dir, rank, world_size)
            return original(write)

        directory.write_shards = stalled_write  # this forked rank only
        return
    calls = []

    def hook(module, args):
        if kind == "step" and module.training and run.state.iteration == 1:
            calls.append(1)
            if len(calls) == 2:
                _stall(report_dir, rank, world_size)
        if kind == "eval" and not module.training and not calls:
            calls.append(1)
            _stall(report_dir, rank, world_size)

    unwrap_model(run.model[0]).register_forward_pre_hook(hook)


def _stalled_world(rank: int, world_size: int, values: dict, kind: str, stalled_rank: int, report_dir: str):
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.training.loop import train

    run = build_tiny_run(tiny_values(**values), MarkovDataset(32), MarkovDataset(32, seed=9))
    run.watchdog.out = open(os.path.join(report_dir, f"stacks{rank}.txt"), "w")

    def write_report(report: str) -> None:
        with open(os.path.join(report_dir, f"tmp{rank}"), "w") as f:
            f.write(report)
        os.rename(os.path.join(report_dir, f"tmp{rank}"), os.path.join(report_dir, f"report{rank}.txt"))

    run.watchdog.on_timeout = write_report  # instead of exit 1: the run goes on once the stall ends
    if rank == stalled_rank:
        _inject(run, kind, report_dir, rank, world_size)
    train(run)
    run.watchdog.close()
    destroy_parallel_context()
    path = os.path.join(report_dir, f"report{rank}.txt")
    return open(path).read() if os.path.exists(path) else None


def _ranks_in(line: str) -> set[int]:
    """{0, 1, 3} from "... ranks 0-1, 3, in ..."."""
    match = re.search(r"\branks? ([\d, -]+?)(?:,? in |$)", line)
    out = set()
    for part in match.group(1).split(","):
        a, _, b = part.strip().partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def _verdicts(report: str) -> tuple[list[str], set[int]]:
    """(the STOPPED block's rank lines, the ranks listed as waiting)."""
    lines = report.splitlines()
    stopped = []
    if any(line.startswith("  STOPPED") for line in lines):
        start = next(i for i, line in enumerate(lines) if line.startswith("  STOPPED")) + 1
        stopped = [line for line in lines[start:] if line.startswith("    ")]
        stopped = stopped[: next((i for i, line in enumerate(lines[start:]) if not line.startswith("    ")), None)]
    waiting = set()
    for line in lines:
        if line.startswith("  waiting for other ranks:"):
            waiting |= _ranks_in(line)
    return stopped, waiting


def _run(tmp_path, world_size: int, values: dict, kind: str, stalled_rank: int) -> list[str]:
    report_dir = str(tmp_path / "reports")
    os.makedirs(report_dir)
    return run_ranks(_stalled_world, world_size, values, kind, stalled_rank, report_dir, timeout=180)


def test_a_rank_stalled_in_a_step_is_named_by_every_rank_and_the_waiting_ranks_are_not(tmp_path):
    """PP4, the stage-2 rank stops in the forward of micro-batch 1 of iteration 2: every rank's
    report (the stalled one's too) names rank 2 alone as stopped, with its stage, host, phase and
    micro-batch, and lists ranks 0, 1 and 3 as waiting."""
    values = dict(pipeline_model_parallel_size=4, train_iters=2, step_timeout_minutes=0.05)
    reports = _run(tmp_path, 4, values, "step", stalled_rank=2)
    assert all(reports), f"every rank's step outlasted the limit, but some did not report: {reports}"
    host = os.uname().nodename
    for rank, report in enumerate(reports):
        stopped, waiting = _verdicts(report)
        assert len(stopped) == 1, f"rank {rank}'s report:\n{report}"
        assert stopped[0].startswith(
            f"    rank 2 (pipeline stage 2 of 4, tensor rank 0, data-parallel rank 0, host "
            f"{host}): the training step of iteration 2, micro-batch 1 of model chunk 0, "
            f"no progress for "
        ), report
        assert "in _stall" in stopped[0]
        assert waiting == {0, 1, 3}, report


def test_a_rank_stalled_in_an_evaluation_is_caught_and_named(tmp_path):
    """Evaluations were watched by nothing but the collective timeout: PP2, rank 1 stops in the
    first evaluation forward; the step limit, per evaluation batch, catches it and names it."""
    values = dict(
        pipeline_model_parallel_size=2,
        num_layers=2,
        train_iters=1,
        eval_interval=1,
        eval_iters=1,
        step_timeout_minutes=0.05,
    )
    reports = _run(tmp_path, 2, values, "eval", stalled_rank=1)
    assert reports[1] is not None, "the stalled evaluation was not caught"
    for report in filter(None, reports):
        assert "in an evaluation batch" in report.splitlines()[0]
        stopped, waiting = _verdicts(report)
        assert len(stopped) == 1 and stopped[0].startswith("    rank 1 (pipeline stage 1 of 2"), report
        assert "evaluation batch 0 after iteration 1, micro-batch 0 of model chunk 0" in stopped[0]
        assert 1 not in waiting


def test_a_rank_stalled_in_a_save_is_caught_by_the_save_limit_and_named(tmp_path):
    """No step limit, --save-timeout-minutes only: rank 1 stops before writing its shards; rank 0
    waits in the save's agreement. Both reports name rank 1 in the save."""
    values = dict(
        pipeline_model_parallel_size=2,
        num_layers=2,
        train_iters=1,
        save=str(tmp_path / "ckpt"),
        save_timeout_minutes=0.05,
    )
    reports = _run(tmp_path, 2, values, "save", stalled_rank=1)
    assert all(reports), reports
    for report in reports:
        assert "in a checkpoint save" in report.splitlines()[0] and "--save-timeout-minutes 0.05" in report
        stopped, waiting = _verdicts(report)
        assert len(stopped) == 1 and stopped[0].startswith("    rank 1 (pipeline stage 1 of 2"), report
        assert "the checkpoint save after iteration 1" in stopped[0]
        assert waiting == {0}, report


def _frozen_world(rank: int, world_size: int, report_dir: str):
    """PP2: rank 1 stops itself (SIGSTOP) in the forward of micro-batch 1 of iteration 2, as a hung
    node would: its connections stay open, nothing of it runs. Rank 0's report releases it."""
    import signal

    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.training.loop import train
    from megatron_ext.training.step import unwrap_model

    values = tiny_values(pipeline_model_parallel_size=2, num_layers=2, train_iters=2, step_timeout_minutes=0.05)
    run = build_tiny_run(values, MarkovDataset(32))
    run.watchdog.out = open(os.path.join(report_dir, f"stacks{rank}.txt"), "w")
    reports = []
    pid_file = os.path.join(report_dir, "frozen.pid")

    def release(report: str) -> None:
        reports.append(report)
        if rank == 0:
            os.kill(int(open(pid_file).read()), signal.SIGCONT)

    run.watchdog.on_timeout = release
    calls = []

    def freeze(module, args):
        if module.training and run.state.iteration == 1:
            calls.append(1)
            if len(calls) == 2:
                with open(pid_file, "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)

    if rank == 1:
        unwrap_model(run.model[0]).register_forward_pre_hook(freeze)
    train(run)
    run.watchdog.close()
    destroy_parallel_context()
    return reports[0] if reports else None


def test_a_frozen_rank_is_named_as_having_no_heartbeat(tmp_path):
    """A rank whose process no longer runs at all (SIGSTOP: a hung node, a process frozen holding
    the GIL) publishes nothing more: rank 0's report names it under NO HEARTBEAT, itself waiting."""
    report = run_ranks(_frozen_world, 2, str(tmp_path), timeout=180)[0]
    assert report is not None
    lines = report.splitlines()
    block = lines.index("  NO HEARTBEAT (process dead, or frozen holding the GIL):")
    # (where it was last seen depends on when its last publication fell)
    assert lines[block + 1].startswith("    rank 1 (pipeline stage 1 of 2, tensor rank 0, data-parallel rank 0"), report
    stopped, waiting = _verdicts(report)
    assert stopped == [] and waiting == {0}, report


def _with_and_without(rank: int, world_size: int, root: str):
    """The same run twice: without the watchdog, then with it and a heartbeat every 5 ms."""
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.run import build_step_watchdog
    from megatron_ext.training.loop import train

    out = []
    for watched in (False, True):
        limits = dict(step_timeout_minutes=5, save_timeout_minutes=5) if watched else {}
        values = tiny_values(
            pipeline_model_parallel_size=2,
            num_layers=2,
            train_iters=4,
            eval_interval=2,
            eval_iters=1,
            save=os.path.join(root, str(watched)),
            **limits,
        )
        run = build_tiny_run(values, MarkovDataset(32, mask_every=1), MarkovDataset(32, seed=9))
        lines = []
        run.log = lines.append
        reports = []
        if watched:
            run.watchdog.close()  # the flags' one, replaced by one that publishes often
            run.watchdog = build_step_watchdog(run.cfg, run.ctx, heartbeat_interval_s=0.005, on_timeout=reports.append)
        history = train(run)
        validation = [line for line in lines if "validation" in line]
        publisher = run.watchdog.heartbeats.publisher if watched else None
        out.append((history, run.records, validation, publisher and (publisher.publishes, publisher.failures), reports))
        if watched:
            run.watchdog.close()
        destroy_parallel_context()
    return out


def test_a_normal_run_with_the_watchdog_on_trains_exactly_as_without_it(tmp_path):
    for plain, watched in run_ranks(_with_and_without, 2, str(tmp_path), timeout=180):
        history, records, validation, _, _ = plain
        history_w, records_w, validation_w, (publishes, failures), reports = watched
        assert (history_w, records_w, validation_w) == (history, records, validation)
        assert publishes >= 20 and failures == 0 and reports == []
    assert len(history) == 4 and len(validation) == 2  # the last stage logged every step and both evaluations
