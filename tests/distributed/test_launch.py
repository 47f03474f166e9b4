"""The launch path as a user runs it: launch/torchrun.sh -> torchrun -> our entry points.

Each torchrun of 8 CPU ranks costs ~40 s here (every process imports torch and megatron-core),
so this file launches four times in all: the multi-node topology (two agents), one short
training run of the real entry point (with context parallelism), and two tiny launches of a fake worker for the exit-code
contract.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import time
import uuid

import pytest

from megatron_ext.testing import get_free_port

pytestmark = pytest.mark.torchrun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "launch", "torchrun.sh")


def start_launcher(args: list[str], env: dict[str, str], log_path) -> subprocess.Popen:
    """launch/torchrun.sh in its own session, output to ``log_path`` (no pipe to fill up)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "RDZV_ID", "TRAIN_SCRIPT"):
        if name not in env:
            full_env.pop(name, None)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [LAUNCHER, *args],
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(procs: list[subprocess.Popen], log_paths: list, timeout: float) -> list[tuple[int, str]]:
    """(exit code, output) of each launcher. After ``timeout`` seconds in all, the launchers get
    SIGTERM (which they forward to torchrun and its workers), then their sessions SIGKILL."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        outputs = [open(path).read()[-4000:] for path in log_paths]
        pytest.fail(f"launcher did not finish in {timeout}s; output:\n" + "\n---\n".join(outputs))
    return [(p.returncode, open(path).read()) for p, path in zip(procs, log_paths)]


# ----------------------------------------------------------------------------- topology


def get_expected_groups(world_size: int, tp: int, pp: int) -> dict[str, set[tuple[int, ...]]]:
    """Megatron's default order (tp fastest, then dp, then pp), written out independently."""
    dp = world_size // (tp * pp)
    stride_pp = tp * dp
    return {
        "tp": {tuple(range(start, start + tp)) for start in range(0, world_size, tp)},
        "pp": {tuple(range(r, world_size, stride_pp)) for r in range(stride_pp)},
        "dp": {tuple(p * stride_pp + d * tp + t for d in range(dp)) for p in range(pp) for t in range(tp)},
    }


def test_two_node_topology(tmp_path):
    nnodes, nproc, tp, pp = 2, 4, 2, 2
    port, rdzv_id = get_free_port(), f"topo-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "topology"
    logs = [tmp_path / f"agent{node}.log" for node in range(nnodes)]
    procs = [
        start_launcher(
            [
                "--tensor-model-parallel-size",
                str(tp),
                "--pipeline-model-parallel-size",
                str(pp),
                "--output-dir",
                str(out_dir),
            ],
            {
                "NNODES": str(nnodes),
                "NPROC_PER_NODE": str(nproc),
                "NODE_RANK": str(node),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RDZV_ID": rdzv_id,
                "TRAIN_SCRIPT": os.path.join(REPO, "tools", "print_topology.py"),
            },
            logs[node],
        )
        for node in range(nnodes)
    ]
    results = finish(procs, logs, timeout=240)
    for node, (rc, output) in enumerate(results):
        assert rc == 0, f"agent {node} exited {rc}:\n{output[-4000:]}"

    files = sorted(glob.glob(str(out_dir / "rank*.json")))
    world = nnodes * nproc
    assert len(files) == world, files
    records = {r["rank"]: r for r in (json.load(open(f)) for f in files)}
    assert sorted(records) == list(range(world))

    # torchrun numbers ranks node by node: rank = GROUP_RANK x local world size + LOCAL_RANK.
    for rank, r in records.items():
        assert r["node"] == rank // nproc and r["local_rank"] == rank % nproc, r

    node_of = {rank: r["node"] for rank, r in records.items()}
    for r in records.values():
        assert len({node_of[x] for x in r["tp_ranks"]}) == 1, f"TP group {r['tp_ranks']} crosses nodes"
        assert {node_of[x] for x in r["pp_ranks"]} == set(range(nnodes)), f"PP group {r['pp_ranks']} misses a node"

    expected = get_expected_groups(world, tp, pp)
    for kind in ("tp", "pp", "dp"):
        groups = {tuple(r[f"{kind}_ranks"]) for r in records.values()}
        assert groups == expected[kind], f"{kind} groups {sorted(groups)} != {sorted(expected[kind])}"
        # each rank in exactly one group of each kind, the groups partition the world
        assert sorted(x for g in groups for x in g) == list(range(world))
        for rank, r in records.items():
            assert rank in r[f"{kind}_ranks"]
    sizes = {k: len(next(iter(expected[k]))) for k in expected}
    assert sizes["tp"] * sizes["pp"] * sizes["dp"] == world


# ----------------------------------------------------------------------------- end to end

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*\| lm loss: ([0-9.eE+-]+) \|")


def test_end_to_end_training(tmp_path):
    """The default job through launch/torchrun.sh, with context parallelism 2 added (the suite's one
    launch of it): TP 2 x CP 2 x PP 2 x VPP 2 on 8 ranks, packed documents padded to g = 4, the
    distributed optimizer sharded over CP. Trains, evaluates, saves, and logs its layout."""
    tb_dir = tmp_path / "tb"
    proc = start_launcher(
        [
            "--config",
            "configs/default.yaml",
            "--context-parallel-size",
            "2",
            "--train-iters",
            "6",
            "--log-interval",
            "1",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--tensorboard-dir",
            str(tb_dir),
            "--save",
            str(tmp_path / "ckpt"),
            "--save-interval",
            "3",
        ],
        {"NPROC_PER_NODE": "8"},
        tmp_path / "train.log",
    )
    [(rc, output)] = finish([proc], [tmp_path / "train.log"], timeout=300)
    assert rc == 0, output[-6000:]
    # the default job saves: iterations 3 and 6, published with the latest pointer
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"

    matches = [ITERATION_LINE.search(line) for line in output.splitlines()]
    steps = [(int(m.group(1)), int(m.group(2)), float(m.group(3))) for m in matches if m]
    assert [s[:2] for s in steps] == [(i, 6) for i in range(1, 7)], output[-6000:]
    losses = [s[2] for s in steps]
    assert losses[-1] < losses[0], losses
    assert "> layout: world 8 = TP 2 x CP 2 x PP 2 x DP 1 | virtual stages per pipeline rank 2" in output, output[
        -6000:
    ]
    assert "validation loss at iteration 3 | lm loss value:" in output, output[-6000:]
    assert glob.glob(str(tb_dir / "**" / "events.out.tfevents.*"), recursive=True), os.listdir(tmp_path)


# ----------------------------------------------------------------------------- exit status

FAKE_WORKER = """\
import os, sys
marker_dir = os.environ.get("MEGATRON_EXT_EXIT_MARKER_DIR")
if not marker_dir or not os.path.isdir(marker_dir):
    sys.exit(4)  # the launcher must hand every worker an existing marker directory
code = int(sys.argv[1])
if code == 0:
    open(os.path.join(marker_dir, "rank%s.ok" % os.environ["RANK"]), "w").close()
sys.exit(code)
"""


@pytest.mark.parametrize("worker_code", [0, 3])
def test_launcher_exit_status(tmp_path, worker_code):
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    log = tmp_path / "launch.log"
    proc = start_launcher([str(worker_code)], {"NPROC_PER_NODE": "2", "TRAIN_SCRIPT": str(worker)}, log)
    [(rc, output)] = finish([proc], [log], timeout=120)
    if worker_code == 0:
        assert rc == 0, output[-4000:]
    else:
        assert rc != 0, output[-4000:]


SLOW_EXIT_WORKER = r"""
import os, signal, sys, time
marker_dir = os.environ["MEGATRON_EXT_EXIT_MARKER_DIR"]
def on_term(signum, frame):  # a large model's last step and checkpoint: longer than torchrun's 30 s
    time.sleep(float(sys.argv[1]))
    open(os.path.join(marker_dir, "rank%s.ok" % os.environ["RANK"]), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[2], "w").close()  # the handler is in place
while True:
    time.sleep(0.1)
"""


def test_a_save_on_sigterm_may_outlast_torchruns_default_30_s(tmp_path):
    worker, started = tmp_path / "slow_exit_worker.py", tmp_path / "started"
    worker.write_text(SLOW_EXIT_WORKER)
    log = tmp_path / "launch.log"
    proc = start_launcher(["34", str(started)], {"NPROC_PER_NODE": "1", "TRAIN_SCRIPT": str(worker)}, log)
    deadline = time.monotonic() + 60
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.exists(), open(log).read()[-3000:]
    proc.send_signal(signal.SIGTERM)
    [(rc, output)] = finish([proc], [log], timeout=90)
    assert "forcefully exiting via 9" not in output and rc == 0, output[-3000:]
