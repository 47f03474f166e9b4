"""Gradient-accumulation fusion without Apex: a weight's gradient GEMM accumulates straight into its
fp32 ``main_grad`` (megatron-core's ``--gradient-accumulation-fusion``, on by default in Megatron-LM).

Without it, megatron-core's linear layers write each weight gradient as a new bf16 tensor and
DDP's hook adds it into the fp32 gradient buffer: a kernel, an allocation and 10 bytes of memory
traffic per parameter per micro-batch (~5 ms per micro-batch for 1.3B parameters on an H100, seen
in a profile). megatron-core fuses this only through Apex's ``fused_weight_gradient_mlp_cuda``
extension; torch has the GEMM itself: ``addmm`` with ``out_dtype`` (bf16/fp16 inputs, fp32
accumulator, in place) on CUDA. ``WgradAccumulation`` stands in for Apex's module where Apex is
missing (registered in compat.py); on the CPU, which has no mixed-dtype GEMM, the same call adds
the product into ``main_grad`` (the unfused path's numbers), so CI runs megatron-core's fused code
path (``grad_added_to_main_grad``, the tied embedding's ``zero_out_wgrad``) on every test.
"""

from __future__ import annotations

import torch


def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_output [n, out]^T @ total_input [n, in]``, in ``main_grad``'s dtype."""
    if main_grad.dtype == total_input.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(grad_output.t() @ total_input)


class WgradAccumulation:
    """The two functions megatron-core calls on Apex's ``fused_weight_gradient_mlp_cuda``."""

    wgrad_gemm_accum_fp32 = staticmethod(accumulate_wgrad)
    wgrad_gemm_accum_fp16 = staticmethod(accumulate_wgrad)


def enable_gradient_accumulation_fusion(chunks: list[torch.nn.Module]) -> None:
    """Turn the fusion on in model chunks that megatron-core's DDP is about to wrap: the fused path
    reads ``weight.main_grad``, which only DDP's gradient buffers provide (a chunk run without DDP,
    as conversion tools and kernel tests do, keeps the unfused path: megatron-core would fail on a
    missing ``main_grad`` in its backward). megatron-core's linear layers copy the config flag when
    built, so both the flag and theirs are set. Transformer Engine's layers (built with the flag
    off) keep their own path."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    apply_gradient_accumulation_fusion()
    for chunk in chunks:
        linears = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        for module in linears:
            module.gradient_accumulation_fusion = True
        if linears:
            chunk.config.gradient_accumulation_fusion = True


def apply_gradient_accumulation_fusion() -> None:
    """Make megatron-core 0.16.1's linear layers find ``WgradAccumulation`` where Apex's extension
    is not installed (Apex's stays where it is). Idempotent."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = WgradAccumulation
        layers._grad_accum_fusion_available = True
