"""The global gradient norm as a function of the gradients alone, whichever pipeline rank holds which stage.

Why: megatron-core's ``get_grad_norm_fp32`` (and ``optimizer.grad_norm_squared``, the same without its
host read) sums per rank first: each rank's multi-tensor L2 norm of its own gradients, squared, then one
all-reduce SUM over the grad-stats group. So the fp32 norm depends on which parameters share a rank:
1F1B at PP 2 sums layers 0-1 on rank 0 and 2-3 on rank 1, the V placement (ZBVZeroBubble) layers 0
and 3 on rank 0, interleaving layers 0 and 2. The gradients are the same bit for bit, the norms one
ulp apart, and clipping scales every gradient by that norm: at PP 2, --lr 0, the clipped gradients of
ZBV and 1F1B differed by 7.5e-9 from the first step whose norms differed; trained, the weights by
9.3e-6 after 40 steps (megatron-core's interleaved 1F1B parts from its 1F1B the same way).

What: with pipeline parallelism the sum is taken per *unit*: one parameter's tensor-parallel shard,
named by its global name (layer numbers of the whole model) and TP rank, the same under every placement.
Each rank writes the squared norm of each of its gradient tensors (fp64) into its unit's slot of a
vector that every rank indexes alike (the sorted union of the units, agreed once by an object
all-gather); one all-reduce SUM over the grad-stats group fills it (a slot has one writer, every other
rank adds +0.0: exact in any order), and each rank adds the slots up in that order and rounds once to
fp32. The per-tensor norms are fp32 multi-tensor norms (``torch._foreach_norm``), whose bits depend on
a tensor's values, length and 16-byte alignment only (CUDA's kernel takes its vectorised path on aligned
tensors): a misaligned one is copied first.

Invariant: where every rank holds its gradient tensors whole (no distributed optimizer, or data-parallel
size 1), the norm is a pure function of the gradients: bit for bit the same under every pipeline schedule
and stage placement of one layout (TP, DP, PP sizes). Under the distributed optimizer with DP > 1 a
parameter that a bucket's shard boundary cuts arrives as pieces, and where the cut falls follows the
chunk's buffer, i.e. the placement: there each tensor's norm is taken in fp64 and a unit is the fp64
sum of its pieces, within ~1e-16 of the whole's, so the rounded norm differs only when the two fall on
either side of an fp32 rounding boundary (a chance of order 1e-9 per cut parameter and step).
Cost: a vector of one fp64 per unit (hundreds) all-reduced instead of one fp32, and one object all-gather
at the first step. Pipeline size 1 keeps megatron-core's norm (nothing is placed).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.cpu_platform import get_collective_device
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.model.wrapping import unwrap_model

UNITS_ATTR = "grad_norm_units"  # on each child optimizer: {id(main param): (main param, unit)}


def get_global_param_names(model: list[torch.nn.Module]) -> dict[int, str]:
    """{id(parameter): its global name} over this rank's chunks (layer numbers of the whole model)."""
    names = {}
    for chunk in model:
        module = unwrap_model(chunk)
        offset = get_layer_offset(module)
        for local_name, param in module.named_parameters():
            names[id(param)] = get_global_name(local_name, offset)
    return names


def get_main_param_pairs(child: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, main parameter) of each parameter a megatron-core child optimizer steps: the
    distributed optimizer's (model, fp32 shard), Float16OptimizerWithFloat16Params' (model, fp32 copy),
    and the fp32 optimizer's parameters, which are their own main parameters (none for a stub)."""
    if getattr(child, "is_stub_optimizer", False):
        return []
    if hasattr(child, "model_float16_groups"):  # DistributedOptimizer
        groups = [(child.model_float16_groups, child.shard_fp32_from_float16_groups)]
        groups.append((child.model_fp32_groups, child.shard_fp32_groups))
    elif hasattr(child, "float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = [(child.float16_groups, child.fp32_from_float16_groups)]
        groups.append((child.fp32_from_fp32_groups, child.fp32_from_fp32_groups))
    else:
        params = child.get_parameters()
        groups = [([params], [params])]
    return [(m, p) for models, mains in groups for ms, ps in zip(models, mains) for m, p in zip(ms, ps)]


def maybe_apply_unit_grad_norm(optimizer: Any, model: list[torch.nn.Module], pp_size: int, tp_rank: int) -> bool:
    """With pipeline parallelism, make ``optimizer`` (megatron-core's ChainedOptimizer) compute the
    gradient norm per unit (module docstring), in our one-copy step (``grad_norm_squared``) and in
    megatron-core's own ``step`` (its ``get_grad_norm``); returns whether it did."""
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    if pp_size == 1:
        return False
    names = get_global_param_names(model)
    for child in children:
        pairs = get_main_param_pairs(child)
        setattr(child, UNITS_ATTR, {id(main): (main, (names[id(m)], tp_rank)) for m, main in pairs})
    optimizer.get_grad_norm = lambda: float(unit_grad_norm_squared(children)) ** 0.5
    return True


def has_unit_grad_norm(children: list) -> bool:
    return all(hasattr(c, UNITS_ATTR) for c in children)


def unit_grad_norm_squared(children: list) -> torch.Tensor:
    """[1] fp32 on the device: the squared global gradient norm summed per unit, one all-reduce per
    grad-stats group the children use (megatron-core's grouping of children)."""
    groups = [c.get_grad_stats_parallel_group() for c in children]
    shared = all(g == groups[0] for g in groups)
    parts = [(children, groups[0])] if shared else [([c], g) for c, g in zip(children, groups)]
    total = None
    for opts, group in parts:
        part = _part_norm_squared(opts, group)
        total = part if total is None else total + part
    return total


def _part_norm_squared(children: list, group: Any) -> torch.Tensor:
    tensors, units, fp64 = [], [], False
    for child in children:
        lookup = getattr(child, UNITS_ATTR)
        fp64 |= _cuts_parameters(child)
        for main in _params_for_norm(child):
            tensors.append(main.grad)
            units.append(lookup[id(main)][1])
    device = tensors[0].device if tensors else get_collective_device(group)
    index = _agreed_index(children[0], group, units)
    squares = torch.zeros(len(index), dtype=torch.float64, device=device)
    if tensors:
        norms = _tensor_norms([t if t.data_ptr() % 16 == 0 else t.clone() for t in tensors], fp64)
        slots = torch.tensor([index[u] for u in units], device=device)
        squares.index_copy_(0, slots, torch.stack(norms).double().square())
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(squares, group=group)
    return squares.sum().float().reshape(1)


def _params_for_norm(child: Any) -> list[torch.Tensor]:
    """megatron-core's ``get_main_grads_for_grad_norm`` filter, keeping the main parameters: a gradient,
    not the tied output layer's shared copy, not a tensor-parallel duplicate off TP rank 0."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    if getattr(child, "is_stub_optimizer", False):
        return []
    tp_group = getattr(child, "tp_group", None)
    return [
        p
        for p in child.get_parameters()
        if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group)
    ]


def _cuts_parameters(child: Any) -> bool:
    """The distributed optimizer over more than one DP rank: a parameter may arrive as pieces."""
    group = getattr(child, "data_parallel_group", None)
    return hasattr(child, "model_float16_groups") and group is not None and group.size() > 1


def _tensor_norms(tensors: list[torch.Tensor], fp64: bool) -> list[torch.Tensor]:
    if fp64:  # pieces of a cut parameter add up to the whole's norm within fp64 rounding
        return [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
    return list(torch._foreach_norm(tensors))


def _agreed_index(owner: Any, group: Any, units: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """{unit: slot}, the same on every rank of ``group``: the sorted union of every rank's units,
    gathered once and kept on ``owner``."""
    cache = owner.__dict__.setdefault("_grad_norm_index", {})
    key = id(group)
    if key not in cache:
        gathered = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, sorted(units), group=group)
        cache[key] = {u: i for i, u in enumerate(sorted({u for rank_units in gathered for u in rank_units}))}
    return cache[key]
