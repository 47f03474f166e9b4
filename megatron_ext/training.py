"""One training step on megatron-core's schedules, evaluation, and the training loop.

A step: zero the DDP grad buffers -> ``get_forward_backward_func()`` over the step's m
micro-batches (interleaved 1F1B with VPP, 1F1B with PP, none without) -> megatron-core's
``finalize_model_grads`` (DP reduce, tied-embedding sync, token-count scaling) -> optimizer step
(clipping inside) -> LR schedule. The loss is reported as global sum / global count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ext.batches import Microbatch, build_chunk_iterators, fetch_step_samples, get_microbatch_indices
from megatron_ext.config import JobConfig, get_sequence_padding
from megatron_ext.padding import build_step_microbatches
from megatron_ext.logger import IterationStats, MetricWriter, format_iteration_line, format_validation_line
from megatron_ext.loss import compute_token_loss, get_mean_loss, get_valid_mask, reduce_reported_loss
from megatron_ext.parallel import ParallelContext
from megatron_ext.platform import get_collective_device


@dataclasses.dataclass
class TrainState:
    """What a resume needs besides weights and optimizer state."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0


@dataclasses.dataclass
class StepResult:
    loss_sum_count: torch.Tensor  # [2] float64, this rank's [sum, count] (zeros off the last stage)
    grad_norm: float | None
    update_successful: bool


def _loss_func(valid: torch.Tensor, output_tensor: torch.Tensor):
    return compute_token_loss(output_tensor, valid).to_megatron()


def get_packed_seq_params(mb: Microbatch):
    """megatron-core PackedSeqParams (THD) of a packed micro-batch, else None."""
    if "cu_seqlens" not in mb:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb["cu_seqlens"].to(device=mb["tokens"].device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        max_seqlen_q=mb["max_seqlen"], max_seqlen_kv=mb["max_seqlen"],
    )


def forward_step(data_iterator, model):
    """megatron-core forward_step_func: one micro-batch through one model chunk.

    Every virtual stage has its own iterator over the step's micro-batches, so a packed
    micro-batch's boundaries reach every stage with it (never through the P2P activations).
    """
    mb: Microbatch = next(data_iterator)
    labels = mb["labels"]
    output = model(
        input_ids=mb["tokens"],
        position_ids=mb["position_ids"],
        attention_mask=None,
        labels=labels.clamp(min=0),  # ignored positions are masked out of the loss
        packed_seq_params=get_packed_seq_params(mb),
    )
    return output, functools.partial(_loss_func, get_valid_mask(labels, mb.get("loss_mask")))


def configure_model_hooks(model: list[torch.nn.Module], optimizer: Any) -> None:
    """Wire megatron-core's per-step hooks into the (shared) TransformerConfig."""
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync if len(model) > 1 else no_sync[0]


def run_forward_backward(
    model: list[torch.nn.Module], microbatches: list[Microbatch], seq_length: int,
    forward_only: bool = False, forward_step_func: Callable = forward_step,
) -> list[dict[str, torch.Tensor]]:
    """The schedule over the step's micro-batches; returns the last stage's loss reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
    iterators = build_chunk_iterators(microbatches, len(model))
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )


def train_step(
    model: list[torch.nn.Module], optimizer: Any, scheduler: Any, microbatches: list[Microbatch],
    seq_length: int, global_batch_size: int, ctx: ParallelContext,
) -> StepResult:
    optimizer.zero_grad()
    reports = run_forward_backward(model, microbatches, seq_length)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=global_batch_size)
    local = reduce_reported_loss(reports) if ctx.is_last_stage else torch.zeros(2, dtype=torch.float64)
    return StepResult(local, grad_norm, bool(update_successful))


def reduce_loss_over_dp(local: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Global [sum, count] on the last stage (one all-reduce over its DP group)."""
    if not (ctx.is_last_stage and ctx.dp_size > 1):
        return local.clone()
    total = local.to(get_collective_device(ctx.dp_group))
    dist.all_reduce(total, group=ctx.dp_group)
    return total.cpu()


def get_step_microbatches(run: "TrainingRun", dataset: Any, first_sample: int) -> tuple[list[Microbatch], int]:
    """Fetch this rank's micro-batches of the step starting at ``first_sample`` and pad them
    (``--sequence-padding``); returns them and the schedule's seq_length."""
    cfg, ctx = run.cfg, run.ctx
    indices = get_microbatch_indices(
        first_sample, run.global_batch_size, cfg.training.micro_batch_size, ctx.dp_rank, ctx.dp_size
    )
    microbatches, length = build_step_microbatches(
        fetch_step_samples(dataset, indices), get_sequence_padding(cfg), ctx.mp_group,
        cfg.data.pad_to_multiple_of, cfg.model.seq_length, run.pad_id,
    )
    return [move_to_device(mb, ctx.device) for mb in microbatches], length


def move_to_device(mb: Microbatch, device: torch.device) -> Microbatch:
    """Tensors to the training device (a no-op on the CPU); boundaries stay int32."""
    if device.type == "cpu":
        return mb
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def evaluate(run: "TrainingRun", start_sample: int) -> float:
    """Token-mean validation loss over ``--eval-iters`` global batches."""
    cfg, ctx, model = run.cfg, run.ctx, run.model
    for chunk in model:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(cfg.training.eval_iters):
            microbatches, length = get_step_microbatches(run, run.valid_ds, start_sample + i * run.global_batch_size)
            reports = run_forward_backward(model, microbatches, length, forward_only=True)
            if ctx.is_last_stage:
                total += reduce_reported_loss(reports)
    for chunk in model:
        chunk.train()
    return get_mean_loss(reduce_loss_over_dp(total, ctx))


@dataclasses.dataclass
class TrainingRun:
    """Everything the loop needs, built by the entry point."""

    cfg: JobConfig
    ctx: ParallelContext
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    train_ds: Any
    valid_ds: Any
    global_batch_size: int
    writer: MetricWriter
    pad_id: int = 0
    state: TrainState = dataclasses.field(default_factory=TrainState)
    log: Callable[[str], None] = functools.partial(print, flush=True)
    # One entry per logged iteration on the last stage: {"iteration", "loss", "grad_norm", "lr"}.
    records: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # Called after every step (after logging and evaluation), in order; the loop stops after the
    # step when any returns True (checkpoint-and-exit). Every rank must return the same answer.
    after_step: list[Callable[["TrainingRun"], bool]] = dataclasses.field(default_factory=list)
    # Wraps each step's schedule call (e.g. a pipeline timeline tracer); identity by default.
    schedule_context: Callable[[int], Any] = lambda iteration: contextlib.nullcontext()


def train(run: TrainingRun) -> list[float]:
    """Train to ``--train-iters``; returns the logged losses (global token means) on every rank
    of the last stage (empty elsewhere)."""
    cfg, ctx, state = run.cfg, run.ctx, run.state
    t = cfg.training
    history: list[float] = []
    acc = torch.zeros(2, dtype=torch.float64)
    acc_time, acc_iters, acc_real, acc_slots = 0.0, 0, 0, 0
    while state.iteration < t.train_iters:
        start = time.perf_counter()
        microbatches, length = get_step_microbatches(run, run.train_ds, state.consumed_samples)
        with run.schedule_context(state.iteration + 1):
            result = train_step(
                run.model, run.optimizer, run.scheduler, microbatches, length,
                run.global_batch_size, ctx,
            )
        acc_time += time.perf_counter() - start
        acc_iters += 1
        acc_real += sum(mb["num_real_tokens"] for mb in microbatches)
        acc_slots += sum(mb["tokens"].numel() for mb in microbatches)
        state.iteration += 1
        state.consumed_samples += run.global_batch_size
        state.skipped_iterations += int(not result.update_successful)
        acc += result.loss_sum_count
        if state.iteration % cfg.logging.log_interval == 0 or state.iteration == t.train_iters:
            loss = get_mean_loss(reduce_loss_over_dp(acc, ctx))
            if ctx.is_last_stage:
                history.append(loss)
                run.records.append({
                    "iteration": state.iteration, "loss": loss, "grad_norm": result.grad_norm,
                    "lr": run.optimizer.param_groups[0]["lr"],
                })
            _log_iteration(run, loss, result, acc_time / acc_iters, length, 1.0 - acc_real / max(acc_slots, 1))
            acc.zero_()
            acc_time, acc_iters, acc_real, acc_slots = 0.0, 0, 0, 0
        if t.eval_interval and state.iteration % t.eval_interval == 0 and run.valid_ds is not None:
            eval_start = (state.iteration // t.eval_interval - 1) * t.eval_iters * run.global_batch_size
            val = evaluate(run, eval_start)
            if ctx.is_logging_rank:
                run.log(format_validation_line(state.iteration, val))
                run.writer.write({"lm loss validation": val}, state.iteration)
        stop = [hook(run) for hook in run.after_step]
        if any(stop):
            break
    return history


def _log_iteration(
    run: TrainingRun, loss: float, result: StepResult, seconds: float, seq_length: int, padding: float
) -> None:
    if not run.ctx.is_logging_rank:
        return
    cfg, state = run.cfg, run.state
    lr = run.optimizer.param_groups[0]["lr"]
    stats = IterationStats(
        iteration=state.iteration,
        train_iters=cfg.training.train_iters,
        consumed_samples=state.consumed_samples,
        ms_per_iteration=seconds * 1000.0,
        # slots (padded tokens) per second; the padding fraction says how many were real
        tokens_per_second=run.global_batch_size * seq_length / max(seconds, 1e-9),
        learning_rate=lr,
        global_batch_size=run.global_batch_size,
        lm_loss=loss,
        grad_norm=result.grad_norm,
        skipped_iterations=state.skipped_iterations,
        nan_iterations=state.nan_iterations,
        seq_length=seq_length,
        padding_fraction=padding,
    )
    run.log(format_iteration_line(stats))
    run.writer.write(
        {"lm loss": loss, "learning rate": lr, "grad norm": result.grad_norm or 0.0,
         "tokens/s": stats.tokens_per_second},
        state.iteration,
    )
