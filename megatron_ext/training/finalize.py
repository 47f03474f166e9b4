"""megatron-core's ``finalize_model_grads`` with the token-count scaling on the device.

megatron-core 0.16.1 ends ``finalize_model_grads`` with ``if num_tokens > 0: scale_gradients(1.0 /
num_tokens)`` (finalize_model_grads.py:495): the ``if`` reads the count on the host, a device-to-host
sync every step. With no valid token every gradient is zero (the loss is a sum over no token), so
scaling by ``1 / max(count, 1)`` is the same step with nothing to read: ``finalize_model_grads`` below
runs upstream's steps without the count (``finalize_without_count``: its DP reduce, SP norm and
embedding all-reduces, step for step; its per-step walk over every module, ``reset_model_temporary_tensors``,
only where that resets something) and then upstream's broadcast of the count from the last pipeline
stage, its all-reduce over DP, and that scaling, as one device tensor. Registered in compat.py.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch


def scale_by_token_count(model: list[torch.nn.Module], num_tokens: torch.Tensor) -> None:
    """Every chunk's gradients times ``1 / max(num_tokens, 1)`` (a [1] device tensor: no sync)."""
    scale = 1.0 / num_tokens.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scale)


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """megatron-core's ``finalize_model_grads`` (same signature and steps) without its host sync."""
    from megatron.core.distributed.finalize_model_grads import get_pp_last_rank

    finalize_without_count(model, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is not None:
        scale_by_global_token_count(model, num_tokens, pg_collection, get_pp_last_rank)


def finalize_without_count(model: list[torch.nn.Module], pg_collection: Any = None, force_all_reduce: Any = False):
    """Upstream's ``finalize_model_grads(model, None, ...)`` step for step (its timers too), less the
    walk over every module of ``reset_model_temporary_tensors`` where it resets nothing (no MoE expert
    bias, no global aux loss): ~560 Python calls a step at 4 layers, for nothing."""
    upstream = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    if pg_collection is not None:
        tp, pp, embd, pos_embd = pg_collection.tp, pg_collection.pp, pg_collection.embd, pg_collection.pos_embd
    else:
        tp = parallel_state.get_tensor_model_parallel_group()
        pp = parallel_state.get_pipeline_model_parallel_group()
        embd = parallel_state.get_embedding_group(check_initialized=False)
        pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    with _timed(config, "all-grads-sync"):
        for chunk in model:
            chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    with _timed(config, "conditional-embedder-grads-all-reduce"):
        upstream._allreduce_conditional_embedding_grads(model, config, pp)
    with _timed(config, "non-tensor-parallel-grads-all-reduce"):
        upstream._allreduce_non_tensor_model_parallel_grads(model, config, tp)
    with _timed(config, "embedding-grads-all-reduce"):
        upstream._allreduce_word_embedding_grads(model, config, embd, pp)
        upstream._allreduce_position_embedding_grads(model, config, pos_embd, pp)
    if config.moe_router_enable_expert_bias:
        upstream._update_router_expert_bias(model, config)
    if resets_temporaries(config):
        upstream.reset_model_temporary_tensors(config, model)


def resets_temporaries(config: Any) -> bool:
    """Whether megatron-core's ``reset_model_temporary_tensors`` can touch a module (its two conditions)."""
    balancing = config.moe_router_load_balancing_type
    return bool(
        config.moe_router_enable_expert_bias or balancing == "global_aux_loss" or "global_aux_loss" in balancing
    )


@contextlib.contextmanager
def _timed(config: Any, name: str):
    """Upstream's ``config.timers(name, log_level=1)`` around a step (nothing without timers)."""
    if config.timers is None:
        yield
        return
    config.timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    yield
    config.timers(name).stop()


def scale_by_global_token_count(
    model: list[torch.nn.Module], num_tokens: torch.Tensor, pg_collection: Any, loss_rank_of: Any
) -> None:
    """Upstream's last steps: the count broadcast over the pipeline group from the rank that holds the
    loss (``loss_rank_of(pp_group)``: the last rank, or rank 0 under the V placement), summed over DP
    (with context parallelism), then every gradient scaled on the device."""
    from megatron.core import parallel_state

    if pg_collection is not None:
        pp_group, dp_cp_group = pg_collection.pp, pg_collection.dp_cp
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.broadcast(num_tokens, src=loss_rank_of(pp_group), group=pp_group)
    torch.distributed.all_reduce(num_tokens, group=dp_cp_group)
    scale_by_token_count(model, num_tokens)
