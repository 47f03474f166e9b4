"""Assembling a training run: the one place where every part is built, in order.

``build_training_run(cfg)`` is what ``pretrain_gpt.py``, the tests (``megatron_ext.testing``) and
the benchmarks call: process groups -> run length, tokenizer and the resolved config (padded
vocabulary, dtype, ...) -> model chunks (our layout-independent init) -> megatron-core DDP ->
optimizer and LR schedule -> megatron-core's per-step hooks -> datasets -> the step-data builder
and its prefetcher -> the ``TrainingRun`` the loop consumes. Everything after the process groups
receives them through the ``ParallelContext``; nothing reads megatron-core's globals; every
derived value comes from the one ``ResolvedConfig`` (``derived.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.checkpoint.async_save import AsyncCheckpointSaver
from megatron_ext.checkpoint.exit_policy import ExitDecider, build_exit_decider
from megatron_ext.checkpoint.megatron_lm import check_padded_vocab
from megatron_ext.checkpoint.optimizer_state import apply_optimizer_state_offset_fix
from megatron_ext.checkpoint.parts import CheckpointMeta
from megatron_ext.config import ConfigError, DataConfig, JobConfig, ParallelConfig, TrainingConfig
from megatron_ext.context_parallel.attention import describe_context_parallel_attention
from megatron_ext.cpu_platform import select_device
from megatron_ext.data.builder import build_train_valid_datasets
from megatron_ext.data.context_split import build_context_split
from megatron_ext.data.prefetch import StepPrefetcher, build_data_group
from megatron_ext.data.step_data import StepDataBuilder, StepDataSpec
from megatron_ext.data.tokenizers import build_tokenizer, get_tokenizer_args
from megatron_ext.derived import (
    ResolvedConfig,
    describe_batch_decrease,
    get_kv_channels,
    resolve_config,
    resolve_train_iters,
)
from megatron_ext.guards import StepProgress, StepWatchdog
from megatron_ext.heartbeat import build_heartbeat_board, get_heartbeat_interval
from megatron_ext.model.attention import describe_attention_kernels
from megatron_ext.model.compile import apply_torch_compile, install_lean_linears, mark_static_shapes
from megatron_ext.model.gpt import apply_mixed_precision, build_model_chunks, use_transformer_engine, wrap_with_ddp
from megatron_ext.model.wgrad_deferral import apply_weight_grad_deferral
from megatron_ext.optim import record_flag_settings
from megatron_ext.parallel import ParallelContext, build_parallel_context, ensure_rng_tracker
from megatron_ext.pipeline.names import splits_backward
from megatron_ext.pipeline.runtime import ScheduleRuntime, attach_schedule_runtime
from megatron_ext.pipeline.wgrad_queue import WeightGradQueue
from megatron_ext.straggler import StragglerDetector
from megatron_ext.training.grad_norm import maybe_apply_unit_grad_norm
from megatron_ext.training.loop import TrainingRun
from megatron_ext.training.metrics import MetricWriter
from megatron_ext.training.optimizer import build_optimizer, build_scheduler, get_schedule_lr_range
from megatron_ext.training.profiling import CudaProfilerRange, ManualGC, ProfilerWindow, StepTimers
from megatron_ext.training.spike import build_spike_guard
from megatron_ext.training.step import configure_model_hooks
from megatron_ext.training.timeline import build_pp_timeline
from megatron_ext.training.weight_hash import build_weight_hash_check


def build_training_run(
    cfg: JobConfig,
    *,
    device: torch.device | None = None,
    tokenizer: Any = None,
    data: tuple[Any, Any] | None = None,
    exit_decider: ExitDecider | None = None,
    log: Callable[[str], None] | None = None,
    metrics: bool = True,
    ctx: ParallelContext | None = None,
    padded_vocab: tuple[int, str] | None = None,
) -> TrainingRun:
    """Build everything a run needs on this rank; collective (the process group must exist).

    ``data`` = (train, valid) datasets replaces the ones the data flags describe (tests pass
    synthetic ones); ``exit_decider`` is built from the flags unless given (the entry point builds
    it first thing, so a SIGTERM during start-up counts); ``metrics=False`` writes no TensorBoard
    or wandb scalars; ``ctx`` reuses process groups built before (two runs side by side in one
    process, as a benchmark compares them); ``padded_vocab`` = (rows, origin): the vocabulary of the
    checkpoint the run loads, when it is not this run's padding (``LoadPlan.padded_vocab``).
    """
    device = device or select_device(cfg.parallel.device)
    log = log or functools.partial(print, flush=True)
    if ctx is None:
        ctx = build_parallel_context(cfg, device)
    else:
        ensure_rng_tracker(cfg)
    resolve_train_iters(cfg, ctx.world_size)
    if tokenizer is None:
        tokenizer = build_tokenizer(**get_tokenizer_args(cfg.data))
    resolved = resolve_run_config(cfg, ctx, tokenizer.vocab_size, padded_vocab)
    global_batch_size = resolved.global_batch_size
    decrease = describe_batch_decrease(cfg, ctx.world_size)
    if decrease is not None and ctx.is_logging_rank:
        log(decrease)

    model, optimizer = build_model_and_optimizer(cfg, resolved, ctx, device)
    scheduler = build_scheduler(cfg, optimizer, global_batch_size)
    lg = cfg.logging
    timers = build_step_timers(lg, model, device)
    if data is None:
        data = build_train_valid_datasets(  # sized by the flags' batches: the same on any data-parallel size
            cfg,
            tokenizer,
            resolved.batch_schedule.global_batch_size,
            log if ctx.is_logging_rank else None,
            resolved.batch_schedule,
        )

    step_data = StepDataBuilder(build_step_data_spec(cfg, resolved, ctx, tokenizer), ctx.device, ctx.data_group)

    return TrainingRun(
        cfg=cfg,
        resolved=resolved,
        ctx=ctx,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        optimizer_flags=record_flag_settings(optimizer),
        train_ds=data[0],
        valid_ds=data[1],
        global_batch_size=global_batch_size,
        writer=MetricWriter(cfg, enabled=metrics and ctx.is_logging_rank),
        checkpoint_meta=CheckpointMeta(
            tokenizer=tokenizer.identity(),
            padded_vocab_size=resolved.padded_vocab_size,
            padded_vocab_from=padded_vocab[1] if padded_vocab else None,
        ),
        exit_decider=exit_decider or build_exit_decider(cfg),
        step_data=step_data,
        log=log,
        timeline=build_pp_timeline(cfg.logging.pp_timeline, ctx, resolved.pipeline_schedule)
        if cfg.logging.pp_timeline
        else None,
        watchdog=build_step_watchdog(cfg, ctx),
        timers=timers,
        straggler=StragglerDetector(ctx, lg.straggler_threshold, lg.straggler_minmax_count, timers)
        if lg.log_straggler
        else None,
        profiler=build_profiler(cfg, ctx),
        manual_gc=ManualGC(cfg.logging.manual_gc_interval) if cfg.logging.manual_gc else None,
        async_saver=AsyncCheckpointSaver() if cfg.checkpoint.async_save else None,
        prefetcher=build_prefetcher(cfg.data, ctx, step_data, data[0]),
        spike_guard=build_spike_guard(cfg.training),
        weight_hash=build_weight_hash_check(cfg.training),
    )


def resolve_run_config(
    cfg: JobConfig, ctx: ParallelContext, vocab_size: int, padded_vocab: tuple[int, str] | None
) -> ResolvedConfig:
    """``resolve_config`` for this world and tokenizer, with the padded vocabulary of the checkpoint
    the run loads when it is not this run's (Megatron-LM pads by the multiple x its TP)."""
    resolved = resolve_config(cfg, ctx.world_size, vocab_size)
    if padded_vocab is None:
        return resolved
    problem = check_padded_vocab(padded_vocab[0], vocab_size, ctx.tp_size)
    if problem:
        raise ConfigError([f"--load: {problem}"])
    return dataclasses.replace(resolved, padded_vocab_size=padded_vocab[0])


def build_model_and_optimizer(
    cfg: JobConfig, resolved: ResolvedConfig, ctx: ParallelContext, device: torch.device
) -> tuple[list[torch.nn.Module], Any]:
    """This rank's model chunks (mixed precision, compiled or lean linears, the schedule's runtime,
    DDP) and their optimizer, hooks joined."""
    chunks = apply_mixed_precision(cfg.training, build_model_chunks(cfg, resolved, ctx.placement, device))
    prepare_layers(cfg.training, resolved, chunks)  # compiled or lean linears: before the W deferral and DDP
    # before DDP: deferred W's move DDP's hooks
    runtime = build_schedule_runtime(cfg.parallel, resolved, ctx, chunks)
    model = wrap_with_ddp(cfg.parallel, chunks, cfg.training.gradient_accumulation_fusion)
    attach_schedule_runtime(model, runtime)
    if cfg.parallel.use_distributed_optimizer:
        for chunk in model:
            apply_optimizer_state_offset_fix(chunk)
    optimizer = build_optimizer(cfg, model, device)
    maybe_apply_unit_grad_norm(optimizer, model, ctx.pp_size, ctx.tp_rank)  # the norm whatever the placement
    configure_model_hooks(model, optimizer)
    return model, optimizer


def prepare_layers(t: TrainingConfig, resolved: ResolvedConfig, chunks: list[torch.nn.Module]) -> None:
    """The transformer layers' linears, in place, after mixed precision: --torch-compile compiles each
    layer whole (our traceable linear); else, at TP 1, the lean eager linears (fewer Python calls,
    megatron-core's numbers), except under a zero-bubble schedule, whose W deferral
    (``model/wgrad_deferral.py``) owns the linears' backward (--torch-compile with one is refused by
    ``validation``; ``apply_weight_grad_deferral`` refuses a linear that is ours)."""
    if t.torch_compile:  # in place, after mixed precision, before DDP (model/compile.py)
        apply_torch_compile(chunks, cpp_wrapper=t.torch_compile_cpp_wrapper)
        return
    if not (resolved.uses_our_runtime and splits_backward(resolved.pipeline_schedule)):
        install_lean_linears(chunks)
    if t.cuda_graph_impl == "local":  # captured layers replay one shape: fixed boundaries and lengths
        mark_static_shapes(chunks, resolved.cuda_graph_max_documents)


def build_step_timers(lg: Any, model: list[torch.nn.Module], device: torch.device) -> StepTimers | None:
    """--timing-log-level's timers (None when nothing is timed); --log-straggler needs the level-1 timers
    (and times compute), whatever the log line shows. Level 2 times megatron-core's finalize hook, inside
    the schedule."""
    if not (lg.timing_log_level or lg.log_straggler):
        return None
    timers = StepTimers(max(lg.timing_log_level, int(lg.log_straggler)), device, compute=lg.log_straggler)
    if timers.enabled("grad-reduce") or timers.compute:  # --log-straggler: the phase, timed or not
        model[0].config.finalize_model_grads_func = timers.wrap(
            "grad-reduce", model[0].config.finalize_model_grads_func
        )
    return timers


def build_step_data_spec(
    cfg: JobConfig, resolved: ResolvedConfig, ctx: ParallelContext, tokenizer: Any
) -> StepDataSpec:
    """How this rank's micro-batches of a step are made: its DP slice of the global batch, padded
    as --sequence-padding says with the tokenizer's pad id, token ids checked below its vocabulary."""
    return StepDataSpec(
        global_batch_size=resolved.global_batch_size,
        micro_batch_size=cfg.training.micro_batch_size,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        sequence_padding=resolved.sequence_padding,
        pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        max_microbatch_length=resolved.max_microbatch_length,
        pad_id=tokenizer.pad,
        vocab_size=tokenizer.vocab_size,
        pad_length_bucket=cfg.data.pad_length_bucket,
        batch_schedule=None if resolved.batch_schedule.is_constant else resolved.batch_schedule,
        context_split=build_context_split(cfg.data, ctx.cp_size, ctx.cp_rank),
    )


def build_schedule_runtime(
    p: ParallelConfig, resolved: ResolvedConfig, ctx: ParallelContext, chunks: list[torch.nn.Module]
) -> ScheduleRuntime | None:
    """--pipeline-schedule naming one of ours: this rank's W queue, handed to the chunks' linears
    (``model/wgrad_deferral.py``; zero-bubble schedules only) and to the runtime that runs the
    schedule's action lists (``pipeline/runtime.py``). None: megatron-core's schedules run."""
    if not resolved.uses_our_runtime:
        return None
    name = resolved.pipeline_schedule
    queue = WeightGradQueue()
    if splits_backward(name):
        apply_weight_grad_deferral(chunks, queue)
    divisor = ctx.tp_size if p.sequence_parallel else 1  # [s/c/tp, b, h] on the wire
    return ScheduleRuntime(name, ctx.pp_group, ctx.pp_rank, ctx.pp_size, ctx.vp_size or 1, queue, divisor, ctx.cp_size)


def build_prefetcher(
    d: DataConfig, ctx: ParallelContext, step_data: StepDataBuilder, train_ds: Any
) -> StepPrefetcher | None:
    """The background runner of ``step_data`` for the next training step (--no-data-prefetch: none,
    unless --num-workers asks for worker processes). Collective (its gloo group)."""
    if not (d.data_prefetch or d.num_workers):
        return None
    negotiates = step_data.spec.sequence_padding == "negotiated"  # only negotiated padding has a collective
    group = build_data_group(ctx) if negotiates else None
    return StepPrefetcher(step_data.with_group(group), train_ds, d.num_workers, background=d.data_prefetch)


def build_profiler(cfg: JobConfig, ctx: ParallelContext) -> ProfilerWindow | None:
    """--profile --use-pytorch-profiler on the --profile-ranks (CUDA profiler ranges otherwise)."""
    lg = cfg.logging
    if not lg.profile or ctx.rank not in {int(r) for r in lg.profile_ranks}:
        return None
    if lg.use_pytorch_profiler:
        return ProfilerWindow(lg.profile_step_start, lg.profile_step_end, lg.tensorboard_dir, ctx.device)
    return CudaProfilerRange(lg.profile_step_start, lg.profile_step_end)


def build_step_watchdog(
    cfg: JobConfig, ctx: ParallelContext, *, heartbeat_interval_s: float | None = None, **watchdog_kwargs: Any
) -> StepWatchdog | None:
    """The stall watchdog of --step-timeout-minutes and --save-timeout-minutes (None when both are
    off), with this rank's heartbeat on the job's store when a process group exists (collective in
    effect: every rank publishes, and reads everyone's in a report). ``heartbeat_interval_s``
    replaces the default publication interval (tests, benchmarks); ``watchdog_kwargs`` go to
    ``StepWatchdog`` (``on_timeout``, ``out``)."""
    p = cfg.parallel
    step_s = p.step_timeout_minutes * 60.0 if p.step_timeout_minutes else None
    save_s = p.save_timeout_minutes * 60.0 if p.save_timeout_minutes else None
    if not (step_s or save_s):
        return None
    host = os.uname().nodename
    where = f"rank {ctx.rank} ({ctx.describe_place()}, host {host})"
    progress = StepProgress()
    heartbeats = None
    if dist.is_initialized():
        identity = dict(
            rank=ctx.rank, host=host, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size, tp_rank=ctx.tp_rank, dp_rank=ctx.dp_rank
        )
        if ctx.cp_size > 1:  # (a heartbeat without them is a run without CP)
            identity.update(cp_rank=ctx.cp_rank, cp_size=ctx.cp_size)
        interval = heartbeat_interval_s or get_heartbeat_interval([s for s in (step_s, save_s) if s])
        try:
            heartbeats = build_heartbeat_board(progress, identity, ctx.world_size, interval)
        except Exception as err:  # noqa: BLE001 - the watchdog still ends a stall, naming this rank only
            print(
                f"WARNING rank {ctx.rank}: the stall watchdog cannot reach the job's store ({err!r}): its reports "
                f"will say where this rank is, not which rank stopped",
                file=sys.stderr,
                flush=True,
            )
    return StepWatchdog(
        step_s, lambda: where, progress, save_timeout_s=save_s, heartbeats=heartbeats, **watchdog_kwargs
    )


def describe_schedule(run: TrainingRun, label: str = "schedule") -> str:
    """Run length and LR schedule in steps and samples (megatron-core counts samples), as the
    scheduler holds it (after a load with --use-checkpoint-opt-param-scheduler: the checkpoint's), with
    the learning rates it gives parameter group 0 (``get_schedule_lr_range``)."""
    t, sch, gbs = run.cfg.training, run.scheduler, run.global_batch_size
    per_step = f"x {gbs} samples"
    if t.rampup_batch_size:
        per_step = f"of --rampup-batch-size {' '.join(t.rampup_batch_size)} (up to {gbs} samples)"
    if t.step_batch_size_schedule is not None:
        per_step = f'of --step-batch-size-schedule "{t.step_batch_size_schedule}" samples'
    length = f"{t.train_iters} steps {per_step}" + (f" (--train-samples {t.train_samples})" if t.train_samples else "")
    style = getattr(sch, "lr_decay_style", t.lr_decay_style)
    wsd = (
        f", WSD {getattr(sch, 'lr_wsd_decay_style', t.lr_wsd_decay_style)} decay over the last "
        f"{sch.wsd_decay_steps} samples"
        if style == "WSD"
        else ""
    )
    max_lr, min_lr = get_schedule_lr_range(sch)
    return (
        f"> {label}: {length} | lr {max_lr} -> {min_lr}, "
        f"warm-up {sch.lr_warmup_steps} samples, {style} decay over {sch.lr_decay_steps} samples{wsd}"
    )


def describe_run(run: TrainingRun) -> str:
    """The start-up summary lines of the logging rank: layout, precision, attention kernels."""
    ctx, cfg, resolved = run.ctx, run.cfg, run.resolved
    local = sum(prm.numel() for chunk in run.model for prm in chunk.parameters())
    cp = f" x CP {ctx.cp_size}" if ctx.cp_size > 1 else ""  # a run without CP logs the line it always did
    return (
        f"> layout: world {ctx.world_size} = TP {ctx.tp_size}{cp} x PP {ctx.pp_size} x DP {ctx.dp_size}"
        f" | virtual stages per pipeline rank {ctx.vp_size or 1}"
        f" | distributed optimizer {cfg.parallel.use_distributed_optimizer} | device {ctx.device}"
        f" | {resolved.precision} | padded vocab {resolved.padded_vocab_size}"
        f" | parameters on the logging rank {local:,}\n"
        + describe_schedule(run)
        + "\n"
        + describe_attention(cfg, resolved, ctx)
        + describe_compilation(cfg, resolved)
    )


def describe_attention(cfg: JobConfig, resolved: ResolvedConfig, ctx: ParallelContext) -> str:
    """The attention line: the CP attention under context parallelism, else the kernels by case."""
    if ctx.cp_size > 1:
        return describe_context_parallel_attention(ctx.cp_size, ctx.device.type, cfg.data.packed_sequences)
    return describe_attention_kernels(
        ctx.device.type,
        cfg.model.attention_dropout,
        use_transformer_engine(cfg.model, ctx.device, ctx.cp_size),
        resolved.uses_document_boundaries,
        resolved.params_dtype,
        get_kv_channels(cfg.model),
    )


def describe_compilation(cfg: JobConfig, resolved: ResolvedConfig) -> str:
    """The start-up line of --torch-compile / --cuda-graph-impl (empty without them)."""
    t = cfg.training
    if not (t.torch_compile or t.cuda_graph_impl != "none"):
        return ""
    what = (
        "each transformer layer compiled whole, in place (the first step of each length bucket compiles)"
        if t.torch_compile
        else f"CUDA graphs ({t.cuda_graph_impl}, warm-up {t.cuda_graph_warmup_steps} steps)"
    )
    packed = (
        " | packed micro-batches reach the layers in bounded shapes (one SDPA with a document mask on the "
        "CPU, flash varlen on GPUs)"
        if resolved.uses_document_boundaries
        else ""
    )
    return f"\n> {what} | lengths: --pad-length-bucket {cfg.data.pad_length_bucket}{packed}"
