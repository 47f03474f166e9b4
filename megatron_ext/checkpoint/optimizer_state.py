"""Workarounds for megatron-core 0.16.1's optimizer state in checkpoints (registered in
``megatron_ext/compat.py``).

Invariant: a checkpoint saved with the distributed optimizer (``fully_reshardable``) restores every
parameter's Adam moments and step exactly, in the same or another layout. megatron-core 0.16.1 gets
three things wrong on our path (torch's Adam, no Apex/TE), each corrected here and nowhere else:
the padded bucket ends shift the gathered state (``apply_optimizer_state_offset_fix``), a load
fails on ``step`` and then shares one ``step`` tensor between all parameters
(``load_optimizer_state``), and a never-stepped optimizer has no state to build a sharded state
dict from (``init_empty_optimizer_state``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_ext.optim import torch_adam_optimizers, use_fused_adam


def apply_optimizer_state_offset_fix(ddp_chunk: torch.nn.Module) -> None:
    """Work around megatron-core 0.16.1's distributed-optimizer checkpoint offsets.

    With the distributed optimizer a bucket's end is padded (uniform DP shards), and a tied
    embedding always gets a bucket of its own. ``get_parameter_state_dp_zero`` concatenates the
    buckets WITHOUT that padding (``bucket.numel_unpadded``) while parameters are located by
    their PADDED buffer indices, so every parameter after a padded bucket end reads its saved
    optimizer state shifted (measured: the word embedding's state off by 64 elements, megatron-core
    warning "param range exceeds unpadded buffer", resume not exact). Counting the padding as
    data makes both agree; megatron-core uses ``numel_unpadded`` only for these state gathers.
    """
    for buffer in list(ddp_chunk.buffers) + list(ddp_chunk.expert_parallel_buffers):
        for bucket in buffer.buckets:
            bucket.megatron_numel_unpadded = bucket.numel_unpadded  # megatron_bucket_sizes gives it back
            bucket.numel_unpadded = bucket.grad_data.numel()
        buffer.megatron_numel_unpadded = buffer.numel_unpadded
        buffer.numel_unpadded = buffer.numel


def get_megatron_bucket_sizes(dist_opt) -> list[dict]:
    """The distributed optimizer's ``per_bucket_numel_unpadded`` as megatron-core computes it (before
    ``apply_optimizer_state_offset_fix``): what a ``dp_reshardable`` checkpoint records and its load
    asserts."""
    return [
        {
            (buffer.param_dtype, buffer.grad_dtype): [
                getattr(b, "megatron_numel_unpadded", b.numel_unpadded) for b in buffer.buckets
            ]
        }
        for buffer in dist_opt.buffers
    ]


@contextlib.contextmanager
def megatron_bucket_sizes(optimizer):
    """megatron-core's own bucket sizes while the body runs, the offset fix's after. A
    ``dp_reshardable`` state (Megatron-LM's default) is stored per bucket, ``numel_unpadded`` long,
    and its load asserts the recorded sizes: with the fix's padded sizes it would not load, and
    reading it as padded would shift every parameter after a padded bucket end. The fix matters
    only to the ``fully_reshardable`` gather, which this load does not use."""
    changed = []
    for dist_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(dist_opt, "per_bucket_numel_unpadded"):
            continue
        changed.append((dist_opt, "per_bucket_numel_unpadded", dist_opt.per_bucket_numel_unpadded))
        dist_opt.per_bucket_numel_unpadded = get_megatron_bucket_sizes(dist_opt)
        for buffer in dist_opt.buffers:
            for item in (buffer, *buffer.buckets):
                if hasattr(item, "megatron_numel_unpadded"):
                    changed.append((item, "numel_unpadded", item.numel_unpadded))
                    item.numel_unpadded = item.megatron_numel_unpadded
    try:
        yield
    finally:
        for obj, name, value in reversed(changed):
            setattr(obj, name, value)


@contextlib.contextmanager
def catch_megatron_state_corruption():
    """Collect megatron-core's "param range exceeds unpadded buffer" warnings while building
    the optimizer's sharded state dict."""
    import logging

    found: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "exceeds unpadded buffer" in message:
                found.append(message)

    mcore_logger = logging.getLogger("megatron.core.optimizer.distrib_optimizer")
    handler = _Catch(level=logging.WARNING)
    mcore_logger.addHandler(handler)
    try:
        yield found
    finally:
        mcore_logger.removeHandler(handler)


def init_empty_optimizer_state(optimizer) -> None:
    """Give Adam parameters without state (no step taken yet) zero moments and step 0, as
    ``torch.optim.AdamW`` would on its first step. megatron-core's distributed optimizer reads the
    step count from that state while building its sharded state dict, also for a load (0.16.1,
    torch optimizers: it asserts one common step)."""
    for inner in torch_adam_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32, device=param.device),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def restore_step_zero(state_dict: Any) -> None:
    """Give back the Adam step megatron-core 0.16.1's non-distributed optimizers did not save: their
    ``sharded_state_dict`` stores the parameters' common step only ``if step:``, so a step count of
    0 (a save before the first optimizer step: fp16 with every step so far skipped by the loss
    scaler, or a first step skipped as non-finite) is dropped, and torch's Adam then fails on the
    load (``KeyError: 'step'``). A parameter's state without a step, and no ``common_step`` beside
    it, had step 0. ``state_dict``: one optimizer's (mixed precision: under "optimizer")."""
    if not isinstance(state_dict, dict):
        return
    optim = state_dict.get("optimizer", state_dict)
    states = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(states, dict) or "common_step" in states:
        return
    for state in states.values():
        if isinstance(state, dict) and state and "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)


def load_optimizer_state(optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` plus two fixes for megatron-core 0.16.1's distributed
    optimizer over torch's Adam (no Apex/TE):

    - its fully-reshardable load copies every per-parameter state entry from the checkpoint but
      skips "step" on the source side, then fails on it (``KeyError: 'step'``); we hand each
      parameter's own (already restored) step back as the source;
    - it gives all parameters one shared ``step`` tensor, which torch's Adam increments in place
      once per parameter, so after a resume the bias correction would run N times too fast; each
      parameter gets its own copy.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) == 1:
        restore_step_zero(state_dict)
    else:  # one entry per chained optimizer
        for part in state_dict.values() if isinstance(state_dict, dict) else state_dict:
            restore_step_zero(part)
    patched = []
    for wrapper in chained:
        if hasattr(wrapper, "_set_main_param_and_optimizer_states"):
            patched.append(wrapper)
            wrapper._set_main_param_and_optimizer_states = _keep_own_step(wrapper)
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for wrapper in patched:
            del wrapper._set_main_param_and_optimizer_states  # back to the class method
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    use_fused_adam(optimizer)  # a saved param group's options replace ours in torch's load


def _keep_own_step(dist_opt):
    original = type(dist_opt)._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = dist_opt.model_param_group_index_map[model_param]
        main_param = dist_opt.optimizer.param_groups[group_index]["params"][group_order]
        step = dist_opt.optimizer.state[main_param].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}
        return original(dist_opt, model_param, tensors)

    return set_states
