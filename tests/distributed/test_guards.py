"""Hang and orphan guards: a worker dies with its launcher (kill -9 of the parent), one live job
per --save (a second is refused; a dead one does not block), and a stalled step is reported with
where the rank stands and its stacks instead of waiting for the collective timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_ext.config import ConfigError
from megatron_ext.guards import StepProgress, StepWatchdog, lock_save_dir
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AGENT = r"""
import subprocess, sys, time
# like torchrun: the worker in a new session, so only its parent-death signal can end it
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""
WORKER = r"""
import time
from megatron_ext.guards import apply_parent_death_signal
if {guarded}:
    assert apply_parent_death_signal()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper counts as dead
        return f.read().split(")")[-1].split()[0] != "Z"


def _orphan_survives(guarded: bool) -> bool:
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, WORKER.format(guarded=guarded)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    worker = int(agent.stdout.readline())
    time.sleep(1.0)  # the worker has called prctl
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.05)
    survived = _alive(worker)
    if survived:
        os.kill(worker, signal.SIGKILL)
    return survived


def test_worker_dies_with_its_launcher_on_kill_9():
    assert not _orphan_survives(guarded=True)
    assert _orphan_survives(guarded=False), "control: without the guard the orphan keeps running"


HOLDER = r"""
import sys, time
from megatron_ext.guards import lock_save_dir
handle = lock_save_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_second_live_job_on_one_save_dir_is_refused_and_a_dead_one_blocks_nothing(tmp_path):
    save = str(tmp_path / "ckpt")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, save],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"--save {save} is in use by a live job \(pid {holder.pid} "):
            lock_save_dir(save)
    finally:
        holder.kill()
        holder.wait()
    handle = lock_save_dir(save)  # released by the kernel when the holder died
    handle.close()


def test_stalled_step_is_reported_with_where_and_stacks(tmp_path):
    reports = []
    out = open(tmp_path / "report.txt", "w+")
    progress = StepProgress()
    watchdog = StepWatchdog(0.3, lambda: "rank 5 (pipeline stage 1 of 2)", progress, on_timeout=reports.append, out=out)
    try:
        watchdog.step_started(7)
        time.sleep(0.1)
        watchdog.step_finished()  # a step within the limit: nothing
        time.sleep(0.5)
        assert reports == []
        watchdog.step_started(8)
        progress.microbatch, progress.chunk = 3, 1
        deadline = time.monotonic() + 5
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)  # the stalled "step": this thread's stack is in the dump
    finally:
        watchdog.close()
    (report,) = reports
    assert "rank 5 (pipeline stage 1 of 2)" in report and "iteration 8" in report
    assert "micro-batch 3 of model chunk 1" in report
    out.seek(0)
    dump = out.read()
    assert "test_stalled_step_is_reported_with_where_and_stacks" in dump and "step-watchdog" not in report


def _progress(rank: int, world_size: int) -> tuple:
    run = build_tiny_run(
        tiny_values(train_iters=2, pipeline_model_parallel_size=2, step_timeout_minutes=10.0), MarkovDataset(32)
    )
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.training.loop import train

    train(run)
    p = run.watchdog.progress
    run.watchdog.close()
    destroy_parallel_context()
    return p.iteration, p.microbatch


def test_forward_step_records_the_microbatch_for_the_watchdog():
    # global batch 8 / micro-batch 2 / DP 1 = 4 micro-batches: the last one recorded is index 3
    assert run_ranks(_progress, 2) == [(2, 3), (2, 3)]


def test_a_step_that_raised_leaves_the_watchdog_disarmed(monkeypatch):
    """A step that raised never reached ``step_finished``: the watchdog stayed armed on it, and a
    process that handled the error (or took minutes to unwind: an exit hook, a wandb upload) was
    ended by a false "has spent N s in iteration k" report and exit 1, after the real error."""
    import io
    import types

    import torch

    from megatron_ext.config import build_job_config
    from megatron_ext.training import loop

    def failing_step(*args, **kwargs):
        raise RuntimeError("the forward step failed")

    monkeypatch.setattr(loop, "build_step_microbatches", lambda run, dataset, first, batch=None: ([], 32))
    monkeypatch.setattr(loop, "train_step", failing_step)
    watchdog = StepWatchdog(3600.0, lambda: "rank 0", StepProgress(), on_timeout=lambda report: None, out=io.StringIO())
    cfg = build_job_config({"mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 64})
    run = types.SimpleNamespace(
        cfg=cfg,
        state=loop.TrainState(),
        watchdog=watchdog,
        optimizer=None,
        scheduler=None,
        timers=None,
        prefetcher=None,
        train_ds=None,
        timeline=None,
        model=[torch.nn.Linear(1, 1)],
        steps_this_run=0,
        global_batch_size=8,
        step_data=types.SimpleNamespace(spec=types.SimpleNamespace(get_global_batch_size=lambda consumed: 8)),
        spike_guard=None,
        ctx=None,
    )
    try:
        with pytest.raises(RuntimeError, match="the forward step failed"):
            loop.run_training_iteration(run, loop.LogWindow())
        assert watchdog._started is None  # no step is running: nothing to time out
    finally:
        watchdog.close()
