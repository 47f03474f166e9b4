"""megatron-core's ``finalize_model_grads`` with the token-count scaling on the device.

megatron-core 0.16.1 ends ``finalize_model_grads`` with ``if num_tokens > 0: scale_gradients(1.0 /
num_tokens)`` (finalize_model_grads.py:495): the ``if`` reads the count on the host, a device-to-host
sync every step. With no valid token every gradient is zero (the loss is a sum over no token), so
scaling by ``1 / max(count, 1)`` is the same step with nothing to read: ``finalize_model_grads`` below
runs upstream's function without the count (its DP reduce, SP norm and embedding all-reduces) and then
upstream's broadcast of the count from the last pipeline stage, its all-reduce over DP, and that
scaling, as one device tensor. Registered in compat.py.
"""

from __future__ import annotations

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
    from megatron.core.distributed import finalize_model_grads as upstream
    from megatron.core.distributed.finalize_model_grads import get_pp_last_rank

    upstream(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is not None:
        scale_by_global_token_count(model, num_tokens, pg_collection, get_pp_last_rank)


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
