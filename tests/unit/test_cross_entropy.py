"""Our fp32 cross-entropy (model/cross_entropy.py) against torch's on fp32 logits, and megatron-core's
(what it replaces), for fp32 and bf16 logits, with ignored targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.model.cross_entropy import vocab_parallel_cross_entropy

IGNORE = -100


def _inputs(dtype, s=6, b=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(s, b, vocab, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (s, b), generator=g)
    target[1, 2] = target[4, 0] = IGNORE
    weight = torch.rand(s, b, generator=g)  # a non-uniform incoming gradient
    return logits, target, weight


def _loss_and_grad(fn, logits, target, weight):
    loss = fn(logits, target)
    (loss * weight).sum().backward()
    grad, logits.grad = logits.grad, None
    return loss.detach(), grad


def _torch_reference(logits, target):
    """torch's cross-entropy on the fp32 copy of the logits, per token, unreduced."""
    flat = logits.float().reshape(-1, logits.size(-1))
    return F.cross_entropy(flat, target.reshape(-1).clamp(min=0), reduction="none").reshape(target.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torchs_fp32_cross_entropy_and_its_gradient(dtype):
    logits, target, weight = _inputs(dtype)
    ours, ours_grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, weight)
    ref, ref_grad = _loss_and_grad(_torch_reference, logits, target, weight)
    valid = target != IGNORE
    assert ours.dtype == torch.float32 and ours_grad.dtype == dtype
    torch.testing.assert_close(ours[valid], ref[valid], rtol=1e-6, atol=1e-5)
    # the gradient of the valid tokens (the reference treats an ignored target as token 0)
    rows = valid.unsqueeze(-1).expand_as(ours_grad)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)  # one bf16 rounding
    torch.testing.assert_close(ours_grad[rows].float(), ref_grad[rows].float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_megatron_cores_vocab_parallel_cross_entropy(dtype, monkeypatch):
    """Upstream's on one rank (its TP group stubbed to a group of one), ignored targets included."""
    from megatron.core.tensor_parallel import cross_entropy as upstream

    class _One:
        def size(self):
            return 1

        def rank(self):
            return 0

    monkeypatch.setattr(upstream, "get_tensor_model_parallel_group", lambda: _One())
    monkeypatch.setattr(upstream, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(upstream, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(upstream.torch.distributed, "all_reduce", lambda *a, **k: None)
    logits, target, weight = _inputs(dtype, seed=1)
    ours, ours_grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, weight)
    theirs, theirs_grad = _loss_and_grad(
        lambda x, t: upstream.vocab_parallel_cross_entropy(x.float(), t), logits, target, weight
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)  # ignored targets too
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(ours_grad.float(), theirs_grad.float(), **tol)


def test_a_confident_target_keeps_its_small_gradient():
    """p -> 1 at the target: the target gradient (p - 1) g is formed in fp32, not from a rounded p."""
    logits = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    logits[0, 0, 3] = 12.0  # p(target) = 1 - 7 e^-12 ~ 1 - 4.3e-5
    logits.requires_grad_()
    vocab_parallel_cross_entropy(logits, torch.tensor([[3]])).sum().backward()
    expected = -7 * torch.exp(torch.tensor(-12.0)) / (1 + 7 * torch.exp(torch.tensor(-12.0)))
    assert logits.grad[0, 0, 3].item() == pytest.approx(expected.item(), rel=1e-2)
