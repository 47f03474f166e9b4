"""Varlen attention kernel (pure): equals a dense block-diagonal causal mask; clear errors for
inconsistent boundaries and for layer specs that would ignore them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.model.attention import block_diagonal_causal_mask, check_boundaries, document_causal_attention
from megatron_ext.model.gpt import check_packed_sequence_support


@pytest.mark.parametrize("groups", [1, 2])
def test_per_document_sdpa_equals_block_diagonal_mask(groups):
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]
    t, heads, hn = 32, 4, 8
    q = torch.randn(t, heads, hn)
    k = torch.randn(t, heads // groups, hn)
    v = torch.randn(t, heads // groups, hn)
    got = document_causal_attention(q, k, v, cu, scale=hn**-0.5)
    mask = block_diagonal_causal_mask(cu, t)  # independent reference: one dense SDPA
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    ref = (
        F.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, scale=hn**-0.5
        )
        .transpose(0, 1)
        .reshape(t, -1)
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cu, n", [([0, 4, 4, 8], 8), ([0, 3, 8], 10), ([1, 8], 8), ([0, 6, 3, 8], 8)])
def test_inconsistent_boundaries_are_refused(cu, n):
    with pytest.raises(ValueError, match="document boundaries"):
        check_boundaries(cu, n)
    check_boundaries([0, 3, 8], 8)


class DotProductAttention(torch.nn.Module):
    """Stands in for megatron-core's local attention, which rejects packed inputs."""


def _chunk(core: torch.nn.Module) -> torch.nn.Module:
    chunk, layer = torch.nn.Module(), torch.nn.Module()
    layer.core_attention = core
    chunk.layer = layer
    return chunk


def test_packing_with_a_spec_that_ignores_boundaries_is_refused():
    with pytest.raises(ValueError, match="--packed-sequences: layer.core_attention is DotProductAttention"):
        check_packed_sequence_support([_chunk(DotProductAttention())])
    ok = DotProductAttention()
    ok.supports_packed_sequences = True
    check_packed_sequence_support([_chunk(ok)])


# ----------------------------------------------------------------------------- kernel dispatch


def test_packed_kernel_selection():
    from megatron_ext.model.attention import PER_DOCUMENT, VARLEN, select_packed_kernel

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert select_packed_kernel("cuda", 0.0, True, bf16) == VARLEN
    assert select_packed_kernel("cuda", 0.0, True, fp16) == VARLEN
    assert select_packed_kernel("cuda", 0.0, True, fp32) == PER_DOCUMENT  # flash: no fp32 (seen on an H100)
    assert select_packed_kernel("cuda", 0.1, True, bf16) == PER_DOCUMENT  # varlen_attn has no dropout
    assert select_packed_kernel("cuda", 0.0, False, bf16) == PER_DOCUMENT  # torch < 2.10
    assert select_packed_kernel("cpu", 0.0, True, bf16) == PER_DOCUMENT  # varlen_attn is CUDA-only


def test_varlen_call_is_causal_without_dropout_and_keeps_grouped_kv(monkeypatch):
    import megatron_ext.model.attention as attention

    calls = []

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
        """aten._flash_attention_forward's signature (the real one is CUDA-only)."""
        calls.append(
            dict(
                heads_kv=k.shape[1],
                cu_same=cu_q is cu_k,
                max=(max_q, max_k),
                dropout_p=dropout_p,
                is_causal=is_causal,
                debug=return_debug_mask,
                scale=scale,
            )
        )
        return torch.zeros_like(q), None, None, None, None

    monkeypatch.setattr(attention, "flash_attention_forward", flash)
    q, kv = torch.randn(12, 4, 8), torch.randn(12, 2, 8)
    out = attention.varlen_causal_attention(q, kv, kv, torch.tensor([0, 5, 12], dtype=torch.int32), 7, 0.35)
    assert out.shape == (12, 32)
    assert calls == [dict(heads_kv=2, cu_same=True, max=(7, 7), dropout_p=0.0, is_causal=True, debug=False, scale=0.35)]


def test_torch_varlen_attn_shapes_on_meta_tensors():
    """The real kernel's own shape logic and autograd node (its meta implementation), GQA included:
    CUDA-only at run time."""
    from megatron_ext.model.attention import get_varlen_attn, varlen_causal_attention

    if get_varlen_attn() is None:
        pytest.skip("torch < 2.10 has no varlen_attn")
    q = torch.empty(512, 8, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(512, 2, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.empty(4, device="meta", dtype=torch.int32)
    out = varlen_causal_attention(q, kv, kv, cu, 300, 0.125)
    assert out.shape == (512, 8 * 64) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "FlashAttentionBackward0"  # aten's C++ backward


def _fake_gpu(monkeypatch, capability):
    """A CUDA device of this compute capability, as far as the host-side queries go."""
    import megatron_ext.model.attention as attention

    attention.flash_varlen_supported.cache_clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention, "get_varlen_attn", lambda: object())  # torch >= 2.10
    return attention


def test_attention_notice_names_the_kernel_and_why(monkeypatch):
    from megatron_ext.model.attention import describe_attention_kernels

    bf16 = torch.bfloat16
    assert "Transformer Engine" in describe_attention_kernels("cuda", 0.0, True, True, bf16, 64)
    cpu = describe_attention_kernels("cpu", 0.0, False, True, bf16, 64)
    assert "torch SDPA" in cpu and "per-document SDPA loop (varlen_attn needs CUDA)" in cpu
    assert "packed THD" not in describe_attention_kernels("cpu", 0.0, False, False, bf16, 64)
    attention = _fake_gpu(monkeypatch, (9, 0))
    try:
        assert "packed THD -> flash varlen" in attention.describe_attention_kernels("cuda", 0.0, False, True, bf16, 64)
        assert "--attention-dropout 0.1" in attention.describe_attention_kernels("cuda", 0.1, False, True, bf16, 64)
        assert "bf16/fp16 only: --bf16" in attention.describe_attention_kernels(
            "cuda", 0.0, False, True, torch.float32, 64
        )
        odd = attention.describe_attention_kernels("cuda", 0.0, False, True, bf16, 60)
        assert "per-document SDPA loop" in odd and "head dimension 60" in odd
    finally:
        attention.flash_varlen_supported.cache_clear()


@pytest.mark.parametrize(
    "capability,head_dim,expected",
    [
        ((9, 0), 128, True),
        ((8, 0), 64, True),
        ((8, 6), 256, True),
        ((7, 0), 64, False),  # V100: FlashAttention 2 has no kernels
        ((9, 0), 60, False),
        ((9, 0), 512, False),  # head dims flash does not take
    ],
)
def test_flash_varlen_needs_an_ampere_or_newer_gpu_and_a_flash_head_dim(monkeypatch, capability, head_dim, expected):
    attention = _fake_gpu(monkeypatch, capability)
    try:
        assert attention.flash_varlen_supported(0, head_dim) is expected
    finally:
        attention.flash_varlen_supported.cache_clear()
