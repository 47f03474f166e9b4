"""The loss-spike guard's pure parts: the reference window, the device decision, the optimizer veto."""

from __future__ import annotations

import math

import torch

from megatron_ext.config import build_job_config
from megatron_ext.training.optimizer import step_optimizer_fetching
from megatron_ext.training.spike import SpikeGuard, build_spike_guard, is_spike

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128)


def test_reference_is_the_largest_of_the_last_n_applied_losses():
    guard = SpikeGuard(factor=3.0, window=2)
    assert guard.get_reference() is None and guard.get_threshold() == math.inf  # not armed yet
    guard.record(5.0, applied=True)
    assert guard.get_reference() is None
    guard.record(4.0, applied=True)
    assert guard.get_reference() == 5.0 and guard.get_threshold() == 15.0
    guard.record(100.0, applied=False)  # a skipped step never enters the window
    guard.record(float("nan"), applied=True)  # nor a non-finite one
    assert guard.get_reference() == 5.0 and guard.largest_ratio == 20.0
    guard.record(3.0, applied=True)
    assert guard.get_reference() == 4.0  # 5.0 left the window: the reference follows the loss down


def test_decision_on_the_device():
    assert is_spike(torch.tensor([60.0, 4.0], dtype=torch.float64), 10.0).tolist() == [1.0, 15.0]
    assert is_spike(torch.tensor([40.0, 4.0], dtype=torch.float64), 10.0).tolist() == [0.0, 10.0]  # not above
    assert is_spike(torch.tensor([0.0, 0.0], dtype=torch.float64), 10.0).tolist() == [0.0, 0.0]  # no token
    inf = is_spike(torch.tensor([math.inf, 4.0], dtype=torch.float64), 10.0)
    assert inf[0] == 0.0  # a non-finite loss is the non-finite guard's
    assert is_spike(torch.tensor([1e9, 1.0], dtype=torch.float64), math.inf)[0] == 0.0  # not armed


def test_off_by_default():
    assert build_spike_guard(build_job_config(MOCK).training) is None
    guard = build_spike_guard(build_job_config({**MOCK, "skip_spiky_loss_factor": 8.0}).training)
    assert guard.factor == 8.0 and guard.losses.maxlen == 100


class _Optimizer:
    """megatron-core's optimizer.step() contract, counting calls (the path without the fused check)."""

    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1
        return True, 1.5, None


def test_veto_skips_megatron_cores_step_without_the_fused_check():
    opt = _Optimizer()
    ok, norm, fetched = step_optimizer_fetching(opt, False, [torch.tensor([1.0, 9.0])], veto=0)
    assert (ok, norm, fetched, opt.steps) == (False, None, [[1.0, 9.0]], 0)
    ok, norm, fetched = step_optimizer_fetching(opt, False, [torch.tensor([0.0, 2.0])], veto=0)
    assert (ok, norm, fetched, opt.steps) == (True, 1.5, [[0.0, 2.0]], 1)
