"""Stall watchdog heartbeats (``megatron_ext/heartbeat.py``): what they cost a training step.

    python -m bench.heartbeat [--steps 30] [--publishes 2000]

One process, a one-rank gloo world (its TCPStore on loopback, hosted in this process as rank 0
hosts it without torchrun). Prints:

1. the training thread's side: ``StepProgress.record_microbatch`` (one call per micro-batch forward
   step and per chunk; phases cost the same), ns per call;
2. one publication (a sample of the training thread's stack, JSON, ``store.set`` on the
   heartbeat's own cloned connection), called back to back from this thread: us of wall and CPU
   time each. It runs in the heartbeat thread, never in the training thread;
3. publications per step at the default interval (a twentieth of the limit, within [0.1 s, 10 s]),
   from this job's measured step time, for --step-timeout-minutes 1 and 10;
4. side by side, A B A B: CPU time per step (process-wide, so the heartbeat thread's work counts)
   of the job without the watchdog and with it publishing every 10 ms (300x the default rate of a
   1-minute limit), medians after a warm-up step, and their ratio. Pinned: hidden 128, 4 layers,
   seq 128, micro-batch 2, global batch 8 (4 micro-batches), fp32, one thread.

Measured here (2 shared cores, other jobs running): see README.md of bench/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import init_single_rank_world


def measure_record_ns(calls: int = 1_000_000) -> float:
    """CPU ns per call, the loop's own cost included."""
    from megatron_ext.heartbeat import StepProgress

    record = StepProgress().record_microbatch
    cpu = time.process_time()
    for _ in range(calls):
        record(3, 1)
    return (time.process_time() - cpu) / calls * 1e9


def measure_publish_us(publishes: int) -> tuple[float, float]:
    """(wall us, CPU us) per publication."""
    from megatron_ext.heartbeat import HeartbeatPublisher, StepProgress, open_store_connection

    identity = dict(rank=0, host="h", pp_rank=0, pp_size=1, tp_rank=0, dp_rank=0)
    publisher = HeartbeatPublisher(open_store_connection(5.0), StepProgress(), identity, interval_s=3600)
    for _ in range(50):
        publisher.publish()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(publishes):
        publisher.publish()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert publisher.failures == 0
    return wall / publishes * 1e6, cpu / publishes * 1e6


def build_runs():
    """The pinned job twice on one set of process groups: without and with the watchdog."""
    from megatron_ext.config import build_job_config
    from megatron_ext.parallel import build_parallel_context
    from megatron_ext.run import build_step_watchdog, build_training_run
    from megatron_ext.testing import MarkovDataset, tiny_values

    values = tiny_values(hidden_size=128, seq_length=128, train_iters=10_000)
    cfg = build_job_config(values)
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    data = (MarkovDataset(128), None)
    plain = build_training_run(cfg, device=torch.device("cpu"), data=data, log=lambda s: None, metrics=False, ctx=ctx)
    watched = build_training_run(cfg, device=torch.device("cpu"), data=data, log=lambda s: None, metrics=False, ctx=ctx)
    cfg.parallel.step_timeout_minutes = 1.0
    watched.watchdog = build_step_watchdog(cfg, ctx, heartbeat_interval_s=0.01)
    return plain, watched


def measure_steps(steps: int) -> tuple[list[float], list[float], int]:
    """CPU seconds per step of each run, alternated; publications made during the watched steps."""
    from megatron_ext.training.loop import LogWindow, run_training_iteration

    plain, watched = build_runs()
    times: dict[str, list[float]] = {"plain": [], "watched": []}
    publisher = watched.watchdog.heartbeats.publisher
    published = 0
    for step in range(steps + 1):
        order = (("plain", plain), ("watched", watched))
        for name, run in order if step % 2 else order[::-1]:
            before, cpu = publisher.publishes, time.process_time()
            run_training_iteration(run, LogWindow())
            if step:  # the first step of each is warm-up
                times[name].append(time.process_time() - cpu)
                if name == "watched":
                    published += publisher.publishes - before
    watched.watchdog.close()
    return times["plain"], times["watched"], published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--publishes", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_single_rank_world()
    from megatron_ext.heartbeat import get_heartbeat_interval

    print(f"training thread: StepProgress.record_microbatch {measure_record_ns():.0f} ns of CPU per call")
    wall_us, cpu_us = measure_publish_us(args.publishes)
    print(
        f"one publication (heartbeat thread): {wall_us:.1f} us wall, {cpu_us:.1f} us CPU (mean over {args.publishes})"
    )
    plain, watched, published = measure_steps(args.steps)
    step_s = statistics.median(plain)
    for minutes in (1, 10):
        interval = get_heartbeat_interval([minutes * 60.0])
        print(
            f"--step-timeout-minutes {minutes}: a publication every {interval:g} s = "
            f"{step_s / interval:.4f} per step of {step_s * 1000:.0f} ms (CPU) here"
        )
    ratio = statistics.median(watched) / step_s
    print(
        f"CPU time per step, median of {len(plain)}: without {step_s * 1000:.1f} ms, with a publication every "
        f"10 ms {statistics.median(watched) * 1000:.1f} ms ({published / len(watched):.1f} publications per "
        f"step): ratio {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
