"""launch/slurm.sbatch under a real Slurm: a one-host cluster of two nodes (tools/slurm_local_cluster.sh).

The default job (TP2 x PP2 x VPP2 x DP2: 8 ranks, 4 per node, two torchrun agents meeting at the
first node's NodeAddr) is submitted with ``sbatch``, stopped by ``scancel --signal=TERM`` (Slurm
signals every task of the step: launch/torchrun.sh on each node) and requeued: it saves the iteration
it stops at, resumes from it and finishes, COMPLETED 0:0. A ``--signal=TERM@120`` before a ``--time=4``
limit with no requeue left saves and ends COMPLETED 0:0 there. And one torchrun agent per node when
the job asks for more tasks per node.

Skipped, with the reason, where Slurm (Debian's slurm-wlm + munge) is not installed or the tests do
not run as root (scripts/test.sh installs them where it can); about 4 minutes on 2 cores otherwise. By
hand: see tools/slurm_local_cluster.sh.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from megatron_ext.checkpoint.directory import list_complete_checkpoints, read_tracker
from megatron_ext.testing import get_free_port

pytestmark = pytest.mark.slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(REPO, "tools", "slurm_local_cluster.sh")
SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")
# 2 nodes x 4 ranks, no GPUs here: the script's GPU and CPU defaults are overridden on the command line
RESOURCES = ["--nodes", "2", "--cpus-per-task", "4", "--gpus-per-node", "0"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("slurm"))
    proc = subprocess.run([CLUSTER, "start", root], capture_output=True, text=True, timeout=120)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    env = dict(
        os.environ,
        SLURM_CONF=os.path.join(root, "slurm.conf"),
        PATH=os.environ["PATH"] + ":/usr/sbin",
        NPROC_PER_NODE="4",
        OMP_NUM_THREADS="1",
    )
    yield env
    subprocess.run([CLUSTER, "stop", root], timeout=60)


def submit(env: dict, out: str, args: list[str], sbatch_options: list[str] = (), requeues: int = 0) -> str:
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            *RESOURCES,
            *sbatch_options,
            "--output",
            out,
            "--export",
            # MAX_REQUEUES=0 (unless a test asks): a job stopped by a signal ends there (COMPLETED 0:0)
            f"ALL,MASTER_PORT={get_free_port()},MAX_REQUEUES={requeues}",
            SBATCH,
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_state(env: dict, job: str) -> tuple[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", text)
    code = re.search(r"ExitCode=(\S+)", text)
    return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "?")


def wait_for(env: dict, job: str, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(env, job)
        # SIGNALING / STAGE_OUT: transient (a --signal being delivered, the job's end being staged), not an end
        transient = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SIGNALING", "STAGE_OUT")
        if state[0] not in transient + ("REQUEUED", "REQUEUE_FED"):
            return state
        time.sleep(2)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} still {job_state(env, job)} after {timeout} s")


def wait_for_log(path: str, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            text = open(path, errors="replace").read()
            if re.search(pattern, text):
                return text
        time.sleep(1)
    raise AssertionError(
        f"{pattern!r} not in {path} after {timeout} s:\n"
        f"{open(path, errors='replace').read()[-3000:] if os.path.exists(path) else '(no log)'}"
    )


def _stopped_at(log: str) -> int:
    match = re.search(r"exiting after iteration (\d+): exit signal received", log)
    assert match, log[-3000:]
    return int(match.group(1))


def test_signal_before_the_time_limit_saves_and_ends_cleanly(cluster, tmp_path):
    out, save = str(tmp_path / "job.out"), str(tmp_path / "ckpt")
    # the signal 60 s before a 2 min limit (Slurm may send it up to a minute early; it came on time here)
    job = submit(
        cluster,
        out,
        [
            "--config",
            "configs/default.yaml",
            "--train-iters",
            "100000",
            "--log-interval",
            "1",
            "--eval-interval",
            "0",
            "--save",
            save,
            "--save-interval",
            "100000",
            "--exit-signal-handler",
        ],
        ["--time=2", "--signal=TERM@60"],
    )
    assert wait_for(cluster, job, 400) == ("COMPLETED", "0:0"), open(out).read()[-3000:]
    stopped = _stopped_at(open(out).read())
    assert stopped >= 1 and read_tracker(save) == stopped


WORKER = """
import os, sys, time
open(os.path.join(sys.argv[1], "rank%s.%d" % (os.environ["RANK"], os.getpid())), "w").close()
time.sleep(5)  # while a second agent on the node would join
"""


def test_one_agent_per_node_whatever_the_jobs_tasks_per_node(cluster, tmp_path):
    # sbatch --ntasks-per-node=2 (one task per GPU, as for a srun-launched Megatron-LM): srun took the
    # job's task count, ignored its --ntasks-per-node=1 and started two agents per node; the job FAILED
    worker, ranks, out = tmp_path / "worker.py", tmp_path / "ranks", str(tmp_path / "job.out")
    worker.write_text(WORKER)
    ranks.mkdir()
    job = submit(
        dict(cluster, TRAIN_SCRIPT=str(worker)), out, [str(ranks)], ["--ntasks-per-node", "2", "--cpus-per-task", "2"]
    )
    assert wait_for(cluster, job, 180) == ("COMPLETED", "0:0"), open(out).read()[-3000:]
    assert sorted(int(name.split(".")[0][len("rank") :]) for name in os.listdir(ranks)) == list(range(8))


def test_the_default_job_stopped_by_scancel_requeues_and_resumes_from_its_checkpoint(cluster, tmp_path):
    """The default job under sbatch (8 ranks on two nodes, validation and checkpoints at intervals), stopped
    by ``scancel --signal=TERM`` (what a preemption's SIGTERM gives, Slurm signalling every task of the
    step: launch/torchrun.sh on each node). Issue 31: a clean stop before --train-iters ends the launchers
    with 75 while a requeue is left; the batch script requeues the job, which resumes from the newest
    complete checkpoint in --save (no --load given) and finishes: COMPLETED 0:0 after one requeue.
    (A stop with no requeue left ending COMPLETED 0:0: the time-limit test below.)"""
    out, save = str(tmp_path / "job.out"), str(tmp_path / "ckpt")
    args = ["--config", "configs/default.yaml", "--train-iters", "12", "--log-interval", "1", "--eval-interval", "6"]
    args += ["--save", save, "--save-interval", "6", "--exit-signal-handler"]
    job = submit(cluster, out, args, requeues=1)
    wait_for_log(out, r"iteration\s+3/", 300)
    subprocess.run(["scancel", "--signal=TERM", job], env=cluster, check=True)
    assert wait_for(cluster, job, 600) == ("COMPLETED", "0:0"), open(out).read()[-3000:]
    log = open(out, errors="replace").read()  # --open-mode=append: both runs
    assert "world 8 = TP 2 x PP 2 x DP 2 | virtual stages per pipeline rank 2" in log
    stopped = _stopped_at(log)
    assert f"requeueing job {job} (1 of MAX_REQUEUES=1)" in log, log[-3000:]
    assert f"resuming from the newest complete checkpoint in --save {save} (iteration {stopped})" in log, log[-3000:]
    assert re.search(r"iteration\s+12/\s+12", log) and "validation loss at iteration 12" in log, log[-3000:]
    text = subprocess.run(["scontrol", "show", "job", job], env=cluster, capture_output=True, text=True).stdout
    assert re.search(r"Restarts=1\b", text), text
    assert read_tracker(save) == 12
    assert {6, 12} <= {it for it, _ in list_complete_checkpoints(save)}  # older ones: retention
