"""Our vocab-parallel cross-entropy on two tensor-parallel ranks equals torch's on the whole
vocabulary (loss and each rank's slice of the gradient), with targets on either rank and ignored."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.model.cross_entropy import vocab_parallel_cross_entropy
from megatron_ext.testing import run_ranks
from tests.unit.test_cross_entropy import IGNORE, _inputs, _loss_and_grad, _torch_reference

pytestmark = pytest.mark.distributed


def _tp_world(rank: int, world_size: int, dtype) -> dict:
    logits, target, weight = _inputs(dtype, vocab=64, seed=2)
    local = logits.detach().chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    group = dist.new_group(list(range(world_size)))
    loss, grad = _loss_and_grad(lambda x, t: vocab_parallel_cross_entropy(x, t, group), local, target, weight)
    ref, ref_grad = _loss_and_grad(_torch_reference, logits, target, weight)
    return {
        "loss": loss,
        "grad": grad,
        "ref": ref,
        "ref_grad": ref_grad.chunk(world_size, dim=-1)[rank],
        "target": target,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_tp_ranks_equal_the_whole_vocabulary(dtype):
    per_rank = run_ranks(_tp_world, 2, dtype, timeout=60)
    target = per_rank[0]["target"]
    valid = target != IGNORE
    assert (target[valid] < 32).any() and (target[valid] >= 32).any()  # targets on both ranks
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    for r in per_rank:
        torch.testing.assert_close(r["loss"], per_rank[0]["loss"])
        torch.testing.assert_close(r["loss"][valid], r["ref"][valid], rtol=1e-6, atol=1e-5)
        rows = valid.unsqueeze(-1).expand_as(r["grad"])
        torch.testing.assert_close(r["grad"][rows].float(), r["ref_grad"][rows].float(), **tol)
