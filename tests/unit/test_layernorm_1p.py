"""--apply-layernorm-1p (megatron-core's layernorm_zero_centered_gamma) without a process group: our
(1 + gamma) norms against torch's plain norms with weight 1 + gamma, their zero initial weights,
the +1 / -1 of the HF tensor maps, and the checkpoint check that keeps a 1p model from loading
into a plain one. The whole model (forward, HF round trip, weight decay): tests/distributed/
test_layernorm_1p.py and test_convert_checkpoint.py."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_ext.checkpoint.compatibility import check_compatible
from megatron_ext.checkpoint.parts import CheckpointMeta
from megatron_ext.config import build_job_config
from megatron_ext.model.init_weights import build_full_tensor
from megatron_ext.model.norm import LayerNorm1P, RMSNorm1P, TorchNorm

HIDDEN = 16


def _config(normalization: str, zero_centered: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        normalization=normalization,
        layernorm_zero_centered_gamma=zero_centered,
        sequence_parallel=False,
        persist_layer_norm=False,
        memory_efficient_layer_norm=False,
    )


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_one_plus_gamma_norm_equals_the_plain_norm_with_weight_one_plus_gamma(normalization):
    g = torch.Generator().manual_seed(0)
    ours = TorchNorm(_config(normalization, True), HIDDEN, eps=1e-5)
    plain = TorchNorm(_config(normalization, False), HIDDEN, eps=1e-5)
    assert type(ours) is {"LayerNorm": LayerNorm1P, "RMSNorm": RMSNorm1P}[normalization]
    assert type(plain) is {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[normalization]
    assert torch.equal(ours.weight, torch.zeros(HIDDEN))  # zero-centred: starts at 0
    with torch.no_grad():
        ours.weight.uniform_(-0.5, 0.5, generator=g)
        plain.weight.copy_(1.0 + ours.weight)
        if normalization == "LayerNorm":
            ours.bias.normal_(generator=g)
            plain.bias.copy_(ours.bias)
    x = torch.randn(5, 3, HIDDEN, generator=g)
    torch.testing.assert_close(ours(x), plain(x), rtol=1e-6, atol=1e-6)
    # a norm that forgot the 1 (scaled by gamma alone) is told apart
    if normalization == "LayerNorm":
        forgot = torch.nn.functional.layer_norm(x, (HIDDEN,), ours.weight, ours.bias, 1e-5)
    else:
        forgot = torch.nn.functional.rms_norm(x, (HIDDEN,), ours.weight, 1e-5)
    assert (ours(x) - forgot).abs().max() > 0.1
    # its gradient is the plain norm's weight gradient (d(1 + gamma)/d gamma = 1)
    ours(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_layout_independent_init_gives_zero_norm_weights_under_1p():
    for name in ("decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight"):
        assert torch.equal(build_full_tensor(1, name, (8,), 0.02, 2), torch.ones(8))
        assert torch.equal(build_full_tensor(1, name, (8,), 0.02, 2, zero_centered_norms=True), torch.zeros(8))
    # everything else is untouched by the flag
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(
        build_full_tensor(1, qkv, (24, 8), 0.02, 2),
        build_full_tensor(1, qkv, (24, 8), 0.02, 2, zero_centered_norms=True),
    )


def _hf_state() -> tuple[dict, dict[str, torch.Tensor]]:
    hf = dict(
        num_hidden_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=12,
        vocab_size=10,
        tie_word_embeddings=True,
    )
    shapes = {
        "model.embed_tokens.weight": (10, 8),
        "model.norm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.mlp.gate_proj.weight": (12, 8),
        "model.layers.0.mlp.up_proj.weight": (12, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 12),
    }
    g = torch.Generator().manual_seed(0)
    return hf, {k: torch.rand(*s, generator=g) + 0.5 for k, s in shapes.items()}


def test_hf_maps_subtract_one_from_hf_and_add_it_back():
    from tools.convert_checkpoint import hf_to_megatron_tensors, megatron_to_hf_tensors

    hf, state = _hf_state()
    plain = hf_to_megatron_tensors(state, hf, padded_vocab=16)
    ours = hf_to_megatron_tensors(state, hf, padded_vocab=16, zero_centered_gamma=True)
    norms = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight"]
    norms.append("decoder.final_layernorm.weight")
    assert set(ours) == set(plain)
    for name in ours:
        expected = plain[name] - 1.0 if name in norms else plain[name]
        assert torch.equal(ours[name], expected), name
    back = megatron_to_hf_tensors(ours, hf, zero_centered_gamma=True)
    # HF's weights in [0.5, 1.5): w - 1 and (w - 1) + 1 are exact in fp32 (Sterbenz)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    # and the export of a 1p checkpoint without the +1 would be another model
    assert not torch.equal(megatron_to_hf_tensors(ours, hf)["model.norm.weight"], state["model.norm.weight"])


def test_a_1p_checkpoint_does_not_load_into_a_plain_model():
    def cfg(**v):
        return build_job_config(dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=127, **v))

    saved = {"args": cfg(apply_layernorm_1p=True).to_flat_dict(), "padded_vocab_size": 128}
    meta = CheckpointMeta(tokenizer={}, padded_vocab_size=128)
    (problem,) = check_compatible(saved, cfg(), meta)
    assert problem.startswith("--apply-layernorm-1p: the checkpoint was saved with True, this run has False")
    assert check_compatible(saved, cfg(apply_layernorm_1p=True), meta) == []
    older = {"args": {k: v for k, v in saved["args"].items() if k != "apply_layernorm_1p"}, "padded_vocab_size": 128}
    assert check_compatible(older, cfg(), meta) == []  # checkpoints from before the flag: plain norms
