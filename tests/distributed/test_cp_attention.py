"""The CP attention (context_parallel/attention.py) in forked gloo worlds of c = 2 and 4 ranks against
full-row per-document attention computed in float64 in one process (a dense mask: test references
only): outputs and dq/dk/dv, the c ranks' local shares put back in global order.

- packed documents (per-document head-tail, g = 2c): 1-token documents, documents shorter than 2c
  before padding, documents spanning all 2c chunks, the last one grown by negotiated padding, two
  packs joined (b > 1); MHA and GQA; fp32 within 1e-6 and bf16 within 1e-2;
- unpacked rows (row head-tail, b = 2 rows alike) and GPTDataset windows with documents (row
  head-tail over the windows, attention cut at the documents);
- the CUDA plan (one flash varlen call over all pieces, K/V repacked by one index) with a float64
  stand-in for aten's CUDA-only kernel, THD and rows: what a GPU computes, minus the kernel;
- a negative control: attending to the local keys only (what megatron-core's DotProductAttention
  would do under CP) is far outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.context_parallel.layout import build_document_layout, build_row_layout
from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

HEADS, HEAD_DIM, SCALE = 4, 16, 0.25
PACKS = ((1, 3, 17, 1, 26), (40, 1, 5))  # real document lengths of two packs, joined
NEGOTIATED = 16  # the step's length is padded to a multiple of it: the last document grows
ROWS, ROW_LENGTH = 2, 32
WINDOW_DOCUMENTS = (0, 5, 29, 40, 64)  # GPTDataset windows of 32: documents cross chunks and windows


def padded_boundaries(packs, multiple: int, negotiated: int) -> list[int]:
    """Packs joined, every document padded to ``multiple``, the last one grown to a multiple of ``negotiated``."""
    lengths = [-(-n // multiple) * multiple for pack in packs for n in pack]
    lengths[-1] += -sum(lengths) % negotiated
    return [0] + torch.tensor(lengths).cumsum(0).tolist()


def reference_attention(q, k, v, bounds: list[int]) -> torch.Tensor:
    """q [T, b, np, hn], k/v [T, b, ng, hn] -> [T, b, np, hn]: causal attention within each
    [bounds[i], bounds[i+1]), as one dense masked softmax in the inputs' dtype."""
    doc = torch.zeros(q.shape[0], dtype=torch.long)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc[s:e] = i
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    groups = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kb, vb = kb.repeat_interleave(groups, 1), vb.repeat_interleave(groups, 1)
    scores = (qb @ kb.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vb).permute(2, 0, 1, 3)


def make_inputs(num_tokens: int, rows: int, groups: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, rows, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(num_tokens, rows, HEADS // groups, HEAD_DIM, generator=g)
    v = torch.randn(num_tokens, rows, HEADS // groups, HEAD_DIM, generator=g)
    grad = torch.randn(num_tokens, rows, HEADS * HEAD_DIM, generator=g)
    return q, k, v, grad


def reference_with_grads(inputs, bounds, dtype):
    """Output and q/k/v gradients in float64 from the inputs rounded to ``dtype``."""
    q, k, v, grad = (t.to(dtype).double() for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, bounds)
    out.reshape(grad.shape).backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def cases(c: int) -> dict:
    """name -> (layout builder(rank), attention bounds, T, rows, thd, groups, dtype)."""
    cu = padded_boundaries(PACKS, 2 * c, NEGOTIATED)
    rows = [0, ROW_LENGTH]
    out = {}
    for groups, dtype in ((1, torch.float32), (2, torch.float32), (2, torch.bfloat16)):
        name = f"packed-{'GQA' if groups > 1 else 'MHA'}-{str(dtype)[6:]}"
        out[name] = (lambda r, cu=cu: build_document_layout(cu, c, r), cu, cu[-1], 1, groups, dtype)
    out["rows-GQA"] = (lambda r: build_row_layout(ROW_LENGTH, 1, c, r), rows, ROW_LENGTH, ROWS, 2, torch.float32)
    out["windows-GQA"] = (
        lambda r: build_row_layout(ROW_LENGTH, 2, c, r, WINDOW_DOCUMENTS),
        list(WINDOW_DOCUMENTS),
        2 * ROW_LENGTH,
        1,
        2,
        torch.float32,
    )
    return out


def _run_case(rank: int, c: int, name: str, varlen: bool) -> list:
    """This rank's output and its local q/k/v gradients (k/v after the reduce-scatter), and the
    (shape, dtype) of every tensor saved for backward."""
    from megatron_ext.context_parallel.attention import (
        ContextParallelPlan,
        build_context_parallel_plan,
        build_varlen_plan,
        context_parallel_attention,
    )

    build, _, num_tokens, rows, groups, dtype = cases(c)[name]
    layout = build(rank)
    q, k, v, grad = (t.index_select(0, layout.local_index).to(dtype) for t in make_inputs(num_tokens, rows, groups, 7))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plan = build_context_parallel_plan(layout, torch.device("cpu"), rows)
    if varlen:
        plan = ContextParallelPlan(layout, plan.gather_index, rows, build_varlen_plan(layout, plan.gather_index, rows))
    saved = []

    def record(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        out = context_parallel_attention(q, k, v, plan, dist.group.WORLD, SCALE)
    out.backward(grad)
    return [out.detach().reshape(*out.shape[:2], HEADS, HEAD_DIM), q.grad, k.grad, v.grad, sorted(saved, key=str)]


def stand_in_flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
    """aten._flash_attention_forward's varlen semantics in float64 (differentiable): sequence i's
    queries q[cu_q[i]:cu_q[i+1]] attend to k[cu_k[i]:cu_k[i+1]], causal aligned bottom-right."""
    assert is_causal and dropout_p == 0.0 and not return_debug_mask and q.dim() == 3
    outs = []
    for i in range(cu_q.numel() - 1):
        qs, ks_ = q[cu_q[i] : cu_q[i + 1]].double(), k[cu_k[i] : cu_k[i + 1]].double()
        vs = v[cu_k[i] : cu_k[i + 1]].double()
        nq, nk = qs.shape[0], ks_.shape[0]
        assert nq <= max_q and nk <= max_k
        allowed = torch.arange(nk)[None, :] <= torch.arange(nk - nq, nk)[:, None]
        groups = qs.shape[1] // ks_.shape[1]
        kb, vb = ks_.repeat_interleave(groups, 1).transpose(0, 1), vs.repeat_interleave(groups, 1).transpose(0, 1)
        scores = (qs.transpose(0, 1) @ kb.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vb).transpose(0, 1))
    return (torch.cat(outs).to(q.dtype), None, None, None, None)


def _world(rank: int, world_size: int) -> dict:
    import megatron_ext.context_parallel.attention as cp_attention

    out = {(name, False): _run_case(rank, world_size, name, False) for name in cases(world_size)}
    cp_attention.flash_attention_forward = stand_in_flash  # this forked rank only
    for name in VARLEN_CASES:
        out[(name, True)] = _run_case(rank, world_size, name, True)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def world(request):
    c = request.param
    return c, run_ranks(_world, c)


def assemble(c: int, name: str, varlen: bool, per_rank: list[dict]) -> list[torch.Tensor]:
    """The ranks' local rows put back at their global positions."""
    build, _, num_tokens, *_ = cases(c)[name]
    parts = [r[(name, varlen)] for r in per_rank]
    out = []
    for i in range(4):  # output, dq, dk, dv
        full = torch.zeros(num_tokens, *parts[0][i].shape[1:], dtype=parts[0][i].dtype)
        for rank in range(c):
            full[build(rank).local_index] = parts[rank][i]
        out.append(full)
    return out


def max_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest magnitude."""
    return float((ours.double() - ref).abs().max() / ref.abs().max())


CPU_CASES = ["packed-MHA-float32", "packed-GQA-float32", "packed-GQA-bfloat16", "rows-GQA", "windows-GQA"]
VARLEN_CASES = ["packed-GQA-float32", "rows-GQA", "windows-GQA"]  # the CUDA plan's indices, in fp32


@pytest.mark.parametrize(
    "name,varlen", [(n, False) for n in CPU_CASES] + [(n, True) for n in VARLEN_CASES], ids=lambda x: str(x)
)
def test_cp_attention_equals_full_row_per_document_attention(world, name, varlen):
    c, per_rank = world
    _, bounds, num_tokens, rows, groups, dtype = cases(c)[name]
    ref = reference_with_grads(make_inputs(num_tokens, rows, groups, 7), bounds, dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for what, ours, theirs in zip(("output", "dq", "dk", "dv"), assemble(c, name, varlen, per_rank), ref):
        err = max_error(ours, theirs)
        assert err <= tolerance, f"{name} c={c}: {what} differs by {err:.2e} > {tolerance}"


def test_local_keys_only_is_far_outside_the_tolerance():
    """Negative control: each rank attending to its own tokens only (megatron-core's attention
    under CP) misses every earlier chunk's keys."""
    c = 2
    _, bounds, num_tokens, rows, groups, dtype = cases(c)["packed-GQA-float32"]
    q, k, v, _ = (t.double() for t in make_inputs(num_tokens, rows, groups, 7))
    ref = reference_attention(q, k, v, bounds)
    worst = 0.0
    for rank in range(c):
        layout = build_document_layout(bounds, c, rank)
        idx = layout.local_index
        local_bounds = [0] + [ls for ls, *_ in layout.pieces[1:]] + [layout.num_local_tokens]
        local = reference_attention(q[idx], k[idx], v[idx], sorted(set(local_bounds)))
        worst = max(worst, max_error(local, ref[idx]))
    assert worst > 0.1, worst


def test_saves_no_mask_and_no_expanded_keys(world):
    """What the CPU path keeps for backward, exactly: the local queries, the gathered [K;V] with its
    grouped heads, the output, the logsumexp and the gather order. No [nq, nk] mask, no copy of K/V
    expanded to the query heads."""
    c, per_rank = world
    _, _, num_tokens, _, groups, _ = cases(c)["packed-GQA-float32"]
    n, kv_heads = num_tokens // c, 2 * HEADS // groups
    expected = [
        ((1, HEADS, n), torch.float32),  # logsumexp
        ((n, 1, HEADS, HEAD_DIM), torch.float32),  # queries
        ((n, 1, HEADS, HEAD_DIM), torch.float32),  # output
        ((num_tokens,), torch.int64),  # the gather order (index_select's index)
        ((num_tokens, 1, kv_heads, HEAD_DIM), torch.float32),  # [K;V], grouped
    ]
    for r in per_rank:
        assert r[("packed-GQA-float32", False)][4] == sorted(expected, key=str)
