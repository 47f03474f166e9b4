"""megatron-core optimizer (Adam(W)/SGD, clipping, optional ZeRO-1) and LR/WD schedule.

With --bf16/--fp16 megatron-core keeps fp32 main parameters and gradients and steps on them
(its Float16Optimizer, or the distributed optimizer's fp32 shards); --fp16 adds its loss scaler.

The schedule counts samples, as Megatron-LM does (``scheduler.step(increment=global batch)``).
"""

from __future__ import annotations

import torch

from megatron_ext.config import JobConfig, get_params_dtype


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
        params_dtype=get_params_dtype(cfg),
        loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    # On the CPU every group is gloo already; separate gloo groups exist only on CUDA.
    return get_megatron_optimizer(opt_config, model, use_gloo_process_groups=device.type == "cuda")


def build_scheduler(cfg: JobConfig, optimizer, global_batch_size: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = cfg.training
    decay_iters = t.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters * global_batch_size,
        lr_decay_steps=decay_iters * global_batch_size,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters * global_batch_size,
        wd_incr_style="constant",
    )
