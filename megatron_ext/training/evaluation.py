"""Evaluation: the validation loss of each validation set, as Megatron-LM logs it.

An evaluation's loss is the token mean over what it read: the sum of token losses and the count of
valid tokens over every micro-batch of every DP rank, reduced once and divided once. What it reads:

- by default, evaluation k (1, 2, ...) reads the k-th ``--eval-iters`` global batches of the one
  validation dataset (the end of a run whose length is not a multiple of ``--eval-interval`` is one
  more evaluation; ``data/builder.get_num_samples`` counts it);
- with ``--full-validation``, every evaluation reads each set whole, every sample once
  (``data/validation_sets.FullPassDataset``); with ``--multiple-validation-sets`` each prefix of the
  validation blend is such a set, logged on its own line ("validation-K") and metric.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.cpu_platform import get_collective_device
from megatron_ext.data.validation_sets import FullPassDataset, get_validation_sets
from megatron_ext.parallel import ParallelContext
from megatron_ext.training.loss import get_mean_loss, reduce_reported_loss
from megatron_ext.training.metrics import format_validation_line, get_perplexity
from megatron_ext.training.step import build_step_microbatches, forward_step, params_synced, run_forward_backward


def reduce_loss_over_dp(local: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Global sums of ``local`` ([loss sum, count, ...]) on the last stage (one all-reduce over its
    DP group)."""
    if not (ctx.is_last_stage and ctx.dp_size > 1):
        return local.clone()
    total = local.to(get_collective_device(ctx.dp_group))
    dist.all_reduce(total, group=ctx.dp_group)
    return total.cpu()


def watched(run: Any, phase: str, batch: int | None = None) -> Any:
    """The stall watchdog times ``phase`` (eval, save) after the current iteration, if there is one;
    --log-straggler's pause monitor does not count a save (its pickling holds the GIL for seconds)."""
    within = contextlib.ExitStack()
    if run.watchdog:
        within.enter_context(run.watchdog.watch(phase, run.state.iteration, batch))
    if phase == "save" and run.straggler is not None:
        within.enter_context(run.straggler.monitor.not_counted())
    return within


def get_forward_step(run: Any) -> Callable:
    """The forward step, recording each micro-batch for the watchdog when there is one."""
    return functools.partial(forward_step, progress=run.watchdog.progress) if run.watchdog else forward_step


def evaluate(run: Any, dataset: Any, start_sample: int, num_batches: int) -> float:
    """Token-mean loss over ``num_batches`` global batches of ``dataset`` from ``start_sample``
    (``run`` is the loop's TrainingRun)."""
    ctx, model = run.ctx, run.model
    for chunk in model:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(num_batches):
            with watched(run, "eval", batch=i):  # each batch gets --step-timeout-minutes
                first = start_sample + i * run.global_batch_size  # evaluation reads the settled batch
                microbatches, length = build_step_microbatches(run, dataset, first, run.global_batch_size)
                reports = run_forward_backward(
                    model, microbatches, length, forward_only=True, forward_step_func=get_forward_step(run)
                )
            if ctx.is_last_stage:
                total += reduce_reported_loss(reports)
    for chunk in model:
        chunk.train()
    return get_mean_loss(reduce_loss_over_dp(total, ctx))


def evaluate_and_log(run: Any) -> list[float]:
    """Validation at ``--eval-interval`` and at the end of training, each set logged on its own
    line and metric (see the module docstring for what is read); returns the sets' losses
    (meaningful on the last stage)."""
    t, iteration = run.cfg.training, run.state.iteration
    sets = get_validation_sets(run.valid_ds)
    losses = []
    with params_synced(run.model):
        for _name, dataset in sets:
            if t.full_validation:
                whole = FullPassDataset(dataset, run.global_batch_size)
                losses.append(evaluate(run, whole, 0, whole.num_batches))
            else:
                eval_start = (-(-iteration // t.eval_interval) - 1) * t.eval_iters * run.global_batch_size
                losses.append(evaluate(run, dataset, eval_start, t.eval_iters))
    if run.ctx.is_logging_rank:
        for k, ((name, _), val) in enumerate(zip(sets, losses)):
            suffix = f"-{k}" if t.multiple_validation_sets else ""
            run.log(format_validation_line(iteration, val, suffix, name))
            values = {f"lm loss validation{suffix}": val}
            if run.cfg.logging.log_validation_ppl_to_tensorboard:
                values[f"lm loss validation{suffix} ppl"] = get_perplexity(val)
            run.writer.write(values, iteration)
    return losses
