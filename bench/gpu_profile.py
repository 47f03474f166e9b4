"""Where one training step of ours spends its time on a GPU: kernel time against wall time (is the
step host-bound?), host synchronisations per step, and the heaviest operators by device and host
time, for an unpacked and a packed step side by side.

    python -m bench.gpu_profile [--shape gpt2|1.3b|llama] [--micro-batch 8] [--steps 3] [--accumulate N] [--python]
    python -m bench.gpu_profile --device cpu --tiny     # smoke run of the code paths, no figures

The step is ``bench.gpu_throughput.Ours``: what pretrain_gpt.py builds on one GPU, stepped by the
training loop's own iteration (data built in the step, no prefetch thread, so the profile holds the
training thread alone). This is how the two fixes of 2026-11-23 were found on an H100: 149 host
syncs per step in megatron-core's no-Apex gradient norm, and ~0.5 ms of host time per call in
torch's ``varlen_attn`` wrapper (bench/README.md). Figures hold only within one run.

Host time that no single operator owns (the packed Llama step at micro-batch 1 spent ~35 ms more
host time per step than the unpacked one, spread thin) shows in three more tables: the CUDA runtime
calls (allocations, copies, synchronisations: blocking host time outside any operator's kernels),
the operators whose host time differs most between the two sides, and with ``--python`` the
Python-level attribution of one step (cProfile: own time by package, the heaviest functions, and the
functions whose own time differs most between the sides).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys

import torch
from torch.autograd import DeviceType

from bench import gpu_throughput as throughput

SHAPES = throughput.SHAPES


def wall_ms(side, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        side.step()
    return 1000 * statistics.median(throughput.timed_step(side)[0] for _ in range(steps))


def profile_steps(side, steps: int):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if throughput.DEVICE.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            side.step()
        throughput.synchronize()
    return prof.key_averages()


RUNTIME_PREFIXES = ("cuda", "cu")  # CUDA runtime/driver API calls, as the profiler names them


def runtime_rows(events, steps: int) -> list[tuple[str, float, float]]:
    """(name, calls per step, host ms per step) of the CUDA runtime/driver calls, heaviest first:
    the host time spent in allocations, copies and synchronisations (pure)."""
    rows = [
        (e.key, e.count / steps, e.cpu_time_total / (1000.0 * steps))
        for e in events
        if e.key.startswith(RUNTIME_PREFIXES) and e.device_type == DeviceType.CPU
    ]
    return sorted(rows, key=lambda r: -r[2])


def host_ms_by_key(events, steps: int) -> dict[str, tuple[float, float]]:
    """Operator key -> (calls per step, self host ms per step) (pure). Self time, so a parent and
    its children are not counted twice when two sides are compared."""
    return {
        e.key: (e.count / steps, e.self_cpu_time_total / (1000.0 * steps))
        for e in events
        if e.device_type == DeviceType.CPU
    }


def largest_differences(
    a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]], rows: int
) -> list[tuple[str, float, float, float]]:
    """(key, count in a, count in b, ms of b - ms of a) for the keys whose ms differ most (pure)."""
    keys = set(a) | set(b)
    diffs = [
        (k, a.get(k, (0.0, 0.0))[0], b.get(k, (0.0, 0.0))[0], b.get(k, (0.0, 0.0))[1] - a.get(k, (0.0, 0.0))[1])
        for k in keys
    ]
    return sorted(diffs, key=lambda d: -abs(d[3]))[:rows]


def print_differences(title: str, diffs: list[tuple[str, float, float, float]]) -> None:
    print(title)
    for key, ca, cb, d in diffs:
        print(f"    {key[:72]:<72} {ca:7.0f} vs {cb:7.0f}/step  {d:+8.2f} ms")


def python_group(filename: str, function: str) -> str:
    """The package a cProfile entry belongs to: torch/<sub>, megatron.core/<sub>, megatron_ext/<module>,
    the file, or one of three C groups: the autograd engine (the backward pass's C++ part: its
    operators' dispatch and launches), torch operators called from Python (dispatch and launch), other
    builtins (pure)."""
    if filename == "~":
        if "run_backward" in function:
            return "C: autograd engine (backward operators)"
        if "torch" in function or "TensorBase" in function:
            return "C: torch operators called from Python"
        return "C: other builtins"
    relative = relative_path(filename)
    if relative.startswith("megatron_ext/"):
        return relative
    return "/".join(relative.split("/")[:2])


PACKAGE_MARKERS = (
    ("/megatron_ext/", "megatron_ext"),
    ("/megatron/core/", "megatron.core"),
    ("/torch/", "torch"),
    ("/bench/", "bench"),
)


def relative_path(filename: str) -> str:
    """A source file's path from its package (megatron.core/transformer/attention.py), else its name."""
    path = filename.replace(os.sep, "/")
    for marker, label in PACKAGE_MARKERS:
        if marker in path:
            return f"{label}/{path.rsplit(marker, 1)[1]}"
    return os.path.basename(path)


def python_profile(side, steps: int) -> dict[tuple[str, int, str], tuple[float, float]]:
    """cProfile of ``steps`` steps: (file, line, function) -> (calls, own seconds) per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        side.step()
    throughput.synchronize()
    profiler.disable()
    return {key: (row[1] / steps, row[2] / steps) for key, row in pstats.Stats(profiler).stats.items()}


def summarize_python(name: str, profile: dict[tuple[str, int, str], tuple[float, float]], rows: int) -> None:
    own = {key: seconds for key, (_, seconds) in profile.items()}
    groups: collections.Counter = collections.Counter()
    for (filename, _, function), seconds in own.items():
        groups[python_group(filename, function)] += seconds
    print(f"== {name}: Python own time {1000 * sum(own.values()):.1f} ms/step (cProfile; its own overhead included)")
    print("  by package:")
    for group, seconds in groups.most_common(rows):
        print(f"    {group[:72]:<72} {1000 * seconds:8.2f} ms")
    print("  by function:")
    for key, seconds in sorted(own.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"    {function_label(key)[:72]:<72} {1000 * seconds:8.2f} ms")


def function_label(key: tuple[str, int, str]) -> str:
    filename, line, function = key
    return function if filename == "~" else f"{relative_path(filename)}:{line}({function})"


def summarize(name: str, events, steps: int, wall: float, rows: int) -> dict:
    """Per-step figures of one profiled side; prints its tables."""
    per = 1000.0 * steps  # profiler times are microseconds
    # device-side events only (as the profiler's own "Self CUDA time total"): operators carry their
    # kernels' time too, so summing every row counts it twice
    kernels = (
        sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation)
        / per
    )
    # the step's own syncs (.item(), .tolist(), ...); the profiler window's closing
    # torch.cuda.synchronize() is a cudaDeviceSynchronize and is not counted
    syncs = sum(e.count for e in events if e.key == "cudaStreamSynchronize") / steps
    launches = (
        sum(
            e.count
            for e in events
            if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
        )
        / steps
    )
    bound = "" if throughput.DEVICE.type != "cuda" else f" ({'host' if kernels < 0.9 * wall else 'device'}-bound)"
    print(
        f"== {name}: wall {wall:.1f} ms/step | device kernels {kernels:.1f} ms/step{bound} | host syncs {syncs:.0f}/step"
        f" | kernel launches {launches:.0f}/step",
        flush=True,
    )
    for title, key in (
        ("by device time (self)", lambda e: -e.self_device_time_total),
        ("by host time (total)", lambda e: -e.cpu_time_total),
    ):
        print(f"  {title}:")
        for e in sorted(events, key=key)[:rows]:
            print(
                f"    {e.key[:72]:<72} {e.count / steps:7.0f}/step  device {e.self_device_time_total / per:7.2f} ms"
                f"  host {e.cpu_time_total / per:7.2f} ms"
            )
    runtime = runtime_rows(events, steps)
    if runtime:
        print(f"  CUDA runtime calls (host time; {sum(r[2] for r in runtime):.2f} ms/step in all):")
        for key, count, ms in runtime[:rows]:
            print(f"    {key[:72]:<72} {count:7.0f}/step  host {ms:7.2f} ms")
    return {"wall": wall, "kernels": kernels, "syncs": syncs, "host": host_ms_by_key(events, steps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per side")
    p.add_argument("--timed-steps", type=int, default=8, help="steps timed without the profiler")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rows", type=int, default=15, help="operators listed per table")
    p.add_argument("--no-packed", action="store_true", help="profile the unpacked step only")
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step (as bench.gpu_throughput --accumulate)",
    )
    p.add_argument(
        "--python",
        action="store_true",
        help="also attribute one step's host time to Python packages and functions (cProfile)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (2 x 64, seq 128) for a smoke run")
    args = p.parse_args(argv)
    if args.accumulate < 1:  # before any work starts
        p.error(f"--accumulate {args.accumulate}: needs at least 1 micro-batch per optimizer step")
    name = throughput.start_on_one_device(args.device, "gpu_profile")
    if name is None:
        return 2
    throughput.PREFETCH = False
    throughput.ACCUMULATE = args.accumulate
    if args.tiny:
        throughput.use_tiny_shapes()
    shape = throughput.shape_for(args.shape, args.tiny)
    print(
        f"gpu_profile | {name} | torch {torch.__version__} | {args.shape}{' (--tiny)' if args.tiny else ''},"
        f" micro-batch {args.micro_batch}, {args.accumulate} per optimizer step",
        flush=True,
    )
    unpacked = throughput.Ours(shape, args.micro_batch)
    sides = {"unpacked": unpacked}
    if not args.no_packed:
        sides["packed"] = throughput.Ours(shape, args.micro_batch, packed=True, beside=unpacked)
    found, python = {}, {}
    for side_name, side in sides.items():
        wall = wall_ms(side, args.timed_steps, args.warmup)
        found[side_name] = summarize(side_name, profile_steps(side, args.steps), args.steps, wall, args.rows)
        if args.python:
            python[side_name] = python_profile(side, args.steps)
            summarize_python(side_name, python[side_name], args.rows)
    for side in reversed(sides.values()):
        side.close()
    if "packed" in found:
        u, k = found["unpacked"], found["packed"]
        print(
            f"packed/unpacked: wall {k['wall'] / u['wall']:.3f}x, device kernels "
            f"{k['kernels'] / max(u['kernels'], 1e-9):.3f}x"
        )
        print_differences(
            "  operators whose self host time differs most (unpacked vs packed calls, packed - unpacked):",
            largest_differences(u["host"], k["host"], args.rows),
        )
        if python:
            pu, pk = (
                {function_label(key): (calls, 1000 * sec) for key, (calls, sec) in python[n].items()}
                for n in ("unpacked", "packed")
            )
            print_differences(
                "  Python functions whose own time differs most (packed - unpacked):",
                largest_differences(pu, pk, args.rows),
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
