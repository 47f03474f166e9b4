"""Automatic restart (MAX_RESTARTS) through the real launcher: launch/torchrun.sh -> torchrun -> pretrain_gpt.py.

2 workers (PP 2, gloo), a tiny job of 8 iterations, --save without --load (the launcher's restarts
load --save), --exit-signal-handler on (the survivors of a dead rank must not wait for it in the
agreed SIGTERM save). Faults come from a test-only TRAIN_SCRIPT that wraps the real entry point:
rank 1 SIGKILLs itself (kill -9) as it starts iteration TEST_CRASH_AT in the attempts listed in
TEST_CRASH_ATTEMPTS (or raises an exception there, in those also in TEST_RAISE_ATTEMPTS), or every
step from TEST_DIVERGE_FROM on counts as non-finite (a diverged run).
Seven torchrun launches in all:

1. an uninterrupted run, then a run whose rank 1 dies at iteration 6 under MAX_RESTARTS=2: restarted
   once from iteration 4, it finishes with exit code 0 and its final checkpoint's tensors (weights
   and optimizer state) equal the uninterrupted run's bit for bit; the survivor was not SIGKILLed;
2. a configuration error (MAX_RESTARTS without --save) is not retried: exit code 2, one attempt; its
   error: block is printed once and is the root cause of torchrun's failure summary;
3. a diverged run is not retried: exit code 1, one attempt;
4. a crash at iteration 3 in every attempt stops after 2 attempts (the same failure twice in a row):
   a kill -9, then an exception, each the root cause of torchrun's summary (the signal; the traceback).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from megatron_ext.checkpoint.directory import list_complete_checkpoints
from megatron_ext.checkpoint.state import load_full_tensors
from tests.distributed.test_launch import REPO, finish, start_launcher

pytestmark = pytest.mark.torchrun

FAULTY_WORKER = f"""\
import dataclasses, os, runpy, signal, sys
sys.path.insert(0, {REPO!r})
from megatron_ext.training import loop

crash_at = int(os.environ.get("TEST_CRASH_AT", "0"))
crash_attempts = os.environ.get("TEST_CRASH_ATTEMPTS", "0").split(",")
raise_attempts = os.environ.get("TEST_RAISE_ATTEMPTS", "").split(",")
diverge_from = int(os.environ.get("TEST_DIVERGE_FROM", "0"))
attempt = os.environ.get("MEGATRON_EXT_RESTART_ATTEMPT")
real_iteration = loop.run_training_iteration


def faulty_iteration(run, window):
    starting = run.state.iteration + 1
    if starting == crash_at and os.environ["RANK"] == "1" and ("all" in crash_attempts or attempt in crash_attempts):
        if attempt in raise_attempts:
            raise RuntimeError(f"test crash at iteration {{starting}}")
        os.kill(os.getpid(), signal.SIGKILL)
    result, length = real_iteration(run, window)
    if diverge_from and starting >= diverge_from:
        result = dataclasses.replace(result, non_finite=True)
    return result, length


loop.run_training_iteration = faulty_iteration
runpy.run_path(os.path.join({REPO!r}, "pretrain_gpt.py"), run_name="__main__")  # as torchrun runs it
"""


def _args(save: str | None, save_interval: int = 4) -> list[str]:
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
        "8",
        "--log-interval",
        "1",
        "--lr",
        "1e-3",
        "--split",
        "100,0,0",
        "--exit-signal-handler",
        "--max-nan-iterations",
        "2",
    ] + (["--save", save, "--save-interval", str(save_interval)] if save else [])


def _launch(tmp_path, name: str, args: list[str], **env: str) -> tuple[int, str]:
    worker = tmp_path / "faulty_worker.py"
    worker.write_text(FAULTY_WORKER)
    log = tmp_path / f"{name}.log"
    proc = start_launcher(args, {"NPROC_PER_NODE": "2", "TRAIN_SCRIPT": str(worker), **env}, log)
    [(rc, output)] = finish([proc], [log], timeout=150)
    return rc, output


def _restarts(output: str) -> list[str]:
    return re.findall(r"launch/torchrun.sh: .*", output)


def test_a_killed_rank_is_restarted_from_the_last_checkpoint_bit_identically(tmp_path):
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    rc, output = _launch(tmp_path, "reference", _args(ref))
    assert rc == 0, output[-4000:]
    rc, output = _launch(
        tmp_path, "restarted", _args(run), MAX_RESTARTS="2", TEST_CRASH_AT="6", TEST_CRASH_ATTEMPTS="0"
    )
    assert rc == 0, output[-6000:]
    assert _restarts(output) == [
        "launch/torchrun.sh: torchrun exit code 1 at iteration 6; restart 1 of 2, from "
        "the newest complete checkpoint in --save"
    ], output[-6000:]
    assert f"> restart 1: resuming from the newest complete checkpoint in --save {run} (iteration 4)" in output
    assert f"loaded checkpoint {run}/iter_0000004 at iteration 4" in output, output[-4000:]
    # the survivor left at once (its peer's sockets closed), not SIGKILLed after torchrun's 30 s
    assert "forcefully exiting" not in output, output[-6000:]
    assert [it for it, _ in list_complete_checkpoints(run)] == [4, 8], os.listdir(run)

    expected = load_full_tensors(os.path.join(ref, "iter_0000008"))
    got = load_full_tensors(os.path.join(run, "iter_0000008"))
    assert sorted(got) == sorted(expected) and any("optimizer" in k for k in got), sorted(got)[:20]
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, differ
    # an independent check that the comparison can fail: the checkpoint of iteration 4 differs
    before = load_full_tensors(os.path.join(ref, "iter_0000004"))
    assert any(not torch.equal(before[k], expected[k]) for k in expected if "weight" in k)


def test_a_configuration_error_is_not_retried(tmp_path):
    rc, output = _launch(tmp_path, "config", _args(None), MAX_RESTARTS="2")
    assert rc == 2, output[-4000:]
    assert "error: invalid configuration:\n  - MAX_RESTARTS=2 needs --save DIR" in output, output[-4000:]
    # one error: block per host, and torchrun's summary names it as the root cause (not "To enable
    # traceback see ..."); the other rank, if it got as far, points to it
    assert len(re.findall(r"^error: invalid configuration:", output, re.M)) == 1, output[-4000:]
    assert re.search(
        r"Root Cause \(first observed failure\):\n\[\d\]:\n(  .*\n)*?  traceback : error: invalid configuration:\n"
        r"    - MAX_RESTARTS=2 needs --save DIR",
        output,
    ), output[-4000:]
    assert "To enable traceback see" not in output, output[-4000:]
    assert _restarts(output) == [
        "launch/torchrun.sh: not restarting: a worker stopped on a user error (the error: "
        "block above), which a restart would repeat"
    ], output[-4000:]


def test_a_diverged_run_is_not_retried(tmp_path):
    rc, output = _launch(tmp_path, "diverged", _args(str(tmp_path / "ckpt")), MAX_RESTARTS="2", TEST_DIVERGE_FROM="3")
    assert rc == 1, output[-4000:]
    assert "training diverged: 2 consecutive iterations up to 4" in output, output[-4000:]
    assert _restarts(output) == [
        "launch/torchrun.sh: not restarting: a worker stopped on the run diverged (the "
        "error: block above), which a restart would repeat"
    ], output[-4000:]


def test_a_crash_recurring_at_the_same_iteration_stops_after_two_tries(tmp_path):
    root = str(tmp_path / "ckpt")
    rc, output = _launch(
        tmp_path,
        "recurring",
        _args(root, save_interval=2),
        MAX_RESTARTS="3",
        TEST_CRASH_AT="3",
        TEST_CRASH_ATTEMPTS="all",
        TEST_RAISE_ATTEMPTS="1",
    )
    assert rc == 1, output[-4000:]
    # a real crash keeps torchrun's report: the kill -9, then the exception's traceback (printed by the
    # rank, torch's excepthook prefixing "[rank1]: ", and in torchrun's summary from its error file,
    # @record's; the root cause may be the survivor's "Connection closed by peer", in the same second)
    assert "traceback : Signal 9 (SIGKILL) received by PID" in output, output[-6000:]
    assert re.search(r"^(\[rank1\]: )?RuntimeError: test crash at iteration 3$", output, re.M), output[-6000:]
    summary = (
        r"  traceback : Traceback \(most recent call last\):\n(    .*\n)+  RuntimeError: test crash at iteration 3\n"
    )
    assert re.search(summary, output), output[-6000:]
    assert _restarts(output) == [
        "launch/torchrun.sh: torchrun exit code 1 at iteration 3; restart 1 of 3, from the newest complete "
        "checkpoint in --save",
        "launch/torchrun.sh: not restarting: the same failure (torchrun exit code 1 at iteration 3) happened 2 "
        "times in a row",
    ], output[-6000:]
    assert output.count(f"loaded checkpoint {root}/iter_0000002 at iteration 2") == 1, output[-6000:]
