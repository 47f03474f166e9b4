"""Token-sum language-model loss.

Invariant: a micro-batch's loss is the SUM of token cross-entropies over its valid tokens
(label != IGNORE_INDEX; the micro-batch folds any loss mask into its labels) together with the
integer COUNT of those tokens. With
``calculate_per_token_loss`` (our default) megatron-core's ``finalize_model_grads`` broadcasts the
count from the last pipeline stage, all-reduces it over DP and scales every gradient by
1 / (valid tokens of the whole global batch): the step's gradient is that of the global mean over
valid tokens, whatever the micro-batch, padding and DP split. A zero count is fine: the sum is 0
and megatron-core divides by the global count only (by clamp(count, 1) in the opt-out mode).

Only the last pipeline stage calls this. ``TokenLoss`` is our named type; megatron-core's
``(loss, num_tokens, report)`` tuple exists only at the boundary, in ``to_megatron``.

Non-finite guard: a micro-batch whose loss is not finite makes every gradient of its backward NaN
(``poison_non_finite``), so that the step's global gradient norm, which every rank agrees on before
the optimizer step, is NaN and the update is skipped everywhere, as for non-finite gradients. An inf
loss can come with finite gradients (the cross-entropy's gradient is bounded); without this its
update was applied. No collective and no host synchronisation is added; a finite loss keeps its
value and gradient bit for bit (multiplied by 1.0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenLoss(NamedTuple):
    """Sum of token losses and count of valid tokens of one micro-batch."""

    loss_sum: torch.Tensor  # [] fp32, carries the graph
    num_tokens: torch.Tensor  # [] int

    def to_megatron(self, poison: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """megatron-core's 3-tuple: (loss, num_tokens, {name: [sum, count] for reporting}). ``poison``
        (the non-finite guard on): the loss to differentiate is ``poison_non_finite``'s; the report
        keeps the loss as computed, so that an inf shows as inf."""
        report = torch.stack([self.loss_sum.detach().float(), self.num_tokens.float()])
        loss = poison_non_finite(self.loss_sum) if poison else self.loss_sum
        return loss, self.num_tokens, {"lm loss": report}


def poison_non_finite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times 1.0 where it is finite (the same value and gradient, bit for bit), times NaN
    where it is not: then the gradient of everything upstream of it (every pipeline stage, through
    the P2P gradients) is NaN, and megatron-core's DP reduction carries it to every data-parallel
    replica before the gradient norm is computed. On the device, without a host synchronisation."""
    factor = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
    return loss * factor


def find_non_finite_microbatch(reports: list[dict[str, torch.Tensor]], key: str = "lm loss") -> int | None:
    """The first micro-batch (its place in the step) whose reported loss is not finite, or None."""
    for i, report in enumerate(reports):
        if not bool(torch.isfinite(report[key]).all()):
            return i
    return None


def compute_token_loss(per_token_loss: torch.Tensor, valid: torch.Tensor) -> TokenLoss:
    """``per_token_loss`` [b, s] (megatron-core GPTModel output with labels) -> TokenLoss."""
    per_token_loss = per_token_loss.float()
    # where(), not multiply: an ignored position may hold inf/NaN from a padded label.
    loss_sum = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss)).sum()
    return TokenLoss(loss_sum, valid.sum().to(torch.int))


def reduce_reported_loss(reports: list[dict[str, torch.Tensor]], key: str = "lm loss") -> torch.Tensor:
    """[sum, count] over this rank's micro-batches (float64 to keep the count exact)."""
    total = torch.zeros(2, dtype=torch.float64)
    for r in reports:
        total += r[key].detach().to(device="cpu", dtype=torch.float64)
    return total


def stack_reported_losses(reports: list[dict[str, torch.Tensor]], key: str = "lm loss") -> torch.Tensor:
    """[m, 2] float64 on the device: each micro-batch's reported [sum, count], for one copy to the host."""
    return torch.stack([r[key].detach() for r in reports]).to(torch.float64)


def sum_reported_losses(rows: list[list[float]]) -> torch.Tensor:
    """[sum, count] (float64, on the host) of the micro-batches' host rows, added in order as
    ``reduce_reported_loss`` adds them (the same float64 values); zeros without rows."""
    total = torch.zeros(2, dtype=torch.float64)
    for row in rows:
        total += torch.tensor(row, dtype=torch.float64)
    return total


def get_mean_loss(total: torch.Tensor) -> float:
    """Global sum / global count; NaN-free when no token counted (returns 0)."""
    count = float(total[1])
    return float(total[0]) / count if count > 0 else 0.0


def get_interval_loss(per_iteration: torch.Tensor, advanced: list[bool]) -> float:
    """The loss of a log line, as Megatron-LM's ``training_log`` averages it: the mean, over the
    interval's iterations whose update was applied, of each iteration's global token mean.

    ``per_iteration`` [iterations, 2] holds each iteration's global [sum, count]. Pooling the
    interval's tokens instead would weight an iteration by its valid tokens, which packed and masked
    data make uneven. An iteration without a valid token has no mean and is left out (Megatron-LM
    would average a NaN in). When no iteration qualifies (every update skipped), the interval's
    pooled mean is reported, so that a non-finite loss shows as one."""
    means = [get_mean_loss(row) for row, applied in zip(per_iteration, advanced) if applied and float(row[1]) > 0]
    if means:
        return sum(means) / len(means)
    return get_mean_loss(per_iteration.sum(dim=0))
