"""The CP attention's one collective: a rank's local [K;V] all-gathered over the CP group, its
gradient reduce-scattered back.

Invariant: per layer and micro-batch, one all-gather forward (again when core attention is
recomputed) and one reduce-scatter backward, each of (c - 1) / c x T x 2 ng x hn elements moved
per rank; nothing else crosses the CP group (no sizes are exchanged: every CP rank holds T / c
tokens by construction of the layout, and a gloo all-gather whose ranks pass different sizes aborts
the process).

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (a FutureWarning per
call) for ``all_gather_single`` / ``reduce_scatter_single``, which torch 2.11 (the GPU machines)
lacks: ``get_collective`` picks the new name where torch has it (registered in compat.py), looked up
at call time so that a test's counting wrapper sees every call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# (new name, the deprecated one torch < 2.13 has)
ALL_GATHER = ("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER = ("reduce_scatter_single", "reduce_scatter_tensor")


def get_collective(names: tuple[str, str]):
    """``torch.distributed``'s function of the first name it has (the ``_single`` one on torch >= 2.13)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"torch {torch.__version__} has neither torch.distributed.{names[0]} nor {names[1]}")


def all_gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each of the c ranks -> [c n, ...], rank-major (rank 0's rows, then rank 1's, ...)."""
    size = dist.get_world_size(group)
    out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    get_collective(ALL_GATHER)(out, local.contiguous(), group=group)
    return out


def reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """[c n, ...] on each rank -> [n, ...]: the sum over ranks of this rank's block of rows."""
    size = dist.get_world_size(group)
    out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=full.dtype, device=full.device)
    get_collective(REDUCE_SCATTER)(out, full.contiguous(), group=group)
    return out


class GatherFromContextParallelRegion(torch.autograd.Function):
    """Forward: all-gather over the CP group (rank-major). Backward: reduce-scatter of the gradient
    (every rank's queries contributed to every rank's keys and values). Saves nothing."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_rows(local, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_rows(grad, ctx.group), None


def gather_keys_values(key: torch.Tensor, value: torch.Tensor, group) -> torch.Tensor:
    """key, value [n, b, ng, hn] local -> [c n, b, 2 ng, hn]: every rank's [K;V] in one buffer,
    rank-major (one collective for both, one for both gradients)."""
    return GatherFromContextParallelRegion.apply(torch.cat((key, value), dim=2), group)
