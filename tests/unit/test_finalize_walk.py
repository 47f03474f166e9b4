"""training/finalize.py skips megatron-core's ``reset_model_temporary_tensors`` (a walk over every module,
each step) exactly where that function would touch nothing: checked against the function itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

from megatron_ext.training.finalize import resets_temporaries


class _Router(torch.nn.Module):
    """Has what the reset looks for: an expert bias with its token counts, and a global aux-loss tracker."""

    def __init__(self):
        super().__init__()
        self.expert_bias = torch.zeros(2)
        self.local_tokens_per_expert = torch.ones(2)
        self.resets = 0

    def reset_global_aux_loss_tracker(self):
        self.resets += 1


@pytest.mark.parametrize(
    "bias,balancing",
    [
        (False, "aux_loss"),
        (False, "none"),
        (True, "aux_loss"),
        (False, "global_aux_loss"),
        (False, ["seq_aux_loss", "global_aux_loss"]),
    ],
)
def test_skipped_exactly_where_megatron_cores_reset_touches_nothing(bias, balancing):
    config = SimpleNamespace(moe_router_enable_expert_bias=bias, moe_router_load_balancing_type=balancing)
    router = _Router()
    reset_model_temporary_tensors(config, [torch.nn.Sequential(torch.nn.Linear(2, 2), router)])
    touched = router.resets > 0 or not bool(router.local_tokens_per_expert.eq(1).all())
    assert resets_temporaries(config) is touched
