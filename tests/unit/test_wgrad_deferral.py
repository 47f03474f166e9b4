"""Refusals of the B/W split (model/wgrad_deferral.py) and its W's run-once contract."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_ext.model.wgrad_deferral import WeightGradWork, check_weight_grad_deferral


def _chunk(**config) -> torch.nn.Module:
    chunk = torch.nn.Linear(2, 2)
    chunk.config = types.SimpleNamespace(**config)
    return chunk


def test_megatron_cores_embedding_wgrad_deferral_is_refused_with_it():
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        check_weight_grad_deferral(
            [_chunk(defer_embedding_wgrad_compute=False), _chunk(defer_embedding_wgrad_compute=True)]
        )
    check_weight_grad_deferral([_chunk(defer_embedding_wgrad_compute=False)])


def test_transformer_engine_layers_are_refused():
    te_linear = type("TELayerNormColumnParallelLinear", (torch.nn.Linear,), {})
    te_linear.__module__ = "megatron.core.extensions.transformer_engine"
    chunk = _chunk(defer_embedding_wgrad_compute=False)
    chunk.qkv = te_linear(2, 2)
    with pytest.raises(ValueError, match="--transformer-impl local"):
        check_weight_grad_deferral([chunk])


def test_a_ddp_wrapped_chunk_is_refused():
    from megatron.core.distributed import DistributedDataParallel

    wrapped = DistributedDataParallel.__new__(DistributedDataParallel)  # (isinstance is all the check needs)
    with pytest.raises(RuntimeError, match="before wrap_with_ddp"):
        check_weight_grad_deferral([wrapped])


def test_a_deferred_weight_gradient_runs_once():
    layer = types.SimpleNamespace(wgrad_hooks=[])
    weight = torch.nn.Parameter(torch.zeros(3, 4))
    x, dy = torch.randn(5, 1, 4), torch.randn(5, 1, 3)
    work = WeightGradWork(layer, weight, None, x, dy, False, None)
    assert sum(t.numel() for t in work.held_tensors) == 5 * 4 + 5 * 3
    work()
    torch.testing.assert_close(weight.grad, dy.view(5, 3).t() @ x.view(5, 4))
    assert work.held_tensors == ()
    with pytest.raises(RuntimeError, match="ran twice"):
        work()
