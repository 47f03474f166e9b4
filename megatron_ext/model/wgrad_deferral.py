"""The B/W split in megatron-core's local-spec linear layers: weight gradients (W) deferred into a
``WeightGradQueue`` while a zero-bubble schedule runs the input gradient (B).

``apply_weight_grad_deferral(chunks, queue)`` makes every column- and row-parallel linear of the
chunks (QKV, proj, fc1 gated or not, fc2, the output layer, tied or not) run its backward through
``DeferrableLinear``: the input gradient, its TP all-reduce / SP reduce-scatter and the bias
gradient at once (B); the weight-gradient GEMM as a ``WeightGradWork`` handed to ``queue.defer``
while the backward runs inside ``queue.capture(key)``, and at once otherwise. Norms, biases and the
embedding's gradient stay in B. Without the deferral installed, megatron-core's code path runs,
untouched.

Invariants:
- Numbers: a W, deferred or not, is megatron-core's own GEMM on the same tensors (the fused
  ``wgrad_gemm_accum_*`` into ``main_grad``, or ``grad_output^T @ input`` into ``param.grad``), so
  run in the schedule's order (each weight's micro-batches in order) the gradients are bitwise
  1F1B's.
- DDP's gradient-ready hook moves with W: a deferred weight is marked ``skip_backward_post_hook``
  and, with megatron-core DDP's ``delay_wgrad_compute`` seam (``wrap_with_ddp`` turns it on), DDP
  hands the layer the hook instead of registering it on the weight's AccumulateGrad node. B returns
  no weight gradient and fires nothing; W writes the gradient (into ``main_grad`` with the dummy
  ``param.grad`` megatron-core's fused path returns, or as ``param.grad`` unfused) and then runs the
  hook, which adds an unfused gradient into ``main_grad`` and, under ``--overlap-grad-reduce``,
  registers the weight ready in the last micro-batch (outside ``no_sync``). So no bucket's reduce
  starts before the W of its last weight.
- TP / SP: with sequence parallelism W all-gathers the layer's input shard again at W time (the
  all-gather megatron-core's backward runs for its wgrad, moved from B to W), in deferral order; W
  keeps only the shard [s/tp, b, h] the forward saved, never the gathered [s, b, h] (TP times the
  activation). All TP ranks of a stage run the same actions, and autograd defers their W in the same
  order, so the gathers match across the group as megatron-core's own backward collectives do.
- Recompute: a recomputed layer's B re-runs its forward (megatron-core's checkpoint); the W deferred
  by that backward keeps the recomputed inputs and the output gradients until it runs (nothing is
  recomputed a second time).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext.pipeline.wgrad_queue import WeightGradQueue


class WeightGradWork:
    """One linear layer's weight gradient for one micro-batch: callable once.

    Holds ``input`` (the forward's saved input: [s, b, in] or, with SP, the local shard
    [s/tp, b, in]) and ``grad_output`` [s, b, out] until it runs, then drops them.
    """

    def __init__(
        self,
        layer: torch.nn.Module,
        weight: torch.nn.Parameter,
        main_grad: torch.Tensor | None,
        input_: torch.Tensor,
        grad_output: torch.Tensor,
        sequence_parallel: bool,
        tp_group: Any,
    ):
        self.layer, self.weight, self.main_grad = layer, weight, main_grad
        self.input, self.grad_output = input_, grad_output
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group

    @property
    def held_tensors(self) -> tuple[torch.Tensor, ...]:
        """What this W keeps alive until it runs (empty afterwards)."""
        return tuple(t for t in (self.input, self.grad_output) if t is not None)

    @torch.no_grad()  # as inside autograd's backward: the saved tensors require grad
    def __call__(self) -> None:
        if self.input is None:
            raise RuntimeError("a deferred weight gradient ran twice")
        total_input = gather_sequence_shards(self.input, self.tp_group) if self.sequence_parallel else self.input
        grad_weight = compute_weight_grad(self.weight, self.main_grad, total_input, self.grad_output)
        self.input = self.grad_output = None
        deliver_weight_grad(self.layer, self.weight, grad_weight)


def gather_sequence_shards(shard: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """[s/tp, b, h] shards of the TP group -> [s, b, h], into megatron-core's shared "mpu" buffer
    (as its backward gathers for wgrad; the result is used at once, before any other gather)."""
    from megatron.core.parallel_state import get_global_memory_buffer
    from megatron.core.tensor_parallel.layers import dist_all_gather_func

    size = list(shard.size())
    size[0] *= tp_group.size()
    buffer = get_global_memory_buffer().get_tensor(size, shard.dtype, "mpu")
    dist_all_gather_func(buffer, shard, group=tp_group)
    return buffer


def compute_weight_grad(
    weight: torch.nn.Parameter, main_grad: torch.Tensor | None, total_input: torch.Tensor, grad_output: torch.Tensor
) -> torch.Tensor | None:
    """megatron-core's weight-gradient step of ``LinearWithGradAccumulationAndAsyncCommunication``:
    fused, ``main_grad [out, in] += grad_output^T @ total_input`` and the dummy gradient that DDP's
    hook expects (zeros where the weight is ``zero_out_wgrad``; None without DDP); unfused, the
    gradient itself. ``total_input`` [s, b, in], ``grad_output`` [s, b, out]."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    if main_grad is None:
        return grad_output.t().matmul(total_input)
    if main_grad.dtype == torch.float32:
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError(f"unsupported main_grad dtype {main_grad.dtype} for gradient accumulation fusion")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    fill = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return fill(main_grad.shape, dtype=total_input.dtype, device=total_input.device)


def deliver_weight_grad(layer: torch.nn.Module, weight: torch.nn.Parameter, grad: torch.Tensor | None) -> None:
    """Hand a computed weight gradient over as autograd's AccumulateGrad would, then run DDP's
    hook where DDP gave one (it adds an unfused ``param.grad`` into ``main_grad``, clears it and,
    under --overlap-grad-reduce, registers the weight ready)."""
    if grad is not None:
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad.add_(grad)
    for hook in layer.wgrad_hooks:
        hook()


def _custom_fwd_bwd() -> tuple[Callable, Callable]:
    from megatron.core.tensor_parallel.layers import custom_bwd, custom_fwd

    return custom_fwd, custom_bwd


_custom_fwd, _custom_bwd = _custom_fwd_bwd()


class DeferrableLinear(torch.autograd.Function):
    """megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` (forward unchanged:
    ``output [s, b, out] = gather_sp(input) @ weight^T + bias``) with its weight gradient as a
    ``WeightGradWork``, deferred into ``layer.wgrad_queue`` inside a capture, run at once outside."""

    @staticmethod
    @_custom_fwd
    def forward(
        ctx, input_, weight, bias, layer, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, tp_group
    ):
        from megatron.core.parallel_state import get_global_memory_buffer
        from megatron.core.tensor_parallel.layers import dist_all_gather_func

        ctx.save_for_backward(input_, weight)
        # as upstream: main_grad kept on ctx (the buffer DDP mapped the weight to at this forward)
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.layer, ctx.use_bias, ctx.tp_group = layer, bias is not None, tp_group
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        total_input = input_
        if sequence_parallel:
            size = list(input_.size())
            size[0] *= tp_group.size()
            total_input = get_global_memory_buffer().get_tensor(size, input_.dtype, "mpu")
            dist_all_gather_func(total_input, input_, group=tp_group)
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel.layers import dist_reduce_scatter_func

        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:  # overlaps an at-once W, as upstream
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        if ctx.sequence_parallel:
            sub_grad_input = torch.empty(input_.size(), dtype=input_.dtype, device=grad_input.device)
            handle = dist_reduce_scatter_func(sub_grad_input, grad_input, group=ctx.tp_group, async_op=True)
            grad_input = sub_grad_input
        work = WeightGradWork(
            ctx.layer, weight, ctx.main_grad, input_, grad_output, ctx.sequence_parallel, ctx.tp_group
        )
        if not ctx.layer.wgrad_queue.defer(work):
            work()
        grad_bias = None
        if ctx.use_bias:  # upstream sums the 2-D contiguous view
            grad_bias = grad_output.contiguous().view(-1, grad_output.shape[-1]).sum(dim=0)
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None, None, None, None


def _deferrable_forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (upstream's name)
    """``_forward_impl`` of a linear with deferral installed (bound to the instance): upstream's
    arguments, our Function; a frozen weight keeps upstream's path."""
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    if not weight.requires_grad:
        return linear_with_frozen_weight(input, weight, *args, **kwargs)
    if weight is not self.weight:
        raise RuntimeError("a linear layer with weight-gradient deferral was given another layer's weight")
    bias, fusion, allreduce_dgrad, sequence_parallel = (
        kwargs[k] for k in ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel")
    )
    tp_group = get_tensor_model_parallel_group_if_none(kwargs.get("tp_group"))
    return DeferrableLinear.apply(input, weight, bias, self, fusion, allreduce_dgrad, sequence_parallel, tp_group)


def _register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[..., None]) -> None:
    """megatron-core DDP's seam (``delay_wgrad_compute``): the weight's grad-ready hook, run by W."""
    self.wgrad_hooks.append(hook)


def _deferrable_linears(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")


def check_weight_grad_deferral(chunks: list[torch.nn.Module]) -> None:
    """Refuse what the split cannot serve, before anything is changed."""
    from megatron.core.distributed import DistributedDataParallel

    for i, chunk in enumerate(chunks):
        if isinstance(chunk, DistributedDataParallel):
            raise RuntimeError(
                f"chunk {i} is already wrapped in DDP, which registered its gradient hooks on "
                f"the weights: apply the weight-gradient deferral before wrap_with_ddp"
            )
        config = getattr(chunk, "config", None)
        if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
            raise ValueError(
                "megatron-core's defer_embedding_wgrad_compute (the output layer's W buffered to "
                "the pipeline flush) and a zero-bubble schedule's W queue both defer the output "
                "layer's weight gradient: turn defer_embedding_wgrad_compute off"
            )
        ours = [name for name, m in chunk.named_modules() if getattr(m, "traceable_linear", False)]
        if ours:
            raise ValueError(
                f"chunk {i}'s {ours[0]} runs our traceable linear (model/compile.py: --torch-compile's, "
                f"or the lean TP-1 eager one), whose backward accumulates the weight gradient itself, "
                f"so no W would reach the zero-bubble queue: drop --torch-compile with a zero-bubble "
                f"--pipeline-schedule (run.prepare_layers skips the lean linears under one)"
            )
        te = sorted({type(m).__name__ for m in chunk.modules() if type(m).__module__.startswith(TE_MODULES)})
        if te:
            raise ValueError(
                f"chunk {i} has Transformer Engine layers ({', '.join(te)}), whose weight gradients "
                f"the B/W split does not defer (their W would run in B): use --transformer-impl local "
                f"with a zero-bubble --pipeline-schedule"
            )
        model = chunk
        while hasattr(model, "module"):  # Float16Module
            model = model.module
        if (
            getattr(model, "share_embeddings_and_output_weights", False)
            and getattr(model, "pre_process", False)
            and getattr(model, "post_process", False)
        ):
            raise ValueError(
                f"chunk {i} holds the embedding and the output layer tied to it (pipeline size 1): "
                f"their one weight would get the embedding's gradient in B and the output layer's in "
                f"W, out of 1F1B's order; zero-bubble schedules need --pipeline-model-parallel-size > 1 "
                f"(or --untie-embeddings-and-output-weights)"
            )


def apply_weight_grad_deferral(chunks: list[torch.nn.Module], queue: WeightGradQueue) -> int:
    """Install the B/W split on every column- and row-parallel linear of ``chunks`` (GPTModels,
    optionally inside Float16Module; before ``wrap_with_ddp``). Idempotent per layer; returns how
    many linear layers defer their W. Outside ``queue.capture`` the numbers are unchanged."""
    check_weight_grad_deferral(chunks)
    count = 0
    for chunk in chunks:
        for layer in _deferrable_linears(chunk):
            if getattr(layer, "wgrad_queue", None) is not None:
                layer.wgrad_queue = queue
                count += 1
                continue
            layer.wgrad_queue = queue
            layer.wgrad_hooks = []
            layer._forward_impl = types.MethodType(_deferrable_forward_impl, layer)
            layer.register_wgrad_accumulation_and_reduce_hooks = types.MethodType(
                _register_wgrad_accumulation_and_reduce_hooks, layer
            )
            layer.weight.skip_backward_post_hook = True
            count += 1
    return count


def uses_weight_grad_deferral(chunks: list[torch.nn.Module]) -> bool:
    """Whether any linear of ``chunks`` defers its W (``wrap_with_ddp`` then moves DDP's hooks)."""
    return any(getattr(p, "skip_backward_post_hook", False) for chunk in chunks for p in chunk.parameters())
