"""Our core attention against megatron-core's, in a 1-rank world (megatron-core's attention needs
its process groups and memory buffer).

- SDPA for unpacked causal attention equals megatron-core's ``DotProductAttention`` (outputs and
  q/k/v gradients; MHA and GQA; fp32 at 1e-5, bf16 at 2e-2);
- dropout draws from megatron-core's model-parallel RNG stream: the same tracker state gives the
  same output, the tracker advances, the default generator is untouched;
- the packed path with the varlen kernel selected (a stand-in for torch's CUDA-only
  flash kernel that runs the per-document reference) equals the per-document loop;
- a packed micro-batch goes through a whole RoPE/GQA model without one device-to-host read
  (``.tolist()``, ``.item()``, ``bool()``); megatron-core's own THD path, the negative control,
  makes several per layer;
- RoPE applied by our core attention gives a whole Llama-style model (fp32 and bf16, unpacked and
  packed) the same logits and gradients as megatron-core's own rotation, bitwise, without computing
  cos/sin in its layers (megatron-core: twice per layer).
"""

from __future__ import annotations

import collections
import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.testing import run_ranks, tiny_values

pytestmark = pytest.mark.distributed

SYNCS = (
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
)
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    group_query_attention=True,
    num_query_groups=2,
)


class SyncRecorder(TorchFunctionMode):
    """Counts calls that read a tensor's value on the host, by (function, caller file:line)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            caller = traceback.extract_stack(limit=3)[0]
            self.calls[(func.__name__, f"{caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}")] += 1
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Counts aten operators by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _rope_model_runs(packed: bool, bf16: bool) -> dict:
    """One Llama-style chunk, RoPE by our core attention, then (same weights, same input) by
    megatron-core's attention: logits, gradients and cos kernels of a second forward+backward."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ext.config import build_job_config
    from megatron_ext.data.packed_dataset import build_packed_sample
    from megatron_ext.data.padding import collate
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import apply_mixed_precision, build_model_chunks
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
    from megatron_ext.training.step import get_packed_seq_params, unwrap_model

    cfg = build_job_config(
        tiny_values(seq_length=64, packed_sequences=packed, micro_batch_size=1 if packed else 2, bf16=bf16, **LLAMA)
    )
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    resolved = resolve_config(cfg, ctx.world_size, 128)
    (model,) = apply_mixed_precision(
        cfg.training, build_model_chunks(cfg, resolved, ctx.placement, torch.device("cpu"))
    )
    if packed:
        mb = collate([build_packed_sample([np.arange(n) % 100 for n in (5, 17, 9, 33)])])
        tokens, positions = mb.tokens, mb.position_ids
    else:
        tokens = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(3))
        positions = torch.arange(64).expand(2, 64)
    weight = torch.randn(*tokens.shape, 128, generator=torch.Generator().manual_seed(4))

    def run(params):
        model.zero_grad(set_to_none=True)
        counter = OpCounter()
        with counter:
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
            (logits.float() * weight).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return dict(logits=logits.detach().float(), grads=grads, cos=counter.counts["cos"])

    ours_params = get_packed_seq_params(mb, model) if packed else None
    run(ours_params)  # the table's first use
    ours = run(get_packed_seq_params(mb, model) if packed else None)
    unwrap_model(model).rotary_pos_emb.__class__ = RotaryEmbedding  # megatron-core rotates
    control = None
    if packed:
        control = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seqlens,
            cu_seqlens_kv=mb.cu_seqlens,
            max_seqlen_q=mb.max_seqlen,
            max_seqlen_kv=mb.max_seqlen,
        )
    theirs = run(control)
    destroy_parallel_context()
    return dict(ours=ours, theirs=theirs, layers=cfg.model.num_layers)


def _modules(groups: int, dropout: float = 0.0, dtype=torch.float32):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.model.attention import VarlenDotProductAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4 // groups,
        attention_dropout=dropout,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )
    args = (config, 1, AttnMaskType.causal, "self")
    return VarlenDotProductAttention(*args), DotProductAttention(*args)


def _qkv(s: int, b: int, groups: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, 4, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(s, b, 4 // groups, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(s, b, 4 // groups, 16, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _sdpa_vs_megatron(groups: int, dtype) -> dict:
    ours, theirs = _modules(groups, dtype=dtype)
    out = {}
    for name, module in (("ours", ours), ("megatron", theirs)):
        q, k, v = _qkv(24, 2, groups, dtype)
        o = module(q, k, v, None)
        o.float().pow(2).sum().backward()
        out[name] = [o.detach().float()] + [t.grad.float() for t in (q, k, v)]
    return out


def _dropout_under_tracker() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    ours, _ = _modules(1, dropout=0.5)
    q, k, v = _qkv(16, 1, 1, torch.float32)
    tracker = get_cuda_rng_tracker()
    before = tracker.get_states()
    default_before = torch.get_rng_state()
    first = ours(q, k, v, None)
    advanced = not all(torch.equal(before[n], s) for n, s in tracker.get_states().items())
    default_untouched = torch.equal(default_before, torch.get_rng_state())
    tracker.set_states(before)
    again = ours(q, k, v, None)
    ours.eval()
    no_dropout = ours(q, k, v, None)
    return dict(
        same=torch.equal(first, again),
        advanced=advanced,
        default_untouched=default_untouched,
        dropped=not torch.allclose(first, no_dropout),
    )


def _packed_varlen_vs_loop() -> dict:
    import megatron_ext.model.attention as attention
    from megatron_ext.model.attention import PackedMicrobatchParams, document_causal_attention

    ours, _ = _modules(2)
    cu = (0, 5, 6, 19, 32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(32, 4, 16, generator=g),
        torch.randn(32, 2, 16, generator=g),
        torch.randn(32, 2, 16, generator=g),
    )
    cu_t = torch.tensor(cu, dtype=torch.int32)
    params = PackedMicrobatchParams(
        qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=13, max_seqlen_kv=13, cu_seqlens_host=cu
    )
    calls = []

    def fake_flash(query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
        """aten._flash_attention_forward's signature; the per-document reference inside (the real
        kernel is CUDA-only)."""
        calls.append(dict(is_causal=is_causal, dropout_p=dropout_p, max_q=max_q, heads=key.shape[1]))
        out = document_causal_attention(query, key, value, cu_q.tolist(), scale)
        return out.view(query.shape), None, None, None, None

    original = (attention.select_packed_kernel, attention.flash_attention_forward)
    attention.select_packed_kernel = lambda *args: attention.VARLEN
    attention.flash_attention_forward = fake_flash
    try:
        varlen = ours(q, k, v, None, packed_seq_params=params)
    finally:
        attention.select_packed_kernel, attention.flash_attention_forward = original
    loop = ours(q, k, v, None, packed_seq_params=params)
    return dict(varlen=varlen, loop=loop, calls=calls)


def _syncs_in_packed_forward(controlled: bool) -> dict:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ext.config import build_job_config
    from megatron_ext.data.packed_dataset import build_packed_sample
    from megatron_ext.data.padding import collate
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
    from megatron_ext.training.step import get_packed_seq_params

    cfg = build_job_config(tiny_values(seq_length=64, packed_sequences=True, micro_batch_size=1, **LLAMA))
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    (model,) = build_model_chunks(cfg, resolve_config(cfg, ctx.world_size, 128), ctx.placement, torch.device("cpu"))
    mb = collate([build_packed_sample([np.arange(n) % 100 for n in (5, 17, 9)])])
    if controlled:  # megatron-core's own THD rotary path and PackedSeqParams
        model.rotary_pos_emb.__class__ = RotaryEmbedding
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seqlens,
            cu_seqlens_kv=mb.cu_seqlens,
            max_seqlen_q=mb.max_seqlen,
            max_seqlen_kv=mb.max_seqlen,
        )
    else:
        params = get_packed_seq_params(mb, model)  # built once per micro-batch, outside the model
    recorder = SyncRecorder()
    with recorder:
        model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, packed_seq_params=params)
    destroy_parallel_context()
    return dict(recorder.calls)


def _world(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    out = {("sdpa", g, str(d)): _sdpa_vs_megatron(g, d) for g in (1, 2) for d in (torch.float32, torch.bfloat16)}
    out["dropout"] = _dropout_under_tracker()
    out["packed"] = _packed_varlen_vs_loop()
    ps.destroy_model_parallel()
    out["syncs"] = _syncs_in_packed_forward(controlled=False)
    out["syncs_megatron"] = _syncs_in_packed_forward(controlled=True)
    for packed in (False, True):
        for bf16 in (False, True):
            out[("rope", packed, bf16)] = _rope_model_runs(packed, bf16)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 1)[0]


@pytest.mark.parametrize("groups", [1, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_sdpa_equals_megatron_core_attention(results, groups, dtype, tol):
    r = results[("sdpa", groups, str(dtype))]
    for name, ours, theirs in zip(("output", "dq", "dk", "dv"), r["ours"], r["megatron"]):
        rel = float((ours - theirs).norm() / theirs.norm())
        assert rel <= tol, f"{name}: relative difference {rel:.2e} > {tol}"


def test_dropout_draws_from_the_model_parallel_rng_tracker(results):
    r = results["dropout"]
    assert r["dropped"], "dropout 0.5 changed nothing"
    assert r["same"], "the same tracker state must give the same dropout mask"
    assert r["advanced"] and r["default_untouched"], r


def test_packed_varlen_kernel_path_equals_per_document_loop(results):
    r = results["packed"]
    torch.testing.assert_close(r["varlen"], r["loop"], rtol=1e-6, atol=1e-6)
    (call,) = r["calls"]
    assert call == dict(is_causal=True, dropout_p=0.0, max_q=13, heads=2)  # grouped k/v as they are


def test_packed_forward_reads_nothing_back_from_the_device(results):
    assert results["syncs"] == {}, f"host reads inside the model: {results['syncs']}"
    control = results["syncs_megatron"]
    assert any(name == "tolist" and "rope_utils" in where for name, where in control), control


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_rope_in_core_attention_equals_megatron_cores_rotation(results, packed, bf16):
    r = results[("rope", packed, bf16)]
    ours, theirs = r["ours"], r["theirs"]
    assert torch.equal(ours["logits"], theirs["logits"]), (ours["logits"] - theirs["logits"]).abs().max()
    assert ours["grads"].keys() == theirs["grads"].keys()
    for name, grad in ours["grads"].items():
        assert torch.equal(grad, theirs["grads"][name]), name
    # packed: cos once per micro-batch (made with its frequencies); unpacked: kept from the first step
    assert ours["cos"] == (1 if packed else 0), ours["cos"]
    assert theirs["cos"] >= 2 * r["layers"], theirs["cos"]  # megatron-core: for q and for k, every layer


def _packed_rope_without_frequencies() -> str:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ext.config import build_job_config
    from megatron_ext.data.packed_dataset import build_packed_sample
    from megatron_ext.data.padding import collate
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context

    cfg = build_job_config(tiny_values(seq_length=64, packed_sequences=True, micro_batch_size=1, **LLAMA))
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    (model,) = build_model_chunks(cfg, resolve_config(cfg, ctx.world_size, 128), ctx.placement, torch.device("cpu"))
    mb = collate([build_packed_sample([np.arange(n) % 100 for n in (5, 17, 9)])])
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )
    try:
        model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, packed_seq_params=params)
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        destroy_parallel_context()


def test_packed_rope_without_frequencies_is_refused_not_skipped():
    """megatron-core's own PackedSeqParams reach a RoPE model whose rotary module yields nothing:
    one clear error, not a silent model without positions."""
    message = run_ranks(lambda rank, world: _packed_rope_without_frequencies(), 1)[0]
    assert "carry no rotary frequencies" in message and "get_packed_seq_params" in message, message
