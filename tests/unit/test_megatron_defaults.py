"""Flags with Megatron-LM's names mean what they mean there: the defaults Megatron-LM resolves for
them (core_v0.16.1: megatron/training/arguments.py ``validate_args`` and
``get_optimizer_param_scheduler`` in training.py), written out here rather than read from our code."""

from __future__ import annotations

import pytest

from megatron_ext.config import ConfigError, build_job_config, validate
from megatron_ext.model.gpt import resolve_ffn_hidden_size

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128, global_batch_size=8, micro_batch_size=1)


def megatron_lm_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's validate_args: ``int((4 * h * 2 / 3) / 64) * 64`` with --swiglu, else 4h."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@pytest.mark.parametrize("hidden_size", [64, 128, 256, 768, 1024, 2048, 4096, 5120, 8192])
@pytest.mark.parametrize("swiglu", [False, True])
def test_default_ffn_hidden_size_is_megatron_lms(hidden_size, swiglu):
    # --swiglu rounds 2/3 of 4h DOWN to a multiple of 64: 4096 -> 10880 (rounding up gave 10944,
    # another model than a Megatron-LM script without --ffn-hidden-size builds)
    assert resolve_ffn_hidden_size(None, hidden_size, swiglu) == megatron_lm_ffn_hidden_size(hidden_size, swiglu)
    assert resolve_ffn_hidden_size(1000, hidden_size, swiglu) == 1000  # given: used as it is


def test_swiglu_default_width_of_zero_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--swiglu with --hidden-size 16: the default --ffn-hidden-size .* is 0; "
                                          "give --ffn-hidden-size"):
        validate(build_job_config({**MOCK, "hidden_size": 16, "num_attention_heads": 4, "swiglu": True}), 1)
    validate(build_job_config({**MOCK, "hidden_size": 16, "num_attention_heads": 4, "swiglu": True,
                               "ffn_hidden_size": 32}), 1)


def test_hf_export_of_a_default_width_checkpoint_names_the_width_it_trained():
    from tools.convert_checkpoint import build_hf_config

    args = dict(swiglu=True, normalization="RMSNorm", disable_bias_linear=True, position_embedding_type="rope",
                hidden_size=256, ffn_hidden_size=None, num_layers=2, num_attention_heads=4, group_query_attention=False,
                norm_epsilon=1e-5, rotary_base=10000, seq_length=32, untie_embeddings_and_output_weights=True)
    assert build_hf_config(args, {"padded_vocab_size": 256})["intermediate_size"] == 640
