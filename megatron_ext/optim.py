"""The optimizer and LR-scheduler state that both sides touch: ``training/optimizer.py`` builds them,
``checkpoint/`` saves and loads them. What a load replaces or must re-establish lives here, below
both, so that neither imports the other.

- the torch Adam(W) inside megatron-core's chained optimizer, and its fused kernel (set when the
  optimizer is built and again after every load, which restores the saved groups' options);
- the parameter-group settings this run's flags give (recorded when built, given back after a
  load under --override-opt-param-scheduler);
- the scheduler's state with the WSD phase megatron-core does not save.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_adam_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW instances inside megatron-core's (chained) optimizer: what it builds
    where neither Transformer Engine nor Apex is installed (their FusedAdam is left alone)."""
    inner = (getattr(w, "optimizer", None) for w in getattr(optimizer, "chained_optimizers", [optimizer]))
    return [o for o in inner if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]


def use_fused_adam(optimizer) -> None:
    """Step torch's Adam(W) with its fused kernel (``fused=True``), on CUDA and on the CPU alike.

    megatron-core 0.16.1 without TE/Apex builds ``torch.optim.AdamW`` with torch's default, the
    ``foreach`` kernels on CUDA (about 20 passes over the fp32 main parameters and moments per step
    against 7 for the fused kernel: ~35 vs ~12 ms per step for 1.3B parameters on an H100) and the
    per-parameter loop on the CPU. The fused kernel is the one TE/Apex's FusedAdam stands for, and
    torch runs it on both device types, so CI covers the path GPUs run. ``fused`` is a public
    AdamW option kept in each param group; ``load_state_dict`` restores the saved groups' options
    and megatron-core's distributed optimizer restores states itself, so this runs after every
    load too. The fused kernel keeps ``step`` as a float32 tensor on the parameter's device (as
    torch's own ``_init_group`` makes it); existing step counts are moved there. Idempotent."""
    for inner in torch_adam_optimizers(optimizer):
        for options in [inner.defaults, *inner.param_groups]:
            options["fused"], options["foreach"] = True, False
        for group in inner.param_groups:
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor) and (step.device != param.device or step.dtype != torch.float32):
                    inner.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)


# Parameter-group settings that this run's flags give when the optimizer is built and that loading
# an optimizer state replaces with the checkpoint's: torch's ``Optimizer.load_state_dict`` keeps the
# saved groups' options (megatron-core's distributed optimizer hands it the saved groups too), and
# megatron-core's scheduler reads a group's own ``max_lr``/``min_lr`` before its fields
# (OptimizerParamScheduler.get_lr, 0.16.1).
FLAG_GROUP_KEYS = ("max_lr", "min_lr", "betas", "eps")


def record_flag_settings(optimizer) -> list[dict[str, Any]]:
    """Each parameter group's FLAG_GROUP_KEYS values as built, by group index. Call right after
    ``build_optimizer``: the values are megatron-core's per group (a group with a decoupled LR has
    its own ``max_lr``), not just --lr. Every rank has the same groups in the same order (megatron-core
    aligns them across ranks for distributed checkpoints; a rank without parameters in one keeps it empty)."""
    return [{key: group[key] for key in FLAG_GROUP_KEYS if key in group} for group in optimizer.param_groups]


def apply_flag_settings(optimizer, recorded: list[dict[str, Any]]) -> None:
    """Give each parameter group back the values ``record_flag_settings`` recorded (after loading an
    optimizer state, before the scheduler's state: its load sets each group's ``lr`` from them).
    ``optimizer.param_groups`` is read afresh: a load replaces the group dicts (the distributed
    optimizer's live in its inner optimizer over the main-parameter shards, which the property returns)."""
    groups = optimizer.param_groups
    assert len(groups) == len(recorded), f"{len(groups)} parameter groups after the load, {len(recorded)} built"
    for group, settings in zip(groups, recorded):
        group.update(settings)


def get_scheduler_state(scheduler) -> dict:
    """The scheduler's state dict plus the WSD phase (megatron-core 0.16.1 saves neither its
    length nor its style, so a resume could change them unnoticed)."""
    return {
        **scheduler.state_dict(),
        "wsd_decay_steps": scheduler.wsd_decay_steps,
        "lr_wsd_decay_style": scheduler.lr_wsd_decay_style,
    }


def load_scheduler_state(scheduler, state: dict) -> None:
    """megatron-core's load, with the checkpoint's WSD phase first when its schedule wins (the load
    sets the learning rate of the restored step)."""
    if scheduler.use_checkpoint_opt_param_scheduler and "wsd_decay_steps" in state:
        scheduler.wsd_decay_steps, scheduler.lr_wsd_decay_style = state["wsd_decay_steps"], state["lr_wsd_decay_style"]
    scheduler.load_state_dict(state)
