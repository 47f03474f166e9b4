"""--log-params-norm: the global L2 norm of the model's parameters, as Megatron-LM's
``calc_params_l2_norm`` (megatron/training/utils.py, core_v0.16.1) computes it.

Invariant: every parameter of the model counts exactly once, whatever the layout. A rank sums the
squares of its own parameters, leaving out a tensor-parallel duplicate (a parameter without
``tensor_model_parallel``, e.g. a norm weight or a row-parallel bias: the same on every TP rank)
except on TP rank 0, and the copy of the word embedding that a tied last pipeline stage holds
(megatron-core marks it ``shared``); one all-reduce over the model-parallel group (TP x PP) adds the
ranks up. Values, as Megatron-LM reads them: under --bf16 the fp32 main parameter where the
optimizer keeps one on the parameter (the distributed optimizer: this rank's shard of it, sharded
over DP x CP, so those shards are summed over the DP x CP group first), else the parameter itself in
fp32. CP ranks hold whole replicas of their stage, as DP replicas do: the model-parallel group holds
one CP rank, so no replica is counted twice.
Computed on logging iterations only: a multi-tensor norm, one or two all-reduces, one host read.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_ext.cpu_platform import get_collective_device
from megatron_ext.parallel import ParallelContext


def select_params_to_norm(
    params: Iterable[torch.nn.Parameter], tp_rank: int, use_main_params: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(whole, sharded): the tensors whose squares this rank adds, ``sharded`` being distributed-
    optimizer main-parameter shards (to be summed over the DP group). Pure: no process group."""
    whole, sharded = [], []
    for param in params:
        if not getattr(param, "tensor_model_parallel", False) and tp_rank != 0:
            continue  # a TP duplicate: counted on TP rank 0
        if getattr(param, "shared", False):
            continue  # the tied output layer's copy of the word embedding
        main = getattr(param, "main_param", None) if use_main_params else None
        if use_main_params and getattr(param, "main_param_sharded", False):
            if main is not None:  # None: this DP rank holds no part of it
                sharded.append(main)
        elif main is not None:
            whole.append(main)
        else:
            whole.append(param.detach())
    return whole, sharded


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[1] float64: the sum of the squared elements of ``tensors`` (each tensor's norm in fp32)."""
    if not tensors:
        return torch.zeros(1, dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum().reshape(1).to(device)


@torch.no_grad()
def calc_params_l2_norm(model: list[torch.nn.Module], ctx: ParallelContext, use_main_params: bool) -> float:
    """The global L2 norm of the parameters of the whole model (collective over every rank)."""
    params = [p for chunk in model for p in chunk.parameters()]
    whole, sharded = select_params_to_norm(params, ctx.tp_rank, use_main_params)
    device = get_collective_device(ctx.mp_group)
    total = sum_of_squares(whole, device)
    if use_main_params and ctx.dp_size * ctx.cp_size > 1:  # every DP x CP rank joins, also one holding no shard
        shards = sum_of_squares(sharded, device)
        dist.all_reduce(shards, group=ctx.reduce_group)
        total = total + shards
    else:
        total = total + sum_of_squares(sharded, device)
    if ctx.tp_size * ctx.pp_size > 1:
        dist.all_reduce(total, group=ctx.mp_group)
    return float(total) ** 0.5
