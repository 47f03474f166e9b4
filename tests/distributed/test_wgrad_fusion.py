"""Gradient-accumulation fusion (model/wgrad.py): megatron-core's fused weight-gradient path, run
through our stand-in for Apex's extension, gives the gradients of its unfused path, tied
embedding included (the output layer's weight gradient and the embedding's both reach it)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.model.wgrad import accumulate_wgrad
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import (
    MarkovDataset,
    build_tiny_run,
    fetch_step_microbatches,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.step import run_forward_backward

pytestmark = pytest.mark.distributed


def _step_grads(fused: bool, bf16: bool) -> tuple[bool, dict[str, torch.Tensor]]:
    """One step's gradients, with (the default) or without --no-gradient-accumulation-fusion."""
    run = build_tiny_run(tiny_values(bf16=bf16, gradient_accumulation_fusion=fused), MarkovDataset(32, mask_every=1))
    indices = get_microbatch_indices(0, run.global_batch_size, 2, run.ctx.dp_rank, run.ctx.dp_size)
    run_forward_backward(run.model, fetch_step_microbatches(run.train_ds, indices), 32)  # 4 micro-batches
    linears = [m for m in run.model[0].modules() if hasattr(m, "gradient_accumulation_fusion")]
    out = all(m.gradient_accumulation_fusion for m in linears) and len(linears) > 0, gather_full_grads(run)
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int) -> dict:
    return {(fused, bf16): _step_grads(fused, bf16) for fused in (True, False) for bf16 in (False, True)}


@pytest.fixture(scope="module")
def grads():
    (out,) = run_ranks(_world, 1, timeout=120)
    return out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_fused_weight_gradients_equal_the_unfused_path(grads, bf16):
    (fused_on, fused), (fused_off, unfused) = grads[(True, bf16)], grads[(False, bf16)]
    assert fused_on and not fused_off  # every linear layer fused, or none
    assert fused.keys() == unfused.keys() and "embedding.word_embeddings.weight" in fused
    # fp32: one GEMM with beta = 1 against GEMM then add; bf16: the tied embedding's two parts are
    # summed in fp32 instead of bf16 (the other weights see the same numbers on the CPU)
    tol = 1e-6 if not bf16 else 1e-2
    for name, g in unfused.items():
        assert g.abs().sum() > 0, name
        assert (fused[name] - g).norm() <= tol * g.norm(), name


def test_accumulate_wgrad_adds_the_weight_gradient_in_main_grads_dtype():
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(10, 6, generator=gen), torch.randn(10, 4, generator=gen)
    main = torch.randn(4, 6, generator=gen)
    expected = main + dy.t() @ x
    accumulate_wgrad(x, dy, main)  # fp32 inputs: in-place addmm
    torch.testing.assert_close(main, expected)
    main32 = torch.zeros(4, 6)
    accumulate_wgrad(x.bfloat16(), dy.bfloat16(), main32)  # bf16 inputs into an fp32 buffer
    assert main32.dtype == torch.float32
    torch.testing.assert_close(main32, (dy.bfloat16().t() @ x.bfloat16()).float())
