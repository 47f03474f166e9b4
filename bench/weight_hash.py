"""The cross-replica weight check (--check-weight-hash-across-dp-replicas-interval): the cost of one check.

    python -m bench.weight_hash [--params-gib 1] [--dtype fp32|bf16] [--device cpu|cuda] [--rounds 5] [--warmup 1]

One process, one thread on the CPU. The rank's parameters are ``--params-gib`` of GPT layers at hidden
512 (``bench.checkpoint.build_tensors``, 12 tensors per layer from 2 KiB to 4 MiB) in ``--dtype``, on
``--device``. Per round, in rotating order:

- check: ``weight_hash.compute_param_digests`` over every parameter and the one copy of the
  [parameters, 8] int64 digests to the host, what a check costs on a rank besides its all-gather of
  (parameters + 1) x 64 bytes over the DP x CP group and one all-reduce of 8 bytes over the world
  (both printed; on a GPU, the device time of the digests: the copy to the host waits for them);
- Megatron-LM's check (megatron-core 0.16.1 ``check_param_hashes_across_dp_replicas``): each
  parameter copied to the host as fp32 and its SHA-1 taken there, for comparison;
- one copy of each tensor (``clone``): a read and a write of the bytes, for scale.

The first ``--warmup`` rounds are dropped; medians. The check runs every N steps, so its cost per
step is the figure here divided by N.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from bench.checkpoint import build_tensors
from megatron_ext.training.weight_hash import LANES, build_digest_tables, compute_param_digests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_params(params_gib: float, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``params_gib`` of parameter tensors in ``dtype`` on ``device`` (model-like shapes)."""
    fp32_mib = int(params_gib * 1024 * 4 / torch.tensor([], dtype=dtype).element_size())
    return [t.to(device=device, dtype=dtype) for t in build_tensors(fp32_mib, model_like=True).values()]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rounds(params: list[torch.Tensor], device: torch.device, rounds: int) -> dict[str, list[float]]:
    tables = build_digest_tables(device)

    def check():
        compute_param_digests(params, tables).cpu()  # the one transfer: waits for the digests

    def megatron_lm():
        for p in params:
            hashlib.sha1(p.data.to("cpu").float().numpy(force=True)).digest()

    def copy():
        for p in params:
            p.clone()

    cases = {"check": check, "Megatron-LM's sha1 on the host": megatron_lm, "one copy (clone)": copy}
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order each round
            synchronize(device)
            start = time.perf_counter()
            cases[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-gib", type=float, default=1.0, help="parameters per rank, GiB")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    params = build_params(args.params_gib, DTYPES[args.dtype], device)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    times = run_rounds(params, device, args.warmup + args.rounds)
    median = {name: statistics.median(t[args.warmup :]) for name, t in times.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    print(
        f"weight hash bench: {where}, {len(params)} {args.dtype} parameter tensors, {nbytes / 2**30:.2f} GiB read "
        f"per check; medians of {args.rounds} rounds (+{args.warmup} warm-up)"
    )
    for name, seconds in median.items():
        print(f"  {name:<32} {seconds:8.3f} s  {nbytes / seconds / 1e9:7.2f} GB/s")
    print(
        f"  + per check: an all-gather of {(len(params) + 1) * LANES * 8:,} bytes per rank over the DP x CP group "
        f"and an all-reduce of 8 bytes over the world"
    )


if __name__ == "__main__":
    main()
