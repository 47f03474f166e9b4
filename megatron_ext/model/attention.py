"""Core attention for the local (torch) layer spec that honours packed sequences (THD).

Invariant: with ``PackedSeqParams(qkv_format="thd")`` no token attends across a document
boundary of ``cu_seqlens``: each document is its own causal attention problem. Without packed
parameters it is megatron-core's own ``DotProductAttention``, unchanged.

Kernel: ``torch.nn.functional.scaled_dot_product_attention`` per document (causal, exact, 4-D
views so torch's CPU flash kernel runs). Chosen by ``bench/varlen.py`` on the embedded corpus at
seq 2048: 1.52x the useful tokens/CPU-s of one SDPA over the pack with a dense block-diagonal mask
(FLOP bound 1.40), 2.15x megatron-core's attention with that mask, and 17x one document per row
padded to 2048 (bound 8.07). flex_attention has no CPU backward and nested-jagged SDPA no CPU
backend in torch 2.13 (both probed). On GPUs, Transformer Engine's attention consumes the same
``PackedSeqParams``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention


def document_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int],
    scale: float, dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [t, np, hn], key/value [t, ng, hn] (ng divides np) -> [t, np * hn]."""
    groups = query.shape[1] // key.shape[1]
    outs = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        # 4-D views: torch's CPU flash kernel takes only [b, heads, n, hn]; 3-D views fall back
        # to the math kernel, which materialises n x n scores (measured 1.34x slower end to end)
        q = query[s:e].transpose(0, 1).unsqueeze(0)  # [1, np, n, hn]
        k = key[s:e].transpose(0, 1).unsqueeze(0)  # [1, ng, n, hn]
        v = value[s:e].transpose(0, 1).unsqueeze(0)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        outs.append(o.squeeze(0).transpose(0, 1))  # [n, np, hn]
    out = torch.cat(outs, dim=0)
    return out.reshape(out.shape[0], -1)


def block_diagonal_causal_mask(cu_seqlens: list[int], length: int) -> torch.Tensor:
    """[t, t] bool, True where attention is allowed: same document and not in the future."""
    doc = torch.zeros(length, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        doc[s:e] = i
    same = doc[:, None] == doc[None, :]
    return same & torch.ones(length, length, dtype=torch.bool).tril()


def check_boundaries(cu_seqlens: list[int], num_tokens: int) -> None:
    """ValueError unless 0 = c_0 < c_1 < ... < c_n = num_tokens (no empty document)."""
    if (not cu_seqlens or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens
            or any(b <= a for a, b in zip(cu_seqlens, cu_seqlens[1:]))):
        raise ValueError(
            f"packed sequences: document boundaries {cu_seqlens[:4]}...{cu_seqlens[-2:]} do not "
            f"describe {num_tokens} tokens (need 0 = c_0 < c_1 < ... < c_n = tokens)"
        )


class VarlenDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention plus the packed (THD) path."""

    supports_packed_sequences = True

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences: qkv_format {packed_seq_params.qkv_format!r} is not supported (use 'thd')")
        cu = packed_seq_params.cu_seqlens_q
        if not torch.equal(cu, packed_seq_params.cu_seqlens_kv):
            raise ValueError("packed sequences: cu_seqlens_q and cu_seqlens_kv must be equal for self-attention")
        cu_list = cu.tolist()
        check_boundaries(cu_list, query.shape[0])
        p = self.config.attention_dropout if self.training else 0.0
        if p > 0.0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return document_causal_attention(query, key, value, cu_list, self.softmax_scale, p)
        return document_causal_attention(query, key, value, cu_list, self.softmax_scale)
