"""launch/torchrun.sh and launch/slurm.sbatch as shell scripts, with fake ``torchrun``, ``srun`` and
``scontrol`` on PATH: what reaches torchrun (arguments, environment), signals, Slurm's node list;
and the device a rank picks from LOCAL_RANK. No torch process starts here (tests/distributed/test_launch.py
and tests/slurm run the real ones)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torchrun: records its arguments and the environment the launcher gave it, then waits
# FAKE_TORCHRUN_SLEEP seconds (as torchrun waits for its peers in the rendezvous)
FAKE_TORCHRUN = f"""#!{sys.executable}
import json, os, sys, time
out = os.environ["FAKE_TORCHRUN_OUT"]
env = {{k: v for k, v in os.environ.items() if k.startswith(("MASTER_", "NNODES", "NODE_RANK", "NPROC_", "OMP_",
                                                             "CUDA_", "TORCH_", "MEGATRON_EXT_", "RDZV_"))}}
with open(out + ".tmp", "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": env}}, f)
os.replace(out + ".tmp", out)
time.sleep(float(os.environ.get("FAKE_TORCHRUN_SLEEP", "0")))
"""

# scontrol: `show hostnames` expands to FAKE_NODES names (node1, node2, ...); `show node X` gives
# NodeAddr=addr-of-X, or fails as where node information is private (FAKE_SHOW_NODE_FAILS)
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1" == requeue ]] && { echo "requeue $2" >> "$FAKE_TORCHRUN_OUT.requeue"; exit 0; }
case "$1 $2" in
  "show hostnames") exec seq -f 'node%g' 1 "${FAKE_NODES:-2}" ;;
  "show node")
    if [[ -n "${FAKE_SHOW_NODE_FAILS:-}" ]]; then echo "slurm_load_node error: Access/permission denied" >&2; exit 1; fi
    echo "NodeName=$3 Arch=x86_64 CoresPerSocket=8 NodeAddr=addr-of-$3 NodeHostName=$3 Version=22.05"
    exit 0 ;;
esac
exit 1
"""

# srun: drops its options and runs the task once, as node 0 (or exits FAKE_SRUN_RC without running it)
FAKE_SRUN = """#!/usr/bin/env bash
[[ -n "${FAKE_SRUN_RC:-}" ]] && { echo "STOPPED_EXIT_CODE=$STOPPED_EXIT_CODE" > "$FAKE_TORCHRUN_OUT.srun"; exit "$FAKE_SRUN_RC"; }
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""

LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "RDZV_ID",
    "TRAIN_SCRIPT",
    "MEGATRON_EXT_ROOT",
    "OMP_NUM_THREADS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
)


def make_fakes(tmp_path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("torchrun", FAKE_TORCHRUN), ("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def launch_env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(
        PATH=make_fakes(tmp_path) + os.pathsep + os.environ["PATH"],
        FAKE_TORCHRUN_OUT=str(tmp_path / "torchrun.json"),
        **extra,
    )
    return env


def slurm_env(tmp_path, nodes: int, **extra: str) -> dict[str, str]:
    return launch_env(
        tmp_path,
        SLURM_JOB_NODELIST=f"node[1-{nodes}]",
        SLURM_NNODES=str(nodes),
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=REPO,
        SLURM_CPUS_PER_TASK="4",
        FAKE_NODES=str(nodes),
        **extra,
    )


def run_sbatch(tmp_path, env: dict[str, str], args: list[str]) -> dict:
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "launch", "slurm.sbatch"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    with open(tmp_path / "torchrun.json") as f:
        return json.load(f)


def test_sbatch_passes_flags_and_paths_with_spaces_and_quotes_through(tmp_path):
    root = tmp_path / "my repo"
    shutil.copytree(os.path.join(REPO, "launch"), root / "launch")
    flags = ["--config", "my configs/a b.yaml", "--wandb-exp-name", 'it\'s "quoted" $HOME *', "--empty", ""]
    seen = run_sbatch(tmp_path, slurm_env(tmp_path, 2, MEGATRON_EXT_ROOT=str(root)), flags)
    argv, env = seen["argv"], seen["env"]
    assert argv[-len(flags) - 1 :] == [str(root / "pretrain_gpt.py"), *flags], argv
    opts = dict(zip(argv[: -len(flags) - 1 : 2], argv[1 : -len(flags) - 1 : 2]))
    assert opts == {
        "--nnodes": "2",
        "--nproc-per-node": "8",
        "--node-rank": "0",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "addr-of-node1:29500",
        "--rdzv-id": "4242",
    }, argv
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1", env
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "110" and env["MEGATRON_EXT_EXIT_MARKER_DIR"], env


def test_sbatch_finds_the_first_node_of_a_large_job(tmp_path):
    # `scontrol show hostnames | head -n1` under pipefail: head leaves after one line, scontrol dies
    # of SIGPIPE writing the rest, and set -e ended the job with status 141 before srun, silently
    seen = run_sbatch(tmp_path, slurm_env(tmp_path, 20000), ["--config", "configs/default.yaml"])
    assert seen["env"]["MASTER_ADDR"] == "addr-of-node1" and seen["env"]["NNODES"] == "20000", seen


def test_sbatch_falls_back_to_the_node_name_when_scontrol_shows_no_node(tmp_path):
    # the fallback below the NodeAddr lookup was unreachable: set -e ended the job on scontrol's error
    seen = run_sbatch(tmp_path, slurm_env(tmp_path, 2, FAKE_SHOW_NODE_FAILS="1"), ["--config", "configs/default.yaml"])
    assert seen["env"]["MASTER_ADDR"] == "node1", seen


def test_sigint_reaches_torchrun_before_its_workers_start(tmp_path):
    # torchrun ignores nothing itself, but a command started with `&` by a script inherits SIGINT
    # ignored (bash, without job control): the launcher's forwarded SIGINT (Ctrl-C) did nothing
    # until torchrun's workers started, e.g. not while it waited in the rendezvous for other nodes
    env = launch_env(tmp_path, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", FAKE_TORCHRUN_SLEEP="120")
    # started as from a terminal or srun: SIGINT not ignored (this test process may have been started with it
    # ignored, and a shell cannot trap a signal ignored when it starts)
    proc = subprocess.Popen(
        [os.path.join(REPO, "launch", "torchrun.sh"), "--flag"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "torchrun.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "torchrun.json").exists(), proc.communicate(timeout=5)[0]
        proc.send_signal(signal.SIGINT)
        try:
            output = proc.communicate(timeout=15)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            raise AssertionError("torchrun still running 15 s after the launcher got SIGINT") from None
        assert proc.returncode != 0 and "KeyboardInterrupt" in output, (proc.returncode, output[-2000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_more_ranks_per_node_than_gpus_is_one_clear_error(monkeypatch):
    # NPROC_PER_NODE defaults to 8: on a 4-GPU node, ranks 4-7 died in torch.cuda.set_device with
    # "CUDA error: invalid device ordinal" tracebacks instead of one error naming the setting
    import torch

    from megatron_ext.config import ConfigError
    from megatron_ext.cpu_platform import select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device("auto") == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for requested in ("auto", "cuda"):
        with pytest.raises(ConfigError) as err:
            select_device(requested)
        assert "LOCAL_RANK 5, 4 CUDA devices visible" in str(err.value), err.value
        assert "NPROC_PER_NODE=4" in str(err.value) and "--nproc-per-node 4" in str(err.value), err.value
    # under torchrun: one text for ranks 4-7, reported once per node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    messages = set()
    for local_rank in (4, 7):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        with pytest.raises(ConfigError) as err:
            select_device("auto")
        messages.add(str(err.value))
    assert len(messages) == 1 and "8 processes on this node (LOCAL_WORLD_SIZE), 4 CUDA devices" in messages.pop()
    assert select_device("cpu") == torch.device("cpu")


# ----------------------------------------------------------------------------- automatic restart (MAX_RESTARTS)

# torchrun that plays one entry of FAKE_PLAN (JSON) per attempt: writes the markers a worker would
# leave ("ok": ranks, "noretry": {rank: "code reason"}, "iteration": {rank: n}) into the attempt's
# MEGATRON_EXT_EXIT_MARKER_DIR, records what it was given, and exits with "rc"
FAKE_PLAYING_TORCHRUN = f"""#!{sys.executable}
import json, os, sys, time
plan = json.loads(os.environ["FAKE_PLAN"])
seen = [json.loads(line) for line in open(os.environ["FAKE_TORCHRUN_LOG"])] if os.path.exists(
    os.environ["FAKE_TORCHRUN_LOG"]) else []
marker_dir = os.environ["MEGATRON_EXT_EXIT_MARKER_DIR"]
step = plan[len(seen)]
with open(os.environ["FAKE_TORCHRUN_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "marker_dir": marker_dir, "files": sorted(os.listdir(marker_dir)),
                        **{{k: os.environ.get(k) for k in ("MEGATRON_EXT_RESTART_ATTEMPT", "MEGATRON_EXT_RESUME_FROM_SAVE",
                                                          "MEGATRON_EXT_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")}}}}) + "\\n")
for rank in step.get("ok", []):
    open(os.path.join(marker_dir, "rank%d.ok" % rank), "w").write("finished\\n")
for rank, it in step.get("stopped", {{}}).items():
    open(os.path.join(marker_dir, "rank%s.ok" % rank), "w").write("stopped %d\\n" % it)
for rank, text in step.get("noretry", {{}}).items():
    open(os.path.join(marker_dir, "rank%s.noretry" % rank), "w").write(text + "\\n")
for rank, it in step.get("iteration", {{}}).items():
    open(os.path.join(marker_dir, "rank%s.iteration" % rank), "w").write("%12d\\n" % it)
time.sleep(step.get("sleep", 0))
sys.exit(step["rc"])
"""


def run_restarts(tmp_path, plan: list[dict], max_restarts: str, **extra: str) -> tuple[int, str, list[dict]]:
    """launch/torchrun.sh under MAX_RESTARTS with the playing torchrun: (exit code, stderr, one record per attempt)."""
    tmp_path.mkdir(exist_ok=True)
    env = launch_env(
        tmp_path,
        NPROC_PER_NODE="2",
        MAX_RESTARTS=max_restarts,
        FAKE_PLAN=json.dumps(plan),
        FAKE_TORCHRUN_LOG=str(tmp_path / "attempts.jsonl"),
        **extra,
    )
    (tmp_path / "bin" / "torchrun").write_text(FAKE_PLAYING_TORCHRUN)
    proc = subprocess.run(
        [os.path.join(REPO, "launch", "torchrun.sh"), "--save", "ckpt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    log = tmp_path / "attempts.jsonl"
    attempts = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, proc.stderr, attempts


CRASH = {"rc": 1, "iteration": {"0": 7, "1": 6}}  # rank 1 died starting iteration 7 (rank 0 had begun it)
DONE = {"rc": 0, "ok": [0, 1]}


def test_a_crash_is_restarted_with_fresh_markers_and_resumes_from_save(tmp_path):
    rc, err, attempts = run_restarts(tmp_path, [CRASH, {"rc": 1, "iteration": {"0": 12, "1": 12}}, DONE], "2")
    assert rc == 0 and len(attempts) == 3, (rc, err, attempts)
    assert [a["MEGATRON_EXT_RESTART_ATTEMPT"] for a in attempts] == ["0", "1", "2"], attempts
    assert [a["MEGATRON_EXT_RESUME_FROM_SAVE"] for a in attempts] == [None, "1", "1"], attempts
    assert {a["MEGATRON_EXT_MAX_RESTARTS"] for a in attempts} == {"2"}
    # each attempt starts with an empty directory of its own: an earlier attempt's marker never counts
    assert len({a["marker_dir"] for a in attempts}) == 3 and all(a["files"] == [] for a in attempts), attempts
    assert "torchrun exit code 1 at iteration 7; restart 1 of 2" in err, err
    assert "torchrun exit code 1 at iteration 12; restart 2 of 2" in err, err
    # the worker's arguments, unchanged on every attempt (the restart's --load is the worker's business)
    assert all(a["argv"][-3:] == [os.path.join(REPO, "pretrain_gpt.py"), "--save", "ckpt"] for a in attempts), attempts


def test_the_markers_of_an_earlier_attempt_do_not_count(tmp_path):
    # attempt 0: rank 0 finished, rank 1 crashed; attempt 1: only rank 1 finished -> not a success
    rc, err, attempts = run_restarts(
        tmp_path, [{"rc": 1, "ok": [0], "iteration": {"1": 3}}, {"rc": 1, "ok": [1], "iteration": {"0": 5}}], "1"
    )
    assert rc == 75 and len(attempts) == 2, (rc, err, attempts)  # ended retryably
    assert "MAX_RESTARTS=1 restarts are used up (exit 75: a new start" in err, err


def test_the_same_failure_twice_in_a_row_stops(tmp_path):
    rc, err, attempts = run_restarts(tmp_path / "a", [CRASH, CRASH, DONE], "5")
    assert rc == 1 and len(attempts) == 2, (rc, err, attempts)
    assert "not restarting: the same failure (torchrun exit code 1 at iteration 7) happened 2 times in a row" in err
    # a failure before the first iteration is a failure of its own kind, recurring too
    rc, err, attempts = run_restarts(tmp_path / "b", [{"rc": 1}, {"rc": 1}, DONE], "5")
    assert rc == 1 and len(attempts) == 2 and "before its first iteration) happened 2 times" in err, (rc, err)
    # the same iteration, but not in a row: restarted
    rc, err, attempts = run_restarts(tmp_path / "c", [CRASH, {"rc": 1, "iteration": {"0": 9}}, CRASH, DONE], "5")
    assert rc == 0 and len(attempts) == 4, (rc, err)


def test_a_worker_that_says_do_not_retry_is_not_restarted(tmp_path):
    user_error = {
        "rc": 1,
        "noretry": {"0": "2 a user error (the error: block above)", "1": "2 a user error (the error: block above)"},
    }
    rc, err, attempts = run_restarts(tmp_path, [user_error, DONE], "3")
    assert rc == 2 and len(attempts) == 1, (rc, err, attempts)
    assert "not restarting: a worker stopped on a user error" in err, err
    (tmp_path / "d").mkdir()
    diverged = {"rc": 1, "noretry": {"1": "1 the run diverged (the error: block above)"}, "iteration": {"1": 9}}
    rc, err, attempts = run_restarts(tmp_path / "d", [diverged, DONE], "3")
    assert rc == 1 and len(attempts) == 1 and "the run diverged" in err, (rc, err, attempts)
    # without MAX_RESTARTS too, the last line (after torchrun's failure summary) names the user error
    rc, err, attempts = run_restarts(tmp_path / "no_restarts", [user_error, DONE], "0")
    assert rc == 2 and len(attempts) == 1, (rc, err, attempts)
    assert err.strip().splitlines()[-1] == (
        "launch/torchrun.sh: exit 2: a worker stopped on a user error (the error: block above)"
    ), err
    # torchrun copies the root cause's error file to its own (without one it logs an error line)
    assert attempts[0]["TORCHELASTIC_ERROR_FILE"] == os.path.join(attempts[0]["marker_dir"], "torchrun_error.json")


def test_no_restart_by_default_and_a_bad_max_restarts_is_one_error(tmp_path):
    rc, err, attempts = run_restarts(tmp_path / "default", [CRASH, DONE], "0")
    assert rc == 75 and len(attempts) == 1 and "launch/torchrun.sh:" not in err, (rc, err)  # ended retryably
    rc, err, attempts = run_restarts(tmp_path / "empty", [DONE], "")  # empty: the default
    assert rc == 0 and len(attempts) == 1, (rc, err)
    for i, bad in enumerate(("two", "-1", "1.5", "3 ")):
        rc, err, attempts = run_restarts(tmp_path / f"bad{i}", [DONE], bad)
        assert rc == 2 and attempts == [], (bad, rc, err)
        assert err.strip().splitlines() == [
            f"error: MAX_RESTARTS={bad} is not a whole number from 0 to 1000000000: give how many times to "
            f"restart after a failure, e.g. MAX_RESTARTS=3 (0, the default: never)"
        ]


def test_restarted_multi_node_attempts_meet_at_their_own_rendezvous_id(tmp_path):
    rc, err, attempts = run_restarts(tmp_path, [CRASH, DONE], "1", NNODES="2", MASTER_ADDR="10.0.0.1", RDZV_ID="job7")
    assert rc == 0, (rc, err)
    ids = [a["argv"][a["argv"].index("--rdzv-id") + 1] for a in attempts]
    assert ids == ["job7", "job7.restart1"], ids


def test_a_launcher_asked_to_stop_does_not_restart(tmp_path):
    # preemption without --exit-signal-handler: torchrun dies of the forwarded SIGTERM, no worker finished
    env = launch_env(
        tmp_path,
        NPROC_PER_NODE="2",
        MAX_RESTARTS="3",
        FAKE_TORCHRUN_LOG=str(tmp_path / "attempts.jsonl"),
        FAKE_PLAN=json.dumps([{"rc": 1, "iteration": {"0": 4}, "sleep": 60}, DONE]),
    )
    (tmp_path / "bin" / "torchrun").write_text(FAKE_PLAYING_TORCHRUN)
    proc = subprocess.Popen(
        [os.path.join(REPO, "launch", "torchrun.sh")],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "attempts.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert "not restarting: this launcher was asked to stop (SIGTERM/SIGINT)" in err, err
    assert len((tmp_path / "attempts.jsonl").read_text().splitlines()) == 1


def test_a_clean_stop_before_the_end_exits_the_stopped_code(tmp_path):
    """A worker's marker says "stopped <iteration>" when a signal or an exit flag ended it early: exit 0 as
    before, or STOPPED_EXIT_CODE (launch/slurm.sbatch: 75, requeue); "finished" markers exit 0 either way."""
    stopped = {"rc": 1, "ok": [0], "stopped": {"1": 40}}  # torchrun's code after a SIGTERM is not 0
    rc, err, attempts = run_restarts(tmp_path / "a", [stopped], "0")
    assert rc == 0 and len(attempts) == 1, (rc, err)
    rc, err, attempts = run_restarts(tmp_path / "b", [stopped], "2", STOPPED_EXIT_CODE="75")
    assert rc == 75 and len(attempts) == 1, (rc, err)  # a clean stop is never restarted by the launcher
    rc, err, attempts = run_restarts(tmp_path / "c", [DONE], "0", STOPPED_EXIT_CODE="75")
    assert rc == 0, (rc, err)
    rc, err, attempts = run_restarts(tmp_path / "d", [DONE], "0", STOPPED_EXIT_CODE="x")
    assert (
        rc == 2
        and attempts == []
        and "STOPPED_EXIT_CODE=x is not a whole number from 0 to 255: give an exit code" in err
    ), (rc, err)


def run_sbatch_ending(tmp_path, srun_rc: int, **extra: str) -> tuple[int, str, list[str], str]:
    """launch/slurm.sbatch whose srun ends with ``srun_rc``: (exit code, stderr, scontrol requeues, what srun saw)."""
    env = slurm_env(tmp_path, 2, FAKE_SRUN_RC=str(srun_rc), **extra)
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "launch", "slurm.sbatch"), "--save", "ckpt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    requeues = tmp_path / "torchrun.json.requeue"
    seen = (tmp_path / "torchrun.json.srun").read_text().strip()
    return proc.returncode, proc.stderr, requeues.read_text().splitlines() if requeues.exists() else [], seen


@pytest.mark.parametrize("srun_rc, requeued", [(0, False), (2, False), (1, False), (75, True), (137, False)])
def test_sbatch_requeues_only_a_run_that_ended_retryably(tmp_path, srun_rc, requeued):
    """Issue 31: 75 (a crash no worker called final, or a clean stop before --train-iters) requeues the job;
    finished (0), a user error (2), a divergence or a recurring failure (1) never do; other codes (a node
    lost, srun killed) are Slurm's to requeue (#SBATCH --requeue), not the script's."""
    rc, err, requeues, seen = run_sbatch_ending(tmp_path, srun_rc)
    assert seen == "STOPPED_EXIT_CODE=75"  # the launchers report a clean early stop as retryable
    assert requeues == (["requeue 4242"] if requeued else []), (rc, err, requeues)
    assert rc == (0 if requeued else srun_rc), (rc, err)
    if requeued:
        assert "requeueing job 4242 (1 of MAX_REQUEUES=3)" in err, err


def test_sbatch_stops_requeueing_after_max_requeues(tmp_path):
    rc, err, requeues, seen = run_sbatch_ending(tmp_path, 75, SLURM_RESTART_COUNT="3")
    assert rc == 75 and requeues == [] and "requeued 3 times already (MAX_REQUEUES=3)" in err, (rc, err)
    assert seen == "STOPPED_EXIT_CODE=0"  # no requeue left: a clean early stop ends the job as success
    (tmp_path / "more").mkdir()
    rc, err, requeues, _ = run_sbatch_ending(tmp_path / "more", 75, SLURM_RESTART_COUNT="3", MAX_REQUEUES="5")
    assert rc == 0 and requeues == ["requeue 4242"], (rc, err)
    (tmp_path / "bad").mkdir()
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "launch", "slurm.sbatch")],
        cwd=tmp_path / "bad",
        env=slurm_env(tmp_path / "bad", 2, MAX_REQUEUES="many"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "MAX_REQUEUES=many is not a whole number" in proc.stderr, proc.stderr
