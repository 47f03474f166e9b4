"""What the non-finite-loss guard costs: per step, per micro-batch, and per skipped --fp16 step.

    python -m bench.nan_guard [--steps 14] [--microbatches 8]

The guard (``megatron_ext.training.loss.poison_non_finite``) multiplies each micro-batch's loss by
``where(isfinite(loss), 1, NaN)`` before the backward: a few scalar kernels per micro-batch on the
last stage, no collective, no host synchronisation. Only after a skipped ``--fp16`` step does one
all-reduce of one element over the world tell a non-finite loss from a loss-scaler overflow
(``step.agree_loss_non_finite``).

1. Per step: ``train_step`` of a small GPT at TP=PP=DP=1 (1-rank gloo world in this process) with
   the guard as shipped (A) and with ``poison_non_finite`` replaced by the identity (B, the code
   before the guard), alternated A B A B on one run, CPU time, warm-up dropped, medians. Small shape
   on purpose (hidden 64, 2 layers, seq 64, micro-batch 1, ``--microbatches`` per step), so that a
   per-micro-batch cost is as visible as it can be.
2. Per micro-batch: forward and backward of a scalar loss with and without the factor (median of
   many repetitions), in microseconds.
3. Per skipped --fp16 step: the one-element all-reduce MAX, 4 forked gloo ranks, median wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch  # noqa: E402

from bench.common import init_single_rank_world  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=14, help="timed steps per side (first 2 dropped)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    return p.parse_args(argv)


def time_steps(args: argparse.Namespace) -> tuple[float, float]:
    """Median CPU seconds per step with the guard (A) and without it (B)."""
    from megatron_ext import testing
    from megatron_ext.training import loss as loss_module
    from megatron_ext.training.step import build_step_microbatches, train_step

    values = testing.tiny_values(
        num_layers=2, seq_length=64, micro_batch_size=1, global_batch_size=args.microbatches, train_iters=10_000
    )
    run = testing.build_tiny_run(values, testing.MarkovDataset(64))
    microbatches, length = build_step_microbatches(run, run.train_ds, 0)
    guarded, identity = loss_module.poison_non_finite, (lambda loss: loss)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(2 * args.steps):
        side = "AB"[i % 2]
        loss_module.poison_non_finite = guarded if side == "A" else identity
        start = time.process_time()
        train_step(run.model, run.optimizer, run.scheduler, microbatches, length, run.global_batch_size, run.ctx)
        times[side].append(time.process_time() - start)
    loss_module.poison_non_finite = guarded
    return tuple(statistics.median(times[s][2:]) for s in "AB")


def time_factor(reps: int = 20_000) -> tuple[float, float]:
    """Median microseconds of forward+backward of a scalar loss with and without the factor."""
    from megatron_ext.training.loss import poison_non_finite

    x = torch.randn(64, requires_grad=True)
    out = {}
    for name, fn in (("with", poison_non_finite), ("without", lambda loss: loss)) * 2:
        samples = []
        for _ in range(reps // 100):
            start = time.perf_counter()
            for _ in range(100):
                fn(x.sum()).backward()
            samples.append((time.perf_counter() - start) / 100 * 1e6)
        out[name] = statistics.median(samples)
    return out["with"], out["without"]


def _all_reduce_world(rank: int, world_size: int, reps: int) -> float:
    import torch.distributed as dist

    flag = torch.zeros(1)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[5:]) * 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from megatron_ext.testing import run_ranks

    all_reduce_us = max(run_ranks(_all_reduce_world, 4, 200))  # forked before this process's world
    init_single_rank_world()
    a, b = time_steps(args)
    with_us, without_us = time_factor()
    print(
        f"per step ({args.microbatches} micro-batches, hidden 64, 2 layers, seq 64): guard {a * 1e3:.2f} ms, "
        f"without {b * 1e3:.2f} ms CPU, ratio {a / b:.3f}"
    )
    print(
        f"per micro-batch: scalar loss forward+backward {with_us:.1f} us with the factor, {without_us:.1f} us "
        f"without (+{with_us - without_us:.1f} us)"
    )
    print(
        f"per skipped --fp16 step: one-element all-reduce MAX over 4 gloo ranks {all_reduce_us:.0f} us (median); "
        f"steps whose update is applied and every step without --fp16: none"
    )


if __name__ == "__main__":
    main()
