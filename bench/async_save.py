"""--async-save: training time lost per save, synchronous vs asynchronous, side by side.

    python -m bench.async_save [--sizes-mib 128 1024] [--rounds 3] [--steps 30] [--dir /tmp]

One process (a 1-rank gloo world). A "training step" is fixed compute (fp32 matmuls, ~50 ms on
one core here) plus an in-place update of one of the checkpointed tensors, round robin, so a
background write must not read what the steps change. Each round runs ``--steps`` steps three
ways, in rotating order:

- none: no save (the baseline);
- sync: ``write_checkpoint`` after step 1 (our synchronous save: megatron-core ``torch_dist``
  through the in-process writer, fsync, marker, rename, pointer);
- async: ``AsyncCheckpointSaver.start`` after step 1 (plan, host snapshot, background thread),
  then every step the exit decision's all-reduce with the save's bits and the publish once no
  rank writes, and a blocking ``finish`` after the last step if the write is still going.

Training time lost per save = run time - baseline run time (median over rounds, first round
dropped as warm-up). Both pay the same plan and fsync; async also pays the snapshot copy (one
memcpy of the state) and its writer competes with the steps for the cores: on a 2-core machine
the figure is reported, not a target. Checkpoints are deleted as they go (``keep_last=1``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from bench.checkpoint import as_sharded, build_tensors, init_single_process_world


def make_step(tensors: dict[str, torch.Tensor]):
    a = torch.randn(384, 384)
    names = sorted(tensors)
    counter = [0]

    def step() -> None:
        x = a
        for _ in range(20):
            x = torch.tanh(x @ a) * 0.5
        t = tensors[names[counter[0] % len(names)]]
        t.add_(float(x[0, 0]) * 1e-3)
        counter[0] += 1

    return step


def run_none(step, steps: int, **_: object) -> dict:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return {"seconds": time.perf_counter() - start}


def run_sync(step, steps: int, tensors, root: str, iteration: int, **_: object) -> dict:
    from megatron_ext.checkpoint.directory import write_checkpoint

    start = time.perf_counter()
    step()
    t0 = time.perf_counter()
    write_checkpoint(as_sharded(tensors), root, iteration, keep_last=1)
    save = time.perf_counter() - t0
    for _ in range(steps - 1):
        step()
    return {"seconds": time.perf_counter() - start, "save": save}


def run_async(step, steps: int, tensors, root: str, iteration: int, saver) -> dict:
    from megatron_ext.checkpoint.exit_policy import agree_on_flags

    start = time.perf_counter()
    step()
    held = saver.start(as_sharded(tensors), root, iteration, keep_last=1)
    published_after = None
    for i in range(steps - 1):
        step()
        if saver.in_flight:
            flags = agree_on_flags(saver.local_flags())
            if saver.finish_if_agreed(flags) is not None:
                published_after = i + 2
    t0 = time.perf_counter()
    waited = saver.finish() is not None
    end_wait = time.perf_counter() - t0
    return {
        "seconds": time.perf_counter() - start,
        "held": held,
        "end_wait": end_wait,
        "published_after": published_after if not waited else None,
    }


def bench_size(size_mib: int, rounds: int, steps: int, base: str) -> dict:
    from megatron_ext.checkpoint.async_save import AsyncCheckpointSaver

    tensors = build_tensors(size_mib)
    step = make_step(tensors)
    saver = AsyncCheckpointSaver()
    root = tempfile.mkdtemp(prefix=f"async-{size_mib}-", dir=base)
    results: dict[str, list[dict]] = {"none": [], "sync": [], "async": []}
    order = ["none", "sync", "async"]
    iteration = 0
    try:
        for r in range(rounds + 1):
            for name in order[r % 3 :] + order[: r % 3]:
                iteration += 1
                out = {"none": run_none, "sync": run_sync, "async": run_async}[name](
                    step, steps, tensors=tensors, root=root, iteration=iteration, saver=saver
                )
                if r > 0:
                    results[name].append(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    init_single_process_world()
    torch.set_num_threads(1)
    print(f"{args.steps} steps per run, {args.rounds} rounds (after one warm-up), medians; 1 rank")
    print(
        f"{'MiB':>6} {'step ms':>8} {'sync lost s':>12} {'async lost s':>13} {'async/sync':>11} "
        f"{'held s':>7} {'end wait s':>11} {'published after step':>21}"
    )
    for size in args.sizes_mib:
        res = bench_size(size, args.rounds, args.steps, args.dir or tempfile.gettempdir())
        med = {k: statistics.median(x["seconds"] for x in v) for k, v in res.items()}
        sync_lost, async_lost = med["sync"] - med["none"], med["async"] - med["none"]
        held = statistics.median(x["held"] for x in res["async"])
        end_wait = statistics.median(x["end_wait"] for x in res["async"])
        after = [x["published_after"] for x in res["async"]]
        print(
            f"{size:>6} {1000 * med['none'] / args.steps:>8.1f} {sync_lost:>12.2f} {async_lost:>13.2f} "
            f"{async_lost / sync_lost if sync_lost > 0 else float('nan'):>11.2f} {held:>7.2f} {end_wait:>11.2f} "
            f"{str(after):>21}"
        )


if __name__ == "__main__":
    main()
