"""The training loop: steps, logging, evaluation, checkpoints and exits, in one readable order.

After every step, in this order and nowhere else: count a non-finite step (its update was skipped
on every rank; stop after ``--max-nan-iterations`` in a row) -> count a spiky one (``spike.py``,
``--skip-spiky-loss-factor``) -> check the replicas' weights (``weight_hash.py``, every
``--check-weight-hash-across-dp-replicas-interval`` steps, and before the first) -> log (every ``--log-interval``
steps) -> evaluate (every ``--eval-interval``) -> agree on an exit (signal, time limit,
``--exit-interval``; every rank gets the same answer; with ``--async-save`` the same agreement
says whether every rank finished writing the save in flight, which is then published) -> save (on
``--save-interval``, at ``--train-iters`` and before an exit; never in a run of non-finite steps;
``--async-save`` starts a background save, except for the last one and before an exit; a save
whose weights are not finite on some rank is refused and stops the run, ``WeightsNotFinite``) ->
stop if exiting. At ``--train-iters`` (not at an earlier exit) a run whose length is not a multiple of
``--eval-interval`` is evaluated once more, as Megatron-LM evaluates at the end of training. An
iteration's loss is its global sum / global count (every micro-batch and DP rank); a log line
reports the mean of those over its iterations whose update was applied, and counts the skipped and
non-finite ones of its interval, as Megatron-LM's ``training_log`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.checkpoint.async_save import AsyncCheckpointSaver
from megatron_ext.checkpoint.directory import NonFiniteCheckpoint
from megatron_ext.checkpoint.exit_policy import EXIT_FLAGS, ExitDecider, describe_exit
from megatron_ext.checkpoint.parts import CheckpointMeta, TrainState
from megatron_ext.config import ConfigError, JobConfig
from megatron_ext.data.batch_schedule import get_train_iters as get_schedule_train_iters
from megatron_ext.data.prefetch import StepPrefetcher
from megatron_ext.data.step_data import StepDataBuilder
from megatron_ext.derived import ResolvedConfig
from megatron_ext.guards import StepWatchdog
from megatron_ext.layout_rules import check_steps_left
from megatron_ext.parallel import ParallelContext
from megatron_ext.restart import IterationRecord
from megatron_ext.straggler import StragglerDetector
from megatron_ext.training.checkpointing import (
    describe_non_finite_save,
    maybe_export_hf,
    save_checkpoint,
    start_async_checkpoint,
)
from megatron_ext.training.evaluation import evaluate_and_log, reduce_loss_over_dp, watched
from megatron_ext.training.loss import get_interval_loss, get_mean_loss
from megatron_ext.training.metrics import (
    IterationStats,
    MetricWriter,
    format_iteration_line,
    get_log_line_scalars,
    get_memory_report,
    get_memory_stats,
    get_peak_tflops,
    num_floating_point_operations,
)
from megatron_ext.training.optimizer import read_loss_scale
from megatron_ext.training.params_norm import calc_params_l2_norm
from megatron_ext.training.profiling import ManualGC, ProfilerWindow, StepTimers, format_timers
from megatron_ext.training.spike import SpikeGuard, check_spike, log_spike_summary
from megatron_ext.training.step import (
    StepResult,
    build_step_microbatches,
    first_step_without_param_sync,
    params_synced,
    train_step,
)
from megatron_ext.training.timeline import PipelineTimeline
from megatron_ext.training.weight_hash import WeightHashCheck, maybe_check_weight_hash


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite iterations: the run stops without saving."""


class WeightsNotFinite(TrainingDiverged):
    """A save found non-finite weights (an update from finite gradients overflowed them): it was
    refused on every rank, nothing was written or deleted, and the run stops."""


@dataclasses.dataclass
class TrainingRun:
    """Everything the loop needs, built by ``megatron_ext.run.build_training_run``."""

    cfg: JobConfig
    resolved: ResolvedConfig  # what the flags of cfg mean for this run (derived.resolve_config)
    ctx: ParallelContext
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    train_ds: Any
    valid_ds: Any
    global_batch_size: int
    writer: MetricWriter
    checkpoint_meta: CheckpointMeta
    exit_decider: ExitDecider
    # builds a step's micro-batches now, in this thread (evaluation; training without a prefetcher)
    step_data: StepDataBuilder
    state: TrainState = dataclasses.field(default_factory=TrainState)
    # each optimizer parameter group's flag-given settings as built (optim.record_flag_settings),
    # restored after a load under --override-opt-param-scheduler
    optimizer_flags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    log: Callable[[str], None] = functools.partial(print, flush=True)
    # One entry per logged iteration on the last stage: {"iteration", "loss", "grad_norm", "lr"}.
    records: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # --pp-timeline: records each step's forward/backward spans; None when off.
    timeline: PipelineTimeline | None = None
    # --step-timeout-minutes / --save-timeout-minutes: the watchdog and the progress it reports (None when off)
    watchdog: StepWatchdog | None = None
    # --timing-log-level or --log-straggler (None: times nothing), --profile on this rank, --manual-gc
    timers: StepTimers | None = None
    profiler: ProfilerWindow | None = None
    manual_gc: ManualGC | None = None
    # consecutive non-finite iterations so far, and where the first of them appeared
    nan_streak: int = 0
    nan_origin: str = ""
    # steps taken by this process (the first runs without the overlapped parameter all-gather)
    steps_this_run: int = 0
    # the memory report follows this process's first log line (a resumed run's too)
    memory_reported: bool = False
    # --async-save: the save in flight (None without the flag)
    async_saver: AsyncCheckpointSaver | None = None
    # the iteration of this process's last published save, whose weights every rank found finite
    weights_finite_at: int | None = None
    # builds the next step's data in the background (None with --no-data-prefetch)
    prefetcher: StepPrefetcher | None = None
    # under launch/torchrun.sh: the iteration each step starts, for its restart decisions (restart.py)
    iteration_record: IterationRecord | None = None
    # --log-straggler: gathers every rank's step timers at log steps and names slow ranks
    straggler: StragglerDetector | None = None
    # --skip-spiky-loss-factor (ours): the reference of the loss-spike guard (None when off)
    spike_guard: SpikeGuard | None = None
    # --check-weight-hash-across-dp-replicas-interval: the replicas' weight check (None when off)
    weight_hash: WeightHashCheck | None = None


@dataclasses.dataclass
class LogWindow:
    """What accumulates between two log lines. ``totals`` = [loss sum, valid-token count, real
    tokens, model FLOPs] of this rank's micro-batches, and ``iteration_losses`` each iteration's
    [loss sum, valid-token count]: summed over DP in the one all-reduce the logged loss needs."""

    totals: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(4, dtype=torch.float64))
    iteration_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [2] float64 each
    advanced: list[bool] = dataclasses.field(default_factory=list)  # each iteration's update was applied
    # each iteration's (iteration, learning rate, grad norm, zeros in grad or None), for --tensorboard-log-interval
    iteration_scalars: list[tuple[int, float, float | None, float | None]] = dataclasses.field(default_factory=list)
    # the first iterations' losses, already summed over DP and written (flush_iteration_scalars)
    reduced_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [2] float64 each
    skipped_iterations: int = 0  # of this interval (fp16 overflows), as Megatron-LM's log line counts them
    nan_iterations: int = 0  # of this interval
    seconds: float = 0.0
    iterations: int = 0
    real_tokens: int = 0  # this rank's, for the padding fraction
    slots: int = 0
    global_batch_size: int = 0  # of the last step (a batch schedule changes it)


def run_training_iteration(run: TrainingRun, window: LogWindow) -> tuple[StepResult, int]:
    """Fetch and pad the step's micro-batches, take one optimizer step, advance the state;
    returns the step's result and padded length."""
    state = run.state
    start = time.perf_counter()
    window.global_batch_size = batch = run.step_data.spec.get_global_batch_size(state.consumed_samples)
    if run.watchdog is None:
        microbatches, length, result = _take_step(run, None, batch)
    else:
        run.watchdog.step_started(state.iteration + 1)
        try:
            microbatches, length, result = _take_step(run, run.watchdog.progress, batch)
        finally:  # also when the step raised: left armed, it would report a stall of no running step
            run.watchdog.step_finished()
    window.seconds += time.perf_counter() - start
    window.iterations += 1
    real = sum(mb.num_real_tokens for mb in microbatches)
    flops = sum(
        num_floating_point_operations(
            run.cfg.model, run.checkpoint_meta.padded_vocab_size, mb.num_real_tokens, mb.attention_pairs
        )
        for mb in microbatches
    )
    window.real_tokens += real
    window.slots += sum(mb.num_slots for mb in microbatches)
    window.totals += torch.cat([result.loss_sum_count, torch.tensor([real, flops], dtype=torch.float64)])
    window.iteration_losses.append(result.loss_sum_count)
    window.advanced.append(result.update_successful)
    skipped = int(not result.update_successful and not result.non_finite)
    window.skipped_iterations += skipped
    window.nan_iterations += int(result.non_finite)
    state.iteration += 1
    state.consumed_samples += batch
    state.skipped_iterations += skipped
    window.iteration_scalars.append(
        (state.iteration, run.optimizer.param_groups[0]["lr"], result.grad_norm, result.num_zeros_in_grad)
    )
    return result, length


def _take_step(run: TrainingRun, progress: Any, global_batch_size: int) -> tuple[list, int, StepResult]:
    """The step's micro-batches (prefetched or built now; ``global_batch_size`` samples, the batch
    schedule's) and its optimizer step: what the step watchdog times."""
    state = run.state
    with run.timers.time("data") if run.timers else contextlib.nullcontext():
        if run.prefetcher is None:
            microbatches, length = build_step_microbatches(run, run.train_ds, state.consumed_samples)
        else:
            microbatches, length = run.prefetcher.take(state.consumed_samples)
            if (
                run.prefetcher.background and state.iteration + 1 < run.cfg.training.train_iters
            ):  # the next, while this one runs
                run.prefetcher.request(state.consumed_samples + global_batch_size)
    traced = run.timeline.trace_step(state.iteration + 1) if run.timeline else contextlib.nullcontext()
    computed = run.timers.trace_compute() if run.timers else contextlib.nullcontext()  # --log-straggler
    with traced, computed, first_step_without_param_sync(run.model, run.steps_this_run == 0):
        run.steps_this_run += 1
        result = train_step(
            run.model,
            run.optimizer,
            run.scheduler,
            microbatches,
            length,
            global_batch_size,
            run.ctx,
            run.cfg.training.check_for_nan_in_loss_and_grad,
            progress,
            run.timers,
            run.cfg.training.empty_unused_memory_level,
            agreement=lambda: run.exit_decider.start_agreement(get_save_flags(run)),
            spike_threshold=run.spike_guard.get_threshold() if run.spike_guard is not None else None,
        )
    if run.timers is not None:
        run.timers.steps += 1
    return microbatches, length, result


def locate_non_finite(run: TrainingRun, result: StepResult) -> str:
    """Where a non-finite step came from: the ranks whose own loss was not finite, each with its
    first such micro-batch (one all-gather, only in a non-finite step, which every rank sees)."""
    ctx = run.ctx
    mine = (ctx.rank, ctx.pp_rank, ctx.tp_rank, ctx.dp_rank, result.non_finite_microbatch)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    bad = [
        f"rank {r} (pipeline stage {pp}, tensor rank {tp}, data-parallel rank {dp}, micro-batch {mb})"
        for r, pp, tp, dp, mb in everyone
        if mb is not None
    ]
    if bad:
        return "the loss was not finite on " + ", ".join(bad)
    return (
        "the loss was finite everywhere but the gradients were not (a weight, an activation or the "
        "learning rate diverged)"
    )


def count_non_finite(run: TrainingRun, result: StepResult) -> None:
    """Count a skipped non-finite step; raise TrainingDiverged after --max-nan-iterations in a row."""
    t, state = run.cfg.training, run.state
    if not result.non_finite:
        run.nan_streak = 0
        return
    state.nan_iterations += 1
    run.nan_streak += 1
    if run.nan_streak == 1:
        run.nan_origin = f"iteration {state.iteration}: " + locate_non_finite(run, result)
    if run.ctx.is_logging_rank:
        run.log(
            f"WARNING: iteration {state.iteration}: loss or gradients not finite, update skipped on "
            f"every rank ({run.nan_streak} in a row; stop at --max-nan-iterations {t.max_nan_iterations})"
        )
    if run.nan_streak >= t.max_nan_iterations:
        raise TrainingDiverged(
            f"training diverged: {run.nan_streak} consecutive iterations up to {state.iteration} had a "
            f"non-finite loss or gradient (--max-nan-iterations {t.max_nan_iterations}); first at "
            f"{run.nan_origin}. Nothing was saved after the last finite step; lower --lr, check "
            f"--init-method-std and the data, or --no-check-for-nan-in-loss-and-grad to apply such updates"
        )


def log_progress(run: TrainingRun, window: LogWindow, result: StepResult, length: int) -> float:
    """The loss since the last log line (``get_interval_loss`` of each iteration's global token
    mean), logged and recorded; resets ``window``."""
    start = len(window.reduced_losses)  # iterations written before an evaluation (flush_iteration_scalars)
    reduced = reduce_loss_over_dp(torch.cat([window.totals, *window.iteration_losses[start:]]), run.ctx)
    totals = reduced[:4]
    rows = reduced[4:].view(-1, 2)
    loss = get_interval_loss(torch.cat([torch.stack(window.reduced_losses), rows]) if start else rows, window.advanced)
    if run.ctx.is_logging_rank:
        write_iteration_scalars(run, rows, window, start)
    if run.ctx.is_last_stage:
        run.records.append(
            {
                "iteration": run.state.iteration,
                "loss": loss,
                "grad_norm": result.grad_norm,
                "lr": run.optimizer.param_groups[0]["lr"],
            }
        )
    timers = run.timers.report() if run.timers is not None else {}
    # collective (every rank logs at the same steps): one all-gather of the ranks' timers
    straggler_lines = run.straggler.report(timers) if run.straggler is not None else []
    params_norm = None
    if run.cfg.logging.log_params_norm:  # collective too: an all-reduce over the model-parallel ranks
        with params_synced(run.model):
            params_norm = calc_params_l2_norm(run.model, run.ctx, run.cfg.training.bf16)
    if run.ctx.is_logging_rank:
        _log_iteration(run, loss, result, window, totals, length, params_norm)
        _log_timers_and_memory(run, timers)
        for line in straggler_lines:
            run.log(line)
    window.__init__()
    return loss


def flush_iteration_scalars(run: TrainingRun, window: LogWindow) -> None:
    """Write the window's per-iteration scalars not yet written (one DP all-reduce of their losses,
    on every rank), before something writes a later step: wandb ignores a step below one it has
    logged, so an evaluation between two log lines would otherwise drop the iterations before it."""
    start = len(window.reduced_losses)
    if start == len(window.iteration_losses):
        return
    rows = reduce_loss_over_dp(torch.cat(window.iteration_losses[start:]), run.ctx).view(-1, 2)
    window.reduced_losses.extend(rows)
    if run.ctx.is_logging_rank:
        write_iteration_scalars(run, rows, window, start)


def write_iteration_scalars(run: TrainingRun, per_iteration: torch.Tensor, window: LogWindow, start: int = 0) -> None:
    """TensorBoard/wandb scalars of each ``--tensorboard-log-interval``-th iteration of the window
    (Megatron-LM writes them as each iteration ends, after an all-reduce per iteration; here they
    come from the log line's one all-reduce): its lm loss (global token mean; none for a skipped
    update, as the log line leaves it out: Megatron-LM writes it), learning rate and grad norm."""
    every = run.cfg.logging.tensorboard_log_interval
    for (iteration, lr, grad_norm, num_zeros), row, applied in zip(
        window.iteration_scalars[start:], per_iteration, window.advanced[start:]
    ):
        if iteration % every:
            continue
        values = {"learning rate": lr}
        if applied and float(row[1]) > 0:
            values["lm loss"] = get_mean_loss(row)
        if grad_norm is not None:
            values["grad norm"] = grad_norm
        if num_zeros is not None:
            values["num zeros"] = num_zeros
        run.writer.write(values, iteration)


def _log_timers_and_memory(run: TrainingRun, timers: dict[str, float]) -> None:
    lg, iteration = run.cfg.logging, run.state.iteration
    if timers and lg.timing_log_level:  # (--log-straggler alone times the steps but prints its own lines)
        run.log(f"  timers (ms per iteration, this rank): {format_timers(timers)}")
        if lg.log_timers_to_tensorboard:
            run.writer.write({f"timers/{name}": ms for name, ms in timers.items()}, iteration)
    if lg.log_memory_to_tensorboard:
        run.writer.write({f"memory/{k}": v for k, v in get_memory_stats(run.ctx.device).items()}, iteration)


def should_save(cfg: JobConfig, iteration: int, exiting: bool) -> bool:
    """On ``--save-interval``, at ``--train-iters`` and before an exit, when ``--save`` is set."""
    c = cfg.checkpoint
    due = bool(c.save_interval) and iteration % c.save_interval == 0
    return bool(c.save) and (due or exiting or iteration == cfg.training.train_iters)


def train(run: TrainingRun) -> list[float]:
    """Train to ``--train-iters`` (or an agreed exit); returns the logged losses (global token
    means) on every rank of the last stage (empty elsewhere). A save refused for non-finite
    weights raises WeightsNotFinite on every rank."""
    try:
        return _train_to_the_end(run)
    except NonFiniteCheckpoint as err:
        raise WeightsNotFinite(describe_non_finite_save(run, err)) from None


def _train_to_the_end(run: TrainingRun) -> list[float]:
    """``train`` without the translation of a refused save."""
    cfg, state = run.cfg, run.state
    t = cfg.training
    history: list[float] = []
    window = LogWindow()
    maybe_recount_train_iters(run)
    if state.iteration >= t.train_iters and run.ctx.is_logging_rank:
        run.log(
            f"nothing to train: the run is at iteration {state.iteration} and --train-iters is {t.train_iters} "
            f"(raise --train-iters or --train-samples to train further)"
        )
    started = state.iteration
    if run.profiler is not None:
        warning = run.profiler.begin(state.iteration)
        if warning:
            run.log(warning)
    try:
        refuse_bad_steps_left(run)  # before any step, so before any save
        maybe_check_weight_hash(run, before_first_step=True)
        finished = True
        while state.iteration < t.train_iters:
            if not train_one(run, window, history):
                finished = state.iteration >= t.train_iters
                break
        if state.iteration > started:  # the loop's normal end: --train-iters or an agreed exit
            log_spike_summary(run)
        if (
            finished
            and state.iteration > started
            and t.eval_interval
            and state.iteration % t.eval_interval
            and run.valid_ds is not None
        ):
            evaluate_and_log(run)  # the end of training, as Megatron-LM evaluates it
        if run.async_saver is not None:
            with watched(run, "save"):
                finish_async_save(run)
        with params_synced(run.model):
            pass  # --overlap-param-gather: the model leaves with the last update's parameters
        if run.prefetcher is not None:
            run.prefetcher.close()  # an agreed exit: every rank requested the same next step
    except (TrainingDiverged, NonFiniteCheckpoint):
        finish_async_save(run)  # every rank raised it after the same step: the earlier save is good
        if run.prefetcher is not None:
            run.prefetcher.close()
        raise
    except BaseException:
        if run.prefetcher is not None:
            run.prefetcher.close(wait=False)  # maybe this rank alone: never wait on a collective
        # maybe this rank alone: no collective; the save in flight is never published
        abandoned = run.async_saver.abandon() if run.async_saver is not None else None
        if abandoned is not None:
            run.log(
                f"WARNING rank {run.ctx.rank}: the asynchronous save of iteration {abandoned} was in flight "
                f"and is abandoned; the last complete checkpoint stays the newest"
            )
        raise
    finally:
        for tool in (run.profiler, run.manual_gc, run.straggler):
            if tool is not None:
                tool.close()
    return history


def maybe_recount_train_iters(run: TrainingRun) -> None:
    """A resumed --train-samples run under --decrease-batch-size-if-needed: its steps counted again
    from the loaded consumed samples (``batch_schedule.get_train_iters``), since the steps before the
    save may have run another batch (another data-parallel size) than the count from sample 0
    assumed. On the layout the checkpoint was saved on, the count is unchanged."""
    t, state, schedule = run.cfg.training, run.state, run.resolved.batch_schedule
    if t.train_samples is None or not schedule.decreases or state.iteration == 0:
        return
    t.train_iters = state.iteration + get_schedule_train_iters(schedule, t.train_samples, state.consumed_samples)


def refuse_bad_steps_left(run: TrainingRun) -> None:
    """ConfigError when a step still to come takes a global batch (of --rampup-batch-size or
    --step-batch-size-schedule) that this layout's batch rules refuse, counted from the consumed
    samples the run starts at: a resumed run's (``validation`` skips the steps then, as the ramp it
    trained past may not divide on a new data-parallel size); a new run's steps were validated from
    step 0 already. Every rank loaded the same consumed samples, so every rank raises alike: one
    error, no collective left waiting, nothing written."""
    t, state = run.cfg.training, run.state
    problems = check_steps_left(
        run.cfg,
        run.ctx.world_size,
        run.resolved.batch_schedule,
        state.consumed_samples,
        t.train_iters - state.iteration,
    )
    if problems:
        raise ConfigError(problems)


def finish_async_save(run: TrainingRun) -> None:
    """Wait for the asynchronous save in flight, if any, and publish it (collective)."""
    published = run.async_saver.finish() if run.async_saver is not None else None
    if published is not None:
        run.weights_finite_at = published.iteration
        if run.ctx.is_logging_rank:
            run.log(published.describe())


def get_save_flags(run: TrainingRun) -> int | None:
    """This rank's asynchronous-save bits for the exit agreement while a save is in flight, else None."""
    saver = run.async_saver
    return saver.local_flags() if saver and saver.in_flight else None


def train_one(run: TrainingRun, window: LogWindow, history: list[float]) -> bool:
    """One iteration and what follows it, in the module docstring's order; False to stop."""
    cfg, state, t = run.cfg, run.state, run.cfg.training
    if run.iteration_record is not None:
        run.iteration_record.record(state.iteration + 1)
    result, length = run_training_iteration(run, window)
    for tool in (run.profiler, run.manual_gc):
        if tool is not None:
            tool.after_step(state.iteration)
    count_non_finite(run, result)
    check_spike(run, result)
    maybe_check_weight_hash(run)  # after the optimizer step, before the log, evaluation and save
    if state.iteration % cfg.logging.log_interval == 0 or state.iteration == t.train_iters:
        loss = log_progress(run, window, result, length)
        if run.ctx.is_last_stage:
            history.append(loss)
    if t.eval_interval and state.iteration % t.eval_interval == 0 and run.valid_ds is not None:
        flush_iteration_scalars(run, window)  # steps before the validation loss's, for wandb
        evaluate_and_log(run)
    saver = run.async_saver
    agreed = run.exit_decider.decide(state.iteration, get_save_flags(run), agreed_bits=result.agreed_bits)
    exit_flags = agreed & EXIT_FLAGS
    if exit_flags:  # agreed by every rank; the resumed run starts after this iteration
        flush_iteration_scalars(run, window)
    if saver is not None:
        with watched(run, "save"):  # publishing the save in flight, when every rank finished writing
            published = saver.finish_if_agreed(agreed)
        if published is not None:
            run.weights_finite_at = published.iteration
            if run.ctx.is_logging_rank:
                run.log(published.describe(after_iteration=state.iteration))
    if should_save(cfg, state.iteration, bool(exit_flags)) and run.nan_streak == 0:
        with watched(run, "save"), params_synced(run.model):
            if saver is not None and not exit_flags and state.iteration < t.train_iters:
                finish_async_save(run)
                start_async_checkpoint(run, cfg.checkpoint.save, cfg.checkpoint.keep_last)
            else:
                finish_async_save(run)
                save_checkpoint(run, cfg.checkpoint.save, cfg.checkpoint.keep_last)
                run.weights_finite_at = state.iteration
            maybe_export_hf(run, last=bool(exit_flags) or state.iteration >= t.train_iters)
    if exit_flags and run.ctx.is_logging_rank:
        run.log(f"exiting after iteration {state.iteration}: {describe_exit(exit_flags)}")
    return not exit_flags


def _log_iteration(
    run: TrainingRun,
    loss: float,
    result: StepResult,
    window: LogWindow,
    totals: torch.Tensor,
    seq_length: int,
    params_norm: float | None = None,
) -> None:
    cfg, state, ctx = run.cfg, run.state, run.ctx
    lr = run.optimizer.param_groups[0]["lr"]
    seconds = max(window.seconds, 1e-9)
    tflops = float(totals[3]) / seconds / ctx.world_size / 1e12
    peak = get_peak_tflops(torch.cuda.get_device_name(ctx.device)) if ctx.device.type == "cuda" else None
    stats = IterationStats(
        iteration=state.iteration,
        train_iters=cfg.training.train_iters,
        consumed_samples=state.consumed_samples,
        ms_per_iteration=seconds / window.iterations * 1000.0,
        tokens_per_second=float(totals[2]) / seconds,  # real tokens of the whole job, no padding
        learning_rate=lr,
        global_batch_size=window.global_batch_size,
        lm_loss=loss,
        grad_norm=result.grad_norm,
        num_zeros_in_grad=result.num_zeros_in_grad,
        params_norm=params_norm,
        skipped_iterations=window.skipped_iterations,
        nan_iterations=window.nan_iterations,
        seq_length=seq_length,
        padding_fraction=1.0 - window.real_tokens / max(window.slots, 1),
        tflops_per_gpu=tflops,
        mfu=tflops / peak if peak else None,
    )
    run.log(format_iteration_line(stats))
    # (lm loss, learning rate and grad norm per iteration: write_iteration_scalars)
    lg = cfg.logging  # loss scale: after this iteration's step
    # (a device read: only where a writer takes it, not on every log line of a run without TensorBoard)
    loss_scale = read_loss_scale(run.optimizer) if lg.log_loss_scale_to_tensorboard and run.writer.active else None
    world_size = ctx.world_size if lg.log_world_size_to_tensorboard else None
    run.writer.write(get_log_line_scalars(stats, loss_scale, world_size), state.iteration)
    if not run.memory_reported:  # this process's first log line: memory after its first steps
        run.memory_reported = True
        run.log(f"> memory after iteration {state.iteration}: {get_memory_report(ctx.device)}")
