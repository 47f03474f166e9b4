"""One training step on megatron-core's schedules.

A step: zero the DDP grad buffers -> ``get_forward_backward_func()`` over the step's m
micro-batches (interleaved 1F1B with VPP, 1F1B with PP, none without) -> megatron-core's
``finalize_model_grads`` (DP reduce, tied-embedding sync, token-count scaling) -> optimizer step
(clipping inside) -> LR schedule.

Invariant: every virtual stage gets its own iterator over the same m micro-batches of the step,
in order, so a packed micro-batch's boundaries reach every stage with it (never through the P2P
activations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ext.context_parallel.attention import build_context_parallel_plan
from megatron_ext.cpu_platform import get_collective_device
from megatron_ext.data.microbatch import Microbatch, build_chunk_iterators
from megatron_ext.guards import StepProgress
from megatron_ext.model.attention import CoreAttentionRotaryEmbedding, PackedMicrobatchParams, build_packed_rotary_freqs
from megatron_ext.model.compile import (
    fixed_packed_documents,
    prepare_static_shapes,
    uses_static_shapes,
    warm_rotary_table,
)
from megatron_ext.model.v_placement import finalize_model_grads_v, get_config_placement
from megatron_ext.model.wrapping import unwrap_model
from megatron_ext.parallel import ParallelContext
from megatron_ext.pipeline.runtime import get_schedule_runtime
from megatron_ext.training.finalize import finalize_model_grads
from megatron_ext.training.loss import compute_token_loss, stack_reported_losses, sum_reported_losses
from megatron_ext.training.optimizer import counts_zeros_in_grad, step_optimizer_fetching, step_optimizer_upstream
from megatron_ext.training.profiling import StepTimers
from megatron_ext.training.spike import agree_spike


@dataclasses.dataclass
class StepResult:
    loss_sum_count: torch.Tensor  # [2] float64, this rank's [sum, count] (zeros off the last stage)
    grad_norm: float | None
    update_successful: bool
    # the update was skipped because a loss or gradient was not finite (not an fp16 overflow,
    # which the loss scaler handles): the same on every rank
    non_finite: bool = False
    # this rank's first micro-batch (its place in the step) whose loss was not finite (last stage only)
    non_finite_microbatch: int | None = None
    # the exit agreement begun inside the step, read on the host (None: none was begun)
    agreed_bits: list[float] | None = None
    # --skip-spiky-loss-factor (None without it): the step's global loss (token mean), whether it was
    # skipped as a spike (the same on every rank), and this rank's largest micro-batch (place, loss)
    step_loss: float | None = None
    spiked: bool = False
    spike_microbatch: tuple[int, float] | None = None
    # --log-num-zeros-in-grad (None without it): zeros in the step's main gradients, the whole model's
    num_zeros_in_grad: float | None = None


def _loss_func(valid: torch.Tensor, output_tensor: torch.Tensor, check_for_nan: bool = True):
    return compute_token_loss(output_tensor, valid).to_megatron(poison=check_for_nan)


def get_core_rotary(model: torch.nn.Module | None) -> CoreAttentionRotaryEmbedding | None:
    """The chunk's rotary module when our core attention applies RoPE (local spec), else None."""
    rotary = getattr(unwrap_model(model), "rotary_pos_emb", None) if model is not None else None
    return rotary if isinstance(rotary, CoreAttentionRotaryEmbedding) else None


def get_packed_seq_params(mb: Microbatch, model: torch.nn.Module | None = None) -> PackedSeqParams | None:
    """THD parameters of a packed micro-batch (None unpacked), with the host boundaries and, for
    a RoPE model chunk on the local spec, its tokens' rotary frequencies: computed here once per
    micro-batch and chunk, never inside a layer. With static shapes (--torch-compile, CUDA graphs):
    ``StaticPackedParams`` instead, tensors of bounded shapes and nothing host-side. Under context
    parallelism (``mb.cp_layout``), packed or not: ``get_context_parallel_params``."""
    if mb.cp_layout is not None:
        return get_context_parallel_params(mb, model)
    if not mb.is_packed:
        return None
    rotary = get_core_rotary(model)
    freqs = None if rotary is None else build_packed_rotary_freqs(rotary, mb.position_ids, mb.max_seqlen)
    cu = mb.cu_seqlens.to(device=mb.tokens.device, dtype=torch.int32)
    params = PackedMicrobatchParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
        cu_seqlens_host=mb.cu_seqlens_host,
        rotary_freqs=freqs,
    )
    if model is not None and uses_static_shapes(model):  # --torch-compile: bounded shapes, nothing host-side
        fixed = fixed_packed_documents(model)  # CUDA graphs: one shape for the run
        return prepare_static_shapes(params, mb.tokens.shape[1], unwrap_model(model).config, fixed)
    return params


def get_context_parallel_params(mb: Microbatch, model: torch.nn.Module | None = None) -> PackedMicrobatchParams:
    """The parameters of a micro-batch holding this CP rank's tokens: its CP plan (``mb.cp_layout``'s
    pieces, gather order and, on CUDA, the varlen call's boundaries: ``build_context_parallel_plan``)
    and the rotary frequencies of its sliced positions, host work once per micro-batch and chunk.
    Packed (THD, [1, t/c]): megatron-core's THD fields with the global boundaries and longest
    document. Unpacked ([b, s/c], every row one layout): ``qkv_format="sbhd"``, ``max_seqlen`` s (what
    megatron-core's rotary length reads), frequencies [s/c, b, 1, rot_dim] from each row's positions."""
    layout = mb.cp_layout
    if model is not None and uses_static_shapes(model):
        raise ValueError("context parallelism: --torch-compile and --cuda-graph-impl local are not supported under CP")
    rotary = get_core_rotary(model)
    if mb.is_packed:
        plan = build_context_parallel_plan(layout, mb.tokens.device)
        cu = mb.cu_seqlens.to(device=mb.tokens.device, dtype=torch.int32)
        return PackedMicrobatchParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=mb.max_seqlen,
            max_seqlen_kv=mb.max_seqlen,
            cu_seqlens_host=mb.cu_seqlens_host,
            rotary_freqs=None if rotary is None else build_packed_rotary_freqs(rotary, mb.position_ids, mb.max_seqlen),
            context_parallel=plan,
        )
    rows, length = mb.tokens.shape[0], layout.num_tokens
    freqs = None
    if rotary is not None:  # [s/c b, 1, rot_dim], position-major like the activations
        freqs = build_packed_rotary_freqs(rotary, mb.position_ids.t(), length)
        freqs = freqs.view(layout.num_local_tokens, rows, *freqs.shape[1:])
    return PackedMicrobatchParams(
        qkv_format="sbhd",
        max_seqlen_q=length,
        max_seqlen_kv=length,
        rotary_freqs=freqs,
        context_parallel=build_context_parallel_plan(layout, mb.tokens.device, rows),
    )


def forward_step(data_iterator, model, progress: StepProgress | None = None, check_for_nan: bool = True):
    """megatron-core forward_step_func: one micro-batch through one model chunk.

    Every virtual stage has its own iterator over the step's micro-batches, so a packed
    micro-batch's boundaries reach every stage with it (never through the P2P activations).
    ``progress`` (the step watchdog's record) learns which micro-batch and chunk run;
    ``check_for_nan``: a non-finite loss makes the step's gradients NaN (``loss.poison_non_finite``).
    """
    mb: Microbatch = next(data_iterator)
    if progress is not None:
        progress.record_microbatch(mb.index, getattr(unwrap_model(model), "vp_stage", None) or 0)
    if not mb.is_packed and uses_static_shapes(model):  # the layers' RoPE table filled outside them
        warm_rotary_table(unwrap_model(model), mb.tokens.shape[1], mb.tokens.device)
    output = model(
        input_ids=mb.tokens,
        position_ids=mb.position_ids,
        attention_mask=None,
        labels=mb.labels.clamp(min=0),  # ignored positions are masked out of the loss
        packed_seq_params=get_packed_seq_params(mb, model),
    )
    return output, functools.partial(_loss_func, mb.valid, check_for_nan=check_for_nan)


def set_current_microbatch(model: torch.nn.Module, microbatch_id: int) -> None:
    """megatron-core 0.16.1's ``schedules.set_current_microbatch`` (its forward_step calls it for every
    micro-batch), writing each layer's ``current_microbatch`` into the layer's ``__dict__``: what
    ``nn.Module.__setattr__`` does with an int, less its parameter/module/buffer checks (~13 Python
    calls per layer per micro-batch, two of them Parameter's Python ``__instancecheck__``)."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        model_with_decoder = get_attr_wrapped_model(model, "decoder", allow_none=False, return_model_obj=True)
    except RuntimeError:
        return
    if model_with_decoder is None:
        return
    for layer in model_with_decoder.decoder.layers:
        layer.__dict__["current_microbatch"] = microbatch_id
    if hasattr(model_with_decoder, "mtp"):
        for layer in model_with_decoder.mtp.layers:
            layer.transformer_layer.__dict__["current_microbatch"] = microbatch_id


def install_lean_set_current_microbatch() -> None:
    """``set_current_microbatch`` above in megatron-core's schedules (where their forward_step and
    combined_1f1b look it up at each call). Idempotent; pinned in compat.py."""
    from megatron.core.pipeline_parallel import schedules

    schedules.set_current_microbatch = set_current_microbatch


def configure_model_hooks(model: list[torch.nn.Module], optimizer: Any) -> None:
    """Wire megatron-core's per-step hooks into the (shared) TransformerConfig (under the V
    placement, the finalize that knows the loss and the tied embedding are on pipeline rank 0),
    and the lean ``set_current_microbatch``."""
    install_lean_set_current_microbatch()
    config = model[0].config
    v = get_config_placement(config) == "v"
    # (ours: upstream's, with the token-count scaling on the device)
    config.finalize_model_grads_func = finalize_model_grads_v if v else finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync if len(model) > 1 else no_sync[0]
    ddp = model[0].ddp_config
    if ddp.overlap_param_gather and ddp.align_param_gather:
        # Megatron-LM's wiring: the schedule dispatches every chunk's all-gathers at its start
        sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = sync if len(model) > 1 else sync[0]


def uses_overlapped_param_gather(model: list[torch.nn.Module]) -> bool:
    return bool(getattr(model[0], "ddp_config", None) and model[0].ddp_config.overlap_param_gather)


@contextlib.contextmanager
def params_synced(model: list[torch.nn.Module]):
    """With --overlap-param-gather the parameters may lag the optimizer's last step until the next
    forward gathers them: gather them now (synchronously) and keep the forward hooks off meanwhile,
    for an evaluation or a save, as Megatron-LM does. Nothing to do otherwise."""
    if not uses_overlapped_param_gather(model):
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


@contextlib.contextmanager
def first_step_without_param_sync(model: list[torch.nn.Module], first: bool):
    """Megatron-LM's first iteration under --overlap-param-gather: no all-gather before it (the
    parameters are already in place after initialisation or loading, and an error there then stays
    on its rank), hooks and param_sync_func back on afterwards."""
    if not (first and uses_overlapped_param_gather(model)):
        yield
        return
    config = model[0].config
    saved, config.param_sync_func = config.param_sync_func, None
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=False)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()
        config.param_sync_func = saved


def run_forward_backward(
    model: list[torch.nn.Module],
    microbatches: list[Microbatch],
    seq_length: int,
    forward_only: bool = False,
    forward_step_func: Callable = forward_step,
) -> list[dict[str, torch.Tensor]]:
    """The schedule over the step's micro-batches; returns the last stage's loss reports. The
    schedule is ours (``pipeline/runtime.py``) when run.py attached one to the chunks for
    --pipeline-schedule, else megatron-core's ``get_forward_backward_func()`` (unchanged)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
    iterators = build_chunk_iterators(microbatches, len(model))
    runtime = get_schedule_runtime(model)
    if runtime is not None:
        return runtime.run(
            forward_step_func=forward_step_func,
            data_iterator=iterators,
            model=model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=microbatches[0].tokens.shape[0],
            forward_only=forward_only,
        )
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0].tokens.shape[0],
        forward_only=forward_only,
    )


def empty_unused_memory(ctx: ParallelContext, when: bool) -> None:
    """--empty-unused-memory-level: hand the CUDA caching allocator's free blocks back."""
    if when and ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def step_optimizer_counting(optimizer, check_for_nan: bool, fetch: list, veto: int | None):
    """``step_optimizer_fetching``, or with --log-num-zeros-in-grad megatron-core's own step, which
    counts the gradients' zeros: (update applied, grad norm, zeros or None, fetched)."""
    if counts_zeros_in_grad(optimizer):
        return step_optimizer_upstream(optimizer, fetch, veto)
    applied, grad_norm, fetched = step_optimizer_fetching(optimizer, check_for_nan, fetch, veto=veto)
    return applied, grad_norm, None, fetched


def train_step(
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    microbatches: list[Microbatch],
    seq_length: int,
    global_batch_size: int,
    ctx: ParallelContext,
    check_for_nan: bool = True,
    progress: StepProgress | None = None,
    timers: StepTimers | None = None,
    empty_memory_level: int = 0,
    agreement: Callable[[], torch.Tensor | None] | None = None,
    spike_threshold: float | None = None,
) -> StepResult:
    """One step; ``agreement`` begins the exit agreement (``ExitDecider.start_agreement``) after the
    forward-backward, so that its bits reach the host with the step's one copy (``StepResult.agreed_bits``).
    ``spike_threshold`` (the spike guard's, None without it): a step whose global loss exceeds it is
    skipped on every rank (``spike.agree_spike``: one all-reduce, decided on the device)."""
    timer = timers.time if timers is not None else (lambda name: contextlib.nullcontext())
    optimizer.zero_grad()
    step_func = functools.partial(forward_step, progress=progress, check_for_nan=check_for_nan)
    with timer("forward-backward"):
        reports = run_forward_backward(model, microbatches, seq_length, forward_step_func=step_func)
    empty_unused_memory(ctx, empty_memory_level >= 1)
    # the loss reports (and the exit agreement, begun now) travel to the host with the gradient norm:
    # one device-to-host copy per step (training/optimizer.step_optimizer_fetching)
    on_device = stack_reported_losses(reports) if ctx.is_last_stage and reports else None
    bits = agreement() if agreement is not None else None
    spike = None if spike_threshold is None else agree_spike(on_device, spike_threshold, ctx.device)
    with timer("optimizer"):
        update_successful, grad_norm, num_zeros, (fetched, agreed_bits, spike_row) = step_optimizer_counting(
            optimizer, check_for_nan, [on_device, bits, spike], veto=None if spike is None else 2
        )
        if update_successful:
            scheduler.step(increment=global_batch_size)
    empty_unused_memory(ctx, empty_memory_level >= 2)
    rows = [fetched[i : i + 2] for i in range(0, len(fetched), 2)] if fetched is not None else []
    local = sum_reported_losses(rows)
    bad_microbatch = next((i for i, row in enumerate(rows) if not all(map(math.isfinite, row))), None)
    spiked = bool(spike_row and spike_row[0])
    non_finite = check_for_nan and not update_successful and not spiked
    if non_finite and model[0].config.fp16:
        non_finite = agree_loss_non_finite(bad_microbatch is not None)
    result = StepResult(local, grad_norm, update_successful, non_finite, bad_microbatch, agreed_bits)
    result.num_zeros_in_grad = num_zeros
    if spike_row is not None:
        result.step_loss, result.spiked = spike_row[1], spiked
        means = [(i, s / c) for i, (s, c) in enumerate(rows) if c > 0]
        result.spike_microbatch = max(means, key=lambda m: m[1]) if spiked and means else None
    return result


def agree_loss_non_finite(mine: bool, group: Any = None) -> bool:
    """Whether any rank's loss was not finite (one all-reduce over ``group``, by default the world:
    every rank must learn it, and a pipeline's last stage sees only its own loss). Only after a skipped
    --fp16 step: megatron-core's dynamic loss scaler skips an overflow of the scaled gradients too,
    and the NaN a non-finite loss puts into the gradients looks the same to it; the skip is a nan
    iteration only when a loss caused it (the scaler has backed off for it anyway, as it would for
    an overflow). Steps whose update was applied, and every step without --fp16, never call this."""
    flag = torch.tensor([float(mine)], device=get_collective_device(group))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())


def build_step_microbatches(
    run: Any, dataset: Any, first_sample: int, global_batch_size: int | None = None
) -> tuple[list[Microbatch], int]:
    """This rank's micro-batches of the step starting at ``first_sample`` of ``global_batch_size``
    samples (None: the training step's, from the batch schedule) from ``dataset``, built
    now, in this thread, by the run's step-data builder (``data/step_data.py``: read, pad as
    ``--sequence-padding`` says over the model-parallel group, move to the device); returns them and
    the schedule's seq_length. (Training steps come from ``run.prefetcher`` when there is one.)"""
    return run.step_data.build(dataset, first_sample, global_batch_size)
