"""The megatron-core traps around the CP attention, each worked around or refused (no process group):

- ``DotProductAttention.__init__`` asserts CP == 1: ours is built on a copy and keeps the shared
  config (megatron-core's own, the control, still raises);
- every path that would attend to the local keys only (explicit masks, a bias, a window, another
  softmax, layer scaling), dropout, and a micro-batch without a CP plan: a ValueError at run time;
- torch's CPU flash kernel takes grouped K/V (what SDPA's ``enable_gqa=True`` runs): the output and
  dq bitwise the expanded form's, dk/dv to rounding (summed over the group in another order);
- a per-layer --cp-comm-type list reaches TransformerConfig as one string (0.16.1 indexes the list
  with the 1-based layer number); the auto spec is the local one under CP; a rotary module our core
  attention does not apply is refused under CP.
"""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.config import build_job_config
from megatron_ext.context_parallel.attention import build_context_parallel_plan, check_attention_under_cp
from megatron_ext.context_parallel.layout import build_row_layout
from megatron_ext.model.attention import PackedMicrobatchParams, VarlenDotProductAttention
from megatron_ext.model.gpt import check_rotary_under_cp, get_transformer_cp_comm_type, use_transformer_engine
from megatron_ext.testing import tiny_values


class OneRankGroup:
    def size(self) -> int:
        return 1


PG = types.SimpleNamespace(tp=OneRankGroup(), cp=None)


def build(**config) -> tuple[VarlenDotProductAttention, TransformerConfig]:
    config = dict(attention_dropout=0.0) | config  # (megatron-core's default is 0.1)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=2, **config)
    module = VarlenDotProductAttention(
        config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=PG
    )
    return module, cfg


def cp_params(rows: int = 2) -> PackedMicrobatchParams:
    layout = build_row_layout(16, 1, 2, 0)
    plan = build_context_parallel_plan(layout, torch.device("cpu"), rows)
    return PackedMicrobatchParams(qkv_format="sbhd", max_seqlen_q=16, max_seqlen_kv=16, context_parallel=plan)


def qkv():
    return [torch.randn(8, 2, 4, 16) for _ in range(3)]


def test_built_under_cp_on_a_copy_keeping_the_shared_config():
    module, cfg = build()
    assert module.config is cfg and cfg.context_parallel_size == 2
    with pytest.raises(AssertionError, match="Context parallelism"):  # the trap, upstream
        DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=PG)


def test_only_all_gather_is_built():
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=2)
    with pytest.raises(ValueError, match="all_gather only"):
        VarlenDotProductAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type="p2p", pg_collection=PG)


@pytest.mark.parametrize(
    "config,call,match",
    [
        ({}, dict(attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool)), "explicit attention mask"),
        ({}, dict(attention_bias=torch.zeros(1, 4, 8, 16)), "attention bias"),
        ({}, dict(attn_mask_type=AttnMaskType.padding), "mask type"),
        (dict(window_size=(8, 0)), {}, "window_size"),
        (dict(apply_query_key_layer_scaling=True, fp16=True), {}, "apply_query_key_layer_scaling"),
        (dict(attention_dropout=0.1), {}, "attention dropout"),
        ({}, dict(packed_seq_params=None), "carries no CP plan"),
        ({}, dict(packed_seq_params=PackedSeqParams(qkv_format="thd")), "carries no CP plan"),
    ],
    ids=["mask", "bias", "mask-type", "window", "layer-scaling", "dropout", "no-params", "megatron-params"],
)
def test_what_would_attend_to_local_keys_only_raises_at_run_time(config, call, match):
    module, _ = build(**config)
    kwargs = dict(attention_mask=None, packed_seq_params=cp_params()) | call
    mask = kwargs.pop("attention_mask")
    with pytest.raises(ValueError, match=match):
        module(*qkv(), mask, **kwargs)


def test_another_softmax_raises_at_run_time():
    cfg = types.SimpleNamespace(
        context_parallel_size=2, window_size=None, apply_query_key_layer_scaling=False, softmax_type="off-by-one"
    )
    with pytest.raises(ValueError, match="softmax_type off-by-one"):
        check_attention_under_cp(cfg, AttnMaskType.causal, None, None, None, 0.0, cp_params())


def test_the_cp_path_runs_without_any_of_them():
    """The control: the same module and call without the refused input reaches the collective."""
    module, _ = build()
    with pytest.raises((ValueError, RuntimeError, AttributeError)) as err:
        module(*qkv(), None, packed_seq_params=cp_params())
    assert "not supported" not in str(err.value) and "no CP plan" not in str(err.value), err.value


def test_per_layer_cp_comm_type_reaches_megatron_core_as_one_string():
    cfg = build_job_config(tiny_values(num_layers=2, context_parallel_size=2, cp_comm_type=["allgather", "all_gather"]))
    assert get_transformer_cp_comm_type(cfg.parallel) == "all_gather"
    assert get_transformer_cp_comm_type(build_job_config(tiny_values()).parallel) is None


def test_auto_spec_is_the_local_one_under_cp():
    m = build_job_config(tiny_values(transformer_impl="auto")).model
    assert not use_transformer_engine(m, torch.device("cuda"), context_parallel_size=2)


def test_a_rotary_module_our_attention_does_not_apply_is_refused_under_cp():
    chunk = types.SimpleNamespace(rotary_pos_emb=torch.nn.Identity())
    check_rotary_under_cp(chunk, 1)
    with pytest.raises(ValueError, match="rotary embedding Identity"):
        check_rotary_under_cp(chunk, 2)


def test_grouped_keys_equal_expanded_ones_on_the_cpu_flash_kernel():
    """torch 2.13: the output and dq are bitwise equal; dk/dv are not (2e-7 here: the kernel sums a
    group's heads in another order than repeat_interleave's backward), well inside 1e-6."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 48, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 80, 16, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 8, 48, 16, generator=g)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    expected = torch.autograd.grad(expanded, (q, k, v), grad)
    assert torch.equal(out, expanded) and torch.equal(grads[0], expected[0])
    for ours, theirs in zip(grads[1:], expected[1:]):
        assert float((ours - theirs).abs().max()) <= 1e-6
