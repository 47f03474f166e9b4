"""Replicas that cannot drift apart unseen: ``--check-weight-hash-across-dp-replicas-interval N``.

Invariant: the data-parallel replicas of a parameter (DP x CP: context-parallel ranks hold the same
parameters too) hold the same bits. Checked before a process's first step and after every N-th
optimizer step, before that iteration's log, evaluation and save:

1. pending parameter gathers are completed first (``params_synced``): under
   --use-distributed-optimizer --overlap-param-gather each replica holds only its own shard of the
   last update until the next forward gathers the rest, and a naive hash reports false mismatches;
2. each rank digests each of its parameters on its device (``compute_param_digests``; no host
   synchronisation per parameter), and the DP x CP group all-gathers the digests (one collective,
   one transfer of [parameters + 1, 8] int64 per rank to the host);
3. one all-reduce over the world gives every rank one verdict; on a mismatch one all-gather of the
   findings names the iteration, the parameters, the ranks (the outlier when three or more replicas
   have a majority), the last iteration whose check passed and the newest checkpoint at or before
   it (``checkpoint/replica_check.py``), and every rank raises ``WeightHashMismatch`` (exit code 3).

The digest is exact integer arithmetic on the parameter's bits. Its words (int16 for 2-byte dtypes,
int32 for 4-byte ones) as float64, in rows of 2^11, times a fixed table of multipliers below 2^11:
one float64 GEMM [8, 2048] @ [2048, rows] whose every partial sum is an integer below 2^53, so exact
in any summation order on any device; each row's 8 sums are reduced modulo 8 distinct primes below
2^31 and combined with per-row multipliers in int64. A change confined to one word (one flipped bit,
or several) always changes the digest: lane k moves by delta x m x r mod p_k with m, r in [1, p_k),
and no |delta| < 2^32 is a multiple of all 8 primes. Other changes escape with a probability of about
2^-88 (heuristic: random multipliers). Cost: one read of the parameters and a float64 copy of them in
slices of 32 MiB; on the CPU about 2.5 GB/s on one thread (``python -m bench.weight_hash``), against
2 GB/s for the sha256 of host bytes that Megatron-LM's check takes after copying each parameter to
the host.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.checkpoint.finite import get_named_parameters
from megatron_ext.checkpoint.replica_check import CHECKED_KEY, find_checked_checkpoint, write_mismatch_record
from megatron_ext.config import TrainingConfig
from megatron_ext.cpu_platform import get_collective_device
from megatron_ext.parallel import ParallelContext
from megatron_ext.training.step import params_synced

WEIGHT_HASH_EXIT_CODE = 3  # docs/failures.md#exit-codes
ROW = 2**11  # words per GEMM row: |word| <= 2^31, multiplier < 2^11, 2^11 terms: every partial sum < 2^53
LANES = 8
PRIMES = (2147483647, 2147483629, 2147483587, 2147483579, 2147483563, 2147483549, 2147483543, 2147483497)
SLICE = 2**22  # words per float64 copy: 32 MiB
_SEED = 0x5EED_0044
MAX_NAMED = 8  # parameters listed in the message (then "and N more")


class WeightHashMismatch(RuntimeError):
    """The replicas' weights differ; raised on every rank with the same message. ``checkpoint``: the
    (iteration, path) of the newest checkpoint at or before ``last_passed``, None when there is none."""

    def __init__(self, message: str, iteration: int, last_passed: int | None, checkpoint: tuple[int, str] | None):
        super().__init__(message)
        self.iteration, self.last_passed, self.checkpoint = iteration, last_passed, checkpoint

    def __reduce__(self):  # to a test's parent process with its fields
        return type(self), (str(self), self.iteration, self.last_passed, self.checkpoint)


@dataclasses.dataclass
class DigestTables:
    """The digest's constants on one device, and the float64 slice it copies words into."""

    multipliers: torch.Tensor  # [LANES, ROW] float64, integers in [1, 2^11)
    row_a: torch.Tensor  # [LANES] int64: row r's multiplier is 1 + (r * a + b) mod (p - 1)
    row_b: torch.Tensor  # [LANES] int64
    primes: torch.Tensor  # [LANES] int64
    buffer: torch.Tensor  # [SLICE] float64


def build_digest_tables(device: torch.device) -> DigestTables:
    """The same constants on every rank and run (a fixed seed)."""
    g = torch.Generator().manual_seed(_SEED)
    multipliers = torch.randint(1, ROW, (LANES, ROW), generator=g, dtype=torch.int64)
    primes = torch.tensor(PRIMES, dtype=torch.int64)
    row_a = torch.randint(1, 2**31 - 1, (LANES,), generator=g, dtype=torch.int64) % (primes - 1) + 1
    row_b = torch.randint(0, 2**31 - 1, (LANES,), generator=g, dtype=torch.int64) % (primes - 1)
    return DigestTables(
        multipliers.to(device=device, dtype=torch.float64),
        row_a.to(device),
        row_b.to(device),
        primes.to(device),
        torch.empty(SLICE, dtype=torch.float64, device=device),
    )


def get_words(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as a flat integer view: int8, int16 or int32 words by its element size."""
    flat = tensor.detach().reshape(-1)
    return flat.view({1: torch.int8, 2: torch.int16}.get(flat.element_size(), torch.int32))


def _fold_rows(rows: torch.Tensor, first_row: int, t: DigestTables) -> torch.Tensor:
    """[rows, ROW] float64 words -> [LANES] int64: each row's exact sums (integers below 2^53), reduced
    and weighted by the row's multiplier modulo each lane's prime."""
    # [LANES, ROW] @ [ROW, rows]: on the CPU 1.5x faster than the [rows, ROW] @ [ROW, LANES] it equals
    sums = (t.multipliers @ rows.t()).t().to(torch.int64).remainder_(t.primes)
    rows = torch.arange(first_row, first_row + sums.shape[0], dtype=torch.int64, device=sums.device)
    weights = (rows[:, None] * t.row_a + t.row_b).remainder_(t.primes - 1).add_(1)  # [rows, LANES]
    return sums.mul_(weights).remainder_(t.primes).sum(dim=0)  # products < 2^62


def digest_tensor(tensor: torch.Tensor, t: DigestTables) -> torch.Tensor:
    """[LANES] int64 digest of ``tensor``'s bits, on its device; asynchronous (no host read)."""
    words = get_words(tensor)
    n = words.numel()
    full = n // ROW * ROW
    acc = torch.zeros(LANES, dtype=torch.int64, device=words.device)
    for start in range(0, full, SLICE):
        stop = min(start + SLICE, full)
        rows = t.buffer[: stop - start].copy_(words[start:stop]).view(-1, ROW)
        acc += _fold_rows(rows, start // ROW, t)
    if full < n:  # the last, partial row, zero-padded
        tail = t.buffer[:ROW].zero_()
        tail[: n - full].copy_(words[full:])
        acc += _fold_rows(tail.view(1, ROW), full // ROW, t)
    return acc.remainder_(t.primes)


def compute_param_digests(tensors: list[torch.Tensor], t: DigestTables) -> torch.Tensor:
    """[len(tensors), LANES] int64 on the tables' device: one digest per tensor, no host read."""
    if not tensors:
        return torch.zeros(0, LANES, dtype=torch.int64, device=t.primes.device)
    return torch.stack([digest_tensor(x, t) for x in tensors])


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One parameter whose digests differ across the group: its index, and the group members (their
    places in the group) that hold another value than the majority (all of them: no majority)."""

    index: int
    outliers: list[int]
    majority: list[int]


def find_mismatches(gathered: torch.Tensor) -> list[Mismatch]:
    """The parameters whose digests differ, from ``gathered`` [members, parameters, LANES] (pure). With
    a strict majority of equal digests, the others are the outliers; else every member is named."""
    agree = (gathered == gathered[:1]).all(dim=2).all(dim=0)  # [parameters]
    out = []
    for index in (~agree).nonzero().flatten().tolist():
        values = [tuple(row) for row in gathered[:, index].tolist()]
        common, count = collections.Counter(values).most_common(1)[0]
        if count * 2 > len(values):
            majority = [m for m, v in enumerate(values) if v == common]
            out.append(Mismatch(index, [m for m, v in enumerate(values) if v != common], majority))
        else:
            out.append(Mismatch(index, list(range(len(values))), []))
    return out


def describe_members(members: list[tuple[int, int, int]], which: list[int], cp: bool) -> str:
    """ "rank 5 (data-parallel rank 1)" / "ranks 1, 5 (data-parallel ranks 0, 1)" of the group members
    ``which``; ``members``: each member's (global rank, DP rank, CP rank)."""
    ranks = ", ".join(str(members[m][0]) for m in which)
    dps = ", ".join(str(members[m][1]) for m in which)
    cps = ", ".join(str(members[m][2]) for m in which)
    s = "s" if len(which) > 1 else ""
    where = f"data-parallel rank{s} {dps}" + (f", context-parallel rank{s} {cps}" if cp else "")
    return f"rank{s} {ranks} ({where})"


def describe_mismatch(name: str, mismatch: Mismatch, members: list[tuple[int, int, int]], cp: bool) -> str:
    """One parameter's finding: which replicas differ from which."""
    if mismatch.majority:
        n = len(mismatch.outliers)
        return (
            f"{name}: {describe_members(members, mismatch.outliers, cp)} differ{'s' if n == 1 else ''} from the "
            f"other {len(mismatch.majority)} replicas, which agree: {describe_members(members, mismatch.majority, cp)}"
        )
    if len(members) == 2:
        who = describe_members(members, mismatch.outliers, cp)
        return f"{name}: {who} differ (with two replicas, which one drifted cannot be told)"
    return f"{name}: {describe_members(members, mismatch.outliers, cp)} disagree with no majority"


def compare_replicas(model: list[torch.nn.Module], ctx: ParallelContext, t: DigestTables) -> list[str]:
    """This rank's findings (collective over ``ctx.reduce_group``): one line per parameter whose digests
    differ across the DP x CP group, reported by the group's first member only (every member sees
    the same gathered digests). The parameters must be in place (``params_synced``)."""
    named = list(get_named_parameters(model))
    digests = compute_param_digests([p for _, p in named], t)  # [n, LANES]
    header = torch.zeros(1, LANES, dtype=torch.int64, device=digests.device)
    header[0, :3] = torch.tensor([ctx.rank, ctx.dp_rank, ctx.cp_rank])
    group = ctx.reduce_group
    local = torch.cat([header, digests]).to(get_collective_device(group))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    gathered = torch.stack(parts).cpu()  # [members, n + 1, LANES]: the one transfer to the host
    if dist.get_group_rank(group, ctx.rank) != 0:
        return []
    members = [tuple(row) for row in gathered[:, 0, :3].tolist()]
    position = f" (tensor rank {ctx.tp_rank}, pipeline rank {ctx.pp_rank})" if ctx.tp_size * ctx.pp_size > 1 else ""
    return [
        describe_mismatch(named[m.index][0] + position, m, members, ctx.cp_size > 1)
        for m in find_mismatches(gathered[:, 1:])
    ]


def agree_on_findings(findings: list[str]) -> list[str]:
    """Every rank's findings, on every rank: one all-reduce MAX over the world, and only when some rank
    has findings one all-gather of them."""
    flag = torch.tensor([len(findings)], dtype=torch.int64, device=get_collective_device(None))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, findings)
    return [line for per_rank in everyone for line in per_rank]


@dataclasses.dataclass
class WeightHashCheck:
    """The check's state in a run: its interval and the last iteration whose check passed."""

    interval: int
    last_passed: int | None = None
    tables: DigestTables | None = None  # built at the first check, on the run's device
    seconds: float = 0.0  # of the last check

    def get_marker_record(self) -> dict[str, Any]:
        """What a checkpoint saved now records (``replica_check.py``): the last iteration checked."""
        return {CHECKED_KEY: self.last_passed} if self.last_passed is not None else {}


def build_weight_hash_check(t: TrainingConfig) -> WeightHashCheck | None:
    interval = t.check_weight_hash_across_dp_replicas_interval
    return WeightHashCheck(interval) if interval else None


def maybe_check_weight_hash(run: Any, before_first_step: bool = False) -> None:
    """The check when due (collective): before this process's first step, and after each step whose
    iteration is a multiple of the interval. Raises WeightHashMismatch on every rank on a mismatch."""
    check, state = run.weight_hash, run.state
    if check is None:
        return
    if before_first_step:
        if run.steps_this_run or state.iteration >= run.cfg.training.train_iters:
            return
    elif state.iteration % check.interval:
        return
    if run.ctx.world_size // (run.ctx.tp_size * run.ctx.pp_size) == 1:  # one replica: nothing to compare
        if run.ctx.is_logging_rank:
            run.log("WARNING: --check-weight-hash-across-dp-replicas-interval: one replica (DP x CP = 1), no check")
        run.weight_hash = None
        return
    start = time.perf_counter()
    if check.tables is None:
        check.tables = build_digest_tables(run.ctx.device)
    with params_synced(run.model):  # --overlap-param-gather: the last update's gathers completed
        findings = agree_on_findings(compare_replicas(run.model, run.ctx, check.tables))
    if findings:
        stop_on_mismatch(run, findings)
    check.last_passed, check.seconds = state.iteration, time.perf_counter() - start
    if run.ctx.is_logging_rank:
        run.log(f"weight hashes match across the replicas at iteration {state.iteration} ({check.seconds:.2f} s)")


def stop_on_mismatch(run: Any, findings: list[str]) -> None:
    """Name the last checked checkpoint (rank 0 finds it and records it in --save for a restart:
    ``replica_check.py``) and raise WeightHashMismatch on every rank with one message (collective)."""
    check, iteration, save = run.weight_hash, run.state.iteration, run.cfg.checkpoint.save
    found: list[Any] = [(None, None)]
    if dist.get_rank() == 0 and save and check.last_passed is not None:
        checkpoint, failure = find_checked_checkpoint(save, check.last_passed), None
        if checkpoint is not None:
            try:
                write_mismatch_record(save, iteration, check.last_passed, checkpoint[0])
            except OSError as err:  # raised here alone, it would leave the other ranks in the broadcast
                failure = f"{err.strerror}: {err.filename}"
        found = [(checkpoint, failure)]
    dist.broadcast_object_list(found, src=0)
    checkpoint, failure = found[0]
    message = describe_stop(run, findings, checkpoint, failure)
    raise WeightHashMismatch(message, iteration, check.last_passed, checkpoint if failure is None else None)


def describe_stop(run: Any, findings: list[str], checkpoint: tuple[int, str] | None, failure: str | None) -> str:
    """The one message of a mismatch: what differs, the last check that passed, where to resume
    (``failure``: why the record a restart reads could not be written)."""
    check, iteration, save = run.weight_hash, run.state.iteration, run.cfg.checkpoint.save
    more = f"; and {len(findings) - MAX_NAMED} more" if len(findings) > MAX_NAMED else ""
    head = (
        f"weight-hash mismatch at iteration {iteration}: the data-parallel replicas' weights differ "
        f"(--check-weight-hash-across-dp-replicas-interval {check.interval}; silent data corruption suspected: "
        f"a bit flipped in a replica's memory or computation), in {len(findings)} parameter tensor(s): "
        f"{'; '.join(findings[:MAX_NAMED])}{more}"
    )
    code = f"exit code {WEIGHT_HASH_EXIT_CODE}"
    if check.last_passed is None:
        return (
            f"{head}. This was this run's first check, before its first step: no checked weights to go back "
            f"to, no automatic restart ({code})"
        )
    passed = f"The last check that passed was at iteration {check.last_passed}"
    if checkpoint is None:
        where = (
            f"--save {save} holds no checkpoint at or before it" if save else "the run saves no checkpoints (--save)"
        )
        return f"{head}. {passed}; {where}: no automatic restart ({code})"
    restart = (
        "An automatic restart (launch/torchrun.sh MAX_RESTARTS, a Slurm requeue) resumes from it"
        if failure is None
        else f"No automatic restart: the record a restart reads could not be written to --save ({failure})"
    )
    return (
        f"{head}. {passed}; the newest checkpoint at or before it is {checkpoint[1]} (iteration {checkpoint[0]}), "
        f"the last good one: checkpoints after iteration {check.last_passed} may hold the drift. {restart}; by "
        f"hand: --load {save} --ckpt-step {checkpoint[0]}, better on other hardware than the ranks named ({code})"
    )
