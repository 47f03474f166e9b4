"""--log-straggler (``megatron_ext/straggler.py``): does it name a stopped rank, whatever the stop
lands in, and how often does it warn about nobody?

    python -m bench.straggler [--runs 10] [--stop-s 5] [--clean-steps 200]

Four forked gloo ranks on this machine's cores, PP2 x DP2 (megatron-core's 1F1B), hidden 128, 4
layers, seq 128, micro-batch 2, global batch 16 (4 micro-batches per step), ``--log-interval 1``,
the default ``--straggler-threshold 0.2``, data built in the step (``--no-data-prefetch``, so that
the data wait is the training thread's own). Prints:

1. stops: ``--runs`` runs, each stopping one rank (SIGSTOP, released by SIGCONT ``--stop-s`` later)
   once in each of five phases, one phase per 4 iterations, the rank and the order of the phases
   rotating from run to run. A helper thread of the stopped rank polls its training thread's Python
   stack (every 0.3 ms) until it is in the phase (compute: inside megatron-core's forward or backward
   step, not waiting; P2P wait: inside megatron-core's P2P communication; collective: inside a
   torch.distributed collective; data: building the step's micro-batches; optimizer: inside
   megatron-core's optimizer, not waiting), then stops its own process. A stop is a hit when the
   log line of its iteration (or of the next) warns about the stopped rank; per phase: hits / stops
   and the phase the detector reported. The same figures for the rule at ef6451b (own work per log
   interval, wall clock, no pauses), computed from the same gathered timings.
2. false warnings: an unperturbed run of ``--clean-steps`` steps: warnings per 100 log lines (every
   warning is false), now and by the rule at ef6451b; also the warnings of the stop runs' log lines
   that name a rank not stopped there.
3. cost: the all-gather per log step (median ms, from the clean run), the pause monitor's CPU
   time per second of wall time (its thread alone, from Linux's schedstat), and the CPU time of
   a step timer's open and close on the training thread without and with the flag.

Targets (issue 45.2): every phase >= 9/10, false warnings <= 1 per 100 log lines.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import torch

import megatron_ext.straggler as straggler
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train
from megatron_ext.training.profiling import StepTimers

PHASES = ("compute", "P2P wait", "collective", "data", "optimizer", "between steps")
STEPS_PER_STOP = 4
P2P_FUNCS = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


def _stack(frame) -> list[tuple[str, str]]:
    """(path, function) of each frame, innermost first."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename.replace(os.sep, "/"), frame.f_code.co_name))
        frame = frame.f_back
    return out


def is_in_phase(phase: str, frame) -> bool:
    """Whether a training thread whose innermost frame is ``frame`` is in ``phase`` (read from its
    Python stack alone, independently of the detector's step timers)."""
    stack = _stack(frame)
    if not stack:
        return False
    path, func = stack[0]
    in_c10d = path.endswith("torch/distributed/distributed_c10d.py")
    in_p2p = path.endswith("pipeline_parallel/p2p_communication.py") or (in_c10d and func in P2P_FUNCS)
    waiting = in_p2p or in_c10d or ".wait" in func
    if phase == "P2P wait":
        return in_p2p
    if phase == "collective":  # the gradient reduce (DP, and the tied embedding's)
        return in_c10d and func not in P2P_FUNCS and any(f == "finalize_model_grads" for _, f in stack)
    if phase == "between steps":  # the log step's loss all-reduce
        return in_c10d and any(f == "log_progress" for _, f in stack)
    if waiting:
        return False
    if phase == "compute":
        return any(
            p.endswith("pipeline_parallel/schedules.py") and f in ("forward_step", "backward_step") for p, f in stack
        )
    if phase == "data":
        return any(f == "build_step_microbatches" for _, f in stack)
    if phase == "optimizer":
        return any(f.startswith("step_optimizer_") for _, f in stack)
    raise ValueError(phase)


class Stopper:
    """In one rank: stops this process (SIGSTOP) for ``stop_s`` once from each planned iteration
    on, as soon as its training thread is in the planned phase (polled every ``poll_s``); ``done``:
    (iterations completed before the stop, phase) for each stop. ``get_iteration``: the iterations
    completed so far."""

    def __init__(self, plan: list[tuple[int, str]], stop_s: float, get_iteration, poll_s: float = 0.0003):
        self.plan, self.stop_s, self.get_iteration, self.poll_s = list(plan), stop_s, get_iteration, poll_s
        self.training_thread = threading.get_ident()
        self.done: list[tuple[int, str]] = []
        self._end = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stopper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.plan and not self._end.is_set():
            # ready before the stop: starting a process takes ms, in which the thread may move on
            release = f"read go && sleep {self.stop_s} && kill -CONT {os.getpid()}"
            helper = subprocess.Popen(["/bin/sh", "-c", release], stdin=subprocess.PIPE)
            iteration, phase = self.plan[0]
            while not self._end.is_set():
                completed = self.get_iteration()
                if completed + 1 >= iteration and is_in_phase(phase, sys._current_frames().get(self.training_thread)):
                    os.write(helper.stdin.fileno(), b"go\n")
                    os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, this thread included
                    self.done.append((completed, phase))
                    self.plan.pop(0)
                    break
                time.sleep(self.poll_s)
            helper.stdin.close()  # (a helper never told to go ends at its read)
            helper.wait()

    def close(self) -> None:
        self._end.set()
        self._thread.join(1.0)


def build_values(train_iters: int, **overrides) -> dict:
    values = dict(
        num_layers=4,
        hidden_size=128,
        seq_length=128,
        pipeline_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=16,
        train_iters=train_iters,
        log_interval=1,
        log_straggler=True,
        data_prefetch=False,
    )
    values.update(overrides)
    return tiny_values(**values)


def run_rank(rank: int, world_size: int, values: dict, plans: dict, stop_s: float) -> dict:
    """One rank of a run: trains, stopping where ``plans[rank]`` says; returns its stops, and on the
    logging rank the log lines, the gathered timings of each log step and the gather times."""
    run = build_tiny_run(values, MarkovDataset(values["seq_length"]))
    lines: list[str] = []
    run.log = lines.append
    tables, gather_ms = [], []
    gather = run.straggler.gather

    def recorded_gather(means):
        start = time.perf_counter()
        timings = gather(means)
        gather_ms.append(1000.0 * (time.perf_counter() - start))
        tables.append((run.state.iteration, timings))
        return timings

    run.straggler.gather = recorded_gather
    stopper = Stopper(plans.get(rank, []), stop_s, lambda: run.state.iteration) if plans.get(rank) else None
    clock = straggler.ThreadClock.open(run.straggler.monitor._thread.native_id)
    wall, cpu = time.monotonic(), []
    close = run.straggler.close

    def measured_close():  # the monitor's CPU time, read before its thread ends
        if clock is not None:
            cpu.append(clock.read()[0] / (time.monotonic() - wall))
        close()

    run.straggler.close = measured_close
    train(run)
    if stopper is not None:
        stopper.close()
    destroy_parallel_context()
    out = dict(stops=stopper.done if stopper else [], monitor_cpu=cpu[0] if cpu else None)
    if run.ctx.is_logging_rank:
        out.update(lines=lines, tables=tables, gather_ms=gather_ms)
    return out


def named_in(lines: list[str], iteration: int) -> list[str]:
    """The warning lines of the log step of ``iteration`` (log interval 1)."""
    out, current = [], None
    for line in lines:
        if "| consumed samples:" in line:
            current = int(line.split("iteration")[1].split("/")[0])
        elif current == iteration and line.startswith("  WARNING straggler:"):
            out.append(line)
    return out


def warned_rank(line: str) -> int:
    return int(line.split("WARNING straggler: rank ")[1].split(" ")[0])


def old_rule(timings) -> set[int]:
    """The ranks ef6451b's detector named: own work (compute + optimizer + data, wall clock) over
    the median of its stage's other ranks (all others when alone) by more than 20% of it, in this
    interval alone."""
    named = set()
    for t in timings:
        others = [o for o in timings if o.pp_rank == t.pp_rank and o.rank != t.rank] or [
            o for o in timings if o.rank != t.rank
        ]
        own = lambda x: x.compute + x.optimizer + x.data  # noqa: E731
        if others and own(t) > 1.2 * statistics.median(own(o) for o in others):
            named.add(t.rank)
    return named


def plan_run(index: int, stop_s: float) -> tuple[dict, int]:
    """Run ``index``'s stops: {rank: [(iteration, phase), ...]} and its length."""
    plans: dict[int, list] = {}
    for k in range(len(PHASES)):
        phase = PHASES[(k + index) % len(PHASES)]
        rank = random.Random(100 * index + k).randrange(4)
        plans.setdefault(rank, []).append(((k + 1) * STEPS_PER_STOP, phase))
    return plans, (len(PHASES) + 1) * STEPS_PER_STOP


def measure_stops(runs: int, stop_s: float, verbose: bool = False) -> dict:
    by_phase = {p: dict(new=0, old=0, stops=0, reported=[]) for p in PHASES}
    wrong, lines_total = dict(new=0, old=0), 0
    for index in range(runs):
        plans, steps = plan_run(index, stop_s)
        results = run_ranks(run_rank, 4, build_values(steps), plans, stop_s, timeout=600)
        log = next(r for r in results if "lines" in r)
        tables = dict(log["tables"])
        culprits: dict[int, int] = {}  # log line -> the rank stopped in the steps it covers
        for rank, r in enumerate(results):
            for completed, phase in r["stops"]:
                # a stop after step N's gather and before step N+1's is in line N+1 (N when before
                # the gather, N+2 when its monitor woke after step N+1's gather)
                covering = (completed, completed + 1, completed + 2)
                culprits.update(dict.fromkeys(covering, rank))
                warnings = [w for it in covering for w in named_in(log["lines"], it)]
                new = [w for w in warnings if warned_rank(w) == rank and "stopped:" in w]
                old = any(rank in old_rule(tables.get(it, [])) for it in covering)
                stats = by_phase[phase]
                stats["stops"] += 1
                stats["new"] += bool(new)
                stats["old"] += old
                if new:
                    stats["reported"].append(new[0].split(") in ")[1].split(";")[0])
        for iteration, timings in tables.items():
            culprit = {culprits.get(iteration)}
            lines_total += 1
            wrong["new"] += len([w for w in named_in(log["lines"], iteration) if warned_rank(w) not in culprit])
            wrong["old"] += len(old_rule(timings) - culprit)
        done = sorted((it + 1, r, p) for r, res in enumerate(results) for it, p in res["stops"])
        print(f"  run {index + 1}/{runs}: (iteration, rank, phase) of each stop: {done}", flush=True)
        if verbose:
            for line in log["lines"]:
                if "WARNING straggler" in line or "| consumed samples:" in line:
                    print("   ", line[:300] if "WARNING" in line else line.split("|")[0])
    return dict(by_phase=by_phase, wrong=wrong, lines=lines_total)


def measure_clean(steps: int) -> dict:
    results = run_ranks(run_rank, 4, build_values(steps), {}, 0.0, timeout=900)
    log = next(r for r in results if "lines" in r)
    new = sum(1 for line in log["lines"] if line.startswith("  WARNING straggler:"))
    old = sum(len(old_rule(timings)) for _, timings in log["tables"])
    cpu = [r["monitor_cpu"] for r in results if r["monitor_cpu"] is not None]
    return dict(lines=len(log["tables"]), new=new, old=old, gather_ms=log["gather_ms"][1:], monitor_cpu=cpu)


def measure_timer_us(calls: int = 20000) -> tuple[float, float]:
    """CPU us per open+close of a step timer, without and with --log-straggler's phase log (and,
    on CPUs, its two reads of the thread's run delay), in this process."""
    out = []
    for compute in (False, True):
        timers = StepTimers(1, torch.device("cpu"), compute=compute)
        start = time.process_time()
        for _ in range(calls):
            with timers.time("compute" if compute else "optimizer"):
                pass
        out.append((time.process_time() - start) / calls * 1e6)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of five stops each (one per phase)")
    parser.add_argument("--stop-s", type=float, default=5.0, help="seconds each stop lasts")
    parser.add_argument("--clean-steps", type=int, default=200, help="steps (= log lines) of the unperturbed run")
    parser.add_argument("--verbose", action="store_true", help="print each stop run's log and warning lines")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    clean = measure_clean(args.clean_steps)
    print(
        f"unperturbed, {clean['lines']} log lines: {clean['new']} warnings = {100.0 * clean['new'] / clean['lines']:.2f} "
        f"per 100 lines (target <= 1); the rule at ef6451b: {clean['old']} = {100.0 * clean['old'] / clean['lines']:.1f} per 100",
        flush=True,
    )
    stops = measure_stops(args.runs, args.stop_s, args.verbose)
    print(f"stops of {args.stop_s:g} s, {args.runs} runs, hits per phase (target >= 9/10 each):")
    for phase, s in stops["by_phase"].items():
        reported = sorted(set(s["reported"]))
        print(
            f"  {phase:<11} now {s['new']}/{s['stops']}   at ef6451b {s['old']}/{s['stops']}   reported in: {reported}"
        )
    w, n = stops["wrong"], stops["lines"]
    print(
        f"warnings naming a rank not stopped in the stop runs' {n} log lines: now {w['new']} "
        f"({100.0 * w['new'] / n:.2f} per 100), at ef6451b {w['old']} ({100.0 * w['old'] / n:.1f} per 100)"
    )
    gather = clean["gather_ms"]
    print(
        f"cost: the log step's all-gather (12 numbers per rank, 4 gloo ranks): median {statistics.median(gather):.2f} ms "
        f"(max {max(gather):.2f}); the pause monitor's thread: {1000.0 * statistics.median(clean['monitor_cpu']):.2f} ms "
        f"of CPU per second per rank"
    )
    plain, traced = measure_timer_us()
    print(
        f"cost on the training thread: a step timer's open+close {plain:.1f} us without the flag, {traced:.1f} us with it "
        f"(phase log, run-delay reads); this job opens 4 + 2 per micro-batch per step"
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
