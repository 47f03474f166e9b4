"""megatron-core optimizer (Adam(W)/SGD, clipping, optional ZeRO-1) and LR/WD schedule.

With --bf16/--fp16 megatron-core keeps fp32 main parameters and gradients and steps on them
(its Float16Optimizer, or the distributed optimizer's fp32 shards); --fp16 adds its loss scaler.

The schedule counts samples, as Megatron-LM does (``scheduler.step(increment=global batch)``).

Non-finite guard (``--check-for-nan-in-loss-and-grad``, on by default): an update whose gradients
hold a NaN or Inf is skipped on every rank. megatron-core's mixed-precision and distributed
optimizers already check found-inf (all ranks agree in their own reduction) and skip when a grad
scaler is set, so they get a constant scaler of 1.0 (fp16 keeps its dynamic one); megatron-core's
fp32 optimizer reports no found-inf, so ``step_optimizer`` decides on the global gradient norm it
computes anyway for clipping (agreed by every rank), before the update. A non-finite loss reaches
the same checks through its gradients, which ``loss.poison_non_finite`` makes NaN.
"""

from __future__ import annotations

import math

import torch

from megatron_ext.config import JobConfig, TrainingConfig
from megatron_ext.derived import get_params_dtype, get_schedule_steps
from megatron_ext.optim import use_fused_adam


def build_optimizer(cfg: JobConfig, model: list[torch.nn.Module], device: torch.device):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = cfg.training
    opt_config = OptimizerConfig(
        optimizer=t.optimizer,
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=get_params_dtype(t),
        loss_scale=get_loss_scale(t),
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    apply_multi_tensor_fallback_fix()
    # On the CPU every group is gloo already; separate gloo groups exist only on CUDA.
    optimizer = get_megatron_optimizer(opt_config, model, use_gloo_process_groups=device.type == "cuda")
    use_fused_adam(optimizer)
    return optimizer


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron-core's ``local_multi_tensor_l2_norm`` (its fallback where neither Apex
    nor Transformer Engine is installed): the l2 norm of every tensor of ``tensor_lists`` as a
    one-element fp32 tensor, on the tensors' device, without a host synchronisation. Upstream
    builds ``torch.tensor([torch.norm(t) for t in ...])``: one ``.item()``, i.e. one device-to-host
    sync, per parameter in every step (149 per step for GPT-2 124M, seen in an H100 profile)."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron-core's ``local_multi_tensor_scale``: ``dst = src * scale`` for each
    pair, in a few multi-tensor kernels instead of two kernels per parameter (main-to-model
    parameter copies and gradient clipping)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def apply_multi_tensor_fallback_fix() -> None:
    """Where megatron-core 0.16.1 fell back to its local multi-tensor implementations (no Apex, no
    TE), use ``foreach_l2_norm`` and ``foreach_scale`` instead (registered in compat.py); with Apex
    or TE installed their fused kernels stay. Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def get_loss_scale(t: TrainingConfig) -> float | None:
    """--loss-scale with --fp16; 1.0 (a constant scaler, so found-inf is checked) with the guard on."""
    if t.fp16:
        return t.loss_scale
    return 1.0 if t.check_for_nan_in_loss_and_grad else None


def step_optimizer(optimizer, check_for_nan: bool) -> tuple[bool, float | None]:
    """megatron-core's optimizer step, plus the non-finite guard for its fp32 optimizer.

    Returns (update applied, global gradient norm). megatron-core 0.16.1 wraps every optimizer in a
    ``ChainedOptimizer``; when it holds an ``FP32Optimizer`` (which reports no found-inf) this is
    ``ChainedOptimizer.step`` (prepare_grads -> get_grad_norm -> clip -> step_with_ready_grads,
    registered in compat.py) with the update skipped when the norm, one global reduction that the
    step computes anyway, is not finite."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.optimizer.optimizer import FP32Optimizer

    children = getattr(optimizer, "chained_optimizers", [optimizer])
    if not (check_for_nan and any(isinstance(c, FP32Optimizer) for c in children)):
        success, grad_norm, _ = optimizer.step()
        return bool(success), grad_norm
    if optimizer.prepare_grads():
        return False, None
    grad_norm = optimizer.get_grad_norm()
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for child in children:
        params = child.get_parameters()
        if getattr(child, "is_stub_optimizer", False) or not params or child.config.clip_grad <= 0.0:
            continue
        clip_grad_by_total_norm_fp32(
            params, max_norm=child.config.clip_grad, total_norm=grad_norm,
            use_decoupled_grad=child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
        )
    return bool(optimizer.step_with_ready_grads()), grad_norm


def get_schedule_lr_range(scheduler) -> tuple[float, float]:
    """(peak, final) learning rate the scheduler gives parameter group 0, the one the log line shows:
    the group's own ``max_lr``/``min_lr`` where it has them (as ``get_lr`` reads them), else the
    scheduler's fields."""
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None) or [{}]
    return groups[0].get("max_lr", scheduler.max_lr), groups[0].get("min_lr", scheduler.min_lr)


def build_scheduler(cfg: JobConfig, optimizer, global_batch_size: int):
    """megatron-core's OptimizerParamScheduler over samples (``derived.get_schedule_steps``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = cfg.training
    steps = get_schedule_steps(cfg, global_batch_size, t.train_iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=steps.lr_warmup_steps,
        lr_decay_steps=steps.lr_decay_steps,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=steps.wd_incr_steps,
        wd_incr_style="constant",
        # Megatron-LM's defaults: on resume the values must agree unless a flag says which wins
        # (checkpoint/state.check_scheduler_flags names the flags first)
        use_checkpoint_opt_param_scheduler=cfg.checkpoint.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=cfg.checkpoint.override_opt_param_scheduler,
        wsd_decay_steps=steps.wsd_decay_steps,
        lr_wsd_decay_style=t.lr_wsd_decay_style if t.lr_decay_style == "WSD" else None,
    )
