"""Checkpoint: save/load MiB/s of our distributed checkpoint vs torch.save/torch.load, same bytes.

    python -m bench.checkpoint [--sizes-mib 32 128 512] [--rounds 5] [--warmup 1] [--dir /tmp]
                               [--fresh-targets] [--model-like]
    python -m bench.checkpoint --readers [--sizes-mib 128 512 1024] [--ranks 2] [--rounds 5]

``--readers``: how ``load_checkpoint`` reads (``state.build_load_strategy``) against megatron-core's
stock reader, on ``--ranks`` forked gloo ranks, each loading its own file of ``--sizes-mib`` MiB
(fp32 tensors of 4 MiB), with and without verification, from the page cache (the files read once
before each load) and from disk (each file fsync'ed and its pages dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)`` before each load; util-linux's ``fincore`` shows the pages
left, printed once per size). All cases of a round alternate, the order reversed every round.

One process (a 1-rank gloo world), fp32 tensors of 4 MiB each adding up to each size
(``--model-like``: GPT layers at hidden 512, 12 tensors per layer from 2 KiB to 4 MiB).
A = ours: ``checkpointing.write_checkpoint`` (megatron-core ``dist_checkpointing.save`` in
``torch_dist`` format through our in-process writer, each file fsync'ed, then the marker, the
rename and the pointer of the atomic publish) and ``dist_checkpointing.load`` into preallocated
tensors through ``load_checkpoint``'s strategy (megatron-core's reader with our checks, ``reader.py``);
the destinations are materialised before the clock, as the model and optimizer tensors are in
``load_checkpoint`` (``--fresh-targets``: untouched ``empty_like`` memory, whose first-touch page
faults then count against us while torch.load's fresh storages may reuse just-freed pages);
B = ``torch.save`` of the same dict of tensors to a new file + fsync, deleting the previous
round's file (as our save deletes the previous checkpoint), and ``torch.load``.
Alternated per size (saves: A B, then B A; loads: A then B, so that torch.load reuses warm
pages), the first ``--warmup`` rounds dropped, medians of wall time (this is I/O; loads read
from the page cache on both sides). Target: A/B >= 0.7 for save and load, time
linear in size.

Checksums: our save computes each item's checksum (XXH3-64 with xxhash installed, else CRC-32) as it
writes; ``ours_load`` checks every item against the marker (``--ckpt-verify``). Both are also timed
without (saves with the hash update skipped, loads without ``--ckpt-verify``), alternated with the
rest; the verification overhead is printed beside its target (on by default only if <= 5% of load
time). ``--readers`` measures it from disk too, and on a resharded load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

TENSOR_MIB = 4


MODEL_HIDDEN = 512
MODEL_LAYER = {
    "qkv.weight": (3, 1),
    "qkv.bias": (3,),
    "proj.weight": (1, 1),
    "proj.bias": (1,),
    "fc1.weight": (4, 1),
    "fc1.bias": (4,),
    "fc2.weight": (1, 4),
    "fc2.bias": (1,),
    "ln1.weight": (1,),
    "ln1.bias": (1,),
    "ln2.weight": (1,),
    "ln2.bias": (1,),
}


def build_tensors(size_mib: int, model_like: bool = False) -> dict[str, torch.Tensor]:
    """fp32 tensors of 4 MiB adding up to ``size_mib``; ``model_like``: GPT layers at hidden 512
    instead (12 tensors per layer from 2 KiB to 4 MiB, ~12 MiB per layer)."""
    g = torch.Generator().manual_seed(0)
    if not model_like:
        n = max(size_mib // TENSOR_MIB, 1)
        return {f"layer{i}.weight": torch.randn(TENSOR_MIB * 2**20 // 4, generator=g) for i in range(n)}
    layers = max(1, round(size_mib / 12))
    return {
        f"layer{i}.{name}": torch.randn(*(m * MODEL_HIDDEN for m in mult), generator=g)
        for i in range(layers)
        for name, mult in MODEL_LAYER.items()
    }


def as_sharded(tensors: dict[str, torch.Tensor]) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in tensors.items()}


def time_ours_save(tensors, root: str, iteration: int, checksums: bool = True) -> float:
    from megatron_ext.checkpoint import writer
    from megatron_ext.checkpoint.directory import write_checkpoint

    original = writer._HashingStream.write
    if not checksums:  # the same writes, the hash update skipped (the marker then holds empty digests)
        writer._HashingStream.write = lambda self, data: self.stream.write(data)
    try:
        start = time.perf_counter()
        write_checkpoint(as_sharded(tensors), root, iteration, keep_last=1)
        return time.perf_counter() - start
    finally:
        writer._HashingStream.write = original


def time_ours_load(tensors, root: str, iteration: int, fresh_targets: bool = False, verify: bool = True) -> float:
    from megatron.core import dist_checkpointing

    from megatron_ext.checkpoint.directory import get_checkpoint_dir, read_marker
    from megatron_ext.checkpoint.state import build_load_strategy

    record = read_marker(get_checkpoint_dir(root, iteration))["checksums"]

    # load_checkpoint loads into the live (initialised) model and optimizer tensors: materialise
    # the destinations before the clock unless --fresh-targets (then their first-touch page faults
    # are timed too)
    make = torch.empty_like if fresh_targets else torch.zeros_like
    target = as_sharded({k: make(v) for k, v in tensors.items()})
    start = time.perf_counter()
    strategy = build_load_strategy(record if verify else None)
    loaded = dist_checkpointing.load(target, get_checkpoint_dir(root, iteration), sharded_strategy=strategy)
    elapsed = time.perf_counter() - start
    assert not verify or (strategy.stats.verified == len(tensors) and strategy.stats.unverified == 0)
    assert all(torch.equal(loaded[k], tensors[k]) for k in list(tensors)[:2])
    return elapsed


def time_torch_save(tensors, path: str, previous: str | None) -> float:
    """torch.save to a NEW file + fsync, then delete the previous one, as a checkpointing loop
    does (our save also writes a new directory and deletes the old checkpoint); overwriting one
    file in place is ~2x faster here for 512 MiB and would not compare like with like."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    if previous and os.path.exists(previous):
        os.remove(previous)
    return time.perf_counter() - start


def time_torch_load(tensors, path: str) -> float:
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    elapsed = time.perf_counter() - start
    assert all(torch.equal(loaded[k], tensors[k]) for k in list(tensors)[:2])
    return elapsed


def bench_size(
    size_mib: int, rounds: int, warmup: int, base: str, fresh_targets: bool = False, model_like: bool = False
) -> dict[str, float]:
    tensors = build_tensors(size_mib, model_like)
    mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    work = tempfile.mkdtemp(prefix="bench_ckpt_", dir=base)
    times = {
        "ours_save": [],
        "ours_save_nocrc": [],
        "torch_save": [],
        "ours_load": [],
        "ours_load_nocheck": [],
        "torch_load": [],
    }
    try:
        for r in range(rounds + warmup):
            root, path = os.path.join(work, "ours"), os.path.join(work, f"torch_{r}.pt")
            previous = os.path.join(work, f"torch_{r - 1}.pt") if r else None
            steps = {
                "ours_save": lambda: time_ours_save(tensors, root, r),
                "ours_save_nocrc": lambda: time_ours_save(tensors, os.path.join(work, "nocrc"), r, checksums=False),
                "ours_load_nocheck": lambda: time_ours_load(tensors, root, r, fresh_targets, verify=False),
                "torch_save": lambda: time_torch_save(tensors, path, previous),
                "ours_load": lambda: time_ours_load(tensors, root, r, fresh_targets),
                "torch_load": lambda: time_torch_load(tensors, path),
            }
            # saves: torch first every other round, so writeback left by the previous step
            # favours neither side; loads: torch.load always last, so its fresh storages reuse
            # the pages our just-freed destinations had (first-touch faults would triple its time)
            saves = (
                ["ours_save", "ours_save_nocrc", "torch_save"]
                if r % 2 == 0
                else ["torch_save", "ours_save_nocrc", "ours_save"]
            )
            loads = ["ours_load", "ours_load_nocheck"] if r % 2 == 0 else ["ours_load_nocheck", "ours_load"]
            order = saves + loads + ["torch_load"]
            sample = {k: steps[k]() for k in order}
            if r >= warmup:
                for k, v in sample.items():
                    times[k].append(v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"mib": mib, **med}


# ----------------------------------------------------------------------------- readers: ours vs megatron-core's

# (label, verify): "stock" is megatron-core's own strategy; "ours" is load_checkpoint's (the stock
# reader with our structural checks), without and with --ckpt-verify
READER_CASES = (("stock", False), ("ours", False), ("ours", True))


def _evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache: fsync (the writer did; nothing dirty may stay),
    then ``POSIX_FADV_DONTNEED``, which drops clean pages no process maps."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(paths: list[str]) -> None:
    """Read the files once, so that the next load finds all their pages in the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def _resident_mib(paths: list[str]) -> str:
    """MiB of the files in the page cache, as util-linux's ``fincore`` reports it (the proof that
    an eviction worked), or "?" without it."""
    import subprocess

    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *paths],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{sum(int(x) for x in out) / 2**20:.0f}"


def _layout(size_mib: int, rank: int, world_size: int, reshard: bool, fill: str) -> dict:
    """This rank's sharded tensors: 2-D [world_size, 1 Mi] fp32 tensors (4 MiB per rank each),
    rank r holding row r (as saved: each rank's items in its own file), or with ``reshard`` a block
    of columns of every row (as a TP reshard reads: part of every rank's items, each read whole).
    ``fill``: "random" (seeded by rank, as saved), "zeros" (load targets)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    g = torch.Generator().manual_seed(rank)
    n, cols = TENSOR_MIB * 2**20 // 4, TENSOR_MIB * 2**20 // 4 // world_size
    shape = (world_size, cols) if reshard else (1, n)
    out = {}
    for i in range(max(size_mib // TENSOR_MIB, 1)):
        data = torch.randn(*shape, generator=g) if fill == "random" else torch.zeros(*shape)
        out[f"layer{i}.weight"] = ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", data, (1, rank, world_size) if reshard else (0, rank, world_size), replica_id=0
        )
    return out


def _load_strategy(label: str, record: dict | None):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from megatron_ext.checkpoint.state import build_load_strategy

    return TorchDistLoadShardedStrategy() if label == "stock" else build_load_strategy(record)


def _timed_load(targets: dict, ckpt_dir: str, label: str, record: dict | None) -> tuple[float, float, tuple]:
    """One collective load: wall time (barrier to barrier), CPU seconds summed over the ranks (every
    thread of each rank: on a shared machine, the cost that waiting for a core does not inflate), and
    the (verified, without a checksum) item counts."""
    from megatron.core import dist_checkpointing

    first = next(iter(targets.values())).data
    first.fill_(float("nan"))  # a load that did nothing fails the check below
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    strategy = _load_strategy(label, record)
    loaded = dist_checkpointing.load(targets, ckpt_dir, sharded_strategy=strategy)
    cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.all_reduce(cpu)
    assert not torch.isnan(loaded[next(iter(targets))]).any()
    stats = getattr(strategy, "stats", None)
    return elapsed, cpu.item(), ((stats.verified, stats.unverified) if stats is not None else (0, 0))


def _reader_rounds(
    size_mib: int, rounds: int, warmup: int, work: str, rank: int, world_size: int, layouts: list[str]
) -> dict:
    """Save one checkpoint of ``size_mib`` per rank, then load it every way, alternated: per round,
    cache state and layout, the READER_CASES in one order, the next round reversed."""
    from megatron_ext.checkpoint.directory import get_checkpoint_dir, read_marker, write_checkpoint

    root = os.path.join(work, f"r{size_mib}")
    write_checkpoint(_layout(size_mib, rank, world_size, False, "random"), root, 0)
    ckpt_dir = get_checkpoint_dir(root, 0)
    record = read_marker(ckpt_dir)["checksums"]
    # load_checkpoint loads into live (materialised) model and optimizer tensors
    targets = {layout: _layout(size_mib, rank, world_size, layout == "reshard", "zeros") for layout in layouts}
    files = sorted(os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir))
    times: dict[tuple, list[float]] = {}
    counts: dict[tuple, tuple[int, int]] = {}
    evicted = "?"
    for r in range(rounds + warmup):
        for where in ("cache", "disk"):
            for layout in layouts:
                for label, verify in READER_CASES if r % 2 == 0 else READER_CASES[::-1]:
                    if rank == 0:
                        if where == "disk":
                            _evict(files)
                            evicted = _resident_mib(files) if r == 0 else evicted
                        else:
                            _warm(files)
                    elapsed, cpu, counted = _timed_load(targets[layout], ckpt_dir, label, record if verify else None)
                    counts[(layout, label, verify)] = counted
                    if r >= warmup:
                        times.setdefault((where, layout, label, verify), []).append(elapsed)
                        times.setdefault(("cpu", where, layout, label, verify), []).append(cpu)
    _check_loaded(targets, size_mib, rank, world_size)
    shutil.rmtree(root, ignore_errors=True)
    return {"times": times, "counts": counts, "evicted_mib": evicted}


def _check_loaded(targets: dict, size_mib: int, rank: int, world_size: int) -> None:
    """The first tensor of each layout holds what was saved (rebuilt from the seeds)."""
    rows = [next(iter(_layout(size_mib, r, world_size, False, "random").values())).data for r in range(world_size)]
    full = torch.cat(rows, dim=0)  # [world_size, 1 Mi]
    cols = full.shape[1] // world_size
    for layout, state in targets.items():
        got = next(iter(state.values())).data
        want = full[:, rank * cols : (rank + 1) * cols] if layout == "reshard" else full[rank : rank + 1]
        assert torch.equal(got, want), layout


def _readers_world(
    rank: int, world_size: int, sizes: list[int], rounds: int, warmup: int, work: str, layouts: list[str]
) -> list:
    from megatron.core import parallel_state

    from megatron_ext.cpu_platform import apply_cpu_platform, quiet_known_warnings

    quiet_known_warnings()
    warnings.simplefilter("ignore", FutureWarning)  # torch DCP's load_state_dict, in megatron-core's reader path
    apply_cpu_platform(torch.device("cpu"))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    return [(size, _reader_rounds(size, rounds, warmup, work, rank, world_size, layouts)) for size in sizes]


def main_readers(args) -> None:
    """``load_checkpoint``'s reading against megatron-core's stock reader, from the page cache and from
    disk, with and without --ckpt-verify, same layout and resharded."""
    from megatron_ext.testing import run_ranks

    work = tempfile.mkdtemp(prefix="bench_readers_", dir=args.dir)
    print(
        f"readers bench: {args.ranks} ranks, fp32 tensors of {TENSOR_MIB} MiB per rank, sizes per rank "
        f"{args.sizes_mib} MiB, medians of {args.rounds} rounds ({args.warmup} warm-up dropped), cases alternated "
        f"(order reversed every round), wall time barrier to barrier, dir {args.dir}; disk = pages evicted before "
        f"each load (fsync + posix_fadvise DONTNEED); load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    try:
        results = run_ranks(
            _readers_world, args.ranks, args.sizes_mib, args.rounds, args.warmup, work, args.layouts, timeout=3600
        )[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{'MiB/rank':>8} {'layout':>7} {'from':>5} | wall: {'stock':>6} {'ours':>6} {'/stock':>6} {'verified':>8} "
        f"{'cost':>6} | CPU s: {'stock':>6} {'ours':>6} {'/stock':>6} {'verified':>8} {'cost':>6}"
    )
    for size, res in results:
        t = {k: statistics.median(v) for k, v in res["times"].items()}
        for layout in args.layouts:
            for where in ("cache", "disk"):
                wall = [t[(where, layout, label, v)] for label, v in READER_CASES]
                cpu = [t[("cpu", where, layout, label, v)] for label, v in READER_CASES]
                cells = [
                    f"{a:5.3f}s {b:5.3f}s {b / a:6.2f} {c:7.3f}s {100 * (c / b - 1):+5.0f}%" for a, b, c in (wall, cpu)
                ]
                print(f"{size:8d} {layout:>7} {where:>5} | wall: {cells[0]} | CPU s: {cells[1]}", flush=True)
        counts = ", ".join(
            f"{layout}: {c[0]} items verified, {c[1]} without a checksum"
            for (layout, label, v), c in sorted(res["counts"].items())
            if v
        )
        print(
            f"{'':8} rank 0 with --ckpt-verify: {counts}; after an eviction {res['evicted_mib']} MiB of the "
            f"files were in the page cache"
        )
    print(
        f"stock = megatron-core's TorchDistLoadShardedStrategy; ours = load_checkpoint's (the same reader with "
        f"shard sizes and byte items checked); verified = ours with --ckpt-verify, cost = verified / ours - 1 "
        f"(default on only if <= 5% of load time); CPU s = CPU seconds of all ranks and their threads; load "
        f"average at the end {os.getloadavg()[0]:.2f}"
    )


def init_single_process_world() -> None:
    from megatron.core import parallel_state

    from bench.common import init_single_rank_world
    from megatron_ext.cpu_platform import apply_cpu_platform, quiet_known_warnings

    quiet_known_warnings()
    init_single_rank_world()
    apply_cpu_platform(torch.device("cpu"))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument(
        "--model-like",
        action="store_true",
        help="GPT layers at hidden 512 (12 tensors per layer, 2 KiB to 4 MiB) instead of uniform 4 MiB tensors",
    )
    parser.add_argument(
        "--fresh-targets", action="store_true", help="load into torch.empty_like tensors never touched before the clock"
    )
    parser.add_argument(
        "--readers",
        action="store_true",
        help="instead: load_checkpoint's reading vs megatron-core's stock reader, --ranks ranks, "
        "from the page cache and from disk, with and without --ckpt-verify",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["same", "reshard"],
        choices=["same", "reshard"],
        help="--readers: load in the saved layout, and/or resharded (every rank reads part of every rank's items)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.readers:
        return main_readers(args)
    init_single_process_world()
    shapes = (
        f"GPT layers at hidden {MODEL_HIDDEN} ({len(MODEL_LAYER)} tensors per layer)"
        if args.model_like
        else f"fp32 tensors of {TENSOR_MIB} MiB"
    )
    print(
        f"checkpoint bench: 1 process, {shapes}, medians of {args.rounds} "
        f"rounds (A B alternated, {args.warmup} warm-up dropped), wall time, dir {args.dir}, "
        f"load targets {'fresh (empty_like)' if args.fresh_targets else 'materialised (zeros_like)'}"
    )
    print(
        f"{'MiB':>6} | {'ours save':>10} {'torch.save':>10} {'ratio':>6} | "
        f"{'ours load':>10} {'torch.load':>10} {'ratio':>6} | "
        f"{'save s':>7} {'load s':>7}"
    )
    rows = []
    for size in args.sizes_mib:
        r = bench_size(size, args.rounds, args.warmup, args.dir, args.fresh_targets, args.model_like)
        rows.append(r)
        speed = {k: r["mib"] / r[k] for k in ("ours_save", "torch_save", "ours_load", "torch_load")}
        print(
            f"{r['mib']:6.0f} | {speed['ours_save']:7.0f}/s {speed['torch_save']:7.0f}/s "
            f"{speed['ours_save'] / speed['torch_save']:6.2f} | {speed['ours_load']:7.0f}/s "
            f"{speed['torch_load']:7.0f}/s {speed['ours_load'] / speed['torch_load']:6.2f} | "
            f"{r['ours_save']:7.3f} {r['ours_load']:7.3f}",
            flush=True,
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        scale = last["mib"] / first["mib"]
        print(
            f"time vs size: {scale:.0f}x the bytes took {last['ours_save'] / first['ours_save']:.1f}x "
            f"(save) and {last['ours_load'] / first['ours_load']:.1f}x (load); linear would be {scale:.0f}x"
        )
    for r in rows:
        load_cost = r["ours_load"] / r["ours_load_nocheck"] - 1
        save_cost = r["ours_save"] / r["ours_save_nocrc"] - 1
        print(
            f"checksums at {r['mib']:.0f} MiB: verification +{100 * load_cost:.1f}% of load time (target < 5%: "
            f"{'PASS' if load_cost < 0.05 else 'FAIL'}), hashing while writing +{100 * save_cost:.1f}% of save time"
        )
    print("target: ratio >= 0.7 (MiB/s, ours / torch) for save and load")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
