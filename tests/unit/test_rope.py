"""RoPE in our core attention (model/attention.py): the same values as megatron-core's unfused
rotation, forward and backward, with cos/sin made once and kept, not per layer."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron_ext.model.attention import (
    PackedMicrobatchParams,
    RotaryTable,
    packed_coefficients,
    rotary_coefficients,
    rotate,
)


def freqs_table(n: int, rot_dim: int, interleaved: bool) -> torch.Tensor:
    """[n, 1, 1, rot_dim] as megatron-core's RotaryEmbedding.get_emb lays it out."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    f = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    emb = torch.stack((f, f), dim=-1).view(n, -1) if interleaved else torch.cat((f, f), dim=-1)
    return emb[:, None, None, :]


def rotated_with_grad(fn, t: torch.Tensor, weight: torch.Tensor):
    t = t.detach().clone().requires_grad_()
    out = fn(t)
    (out.float() * weight).sum().backward()
    return out.detach(), t.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_rotation_equals_megatron_cores_bitwise(dtype, rot_dim, packed):
    torch.manual_seed(0)
    s, b, heads, hn = 12, 2, 3, 16
    freqs = freqs_table(s, rot_dim, interleaved=False)
    t = torch.randn(s, b, heads, hn).to(dtype)
    if packed:  # [t, heads, hn] with per-token frequencies [t, 1, rot_dim]
        t, freqs = t[:, 0], freqs.squeeze(1)
    weight = torch.randn(t.shape)
    cos, sin = rotary_coefficients(freqs, dtype, interleaved=False)
    ours = rotated_with_grad(lambda x: rotate(x, cos, sin, interleaved=False), t, weight)
    theirs = rotated_with_grad(lambda x: _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=False), t, weight)
    assert ours[0].dtype == dtype
    assert torch.equal(ours[0], theirs[0]), "forward differs from megatron-core's rotation"
    assert torch.equal(ours[1], theirs[1]), "backward differs from megatron-core's rotation"
    if rot_dim < hn:  # the unrotated part passes through untouched
        assert torch.equal(ours[0][..., rot_dim:], t[..., rot_dim:])


def test_interleaved_rotation_equals_megatron_cores():
    torch.manual_seed(1)
    freqs = freqs_table(10, 8, interleaved=True)
    t = torch.randn(10, 2, 4, 8)
    weight = torch.randn(t.shape)
    cos, sin = rotary_coefficients(freqs, t.dtype, interleaved=True)
    ours = rotated_with_grad(lambda x: rotate(x, cos, sin, interleaved=True), t, weight)
    theirs = rotated_with_grad(lambda x: _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=True), t, weight)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    plain = rotary_coefficients(freqs, t.dtype, interleaved=False)
    assert not torch.equal(ours[0], rotate(t, *plain, interleaved=False))  # the layouts differ
    # megatron-core's interleaved branch indexes four dimensions; ours also takes packed [t, heads, hn]
    assert torch.equal(rotate(t[:, 0], cos.squeeze(1), sin.squeeze(1), interleaved=True), ours[0][:, 0])


class CountingRotary:
    """Stands in for megatron-core's RotaryEmbedding: its table, and how often it was asked."""

    def __init__(self, rot_dim: int = 8):
        self.calls, self.rot_dim = [], rot_dim

    def get_emb(self, n: int) -> torch.Tensor:
        self.calls.append(n)
        return freqs_table(n, self.rot_dim, interleaved=False)


def test_table_makes_cos_sin_once_per_length_and_dtype():
    rotary = CountingRotary()
    table = RotaryTable(rotary)
    cpu = torch.device("cpu")
    first = table.coefficients(16, torch.bfloat16, cpu, False)
    assert table.coefficients(16, torch.bfloat16, cpu, False) is first  # every layer, every micro-batch: kept
    assert rotary.calls == [16]
    other = table.coefficients(8, torch.bfloat16, cpu, False)
    wide = table.coefficients(16, torch.float32, cpu, False)
    assert rotary.calls == [16, 8, 16]
    assert other[0].shape == (8, 1, 1, 8) and wide[0].dtype == torch.float32 and first[0].dtype == torch.bfloat16
    freqs = freqs_table(16, 8, False)
    assert torch.equal(first[0], torch.cos(freqs).to(torch.bfloat16)) and not first[0].requires_grad
    sin = torch.sin(freqs).to(torch.bfloat16)  # rotate_half's sign moved into it: first half negated
    assert torch.equal(first[1], torch.cat((-sin[..., :4], sin[..., 4:]), dim=-1))


def test_table_is_bounded():
    table = RotaryTable(CountingRotary())
    for n in range(1, RotaryTable.MAX_ENTRIES + 10):
        table.coefficients(n, torch.float32, torch.device("cpu"), False)
    assert len(table._cache) <= RotaryTable.MAX_ENTRIES


def test_packed_micro_batch_makes_cos_sin_once():
    freqs = freqs_table(6, 8, False).squeeze(1)
    params = PackedMicrobatchParams(qkv_format="thd", rotary_freqs=freqs)
    first = packed_coefficients(params, torch.bfloat16, False)
    assert packed_coefficients(params, torch.bfloat16, False) is first
    assert torch.equal(first[0], torch.cos(freqs).to(torch.bfloat16))


def test_cos_sin_first_made_under_inference_mode_serve_a_training_step():
    table = RotaryTable(CountingRotary())
    with torch.inference_mode():
        table.coefficients(6, torch.float32, torch.device("cpu"), False)  # e.g. an evaluation first
    cos, sin = table.coefficients(6, torch.float32, torch.device("cpu"), False)
    assert not cos.is_inference() and not sin.is_inference()
    t = torch.randn(6, 1, 2, 8, requires_grad=True)
    rotate(t, cos, sin, interleaved=False).square().sum().backward()  # saves cos/sin for backward
    assert t.grad is not None
