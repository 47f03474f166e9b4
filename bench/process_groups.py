"""Process-group teardown: threads per rank and seconds per cycle over repeated layouts.

    python -m bench.process_groups [--cycles 20]

8 forked gloo ranks build megatron-core's TP2 x PP4 groups, run one all-reduce over the
model-parallel group, and tear them down, ``--cycles`` times, first with megatron-core's
``destroy_model_parallel()`` alone (it drops its references; every gloo subgroup keeps its threads
and sockets), then with ``megatron_ext.parallel.destroy_parallel_context`` (destroys the
subgroups too). Prints, for each, the OS threads of rank 0 after the first and the last cycle and
the median and last cycle time. Tests and benchmarks build many layouts in one process; before the
fix a few hundred groups meant over 1,000 threads per process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _cycles(rank: int, world_size: int, cycles: int, ours: bool) -> list[tuple[float, int]]:
    from megatron.core import parallel_state as ps

    from megatron_ext.cpu_platform import apply_cpu_platform
    from megatron_ext.parallel import destroy_parallel_context

    apply_cpu_platform(torch.device("cpu"))
    out = []
    for _ in range(cycles):
        start = time.perf_counter()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=4, create_gloo_process_groups=False
        )
        dist.all_reduce(torch.ones(1), group=ps.get_model_parallel_group())
        destroy_parallel_context() if ours else ps.destroy_model_parallel()
        out.append((time.perf_counter() - start, len(os.listdir(f"/proc/{os.getpid()}/task"))))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=20)
    args = p.parse_args(argv)
    from megatron_ext.cpu_platform import quiet_known_warnings
    from megatron_ext.testing import run_ranks

    quiet_known_warnings()
    print(f"process groups | 8 forked gloo ranks, TP2 x PP4, {args.cycles} init/all-reduce/destroy cycles")
    for name, ours in (("megatron-core destroy_model_parallel", False), ("ours destroy_parallel_context", True)):
        rows = run_ranks(_cycles, 8, args.cycles, ours, timeout=900)[0]
        times = [t for t, _ in rows]
        print(
            f"  {name:<38} threads after cycle 1: {rows[0][1]:5d}, after cycle {args.cycles}: {rows[-1][1]:5d} | "
            f"s/cycle median {statistics.median(times):.2f}, last {times[-1]:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
