"""Varlen attention kernel (pure): equals a dense block-diagonal causal mask; clear errors for
inconsistent boundaries and for layer specs that would ignore them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.model.gpt import check_packed_sequence_support
from megatron_ext.model.attention import block_diagonal_causal_mask, check_boundaries, document_causal_attention


@pytest.mark.parametrize("groups", [1, 2])
def test_per_document_sdpa_equals_block_diagonal_mask(groups):
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]
    t, heads, hn = 32, 4, 8
    q = torch.randn(t, heads, hn)
    k = torch.randn(t, heads // groups, hn)
    v = torch.randn(t, heads // groups, hn)
    got = document_causal_attention(q, k, v, cu, scale=hn ** -0.5)
    mask = block_diagonal_causal_mask(cu, t)  # independent reference: one dense SDPA
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                         attn_mask=mask, scale=hn ** -0.5).transpose(0, 1).reshape(t, -1)
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
