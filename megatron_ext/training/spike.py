"""The loss-spike guard (ours, ``--skip-spiky-loss-factor F``, ``--skip-spiky-loss-window N``).

A step whose global loss (token mean over every micro-batch and DP rank) exceeds F times the
reference is skipped exactly as a non-finite step is: no update (the optimizer returns before
clipping and stepping, the LR schedule does not advance), the data move on, the step is counted
in "number of skipped iterations" and logged with the rank and micro-batch of its largest loss.

The reference is the LARGEST loss of the last N steps whose update was applied (armed once it
holds N, also after a resume: the window is not checkpointed). The maximum, not the median or
mean: early in training the loss falls fast, and a median-based reference would make an ordinary
step of a slowly recovering run look like a spike; a max over a recent window follows the loss down
(Megatron-LM's --check-for-spiky-loss keeps the max of the first 100 steps forever) while a skipped
step never enters it.

Invariant: every rank takes the same decision. The step's loss reaches every rank through one
all-reduce (SUM over the world of [loss sum, token count], zeros where no loss is reported; the TP
ranks of the loss stage repeat their values in both, which the mean cancels), the comparison with
the host's threshold runs on the device, and its result travels to the host with the step's one
copy (``optimizer.step_optimizer_fetching``). Without the flag nothing here runs.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.config import TrainingConfig
from megatron_ext.cpu_platform import get_collective_device


class SpikeGuard:
    """The reference window (pure host state, the same on every rank)."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.skipped = 0  # spiky steps skipped by this process
        self.largest_ratio = 0.0  # the largest loss / reference of this process's checked steps

    def get_reference(self) -> float | None:
        """The largest of the last N applied losses, or None until N were seen."""
        return max(self.losses) if len(self.losses) == self.losses.maxlen else None

    def get_threshold(self) -> float:
        """The loss above which a step is skipped (inf while the guard is not armed)."""
        reference = self.get_reference()
        return math.inf if reference is None else self.factor * reference

    def record(self, loss: float | None, applied: bool) -> None:
        """After a step: an applied finite loss joins the window (the ratio is noted first)."""
        reference = self.get_reference()
        if loss is None or not math.isfinite(loss):
            return
        if reference is not None and reference > 0:
            self.largest_ratio = max(self.largest_ratio, loss / reference)
        if applied:
            self.losses.append(loss)


def build_spike_guard(t: TrainingConfig) -> SpikeGuard | None:
    """The guard of ``--skip-spiky-loss-factor`` / ``--skip-spiky-loss-window``; None when off."""
    if t.skip_spiky_loss_factor is None:
        return None
    return SpikeGuard(t.skip_spiky_loss_factor, t.skip_spiky_loss_window)


def is_spike(loss_sum_count: torch.Tensor, threshold: float) -> torch.Tensor:
    """[spike (1.0/0.0), mean] of a global [sum, count] on its device: a finite mean above
    ``threshold`` (a non-finite loss is the non-finite guard's); no token: mean 0, no spike."""
    total, count = loss_sum_count[0], loss_sum_count[1]
    mean = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
    spike = torch.isfinite(mean) & (mean > threshold)
    return torch.stack([spike.to(mean.dtype), mean])


def agree_spike(rows: torch.Tensor | None, threshold: float, device: torch.device, group: Any = None) -> torch.Tensor:
    """[spike, global mean loss] on every rank (float64 on ``device``): ``rows`` [m, 2] this rank's
    micro-batches' [sum, count] (None where no loss is reported); one all-reduce over ``group``
    (the world by default)."""
    local = rows.sum(0) if rows is not None else torch.zeros(2, dtype=torch.float64, device=device)
    local = local.to(get_collective_device(group), torch.float64)
    dist.all_reduce(local, group=group)
    return is_spike(local, threshold)


def locate_spike(run: Any, microbatch: tuple[int, float] | None) -> str:
    """The rank and micro-batch of the spiky step's largest micro-batch loss (one all-gather, only
    in a spiky step, which every rank takes)."""
    ctx = run.ctx
    mine = (ctx.rank, ctx.describe_place(), microbatch)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    found = [e for e in everyone if e[2] is not None]
    if not found:
        return "no micro-batch loss reported"
    r, place, (mb, loss) = max(found, key=lambda e: e[2][1])
    return f"largest micro-batch loss {loss:.4g} on rank {r} ({place}, micro-batch {mb})"


def check_spike(run: Any, result: Any) -> None:
    """After a step under the guard: log and count a skipped spiky step; update the reference."""
    guard: SpikeGuard | None = run.spike_guard
    if guard is None:
        return
    if result.spiked:
        guard.skipped += 1
        where = locate_spike(run, result.spike_microbatch)
        if run.ctx.is_logging_rank:
            run.log(
                f"WARNING: iteration {run.state.iteration}: loss {result.step_loss:.6g} is "
                f"{result.step_loss / guard.get_reference():.3g} x the largest loss of the last "
                f"{guard.losses.maxlen} applied steps ({guard.get_reference():.6g}), above "
                f"--skip-spiky-loss-factor {guard.factor}: update skipped on every rank ({where})"
            )
    guard.record(result.step_loss, result.update_successful)


def log_spike_summary(run: Any) -> None:
    """The guard's summary line, on the logging rank, when the loop ends normally (at
    --train-iters or an agreed exit: --exit-interval, --exit-duration-in-mins, a signal)."""
    guard: SpikeGuard | None = run.spike_guard
    if guard is None or not run.ctx.is_logging_rank:
        return
    run.log(
        f"> loss-spike guard: {guard.skipped} step(s) skipped by this process; largest loss / reference "
        f"of its checked steps: {guard.largest_ratio:.4g} (--skip-spiky-loss-factor {guard.factor}, "
        f"--skip-spiky-loss-window {guard.losses.maxlen})"
    )
