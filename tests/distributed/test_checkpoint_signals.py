"""SIGTERM (Slurm preemption) through the real launcher: launch/torchrun.sh -> torchrun -> workers.

Two launches of 2 workers (PP2) of pretrain_gpt.py with --exit-signal-handler --save DIR:
1. SIGTERM to the torchrun agent, as Slurm delivers it: the agent forwards it to the workers,
   which agree at the next step boundary, save, and exit 0; torchrun's own exit code is not 0
   after a signal, so the launcher reports the workers' exit markers: 0.
2. Relaunch with --load DIR; SIGTERM to every worker directly: it resumes at the saved iteration
   + 1, saves again on the signal, and exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from megatron_ext.checkpoint.directory import find_latest_checkpoint
from tests.distributed.test_launch import finish, start_launcher

pytestmark = pytest.mark.torchrun

ITERATION = re.compile(r"iteration\s+(\d+)/")


def _args(root: str) -> list[str]:
    return [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "127",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--make-vocab-size-divisible-by",
        "32",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2000",
        "--log-interval",
        "1",
        "--lr",
        "1e-3",
        "--split",
        "100,0,0",
        "--save",
        root,
        "--load",
        root,
        "--save-interval",
        "1000",
        "--exit-signal-handler",
    ]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _wait_for_iterations(log_path, after: int, timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = [int(m.group(1)) for m in ITERATION.finditer(open(log_path).read())]
        if seen and seen[-1] >= after + 2:
            return seen
        time.sleep(0.5)
    pytest.fail(f"training did not reach iteration {after + 2}:\n{open(log_path).read()[-4000:]}")


def _launch_and_signal(tmp_path, name: str, root: str, after: int, target: str) -> tuple[int, str, list[int]]:
    log = tmp_path / f"{name}.log"
    proc = start_launcher(_args(root), {"NPROC_PER_NODE": "2"}, log)
    seen = _wait_for_iterations(log, after)
    (agent,) = [c for c in _children(proc.pid)]
    workers = _children(agent)
    assert len(workers) == 2, workers
    for pid in [agent] if target == "agent" else workers:
        os.kill(pid, signal.SIGTERM)
    [(rc, output)] = finish([proc], [log], timeout=120)
    return rc, output, seen


def test_sigterm_to_agent_then_to_workers_saves_and_resumes(tmp_path):
    root = str(tmp_path / "ckpt")
    rc, output, _ = _launch_and_signal(tmp_path, "agent", root, 0, "agent")
    assert rc == 0, output[-6000:]
    assert "exiting after iteration" in output and "exit signal received" in output, output[-4000:]
    first = find_latest_checkpoint(root)
    assert first is not None, output[-4000:]
    stopped_at = first[0]
    logged = [int(m.group(1)) for m in ITERATION.finditer(output)]
    assert logged[-1] == stopped_at, (logged[-5:], stopped_at)

    rc, output, seen = _launch_and_signal(tmp_path, "workers", root, stopped_at, "workers")
    assert rc == 0, output[-6000:]
    assert f"loaded checkpoint {first[1]} at iteration {stopped_at}" in output, output[-4000:]
    assert seen[0] == stopped_at + 1, seen[:5]
    second = find_latest_checkpoint(root)
    assert second[0] > stopped_at and "exit signal received" in output, output[-4000:]
