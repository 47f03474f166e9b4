"""Context-parallel core attention: local queries against keys and values all-gathered over the CP group.

Invariant: on every CP rank, each local query attends causally to exactly the keys of its own
document (or row) at or before its position, whichever rank holds them; the c ranks' outputs,
put back in global order, are the one-process attention's, and so are the summed gradients.

Algorithm (Llama 3's all-gather CP, arXiv 2407.21783 section 3.3.2), per layer:

    kv = all_gather(cat(k, v))                 # [T, b, 2 ng, hn] rank-major; backward: reduce-scatter
    for each local query piece (ls, le, ks, ke) of the layout:
        out[ls:le] = attention(q[ls:le], K[ks:ke], V[ks:ke])   # causal, aligned bottom-right

Queries never move; GQA's key/value heads are never expanded (both kernels take grouped K/V). What
is built on the host once per micro-batch, outside the layers, is a ``ContextParallelPlan``: the
layout's pieces (Python ints), its ``gather_index`` on the device and, on CUDA, the flash varlen
call's boundaries and key index.

Kernels:

- CPU: ``PiecewiseCausalAttention``, one autograd Function over all pieces, around torch's CPU flash
  kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward). A piece of nq
  queries and nk keys is cut into the non-causal prefix block [ks, ke - nq) and the square causal
  block [ke - nq, ke) (where top-left and bottom-right causal agree), merged with the logsumexp the
  kernel returns; backward calls the kernel's backward on each block with the merged output and
  logsumexp (the flash identity), so no mask exists at all. What it saves: q, the gathered K/V,
  the output and the logsumexp. Measured against the alternative (one kernel call per piece with a
  float mask made in forward and made again in backward), ``bench/cp_attention.py``: the same saved
  bytes, 0.69-0.93x its CPU time per rank for a 4,096-token document (the masked call computes the
  masked half of each square block; 1.1-1.2x for 256-token documents, where the second call and the
  merge cost more than they save), and no transient nq x nk mask; SDPA with a bool mask, what not to
  do, saves 1.4-3.2x as much (its float32 mask copy).
- CUDA (bf16/fp16, sm80+): one flash varlen call per layer over all pieces (aten's
  ``_flash_attention_forward``, causal aligned bottom-right), ``cu_seqlens_q`` the pieces' local
  runs, K/V repacked per piece by one ``index_select`` of the gathered buffer (the reorder and the
  repack in one), ``cu_seqlens_k`` their lengths. The repacked K/V hold (2c + 1) / 2c x T rows (a
  rank's two chunks of a document see (r + 1) + (2c - r) of its 2c chunks). Nothing is read back.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.context_parallel.collectives import gather_keys_values
from megatron_ext.context_parallel.layout import ContextParallelLayout, Piece

# looked up at call time, so a test can stand in for the CUDA-only kernel
flash_attention_forward = torch.ops.aten._flash_attention_forward


@dataclasses.dataclass(frozen=True, eq=False)
class VarlenPlan:
    """One flash varlen call over all pieces of all rows (CUDA), built once per micro-batch.

    Queries: the local [n, b] tokens as b rows of n, row-major, cut at the pieces (``cu_seqlens_q``).
    Keys: row ``kv_index[j]`` of the rank-major gathered [K;V] buffer (rows flattened row-major,
    [b T]) is the j-th key of the repacked buffer; each piece's keys [ks, ke) in global order."""

    cu_seqlens_q: torch.Tensor  # [P b + 1] int32
    cu_seqlens_k: torch.Tensor  # [P b + 1] int32
    kv_index: torch.Tensor  # [sum of piece keys x b] int64
    max_seqlen_q: int
    max_seqlen_k: int


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelPlan:
    """What a CP core attention needs of a micro-batch, made once per micro-batch on the host
    (``build_context_parallel_plan``): the layout (pieces as Python ints), its gather order on the
    activations' device, the rows it applies to (every row alike), and the CUDA varlen plan."""

    layout: ContextParallelLayout
    gather_index: torch.Tensor  # [T] int64 on the device
    num_rows: int  # b: rows of an unpacked micro-batch (1 for THD)
    varlen: VarlenPlan | None = None  # CUDA only


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def build_varlen_plan(layout: ContextParallelLayout, gather_index: torch.Tensor, num_rows: int) -> VarlenPlan:
    """The flash varlen call's boundaries and key index for ``num_rows`` rows of ``layout``: host
    arithmetic on the pieces, then one device gather (``gather_index`` is already on the device:
    nothing is read back)."""
    pieces = np.asarray(layout.pieces, dtype=np.int64).reshape(-1, 4)
    n, t = layout.num_local_tokens, layout.num_tokens
    q_lens = np.tile(pieces[:, 1] - pieces[:, 0], num_rows)
    k_lens = np.tile(pieces[:, 3] - pieces[:, 2], num_rows)
    positions = np.concatenate([np.arange(ks, ke) for _, _, ks, ke in layout.pieces])  # global key positions
    row_offsets = np.repeat(np.arange(num_rows, dtype=np.int64) * t, positions.size)
    assert int(q_lens.sum()) == n * num_rows, "the pieces must cover the local tokens"
    device = gather_index.device
    kv_index = gather_index.index_select(0, _to_device(np.tile(positions, num_rows), device))
    if num_rows > 1:
        kv_index = kv_index + _to_device(row_offsets, device)
    cu = lambda lens: _to_device(np.concatenate(([0], np.cumsum(lens))).astype(np.int32), device)  # noqa: E731
    return VarlenPlan(
        cu_seqlens_q=cu(q_lens),
        cu_seqlens_k=cu(k_lens),
        kv_index=kv_index,
        max_seqlen_q=layout.max_piece_queries,
        max_seqlen_k=layout.max_piece_keys,
    )


def build_context_parallel_plan(
    layout: ContextParallelLayout, device: torch.device, num_rows: int = 1
) -> ContextParallelPlan:
    """The plan of one micro-batch (host work, once per micro-batch and model chunk): ``layout`` of
    a THD sequence (``num_rows`` 1) or of each of the ``num_rows`` rows of an unpacked micro-batch."""
    gather_index = layout.gather_index
    if gather_index.device != device:
        gather_index = gather_index.pin_memory().to(device, non_blocking=True)
    varlen = build_varlen_plan(layout, gather_index, num_rows) if device.type == "cuda" else None
    return ContextParallelPlan(layout=layout, gather_index=gather_index, num_rows=num_rows, varlen=varlen)


# ----------------------------------------------------------------------------- CPU


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """[n, b, heads, hn] -> [b, heads, n, hn] (a view: the CPU flash kernel reads strides)."""
    return t.permute(1, 2, 0, 3)


def _snhd(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, n, hn] -> [n, b, heads, hn] (a view)."""
    return t.permute(2, 0, 1, 3)


def piece_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [nq, b, np, hn], k/v [nk, b, ng, hn] with nk >= nq, the queries being the last nq key
    positions -> (out [b, np, nq, hn], logsumexp [b, np, nq] fp32): the square causal block and,
    when nk > nq, the non-causal prefix block, merged by their logsumexps."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    prefix = k.shape[0] - q.shape[0]
    out, lse = flash(_bhsd(q), _bhsd(k[prefix:]), _bhsd(v[prefix:]), 0.0, True, scale=scale)
    if prefix == 0:
        return out, lse
    out_p, lse_p = flash(_bhsd(q), _bhsd(k[:prefix]), _bhsd(v[:prefix]), 0.0, False, scale=scale)
    merged = torch.logaddexp(lse, lse_p)
    total = out.float() * (lse - merged).exp_().unsqueeze(-1)
    total.addcmul_(out_p.float(), (lse_p - merged).exp_().unsqueeze(-1))
    return total.to(q.dtype), merged


def piece_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``piece_forward``'s gradients: grad, q, out [nq, b, np, hn], k/v [nk, b, ng, hn], lse
    [b, np, nq] -> dq [b, np, nq, hn], dk, dv [b, ng, nk, hn]. Each block's backward with the merged
    output and logsumexp gives that block's share exactly (softmax over the union of the blocks)."""
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    prefix = k.shape[0] - q.shape[0]
    g, qb, ob = _bhsd(grad), _bhsd(q), _bhsd(out)
    dq, dk, dv = flash_backward(g, qb, _bhsd(k[prefix:]), _bhsd(v[prefix:]), ob, lse, 0.0, True, scale=scale)
    if prefix == 0:
        return dq, dk, dv
    dq_p, dk_p, dv_p = flash_backward(g, qb, _bhsd(k[:prefix]), _bhsd(v[:prefix]), ob, lse, 0.0, False, scale=scale)
    return dq + dq_p, torch.cat((dk_p, dk), dim=2), torch.cat((dv_p, dv), dim=2)


class PiecewiseCausalAttention(torch.autograd.Function):
    """query [n, b, np, hn] (local), kv [T, b, 2 ng, hn] ([K;V] in global order) and the pieces ->
    [n, b, np, hn]. One node for all pieces: the gradient of the gathered K/V is one buffer
    accumulated in place (slicing per piece would give each piece a full-size zero gradient).
    Saves query, kv, the output and the logsumexp [b, np, n]; no mask."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, kv: torch.Tensor, pieces: tuple[Piece, ...], scale: float):
        ng = kv.shape[2] // 2
        n, b, np_, hn = query.shape
        out = query.new_empty(n, b, np_, hn)
        lse = torch.empty(b, np_, n, dtype=torch.float32, device=query.device)
        for ls, le, ks, ke in pieces:
            o, m = piece_forward(query[ls:le], kv[ks:ke, :, :ng], kv[ks:ke, :, ng:], scale)
            out[ls:le] = _snhd(o)
            lse[:, :, ls:le] = m
        ctx.save_for_backward(query, kv, out, lse)
        ctx.pieces, ctx.scale = pieces, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, kv, out, lse = ctx.saved_tensors
        ng = kv.shape[2] // 2
        dq = torch.empty_like(query)
        dkv = torch.zeros_like(kv)
        for ls, le, ks, ke in ctx.pieces:
            dq_p, dk_p, dv_p = piece_backward(
                grad[ls:le],
                query[ls:le],
                kv[ks:ke, :, :ng],
                kv[ks:ke, :, ng:],
                out[ls:le],
                lse[:, :, ls:le].contiguous(),
                ctx.scale,
            )
            dq[ls:le] = _snhd(dq_p)
            dkv[ks:ke, :, :ng] += _snhd(dk_p)
            dkv[ks:ke, :, ng:] += _snhd(dv_p)
        return dq, dkv, None, None


# ----------------------------------------------------------------------------- CUDA


def varlen_context_parallel_attention(
    query: torch.Tensor, kv: torch.Tensor, plan: VarlenPlan, scale: float
) -> torch.Tensor:
    """query [n, b, np, hn], kv [T, b, 2 ng, hn] rank-major -> [n, b, np, hn]: one flash varlen call
    (aten's C++ autograd node runs the backward; the repack's backward is one index_add)."""
    n, b, np_, hn = query.shape
    ng = kv.shape[2] // 2
    q = query.reshape(n, np_, hn) if b == 1 else query.transpose(0, 1).reshape(b * n, np_, hn)
    rows = kv.reshape(kv.shape[0], 2 * ng, hn) if b == 1 else kv.transpose(0, 1).reshape(-1, 2 * ng, hn)
    packed = rows.index_select(0, plan.kv_index)  # [sum nk, 2 ng, hn]: each piece's keys, in order
    out = flash_attention_forward(
        q,
        packed[:, :ng],
        packed[:, ng:],
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        plan.max_seqlen_q,
        plan.max_seqlen_k,
        0.0,
        True,  # causal, aligned bottom-right (FlashAttention >= 2.1): a piece's last query sees all its keys
        False,
        scale=scale,
    )[0]
    return out.view(n, 1, np_, hn) if b == 1 else out.view(b, n, np_, hn).transpose(0, 1)


# ----------------------------------------------------------------------------- entry


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: ContextParallelPlan,
    group,
    scale: float,
) -> torch.Tensor:
    """query [n, b, np, hn], key/value [n, b, ng, hn] (this rank's n = T / c tokens of each row,
    RoPE applied) -> [n, b, np hn]: every query against its document's keys gathered from ``group``
    (the CP group of the layout's c ranks)."""
    layout = plan.layout
    if query.shape[0] != layout.num_local_tokens or query.shape[1] != plan.num_rows:
        raise ValueError(
            f"context parallelism: the attention's input holds {query.shape[0]} tokens x {query.shape[1]} rows "
            f"but the micro-batch's CP layout {layout.num_local_tokens} x {plan.num_rows} (T = {layout.num_tokens}, "
            f"CP {layout.cp_size}): build the parameters from this micro-batch (training.step.get_packed_seq_params)"
        )
    kv = gather_keys_values(key, value, group)  # [T, b, 2 ng, hn], rank-major
    if plan.varlen is not None:
        out = varlen_context_parallel_attention(query, kv, plan.varlen, scale)
    else:
        kv = kv.index_select(0, plan.gather_index)  # global order
        out = PiecewiseCausalAttention.apply(query, kv, layout.pieces, scale)
    n, b, np_, hn = query.shape
    return out.reshape(n, b, np_ * hn)


# ----------------------------------------------------------------------------- the core attention's side

HALF_DTYPES = (torch.bfloat16, torch.float16)


def get_config_without_cp(config):
    """megatron-core 0.16.1's ``DotProductAttention.__init__`` asserts ``context_parallel_size == 1``
    (upstream, only Transformer Engine attends under CP): our core attention is built on a shallow copy
    with CP 1 and then keeps the shared config (compat.py: local-attention-cp-assert). The shared config
    itself is never changed."""
    if config.context_parallel_size == 1:
        return config
    built_on = copy.copy(config)
    built_on.context_parallel_size = 1
    return built_on


def check_attention_under_cp(
    config, layer_mask_type, attention_mask, attn_mask_type, attention_bias, dropout_p: float, params
) -> None:
    """ValueError for what the CP attention does not do: megatron-core's ``DotProductAttention.forward``,
    our fallback for masks, windows, other softmaxes and layer scaling, would attend to this rank's keys
    only; dropout would draw the same masks on every CP rank (``context_parallel/rules.py`` refuses the
    flags at start-up; this is the run-time guard). And a micro-batch without a CP plan."""
    softmax = getattr(config, "softmax_type", "vanilla")
    why = [
        what
        for what, given in (
            ("an explicit attention mask", attention_mask is not None),
            ("an attention bias", attention_bias is not None),
            (f"mask type {attn_mask_type}", attn_mask_type not in (None, AttnMaskType.causal)),
            (f"the layer's mask type {layer_mask_type}", layer_mask_type != AttnMaskType.causal),
            (f"window_size {config.window_size}", config.window_size is not None),
            (f"softmax_type {softmax}", softmax != "vanilla"),
            ("apply_query_key_layer_scaling", config.apply_query_key_layer_scaling),
            (f"attention dropout {dropout_p}", dropout_p > 0.0),
        )
        if given
    ]
    c = config.context_parallel_size
    if why:
        raise ValueError(
            f"context parallelism ({c} ranks): {', '.join(why)} is not supported by the CP attention "
            f"(megatron-core's DotProductAttention, the fallback, would attend to this rank's keys only; "
            f"dropout would draw the same masks on every CP rank)"
        )
    if getattr(params, "context_parallel", None) is None:
        raise ValueError(
            f"context parallelism ({c} ranks): the micro-batch carries no CP plan (packed_seq_params "
            f"{type(params).__name__}); build its parameters with megatron_ext.training.step.get_packed_seq_params"
            f"(microbatch, model) from a micro-batch with a cp_layout"
        )


def context_parallel_core_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params, group, scale: float
) -> torch.Tensor:
    """The core attention's CP path on RoPE-rotated local q/k/v: THD [t/c, heads, hn] -> [t/c, np hn]
    (``params.qkv_format == "thd"``) or [s/c, b, heads, hn] -> [s/c, b, np hn]."""
    plan: ContextParallelPlan = params.context_parallel
    if plan.varlen is not None and query.dtype not in HALF_DTYPES:
        raise ValueError(
            f"context parallelism on CUDA runs flash's varlen kernel, bf16/fp16 only (--bf16), on an sm80+ GPU; "
            f"the activations are {query.dtype}"
        )
    if params.qkv_format != "thd":
        return context_parallel_attention(query, key, value, plan, group, scale)
    rows = (t.unsqueeze(1) for t in (query, key, value))  # one row of t/c tokens
    return context_parallel_attention(*rows, plan, group, scale).squeeze(1)
