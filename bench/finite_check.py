"""The non-finite weight check of a save: its time as a fraction of the save's, side by side.

    python -m bench.finite_check [--state-gib 1] [--rounds 5] [--warmup 1] [--dir /tmp]

One process (a 1-rank gloo world), one thread. The rank's state is ``--state-gib`` of an Adam
run: fp32 parameters (GPT layers at hidden 512, ``bench.checkpoint.build_tensors``) and their two
moments, 1/3 of the bytes each. Per round, in rotating order:

- save: ``write_checkpoint`` of the whole state (megatron-core ``torch_dist`` through our
  in-process writer, checksums, fsync, marker, rename, pointer; ``keep_last=1``);
- check: ``finite.find_non_finite`` over the parameters, what ``save_checkpoint`` runs (one
  ``torch.aminmax`` per tensor, one host synchronisation);
- check bf16: the same over bf16 parameters of a mixed-precision state of the same size (2 of
  its 14 bytes per parameter: bf16 weights, fp32 main weights, two fp32 moments);
- for comparison: the check over the whole state, and ``isfinite().all()`` over the parameters.

The first ``--warmup`` rounds are dropped; medians. The save is I/O (here mostly the page cache
and fsync); the check reads memory once. It runs at saves only, so its cost is printed as a
fraction of the save it guards, not of a training step.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from bench.checkpoint import as_sharded, build_tensors, init_single_process_world


def build_state(state_gib: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(fp32 parameters, the whole state: parameters and Adam's two moments), ``state_gib`` in all."""
    params = build_tensors(int(state_gib * 1024 / 3), model_like=True)
    state = dict(params)
    for moment in ("exp_avg", "exp_avg_sq"):
        state.update({f"{moment}.{k}": torch.randn_like(v) for k, v in params.items()})
    return params, state


def build_bf16_params(state_bytes: int) -> dict[str, torch.Tensor]:
    """bf16 parameters of a mixed-precision state of ``state_bytes`` (14 bytes per parameter)."""
    params = build_tensors(max(int(state_bytes * 2 / 7 / 2**20), 1), model_like=True)  # fp32: 4 of the 14 bytes
    return {k: v.to(torch.bfloat16) for k, v in params.items()}


def time_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_rounds(params, state, bf16, root: str, rounds: int) -> dict[str, list[float]]:
    from megatron_ext.checkpoint.directory import write_checkpoint
    from megatron_ext.checkpoint.finite import find_non_finite

    def check(tensors):
        bad, _ = find_non_finite(tensors.items())
        assert not bad

    cases = {
        "save": lambda it: write_checkpoint(as_sharded(state), root, it, keep_last=1),
        "check": lambda it: check(params),
        "check bf16": lambda it: check(bf16),
        "check whole state": lambda it: check(state),
        "isfinite().all()": lambda it: all(bool(torch.isfinite(t).all()) for t in params.values()),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order each round
            times[name].append(time_call(lambda: cases[name](r + 1)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_single_process_world()
    params, state = build_state(args.state_gib)
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    bf16 = build_bf16_params(state_bytes)
    root = tempfile.mkdtemp(prefix="bench-finite-", dir=args.dir)
    try:
        times = run_rounds(params, state, bf16, root, args.warmup + args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(t[args.warmup :]) for name, t in times.items()}

    def gib(tensors):
        return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30

    print(
        f"finite check bench: 1 process, 1 thread, state {gib(state):.2f} GiB per rank ({len(state)} tensors: fp32 "
        f"parameters {gib(params):.2f} GiB and Adam's two moments), medians of {args.rounds} rounds "
        f"(+{args.warmup} warm-up)"
    )
    save = median["save"]
    print(f"  {'save (write_checkpoint)':<44} {save:8.3f} s")
    for name, what in (
        ("check", f"check: fp32 parameters, {gib(params):.2f} GiB"),
        ("check bf16", f"check: bf16 parameters, {gib(bf16):.2f} GiB"),
        ("check whole state", f"check: whole state, {gib(state):.2f} GiB"),
        ("isfinite().all()", "isfinite().all(): fp32 parameters"),
    ):
        print(f"  {what:<44} {median[name]:8.3f} s  = {median[name] / save:6.2%} of the save")


if __name__ == "__main__":
    main()
