"""The packed path on tensors alone (model/attention.py ``_static_packed_forward``): what compiled
layers and CUDA graphs receive instead of host boundaries."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.model.attention import (
    MASKED,
    PackedMicrobatchParams,
    bucket_max_seqlen,
    document_bound,
    document_causal_attention,
    masked_document_attention,
    pad_boundaries,
    prepare_static_packed_params,
)


def _params(cu: list[int]) -> PackedMicrobatchParams:
    t = torch.tensor(cu, dtype=torch.int32)
    return PackedMicrobatchParams(
        qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t, max_seqlen_q=0, max_seqlen_kv=0, cu_seqlens_host=tuple(cu)
    )


@pytest.mark.parametrize("groups", [1, 2])
def test_masked_kernel_equals_the_per_document_loop(groups):
    """The reference is the eager kernel (SDPA per document on host boundaries), forward and backward."""
    torch.manual_seed(0)
    cu = [0, 3, 4, 11, 19, 20]
    params = prepare_static_packed_params(_params(cu), 20, torch.float32, False, MASKED)
    q = torch.randn(20, 4, 8, requires_grad=True)
    k = torch.randn(20, 4 // groups, 8, requires_grad=True)
    v = torch.randn(20, 4 // groups, 8, requires_grad=True)
    out = masked_document_attention(q, k, v, params.document_ids, 0.3)
    ref = document_causal_attention(q, k, v, cu, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)  # (a 1-token document's q gradient is 0 up to rounding)


def test_prepared_params_are_bounded_and_host_free():
    params = prepare_static_packed_params(_params([0, 3, 4, 11, 19, 20]), 20, torch.float32, False, MASKED)
    assert params.cu_seqlens_q.tolist() == [0, 3, 4, 11, 19, 20] + [20] * 11  # 16 documents, 11 of them empty
    assert params.document_ids.tolist() == [0] * 3 + [1] + [2] * 7 + [3] * 8 + [4]
    assert params.max_seqlen_q == 8 and params.kernel == MASKED  # the longest (8) is its own bucket
    assert params.rotary_cos is None  # no RoPE frequencies given
    with pytest.raises(ValueError, match="document boundaries"):
        prepare_static_packed_params(_params([0, 3, 3, 20]), 20, torch.float32, False, MASKED)


def test_bounds():
    assert [document_bound(n) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
    assert [bucket_max_seqlen(n, 100) for n in (1, 5, 8, 9, 70)] == [1, 8, 8, 16, 100]
    with pytest.raises(ValueError, match="exceed the bound"):
        pad_boundaries(torch.arange(20), 16)


def test_zero_length_documents_add_nothing_to_the_per_document_loop():
    """Padding cu_seqlens with zero-length documents (what the varlen kernel gets) changes no value in
    the CPU loop either: an empty document holds no query row (no softmax over nothing, no NaN)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(12, 2, 8) for _ in range(3))
    cu = [0, 5, 12]
    padded = pad_boundaries(torch.tensor(cu), 16).tolist()
    out = document_causal_attention(q, k, v, padded, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, document_causal_attention(q, k, v, cu, 0.3))
