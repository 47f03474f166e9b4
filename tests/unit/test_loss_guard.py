"""The non-finite guard on the loss (``loss.poison_non_finite``): a finite loss keeps its value and
gradient bit for bit; a non-finite one makes every gradient upstream NaN while its report keeps the
loss as computed (an inf shows as inf); the first non-finite micro-batch of a step is found."""

from __future__ import annotations

import torch

from megatron_ext.training.loss import compute_token_loss, find_non_finite_microbatch


def _grads(per_token_bump: float, poison: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    torch.manual_seed(0)
    w = torch.randn(4, 8, requires_grad=True)
    per_token = (w * 3.0).exp()  # [b, s] positive, finite
    bump = torch.zeros(4, 8)
    bump[1, 2] = per_token_bump  # a constant: it changes no gradient
    valid = torch.ones(4, 8, dtype=torch.bool)
    valid[0, :3] = False
    loss, num_tokens, report = compute_token_loss(per_token + bump, valid).to_megatron(poison=poison)
    loss.backward()
    return loss.detach(), w.grad, report


def test_a_finite_loss_keeps_its_value_and_gradient_bit_for_bit():
    loss, grad, report = _grads(0.0, poison=True)
    plain_loss, plain_grad, _ = _grads(0.0, poison=False)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert torch.equal(report["lm loss"], torch.stack([plain_loss, torch.tensor(29.0)]))


def test_an_inf_loss_with_finite_gradients_makes_them_nan_and_reports_inf():
    _, unguarded, report = _grads(float("inf"), poison=False)
    assert bool(torch.isfinite(unguarded).all())  # the case the guard exists for: finite gradients
    loss, grad, report = _grads(float("inf"), poison=True)
    valid = torch.ones(4, 8, dtype=torch.bool)
    valid[0, :3] = False  # ignored positions feed no loss: their gradient stays 0
    assert bool(torch.isnan(grad[valid]).all()) and bool((grad[~valid] == 0).all()) and bool(torch.isnan(loss))
    assert report["lm loss"][0] == float("inf")


def test_the_first_non_finite_microbatch_is_found():
    def report(x):
        return {"lm loss": torch.tensor([x, 3.0])}

    assert find_non_finite_microbatch([report(1.0), report(2.0)]) is None
    assert find_non_finite_microbatch([report(1.0), report(float("inf")), report(float("nan"))]) == 1
