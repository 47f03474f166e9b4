"""Qwen3's settings (pure): --qk-layernorm and --kv-channels as flags and layout rules, the Hugging
Face config both ways (``hf/config.py``), the tensor mapping of the q/k norms and a head_dim that is
not hidden / heads (``hf/mapping.py``), --save-hf's refusals, and the FLOPs of the query width."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.hf.config import build_hf_config, check_supported, get_exportable_problems, hf_config_to_values
from megatron_ext.hf.mapping import hf_to_megatron_tensors, megatron_to_hf_tensors
from megatron_ext.training.metrics import num_floating_point_operations
from megatron_ext.validation import validate

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=127)
# Qwen3-0.6B's shape: the queries are 16 x 128 = 2 x hidden wide
QWEN3_06B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    attention_bias=False,
    use_sliding_window=False,
)
QWEN3_OURS = dict(
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    position_embedding_type="rope",
    qk_layernorm=True,
    hidden_size=64,
    num_attention_heads=4,
    kv_channels=32,
    num_layers=2,
    ffn_hidden_size=96,
    seq_length=32,
)


def test_qk_layernorm_and_kv_channels_are_flags():
    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--qk-layernorm"]
    cfg, notes = parse_args_with_notes(argv + ["--kv-channels", "32", "--hidden-size", "64"])
    assert (cfg.model.qk_layernorm, cfg.model.kv_channels) == (True, 32) and not notes


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(kv_channels=0), "--kv-channels must be > 0"),
        (dict(hidden_size=66), "--hidden-size 66 is not divisible by --num-attention-heads 4: give each head's"),
        (dict(kv_channels=15, position_embedding_type="rope"), "the head dimension (--kv-channels) is 15, odd"),
    ],
)
def test_head_dimension_rules_name_the_flags(values, needle):
    with pytest.raises(ConfigError) as err:
        validate(build_job_config({**MOCK, "hidden_size": 64, "num_attention_heads": 4, **values}), 1)
    assert any(needle in p for p in err.value.problems), err.value.problems


def test_hidden_size_need_not_divide_into_heads_with_kv_channels():
    cfg = build_job_config({**MOCK, "hidden_size": 66, "num_attention_heads": 4, "kv_channels": 16})
    assert validate(cfg, 1) is None  # accepted (a refusal raises ConfigError)
    with pytest.raises(ConfigError):  # the same shape without --kv-channels is refused
        validate(build_job_config({**MOCK, "hidden_size": 66, "num_attention_heads": 4}), 1)


def test_qwen3_config_becomes_our_flags_without_biases():
    values = hf_config_to_values(QWEN3_06B)
    assert (values["qk_layernorm"], values["kv_channels"], values["add_qkv_bias"]) == (True, 128, False)
    check_supported(QWEN3_06B)
    # transformers' Qwen3Config reads a missing head_dim as 128, not hidden / heads
    assert hf_config_to_values({**QWEN3_06B, "head_dim": None})["kv_channels"] == 128
    same = hf_config_to_values({**QWEN3_06B, "hidden_size": 2048})  # 16 x 128 = hidden: no flag needed
    assert same["kv_channels"] is None
    llama = hf_config_to_values({**QWEN3_06B, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert (llama["qk_layernorm"], llama["kv_channels"]) == (False, 128)


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(use_sliding_window=True), "use_sliding_window=true: sliding-window attention is not supported"),
        (dict(attention_bias=True), "attention_bias=true: biases in linear layers are not supported"),
        (dict(head_dim=0), "head_dim must be a positive integer"),
    ],
)
def test_unsupported_qwen3_configs_are_named(change, needle):
    with pytest.raises(ValueError, match="cannot convert") as err:
        check_supported({**QWEN3_06B, **change})
    assert needle in str(err.value)


def test_qk_layernorm_models_export_as_qwen3_with_their_head_dim():
    hf = build_hf_config({**QWEN3_OURS, "untie_embeddings_and_output_weights": False, "rotary_base": 10000,
                          "norm_epsilon": 1e-6}, 128, 96)  # fmt: skip
    assert (hf["model_type"], hf["architectures"], hf["head_dim"], hf["attention_bias"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        32,
        False,
    )
    check_supported(hf)
    back = hf_config_to_values(hf)
    assert (back["qk_layernorm"], back["kv_channels"], back["add_qkv_bias"]) == (True, 32, False)


@pytest.mark.parametrize(
    "change",
    [dict(add_qkv_bias=True), dict(normalization="LayerNorm"), dict(disable_bias_linear=False)],
    ids=["q/k/v biases", "LayerNorm", "linear biases"],
)
def test_save_hf_refuses_qk_norm_models_that_are_not_qwen3_by_name(change):
    problems = get_exportable_problems({**QWEN3_OURS, **change})
    assert any(p.startswith("--qk-layernorm: q/k norms export as Qwen3 only") for p in problems), problems
    cfg = build_job_config({**MOCK, **QWEN3_OURS, **change, "save": "/tmp/x", "save_hf": True})
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert any("--save-hf" in p and "--qk-layernorm" in p for p in err.value.problems), err.value.problems
    assert not get_exportable_problems(QWEN3_OURS)


def test_mapping_round_trips_qk_norms_and_a_head_dim_of_its_own():
    hf = dict(QWEN3_06B, vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=24)
    heads, groups, d, h = 16, 8, 24, 64
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(100, h, generator=g), "model.norm.weight": torch.rand(h) + 0.5}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (heads * d, h),
            "self_attn.k_proj.weight": (groups * d, h),
            "self_attn.v_proj.weight": (groups * d, h),
            "self_attn.o_proj.weight": (h, heads * d),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (96, h),
            "mlp.up_proj.weight": (96, h),
            "mlp.down_proj.weight": (h, 96),
        }
        state.update({p + k: torch.rand(s, generator=g) + 0.5 for k, s in shapes.items()})
    for one_p in (False, True):
        ours = hf_to_megatron_tensors(state, hf, 128, zero_centered_gamma=one_p)
        assert ours["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((heads + 2 * groups) * d, h)
        q_norm = ours["decoder.layers.0.self_attention.q_layernorm.weight"]
        assert torch.equal(q_norm, state["model.layers.0.self_attn.q_norm.weight"] - (1.0 if one_p else 0.0))
        back = megatron_to_hf_tensors(ours, hf, zero_centered_gamma=one_p)
        assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_flops_count_the_query_width():
    """Qwen3-0.6B, one sequence of s tokens: 6 x tokens x the matmul weights (attention, MLP, output
    layer) plus the attention scores, 12 x L x s^2 x heads x head_dim (Megatron-LM's accounting)."""
    c = QWEN3_06B
    cfg = build_job_config({**MOCK, **hf_config_to_values(c)})
    L, h, heads, groups, d, ffn, vocab = 28, 1024, 16, 8, 128, 3072, 151936
    s = 4096
    matmul = L * (h * (heads + 2 * groups) * d + heads * d * h + 3 * h * ffn) + vocab * h
    expected = 6 * s * matmul + 12 * L * s * s * heads * d
    assert num_floating_point_operations(cfg.model, vocab, s, s * s) == pytest.approx(expected, rel=1e-12)


def test_a_checkpoint_loads_only_with_its_q_k_norms_and_head_dimension():
    from megatron_ext.checkpoint.compatibility import check_compatible
    from megatron_ext.checkpoint.parts import CheckpointMeta

    def cfg(**v):
        return build_job_config({**MOCK, "hidden_size": 64, "num_attention_heads": 4, **v})

    meta = CheckpointMeta(tokenizer={}, padded_vocab_size=128)
    saved = {"args": cfg(qk_layernorm=True, kv_channels=32).to_flat_dict(), "padded_vocab_size": 128}
    assert check_compatible(saved, cfg(qk_layernorm=True, kv_channels=32), meta) == []
    problems = check_compatible(saved, cfg(), meta)
    assert [p.split(":")[0] for p in problems] == ["--kv-channels", "--qk-layernorm"], problems
    assert "saved with 32, this run has 16" in problems[0]
    plain = {"args": cfg().to_flat_dict(), "padded_vocab_size": 128}
    assert check_compatible(plain, cfg(kv_channels=16), meta) == []  # hidden / heads, given or not
