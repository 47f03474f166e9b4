"""A save never publishes non-finite weights: this rank's check, before its shards are written.

Invariant: a checkpoint is published only when every rank found the model parameters it holds
finite at the save step. The model parameters stand for the fp32 main parameters too (checked in
megatron-core 0.16.1): its Float16Optimizer copies every main parameter into its bf16/fp16 model
parameter after each applied update (``_copy_main_params_to_model_params``); the distributed
optimizer copies each rank's main shard into the parameter buffer the model parameters view, and
all-gathers it (``params_synced`` completes an overlapped all-gather before any save); the fp32
optimizer steps on the model parameters themselves; a skipped update changes neither copy. A cast
keeps NaN and Inf, so non-finite main parameters make non-finite model parameters. The converse
can happen (a finite fp32 value above 65504 is Inf in fp16): that state is refused as well, since
it is the model that computes.

The verdict adds no collective: it rides in the save's agreements (``directory.py``: the
write-failure all-reduce; ``async_save.py``: the exit decision's per-step flags), and a rank whose
weights are not finite writes no shard.

Cost: one read of this rank's parameters, at saves only: about 1% of a 1 GiB per rank save here
(``python -m bench.finite_check``).
``torch.aminmax`` per tensor: its min and max are both finite exactly when every element is (NaN
propagates), it allocates no tensor the size of its input (``isfinite().all()`` does, and is
8-13x slower on the CPU) and cannot overflow (a sum of finite values can).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from megatron_ext.model.init_weights import get_global_name, get_layer_offset


def find_non_finite(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], int]:
    """(names of the tensors holding a NaN or an Inf, number of tensors checked); one host
    synchronisation for all of them."""
    names, extrema = [], []
    for name, tensor in named_tensors:
        if tensor.numel():  # aminmax refuses an empty tensor, which holds nothing non-finite
            names.append(name)
            extrema.append(torch.stack(torch.aminmax(tensor.detach())).float())  # [2]: min, max
    if not extrema:
        return [], 0
    finite = torch.isfinite(torch.stack(extrema)).all(dim=1).tolist()
    return [name for name, ok in zip(names, finite) if not ok], len(names)


def get_named_parameters(model: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, parameter) of every model chunk on this rank, through megatron-core's DDP and
    Float16Module wrappers (layer indices made global, as the checkpoint names them)."""
    for chunk in model:
        module = chunk
        while hasattr(module, "module"):
            module = module.module
        offset = get_layer_offset(module)
        for local_name, param in module.named_parameters():
            yield get_global_name(local_name, offset), param


def describe_non_finite_weights(model: list[torch.nn.Module]) -> str | None:
    """None when every parameter of this rank is finite, else what is not (its first parameter's
    name and how many more): what this rank says when a save is refused."""
    bad, checked = find_non_finite(get_named_parameters(model))
    if not bad:
        return None
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return f"{bad[0]}{more} of {checked} parameter tensors"
