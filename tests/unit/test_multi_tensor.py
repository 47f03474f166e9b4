"""Our stand-ins for megatron-core's local multi-tensor fallbacks (no Apex, no TE): the same
values as upstream's per-tensor loops, installed only where upstream fell back."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.optim import torch_adam_optimizers, use_fused_adam
from megatron_ext.training.optimizer import apply_multi_tensor_fallback_fix, foreach_l2_norm, foreach_scale


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 3), (5,), (2, 4, 6), (1,))]


def test_l2_norm_equals_the_norm_of_every_element():
    a, b = _tensors(), _tensors()[:2]
    norm, per_tensor = foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [a, b], False)
    reference = torch.cat([t.reshape(-1) for t in a + b]).double().norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(norm.item() - reference.item()) <= 1e-5 * reference.item()
    empty, _ = foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [[]], False)
    assert empty.tolist() == [0.0]


@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_scale_writes_src_times_scale_into_dst(scale, dst_dtype):
    src = _tensors()
    dst = [torch.zeros_like(t, dtype=dst_dtype) for t in src]
    foreach_scale(2048 * 32, None, [src, dst], scale)
    for s, d in zip(src, dst):
        assert d.dtype == dst_dtype and torch.equal(
            d, (s * scale).to(dst_dtype)
        )  # upstream's loop: dst.copy_(src * scale)


def test_scale_in_place_as_gradient_clipping_calls_it():
    grads = _tensors()
    expected = [g * 0.25 for g in grads]
    foreach_scale(2048 * 32, None, [grads, grads], 0.25)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_fix_replaces_only_upstreams_local_fallbacks(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    fused = object()  # stands for Apex's / TE's kernel: must stay
    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", fused)
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    apply_multi_tensor_fallback_fix()
    apply_multi_tensor_fallback_fix()  # idempotent
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is fused
    assert optimizer.multi_tensor_scale_impl is foreach_scale


class _Wrapper:
    """Stands for megatron-core's optimizer wrappers: ``.optimizer`` is the torch optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def _adam_steps(fused_by: str, steps: int = 3) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    params = [torch.nn.Parameter(t.clone()) for t in _tensors()]
    kwargs = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    if fused_by == "constructor":
        adam = torch.optim.AdamW(params, fused=True, **kwargs)
    else:
        adam = torch.optim.AdamW(params, foreach=False, **kwargs)  # torch's per-parameter loop
        if fused_by == "use_fused_adam":
            use_fused_adam(_Wrapper(adam))
    for i in range(steps):
        for p in params:
            p.grad = torch.sin(p.detach() * (i + 1))
        adam.step()
    return params, adam


def test_use_fused_adam_steps_as_torchs_fused_adamw_and_close_to_its_loop():
    ours, adam = _adam_steps("use_fused_adam")
    fused, _ = _adam_steps("constructor")
    loop, _ = _adam_steps("loop")
    assert all(torch.equal(a, b) for a, b in zip(ours, fused))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, loop))
    assert not all(torch.equal(a, b) for a, b in zip(ours, loop))  # the loop really is another kernel
    assert {(s["step"].item(), s["step"].dtype) for s in adam.state.values()} == {(3.0, torch.float32)}


def test_use_fused_adam_survives_a_load_of_a_non_fused_state():
    _, loop_adam = _adam_steps("loop")
    params, adam = _adam_steps("use_fused_adam")
    adam.load_state_dict(loop_adam.state_dict())  # torch takes the saved groups' options
    assert adam.param_groups[0]["fused"] is None or adam.param_groups[0]["fused"] is False
    use_fused_adam(_Wrapper(adam))
    assert all(g["fused"] is True and g["foreach"] is False for g in adam.param_groups)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()  # the fused kernel takes the restored step counts
    assert {s["step"].item() for s in adam.state.values()} == {4.0}
    assert torch_adam_optimizers(_Wrapper(torch.optim.SGD(params, lr=0.1))) == []
