"""megatron-core optimizer (Adam(W)/SGD, clipping, optional ZeRO-1) and LR/WD schedule.

With --bf16/--fp16 megatron-core keeps fp32 main parameters and gradients and steps on them
(its Float16Optimizer, or the distributed optimizer's fp32 shards); --fp16 adds its loss scaler.

The schedule counts samples, as Megatron-LM does (``scheduler.step(increment=global batch)``).

Non-finite guard (``--check-for-nan-in-loss-and-grad``, on by default): an update whose gradients
hold a NaN or Inf is skipped on every rank, decided on the global gradient norm (agreed by every
rank) before the update; --bf16 gets megatron-core's constant scaler of 1.0 for it, --fp16 keeps its
dynamic scaler, whose found-inf skips. A non-finite loss reaches the same checks through its
gradients, which ``loss.poison_non_finite`` makes NaN. Either way the step reads found-inf, the norm
and the step's loss reports in one device-to-host copy (``step_optimizer_fetching``).
"""

from __future__ import annotations

import math

import torch

from megatron_ext.config import JobConfig, TrainingConfig
from megatron_ext.derived import get_params_dtype, get_schedule_steps
from megatron_ext.optim import use_fused_adam
from megatron_ext.training.grad_norm import has_unit_grad_norm, unit_grad_norm_squared


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
        log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
    )
    apply_multi_tensor_fallback_fix()
    apply_foreach_main_to_model_copy()
    apply_foreach_float16_param_copy()
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
    parameters) upstream's method runs. (Float16OptimizerWithFloat16Params: ``foreach_copy_this_to_that``.)"""
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


def foreach_copy_this_to_that(this: list[torch.Tensor], that: list[torch.Tensor], overflow_buf=None) -> None:
    """Drop-in for megatron-core's ``optimizer._multi_tensor_copy_this_to_that``: ``that[i].copy_(this[i])``
    for each pair as one ``torch._foreach_copy_``. Upstream copies through ``multi_tensor_scale_impl``
    only when given an overflow buffer, which ``MixedPrecisionOptimizer`` leaves None with --bf16:
    then it loops, one ``copy_`` (one kernel and launch) per parameter, in every
    ``Float16OptimizerWithFloat16Params`` step (148 at GPT-2 124M). With a buffer (--fp16) upstream's
    route is kept (``foreach_scale`` at scale 1.0: a ``_foreach_copy_`` too)."""
    if overflow_buf is not None:
        return _UPSTREAM_COPY_THIS_TO_THAT[0](this, that, overflow_buf)
    pairs = list(zip(this, that))  # upstream zips: the shorter list decides
    if pairs:
        torch._foreach_copy_([d for _, d in pairs], [s for s, _ in pairs])


_UPSTREAM_COPY_THIS_TO_THAT: list = []


def apply_foreach_float16_param_copy() -> None:
    """Install ``foreach_copy_this_to_that`` as megatron-core's ``optimizer._multi_tensor_copy_this_to_that``
    (registered in compat.py; Float16OptimizerWithFloat16Params' main-to-model and model-to-main
    copies and fp8_utils look it up there at call time). Idempotent."""
    from megatron.core.optimizer import optimizer

    if not _UPSTREAM_COPY_THIS_TO_THAT:
        _UPSTREAM_COPY_THIS_TO_THAT.append(optimizer._multi_tensor_copy_this_to_that)
        optimizer._multi_tensor_copy_this_to_that = foreach_copy_this_to_that


def get_loss_scale(t: TrainingConfig) -> float | None:
    """--loss-scale with --fp16; 1.0 (a constant scaler, so found-inf is checked) with the guard on."""
    if t.fp16:
        return t.loss_scale
    return 1.0 if t.check_for_nan_in_loss_and_grad else None


def read_loss_scale(optimizer) -> float:
    """The loss scale on the host (--fp16's; 1.0 without a scaler), as Megatron-LM logs it: the first
    child's (megatron-core's ``ChainedOptimizer.get_loss_scale``, which assumes CUDA when it has none)."""
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    return float(children[0].get_loss_scale()) if children else 1.0


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
    ``.item()`` for found-inf (a grad scaler's) and another for the norm. This runs those steps itself:
    the model gradients copied to the main ones (and, with --fp16's scaler, unscaled and checked into
    each child's ``found_inf``, reduced on the device: ``prepare_grads_on_device``), the squared norm
    computed and all-reduced on the device (``grad_norm_squared``), then one copy of found-inf, the norm
    and ``fetch`` (the step's loss reports and exit agreement), then on the host what megatron-core
    decides after its reads: each scaler's update, the skip on found-inf, clipping and the update.
    Where no scaler can overflow (fp32; --bf16) found-inf says nothing the norm does not (a gradient
    is non-finite exactly when the norm is, and unscaling by 1.0 changes nothing): with
    ``check_for_nan`` the update is skipped when the norm is not finite; without it the update is
    applied, as megatron-core's step applies it (its clipping with a non-finite norm as upstream's).
    ``veto``: the index in ``fetch`` of a tensor whose first value, when nonzero, skips the update (the
    spike guard, ``spike.py``) before any scaler changes, as a step never taken. Children this does not
    know (``steps_in_one_copy``) take megatron-core's step, with ``fetch`` copied after it."""
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    if not all(steps_in_one_copy(c) for c in children):
        applied, grad_norm, _, fetched = step_optimizer_upstream(optimizer, fetch, veto)
        return applied, grad_norm, fetched
    found_inf = [prepare_grads_on_device(c) for c in children]  # [1] per child with a scaler, else None
    flags = [f for f in found_inf if f is not None]
    to_fetch = [grad_norm_squared(children), torch.cat(flags) if flags else None, *fetch]
    (norm_sq,), fetched = fetch_to_host(to_fetch)  # the step's one copy
    grad_norm = norm_sq**0.5  # as get_grad_norm_fp32 takes the root
    inf_values, fetched = fetched[1], fetched[2:]
    if veto is not None and fetched[veto][0]:
        return False, grad_norm, fetched
    if update_grad_scalers(children, found_inf, inf_values):
        return False, None, fetched  # megatron-core's (success, norm) for an overflow
    if check_for_nan and not flags and not math.isfinite(grad_norm):
        return False, grad_norm, fetched
    clip_main_grads(children, grad_norm)
    return bool(optimizer.step_with_ready_grads()), grad_norm, fetched


def step_optimizer_upstream(optimizer, fetch: list[torch.Tensor | None], veto: int | None = None):
    """megatron-core's ``optimizer.step()`` (its own syncs), ``fetch`` copied before it with a
    ``veto`` (a vetoed step does not call it), after it otherwise. Returns (update applied, global
    gradient norm, number of zeros in the gradients (with --log-num-zeros-in-grad, else None), fetched)."""
    if veto is not None:
        fetched = fetch_to_host(fetch)[1]
        if fetched[veto][0]:
            return False, None, None, fetched
        success, grad_norm, num_zeros = optimizer.step()
        return bool(success), grad_norm, num_zeros, fetched
    success, grad_norm, num_zeros = optimizer.step()
    return bool(success), grad_norm, num_zeros, fetch_to_host(fetch)[1]


def counts_zeros_in_grad(optimizer) -> bool:
    """--log-num-zeros-in-grad: megatron-core's step counts the gradients' zeros (and takes our step's place)."""
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(c.config.log_num_zeros_in_grad for c in children)


def steps_in_one_copy(child) -> bool:
    """megatron-core's fp32 or mixed-precision optimizer (Float16OptimizerWithFloat16Params, the
    distributed one), not counting zeros in gradients (which ``step_optimizer_fetching`` does not do)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer

    return isinstance(child, (FP32Optimizer, MixedPrecisionOptimizer)) and not child.config.log_num_zeros_in_grad


@torch.no_grad()
def prepare_grads_on_device(child) -> torch.Tensor | None:
    """``child.prepare_grads()`` less its host read and scaler update: returns the child's found-inf
    ([1] fp32 on the device, reduced MAX over the grad-stats group as upstream's
    ``_unscale_main_grads_and_check_for_nan``) where it has a scaler that can overflow, else None.
    A constant scale of 1.0 (``scales_by_one``: --bf16 with the guard) gets only the copy to main
    gradients: its unscale-by-1.0 changes nothing and its found-inf nothing the norm does not."""
    if getattr(child, "grad_scaler", None) is None:
        child.prepare_grads()  # no sync: the fp32 optimizer's, or a mixed-precision one without a scaler
        return None
    if not child.is_stub_optimizer:
        child._copy_model_grads_to_main_grads()
    if scales_by_one(child):
        return None
    main_grads = [] if child.is_stub_optimizer else child._collect_main_grad_data_for_unscaling()
    child.found_inf.fill_(0.0)
    if not child.is_stub_optimizer:
        torch._amp_foreach_non_finite_check_and_unscale_(main_grads, child.found_inf, child.grad_scaler.inv_scale)
    torch.distributed.all_reduce(
        child.found_inf, op=torch.distributed.ReduceOp.MAX, group=child.get_grad_stats_parallel_group()
    )
    return child.found_inf


def update_grad_scalers(children: list, found_inf: list[torch.Tensor | None], values: list[float] | None) -> bool:
    """Each scaler updated with its own child's found-inf (host ``values``, in the order of the
    non-None entries of ``found_inf``), as upstream's ``prepare_grads`` does; whether any overflowed."""
    overflow, values = False, iter(values or [])
    for child, flag in zip(children, found_inf):
        if flag is None:
            continue
        found = next(values) > 0
        child.grad_scaler.update(found)
        overflow |= found
    return overflow


def clip_main_grads(children: list, grad_norm: float) -> None:
    """``ChainedOptimizer.step``'s clipping of every child's main gradients by the global norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

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
    """A mixed-precision optimizer whose grad scaler is a constant 1.0 with --bf16 (the guard's: see
    ``get_loss_scale``); --fp16 with --loss-scale 1 keeps its found-inf check, upstream's skip."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    scaler = child.grad_scaler
    # (the configured constant, not the scaler's device tensor: reading that would be a sync)
    return isinstance(scaler, ConstantGradScaler) and child.config.loss_scale == 1.0 and not child.config.fp16


@torch.no_grad()
def grad_norm_squared(children: list) -> torch.Tensor:
    """[1] fp32 on the device: the squared global L2 norm of the main gradients, computed and reduced
    as megatron-core's ``ChainedOptimizer.get_grad_norm`` / ``get_grad_norm_fp32`` do (the same
    multi-tensor L2 norm, squared; one all-reduce SUM over the stats group when the children share it,
    else one per child, summed), without their ``.item()``: the norm is ``value ** 0.5`` on the host."""
    from megatron.core.optimizer.clip_grads import l2_norm_impl, multi_tensor_applier

    if has_unit_grad_norm(children):  # pipeline parallel: summed per parameter, whatever the placement
        return unit_grad_norm_squared(children)
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
