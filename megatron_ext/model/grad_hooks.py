"""DDP's per-parameter grad-ready hook, with megatron-core's per-call lookups made once at wrap time.

Invariant: after each parameter's gradient is accumulated, ``main_grad``, ``param.grad`` and the
bucket group's readiness are what megatron-core's hook (``DistributedDataParallel.
_make_backward_post_hook``) leaves: nothing while a CUDA graph is captured; else ``param.grad`` added
into ``main_grad`` unless the linear already accumulated it there (``grad_added_to_main_grad``, a
tied weight's ``zero_out_wgrad`` added anyway), ``param.grad`` cleared and, under
--overlap-grad-reduce, megatron-core's own ``register_grad_ready`` called on the parameter's bucket
group (which starts the bucket's reduction once every parameter is ready).

megatron-core's hook runs for every parameter in every micro-batch and, per call, asks
``is_graph_capturing()``, looks the parameter up in ``param_to_bucket_group`` (torch's
``Tensor.__hash__`` is a Python function), and reads ``zero_out_wgrad`` with ``getattr``: 4-5 Python
calls around the hook's own (135 per micro-batch at 4 Llama-style layers, 27 parameters). Here the
bucket group, the overlap setting and ``zero_out_wgrad`` (megatron-core marks the tied weight while
building the model, before DDP) are read when DDP registers the hook, and the capture flag as the
module global that ``is_graph_capturing()`` returns: one call per parameter (27). Under
--overlap-grad-reduce ``register_grad_ready`` is called only where it acts, in the last micro-batch
(inside ``no_sync`` it returns at once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer import cuda_graphs


class LeanGradHookDDP(DistributedDataParallel):
    """megatron-core's DDP whose grad-ready hooks (on the grad accumulators, or handed to a layer
    that defers its weight gradient) are ``build_grad_ready_hook``'s."""

    def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Callable[..., None]:
        return build_grad_ready_hook(self, param)


def build_grad_ready_hook(ddp: DistributedDataParallel, param: torch.nn.Parameter) -> Callable[..., None]:
    """The hook megatron-core's ``ddp._make_backward_post_hook(param)`` returns, same effects,
    with what cannot change after DDP's construction resolved now."""
    bucket_group = ddp.param_to_bucket_group.get(param)
    if bucket_group is None:  # upstream's hook does nothing for a parameter without a buffer
        return _no_grad_ready_work
    # megatron-core adds a tied weight's zeroed dummy gradient: its main_grad holds the other use's
    always_add = bool(getattr(param, "zero_out_wgrad", False))
    if ddp.ddp_config.overlap_grad_reduce:
        return _overlapped_hook(ddp, param, bucket_group, always_add)
    return _accumulating_hook(param, always_add)


def _no_grad_ready_work(*unused) -> None:
    return None


def _accumulating_hook(param: torch.nn.Parameter, always_add: bool) -> Callable[..., None]:
    def hook(*unused) -> None:
        if cuda_graphs._IS_GRAPH_CAPTURING:
            return
        assert param.requires_grad
        grad = param.grad
        if grad is not None and (always_add or not param.grad_added_to_main_grad):
            param.main_grad.add_(grad.data)
        param.grad = None

    return hook


def _overlapped_hook(
    ddp: DistributedDataParallel, param: torch.nn.Parameter, bucket_group: Any, always_add: bool
) -> Callable[..., None]:
    """``bucket_group``: megatron-core's ``_ParamAndGradBucketGroup`` holding ``param``."""
    register_grad_ready = bucket_group.register_grad_ready

    def hook(*unused) -> None:
        if cuda_graphs._IS_GRAPH_CAPTURING:
            return
        assert param.requires_grad
        grad = param.grad
        assert grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        if always_add or not param.grad_added_to_main_grad:
            param.main_grad.add_(grad.data)
        param.grad = None
        if bucket_group.is_last_microbatch:  # before the last micro-batch register_grad_ready does nothing
            register_grad_ready(param, ddp.force_all_reduce)  # read per call, as upstream: a public attribute

    return hook
