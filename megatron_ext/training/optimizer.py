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
        # the word embedding and output layer (is_embedding_or_output_parameter) in their own group
        decoupled_lr=t.decoupled_lr,
        decoupled_min_lr=t.decoupled_min_lr,
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
    apply_foreach_main_to_model_copy()
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


def foreach_copy_main_params_to_model_params(self) -> None:
    """``DistributedOptimizer._copy_main_params_to_model_params`` (megatron-core 0.16.1) with its
    per-parameter ``copy_`` loop (one kernel, and on CUDA one launch, per parameter, every step) as
    one ``torch._foreach_copy_`` over the same (model-buffer shard, fp32 main shard) pairs. Where
    upstream does something else (a stub, Megatron-FSDP, the precision-aware optimizer, FP8
    parameters) upstream's method runs. (Float16OptimizerWithFloat16Params copies through
    ``multi_tensor_scale_impl`` with scale 1.0: ``foreach_scale`` above, a ``_foreach_copy_`` already.)"""
    from megatron.core.fp8_utils import is_float8tensor

    groups = [
        *zip(self.shard_fp32_from_float16_groups, self.model_float16_groups),
        *zip(self.shard_fp32_groups, self.model_fp32_groups),
    ]
    if (
        self.is_stub_optimizer
        or self.ddp_config.use_megatron_fsdp
        or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        or any(is_float8tensor(p) for _, model_group in groups for p in model_group)
    ):
        return _UPSTREAM_COPY[0](self)
    dst, src = [], []
    for shard_main_group, model_group in groups:
        for shard_main_param, model_param in zip(shard_main_group, model_group):
            world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
            assert world_range.size == shard_main_param.nelement()
            gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
            buffer = self.buffers[gbuf_index].buckets[bucket_id].param_data
            dst.append(buffer.view(-1)[world_range.start : world_range.end])
            src.append(shard_main_param)
    if dst:
        torch._foreach_copy_(dst, src)


_UPSTREAM_COPY: list = []


def apply_foreach_main_to_model_copy() -> None:
    """Install ``foreach_copy_main_params_to_model_params`` on megatron-core's DistributedOptimizer
    (registered in compat.py). Idempotent."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not _UPSTREAM_COPY:
        _UPSTREAM_COPY.append(DistributedOptimizer._copy_main_params_to_model_params)
        DistributedOptimizer._copy_main_params_to_model_params = foreach_copy_main_params_to_model_params


def get_loss_scale(t: TrainingConfig) -> float | None:
    """--loss-scale with --fp16; 1.0 (a constant scaler, so found-inf is checked) with the guard on."""
    if t.fp16:
        return t.loss_scale
    return 1.0 if t.check_for_nan_in_loss_and_grad else None


def step_optimizer(optimizer, check_for_nan: bool) -> tuple[bool, float | None]:
    """``step_optimizer_fetching`` without anything to fetch: (update applied, global gradient norm)."""
    applied, grad_norm, _ = step_optimizer_fetching(optimizer, check_for_nan)
    return applied, grad_norm


def step_optimizer_fetching(
    optimizer,
    check_for_nan: bool,
    fetch: list[torch.Tensor | None] = (),
    veto: int | None = None,
) -> tuple[bool, float | None, list[list[float] | None]]:
    """megatron-core's optimizer step, plus the non-finite guard, in ONE device-to-host copy.

    Returns (update applied, global gradient norm, each tensor of ``fetch`` flattened to host floats,
    None for None). megatron-core 0.16.1 wraps every optimizer in a ``ChainedOptimizer`` whose ``step`` is
    prepare_grads -> get_grad_norm -> clip -> step_with_ready_grads (registered in compat.py), with a
    ``.item()`` for found-inf (a grad scaler's) and another for the norm. Where every child is the fp32
    optimizer or a mixed-precision one with a constant scale of 1.0 (--bf16 with the guard on), found-inf
    says nothing the norm does not (a gradient is non-finite exactly when the norm is, and unscaling by
    1.0 changes nothing), so this runs those steps itself: the model gradients copied to the main ones,
    the squared norm computed and all-reduced on the device (``grad_norm_squared``), then one copy of it
    together with ``fetch`` (the step's loss reports), then clipping and the update, skipped when the
    norm is not finite. Otherwise (--fp16's dynamic scaler) megatron-core's step runs and ``fetch`` is
    copied after it. ``veto``: the index in ``fetch`` of a tensor whose first value, when nonzero, skips
    the update as a non-finite norm does (the spike guard, ``spike.py``); then ``fetch`` is copied
    before megatron-core's step, which is not called (no loss-scale change: the gradients are finite)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    children = getattr(optimizer, "chained_optimizers", [optimizer])
    if not (check_for_nan and all(scales_by_one(c) for c in children)):
        if veto is not None:
            fetched = fetch_to_host(fetch)[1]
            if fetched[veto][0]:
                return False, None, fetched
            success, grad_norm, _ = optimizer.step()
            return bool(success), grad_norm, fetched
        success, grad_norm, _ = optimizer.step()
        return bool(success), grad_norm, fetch_to_host(fetch)[1]
    for child in children:
        if getattr(child, "grad_scaler", None) is None:
            child.prepare_grads()  # no sync: the fp32 optimizer's, or a mixed-precision one without a scaler
        elif not child.is_stub_optimizer:
            child._copy_model_grads_to_main_grads()  # prepare_grads less its unscale-by-1.0 and found-inf sync
    (norm_sq,), fetched = fetch_to_host([grad_norm_squared(children), *fetch])  # the step's one copy
    grad_norm = norm_sq**0.5  # as get_grad_norm_fp32 takes the root
    fetched = fetched[1:] if fetched else [None] * len(fetch)
    if not math.isfinite(grad_norm) or (veto is not None and fetched[veto][0]):
        return False, grad_norm, fetched
    for child in children:
        params = child.get_parameters()
        if getattr(child, "is_stub_optimizer", False) or not params or child.config.clip_grad <= 0.0:
            continue
        clip_grad_by_total_norm_fp32(
            params,
            max_norm=child.config.clip_grad,
            total_norm=grad_norm,
            use_decoupled_grad=child.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
        )
    return bool(optimizer.step_with_ready_grads()), grad_norm, fetched


def fetch_to_host(tensors: list[torch.Tensor | None]) -> tuple[list[float], list[list[float] | None]]:
    """Each tensor flattened to float64 host values (None stays None) with ONE ``tolist`` of their
    concatenation (all on one device); returns (the first's values, all of them)."""
    present = [t.reshape(-1).to(torch.float64) for t in tensors if t is not None]
    if not present:
        return [], [None] * len(tensors)
    flat = (torch.cat(present) if len(present) > 1 else present[0]).tolist()
    out, start = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[start : start + t.numel()])
        start += t.numel()
    return out[0] or [], out


def scales_by_one(child) -> bool:
    """The fp32 optimizer, or a mixed-precision one whose grad scaler is a constant 1.0 (or absent)."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer

    if isinstance(child, FP32Optimizer):
        return True
    if not isinstance(child, MixedPrecisionOptimizer):
        return False
    scaler = child.grad_scaler
    # (the configured constant, not the scaler's device tensor: reading that would be a sync)
    return scaler is None or (isinstance(scaler, ConstantGradScaler) and child.config.loss_scale == 1.0)


@torch.no_grad()
def grad_norm_squared(children: list) -> torch.Tensor:
    """[1] fp32 on the device: the squared global L2 norm of the main gradients, computed and reduced
    as megatron-core's ``ChainedOptimizer.get_grad_norm`` / ``get_grad_norm_fp32`` do (the same
    multi-tensor L2 norm, squared; one all-reduce SUM over the stats group when the children share it,
    else one per child, summed), without their ``.item()``: the norm is ``value ** 0.5`` on the host."""
    from megatron.core.optimizer.clip_grads import l2_norm_impl, multi_tensor_applier

    groups = [c.get_grad_stats_parallel_group() for c in children]
    shared = all(g == groups[0] for g in groups)
    parts = [(children, groups[0])] if shared else [([c], g) for c, g in zip(children, groups)]
    total = None
    for opts, group in parts:
        grads = [g for o in opts for g in o.get_main_grads_for_grad_norm()]
        if grads:
            overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
            norm, _ = multi_tensor_applier(l2_norm_impl, overflow, [grads], False)
            sq = norm**2.0
        else:
            sq = torch.zeros(1, dtype=torch.float, device=torch.cuda.current_device())
        torch.distributed.all_reduce(sq, op=torch.distributed.ReduceOp.SUM, group=group)
        total = sq if total is None else total + sq
    return total


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
