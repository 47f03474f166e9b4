"""Heartbeats and the stall watchdog's limits, without a process group: verdicts from two reads,
where a thread waits, the report's lines, the flags' validation, and the failure modes of the store
(its host gone, a store that never answers) that must neither end nor hang the training process."""

from __future__ import annotations

import datetime
import math
import sys
import threading
import time
import types

import pytest
import torch.distributed as dist

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.heartbeat import (
    Heartbeat,
    HeartbeatBoard,
    HeartbeatPublisher,
    StepProgress,
    classify,
    format_ranks,
    format_verdicts,
    get_wait,
    open_store_connection,
    read_heartbeats,
    sample_thread,
)
from megatron_ext.pipeline.p2p import P2PChannels
from megatron_ext.testing import get_free_port
from megatron_ext.validation import validate

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128)


def _beat(rank: int, seq: int, progress: int, idle_s: float, waiting: str = "", phase: str = "step", **kw) -> Heartbeat:
    return Heartbeat(
        rank=rank,
        host="node7",
        pp_rank=rank,
        pp_size=4,
        seq=seq,
        phase=phase,
        iteration=2,
        microbatch=1,
        chunk=0,
        progress=progress,
        idle_s=idle_s,
        waiting=waiting,
        at="f.py:1 in g",
        **kw,
    )


def test_verdicts_name_the_stopped_rank_not_the_ones_waiting_behind_it():
    recent = 0.3
    first = {
        0: _beat(0, 10, 5, 2.0, "p2p_communication.py:238 in _communicate"),
        1: _beat(1, 10, 7, 2.0),
        2: _beat(2, 10, 3, 2.0),
        3: _beat(3, 10, 9, 0.1),
        4: _beat(4, 10, 4, 0.1),
    }
    second = {
        0: _beat(0, 12, 5, 2.2, "p2p_communication.py:238 in _communicate"),
        1: _beat(1, 12, 7, 2.2),  # computing, no progress: stopped
        2: _beat(2, 10, 3, 2.0),  # seq unchanged: silent (dead or frozen)
        3: _beat(3, 12, 9, 0.2),  # no new event, but its last one is recent: progressing
        4: _beat(4, 12, 6, 0.05),  # new events: progressing
        5: _beat(5, 12, 6, 9.0, phase="closed"),
    }  # its heartbeat closed on purpose
    verdicts = {v.rank: v.verdict for v in classify(first, second, 7, recent)}
    assert verdicts == {
        0: "waiting",
        1: "stopped",
        2: "silent",
        3: "progressing",
        4: "progressing",
        5: "closed",
        6: "missing",
    }


def test_report_lines_name_each_culprit_in_full_and_group_the_waiting_ranks():
    first = {r: _beat(r, 1, 5, 3.0, "" if r == 2 else "distributed_c10d.py:9 in all_reduce") for r in range(6)}
    second = {r: _beat(r, 2, 5, 3.2, b.waiting) for r, b in first.items() if r != 5}
    lines = format_verdicts(classify(first, second, 6, 0.3))
    text = "\n".join(lines)
    stopped = lines.index("  STOPPED (no progress, not waiting for another rank): the ranks holding the others up:")
    assert lines[stopped + 1] == (
        "    rank 2 (pipeline stage 2 of 4, tensor rank 0, data-parallel rank 0, host "
        "node7): the training step of iteration 2, micro-batch 1 of model chunk 0, no "
        "progress for 3.2 s, at f.py:1 in g"
    )
    assert "    rank 5: never published one" in lines
    assert (
        "  waiting for other ranks: ranks 0-1, 3-4, in the training step of iteration 2, in "
        "distributed_c10d.py:9 in all_reduce"
    ) in lines
    assert "no rank stopped outside a communication" not in text


def test_when_every_rank_waits_the_report_says_so_and_names_none():
    beats = {r: _beat(r, 1, 5, 3.0, "distributed_c10d.py:9 in all_reduce") for r in range(2)}
    lines = format_verdicts(classify(beats, {r: _beat(r, 2, 5, 3.0, b.waiting) for r, b in beats.items()}, 2, 0.3))
    assert not any("STOPPED" in line for line in lines)
    assert any("no rank stopped outside a communication" in line for line in lines)


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_heartbeat_round_trips_and_ignores_fields_it_does_not_know():
    beat = _beat(3, 4, 5, 1.5, "x")
    assert Heartbeat.from_json(beat.to_json()) == beat
    assert Heartbeat.from_json('{"rank": 1, "seq": 2, "step_ms": 9.5}') == Heartbeat(rank=1, seq=2)


def _frame(tmp_path, folder: str, line: str) -> types.SimpleNamespace:
    path = tmp_path / folder / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(f"def f():\n    {line}\n")
    return types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename=str(path), co_name="f"), f_lineno=2)


def test_a_wait_is_a_communication_function_or_a_handle_wait_in_torch_or_megatron(tmp_path):
    assert get_wait(_frame(tmp_path, "a/megatron/core", "handle.wait()")) == "mod.py:2 in f"
    assert get_wait(_frame(tmp_path, "b/ours", "handle.wait()")) == ""  # our code waits on local things
    assert get_wait(_frame(tmp_path, "c/megatron/core", "x = y @ z")) == ""
    c10d = types.SimpleNamespace(
        f_code=types.SimpleNamespace(co_filename="/x/torch/distributed/distributed_c10d.py", co_name="all_reduce"),
        f_lineno=3,
    )
    assert get_wait(c10d) == "distributed_c10d.py:3 in all_reduce"


def test_a_receive_of_our_pipeline_runtime_is_a_wait():
    """Our runtime's P2P waits are ``handle.wait()`` in megatron_ext/pipeline/p2p.py: a rank waiting
    there for its neighbour waits; it was listed as STOPPED."""
    seen = []

    class Handle:
        def wait(self):
            seen.append(get_wait(sys._getframe(1)))

    channels = P2PChannels.__new__(P2PChannels)  # (only its receive: a posted message and its handle)
    channels.posted = {"message": (None, Handle())}
    channels.receive("message")
    assert seen[0].startswith("p2p.py:") and seen[0].endswith(" in receive"), seen


def test_a_thread_waiting_on_a_local_thread_is_computing_unless_that_thread_communicates():
    """The training thread blocked on a queue of its own (data prefetch) waits for other ranks only
    when the thread it waits on does; here that thread sleeps (a stuck read): not waiting."""
    release = threading.Event()
    ready = threading.Event()

    def training() -> None:
        ready.set()
        release.wait()

    thread = threading.Thread(target=training)
    thread.start()
    ready.wait()
    time.sleep(0.05)
    try:
        waiting, at = sample_thread(thread.ident)
    finally:
        release.set()
        thread.join()
    assert waiting == ""
    assert at.endswith("in training")  # the caller, not threading.py's plumbing


def test_progress_events_move_the_count_and_leaving_a_phase_keeps_its_last_microbatch():
    p = StepProgress()
    p.enter("step", 4)
    p.record_microbatch(3, 1)
    count = p.count
    p.leave()
    assert (p.phase, p.iteration, p.microbatch, p.count) == ("between", 4, 3, count + 1)
    p.enter("eval", 4, batch=2)
    assert (p.microbatch, p.batch) == (None, 2)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf])
def test_watchdog_limits_must_be_positive_and_finite(value):
    for flag in ("step_timeout_minutes", "save_timeout_minutes"):
        with pytest.raises(ConfigError) as err:
            validate(build_job_config({**MOCK, flag: value}), 1)
        (problem,) = err.value.problems
        assert problem.startswith(f"--{flag.replace('_', '-')} must be a positive number of minutes")


def test_watchdog_limits_must_be_below_the_collective_timeout():
    with pytest.raises(ConfigError) as err:
        validate(build_job_config({**MOCK, "save_timeout_minutes": 12, "distributed_timeout_minutes": 10}), 1)
    assert err.value.problems == [
        "--save-timeout-minutes 12 must be below --distributed-timeout-minutes 10, or the collective timeout ends "
        "a stalled run first, naming no rank: lower it, or raise --distributed-timeout-minutes"
    ]
    validate(build_job_config({**MOCK, "step_timeout_minutes": 0.05, "save_timeout_minutes": 9.5}), 1)


def _store_server() -> tuple[dist.TCPStore, dist.TCPStore]:
    port = get_free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))
    return server, client


def test_publisher_survives_its_store_host_going_away_and_a_report_says_so():
    server, client = _store_server()
    reader = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=1))
    identity = dict(rank=0, host="h", pp_rank=0, pp_size=1, tp_rank=0, dp_rank=0)
    publisher = HeartbeatPublisher(client, StepProgress(), identity, interval_s=0.02)
    publisher.start()
    board = HeartbeatBoard(publisher, reader, 1, "rank 0 at 127.0.0.1", hosts_store=False)
    time.sleep(0.2)
    assert publisher.publishes >= 3 and publisher.failures == 0
    assert read_heartbeats(reader, 1)[0].seq >= 3
    del server  # the store host is gone (rank 0 died)
    time.sleep(0.2)
    start = time.monotonic()
    lines = board.collect()
    assert time.monotonic() - start < 5
    assert publisher.failures >= 1 and publisher._thread.is_alive()
    (line,) = lines
    assert "heartbeats are unavailable: the store (rank 0 at 127.0.0.1) did not answer" in line
    board.close()


def test_a_store_that_never_answers_delays_neither_the_training_thread_nor_close():
    class HungStore:
        def set(self, key, value):
            time.sleep(30)

    identity = dict(rank=0, host="h", pp_rank=0, pp_size=1, tp_rank=0, dp_rank=0)
    progress = StepProgress()
    publisher = HeartbeatPublisher(HungStore(), progress, identity, interval_s=0.01)
    publisher._thread.start()  # (``start`` publishes once from the caller first: not here)
    time.sleep(0.05)
    start = time.monotonic()
    for i in range(1000):
        progress.record_microbatch(i, 0)  # the training thread's side: attribute stores only
    publisher.close(timeout_s=0.2)
    assert time.monotonic() - start < 1.0
    assert publisher._thread.daemon  # the process exits even while the publication hangs


def test_without_a_process_group_store_to_clone_a_client_of_its_own_connects_to_master_addr(monkeypatch):
    """(Here no process group exists: torch's default store lookup raises, as a store without
    ``clone`` would.) Keys go under the torchrun attempt's prefix, as the process group's do."""
    server, _ = _store_server()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    store = open_store_connection(1.0)
    store.set("k", "v")
    assert server.get("megatron_ext/job7/2/k") == b"v"
    assert store.timeout == datetime.timedelta(seconds=1)


def test_in_a_large_world_only_the_first_ranks_to_time_out_read_every_heartbeat():
    """Thousands of ranks time out together: the store host must not serve world_size^2 heartbeats."""
    server, _ = _store_server()
    identity = dict(rank=0, host="h", pp_rank=0, pp_size=1, tp_rank=0, dp_rank=0)
    publisher = HeartbeatPublisher(server, StepProgress(), identity, interval_s=0.01)
    publisher.publish()
    world = HeartbeatBoard.ALL_COLLECT_WORLD + 1
    reports = [
        HeartbeatBoard(publisher, server, world, "rank 0", hosts_store=False).collect()
        for _ in range(HeartbeatBoard.COLLECTORS + 1)
    ]
    for lines in reports[:-1]:
        assert f"    ranks 1-{world - 1}: never published one" in lines
    (line,) = reports[-1]
    assert f"the first {HeartbeatBoard.COLLECTORS} ranks to time out read every rank's heartbeat" in line
    small = HeartbeatBoard(publisher, server, 2, "rank 0", hosts_store=False).collect()
    assert "    rank 1: never published one" in small  # a small world: every rank reads them all


def test_a_rank_that_stops_early_in_training_is_last_seen_in_training_not_start_up():
    """Issue 45: NO HEARTBEAT named a rank frozen a few seconds into training "last seen in start-up":
    its heartbeats came every interval (up to 10 s), the last one published before training began.
    The publisher now publishes as soon as the training thread leaves start-up."""
    server, client = _store_server()
    identity = dict(rank=0, host="h", pp_rank=0, pp_size=1, tp_rank=0, dp_rank=0)
    progress = StepProgress()
    publisher = HeartbeatPublisher(client, progress, identity, interval_s=30.0)  # a 10-hour step limit's
    publisher.start()
    assert read_heartbeats(server, 1)[0].phase == "starting"
    time.sleep(0.2)  # start-up goes on: no publication needed yet
    progress.enter("step", 1)
    progress.record_microbatch(0, 0)
    deadline = time.monotonic() + 5
    while read_heartbeats(server, 1)[0].phase == "starting" and time.monotonic() < deadline:
        time.sleep(0.01)
    last = read_heartbeats(server, 1)[0]
    assert last.phase == "step" and last.iteration == 1, last
    assert publisher.publishes == 2  # the first, and the one as start-up ended: not one per poll
    # the rank then froze: what the report says of it (its heartbeat no longer moves)
    lines = format_verdicts(classify({0: last}, {0: last}, 1, recent_s=1.0))
    assert any("last seen in the training step of iteration 1" in line for line in lines), lines
    publisher.close()
