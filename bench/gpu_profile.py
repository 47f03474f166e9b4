"""Where one training step of ours spends its time on a GPU: kernel time against wall time (is the
step host-bound?), host synchronisations per step, and the heaviest operators by device and host
time, for an unpacked and a packed step side by side.

    python -m bench.gpu_profile [--shape gpt2|1.3b|llama] [--micro-batch 8] [--steps 3]
    python -m bench.gpu_profile --device cpu --tiny     # smoke run of the code paths, no figures

The step is ``bench.gpu_throughput.Ours``: what pretrain_gpt.py builds on one GPU, stepped by the
training loop's own iteration (data built in the step, no prefetch thread, so the profile holds the
training thread alone). This is how the two fixes of 2026-11-23 were found on an H100: 149 host
syncs per step in megatron-core's no-Apex gradient norm, and ~0.5 ms of host time per call in
torch's ``varlen_attn`` wrapper (bench/README.md). Figures hold only within one run.
"""

from __future__ import annotations

import argparse
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


def summarize(name: str, events, steps: int, wall: float, rows: int) -> dict:
    """Per-step figures of one profiled side; prints its tables."""
    per = 1000.0 * steps  # profiler times are microseconds
    # device-side events only (as the profiler's own "Self CUDA time total"): operators carry their
    # kernels' time too, so summing every row counts it twice
    kernels = sum(e.self_device_time_total for e in events
                  if e.device_type != DeviceType.CPU and not e.is_user_annotation) / per
    # the step's own syncs (.item(), .tolist(), ...); the profiler window's closing
    # torch.cuda.synchronize() is a cudaDeviceSynchronize and is not counted
    syncs = sum(e.count for e in events if e.key == "cudaStreamSynchronize") / steps
    launches = sum(e.count for e in events
                   if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")) / steps
    bound = "" if throughput.DEVICE.type != "cuda" else f" ({'host' if kernels < 0.9 * wall else 'device'}-bound)"
    print(f"== {name}: wall {wall:.1f} ms/step | device kernels {kernels:.1f} ms/step{bound} | host syncs {syncs:.0f}/step"
          f" | kernel launches {launches:.0f}/step", flush=True)
    for title, key in (("by device time (self)", lambda e: -e.self_device_time_total),
                       ("by host time (total)", lambda e: -e.cpu_time_total)):
        print(f"  {title}:")
        for e in sorted(events, key=key)[:rows]:
            print(f"    {e.key[:72]:<72} {e.count / steps:7.0f}/step  device {e.self_device_time_total / per:7.2f} ms"
                  f"  host {e.cpu_time_total / per:7.2f} ms")
    return {"wall": wall, "kernels": kernels, "syncs": syncs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per side")
    p.add_argument("--timed-steps", type=int, default=8, help="steps timed without the profiler")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rows", type=int, default=15, help="operators listed per table")
    p.add_argument("--no-packed", action="store_true", help="profile the unpacked step only")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (2 x 64, seq 128) for a smoke run")
    args = p.parse_args(argv)
    name = throughput.start_on_one_device(args.device, "gpu_profile")
    if name is None:
        return 2
    throughput.PREFETCH = False
    shape = throughput.shape_for(args.shape, args.tiny)
    print(f"gpu_profile | {name} | torch {torch.__version__} | {args.shape}{' (--tiny)' if args.tiny else ''},"
          f" micro-batch {args.micro_batch}", flush=True)
    unpacked = throughput.Ours(shape, args.micro_batch)
    sides = {"unpacked": unpacked}
    if not args.no_packed:
        sides["packed"] = throughput.Ours(shape, args.micro_batch, packed=True, beside=unpacked)
    found = {}
    for side_name, side in sides.items():
        wall = wall_ms(side, args.timed_steps, args.warmup)
        found[side_name] = summarize(side_name, profile_steps(side, args.steps), args.steps, wall, args.rows)
    for side in reversed(sides.values()):
        side.close()
    if "packed" in found:
        u, k = found["unpacked"], found["packed"]
        print(f"packed/unpacked: wall {k['wall'] / u['wall']:.3f}x, device kernels "
              f"{k['kernels'] / max(u['kernels'], 1e-9):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
