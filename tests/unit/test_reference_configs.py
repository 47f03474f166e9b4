"""The reference configs at real sizes (configs/llama3-8b.yaml, llama3-70b.yaml, gpt3-175b.yaml):
valid at the world size of the layout they copy from Megatron-LM's examples, and building exactly
the published parameter counts, counted chunk by chunk on the ``meta`` device
(``megatron_ext/model/param_count.py``; a whole 175B model would ask for about 700 GB).

The independent reference is the closed-form count of a GPT/Llama decoder below (the published
totals: Llama 3 8B 8,030,261,248 and 70B 70,553,706,496 as Hugging Face counts them, GPT-3 175B
174,604,836,864 at a vocabulary of 50,304)."""

from __future__ import annotations

import os

import pytest

from megatron_ext.arguments import parse_args
from megatron_ext.config import ConfigError
from megatron_ext.derived import get_chunk_layer_counts, get_data_parallel_size, get_num_microbatches
from megatron_ext.model.param_count import count_parameters
from megatron_ext.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# config -> (world size of its layout, TP, PP, VPP, DP, the model's parameters at the real tokenizer's vocabulary)
REFERENCE = {
    "llama3-8b.yaml": (8, 1, 1, None, 8, 8_030_261_248),
    "llama3-70b.yaml": (64, 4, 8, 5, 2, 70_553_706_496),
    "gpt3-175b.yaml": (128, 8, 16, None, 1, 174_604_836_864),
}


def load(name: str):
    return parse_args(["--config", os.path.join(ROOT, "configs", name)])


def closed_form_layer(h: int, ffn: int, heads: int, groups: int, gated: bool, bias: bool, layernorm: bool) -> int:
    """One decoder layer's parameters: QKV, output projection, MLP and two norms."""
    kv = 2 * groups * (h // heads)
    qkv = h * (h + kv) + (h + kv if bias else 0)
    proj = h * h + (h if bias else 0)
    fc1 = h * ffn * (2 if gated else 1) + (ffn * (2 if gated else 1) if bias else 0)
    fc2 = ffn * h + (h if bias else 0)
    norms = 2 * h * (2 if layernorm else 1)
    return qkv + proj + fc1 + fc2 + norms


def closed_form(cfg, vocab: int) -> tuple[int, int]:
    """(whole model, one layer) of ``cfg`` over ``vocab`` padded ids."""
    m = cfg.model
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    layernorm = m.normalization == "LayerNorm"
    layer = closed_form_layer(
        m.hidden_size,
        m.ffn_hidden_size or 4 * m.hidden_size,
        m.num_attention_heads,
        groups,
        m.swiglu,
        not m.disable_bias_linear,
        layernorm,
    )
    embeddings = vocab * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1)
    positions = (
        (m.max_position_embeddings or m.seq_length) * m.hidden_size
        if m.position_embedding_type == "learned_absolute"
        else 0
    )
    final_norm = m.hidden_size * (2 if layernorm else 1)
    return m.num_layers * layer + embeddings + positions + final_norm, layer


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_config_is_valid_at_its_world_size(name):
    world, tp, pp, vpp, dp, _ = REFERENCE[name]
    cfg = load(name)
    validate(cfg, world)  # pure: mock data, nothing built
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, get_data_parallel_size(cfg, world)) == (
        tp,
        pp,
        dp,
    )
    counts = get_chunk_layer_counts(cfg)
    assert len(counts) == pp * (vpp or 1) and sum(counts) == cfg.model.num_layers
    assert get_num_microbatches(cfg, world) == cfg.training.global_batch_size // dp
    # one rank more does not fit the layout or the batch: refused (the validation is not vacuous)
    with pytest.raises(ConfigError):
        validate(cfg, world + 1)
    # a real corpus instead of the config's synthetic data, from the command line
    real = parse_args(["--config", os.path.join(ROOT, "configs", name), "--no-mock-data", "--data-path", "corpus"])
    assert real.data.mock_data is False and real.data.data_path == ["corpus"]


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_config_builds_the_published_parameter_count(name):
    world, tp, pp, vpp, _, published = REFERENCE[name]
    cfg = load(name)
    vocab = cfg.data.vocab_size  # the real tokenizer's ids (Llama 3's 128,256; GPT-2's 50,257 -> 50,304 padded)
    padded = -(-vocab // cfg.model.make_vocab_size_divisible_by) * cfg.model.make_vocab_size_divisible_by
    reference, layer = closed_form(cfg, padded)
    assert reference == published  # the closed form reproduces the published figure
    count = count_parameters(cfg, vocab)
    assert count.total == published
    assert len(count.chunks) == pp * (vpp or 1) and sorted(c.stage for c in count.chunks) == list(
        range(len(count.chunks))
    )
    assert sum(c.num_layers for c in count.chunks) == cfg.model.num_layers
    # a middle chunk is its layers only; one TP rank holds 1/TP of its matrices and whole norms
    middle = [c for c in count.chunks if 0 < c.stage < len(count.chunks) - 1]
    h = cfg.model.hidden_size
    norms_per_layer = 2 * h * (2 if cfg.model.normalization == "LayerNorm" else 1)
    row_biases = 0 if cfg.model.disable_bias_linear else 2 * h  # attention output and fc2 biases are not split
    for c in middle:
        assert c.parameters == c.num_layers * layer
        assert c.per_tp_rank == c.num_layers * (
            (layer - norms_per_layer - row_biases) // tp + norms_per_layer + row_biases
        )
    # the model's figure changes with its vocabulary (the count reads the padded vocabulary it is given)
    assert count_parameters(cfg, padded + 1).total != published


def test_tied_output_copy_is_held_but_not_counted():
    """GPT-3 175B ties its output layer to the word embeddings: the last pipeline stage holds a copy
    (its memory) that the model's count leaves out."""
    cfg = load("gpt3-175b.yaml")
    count = count_parameters(cfg, cfg.data.vocab_size)
    first, last = count.chunks[0], count.chunks[-1]
    embedding = 50304 * 12288
    assert last.per_tp_rank - count.chunks[1].per_tp_rank == embedding // 8 + 2 * 12288  # the copy, the final norm
    assert first.parameters - count.chunks[1].parameters == embedding + 2048 * 12288
    assert last.parameters - count.chunks[1].parameters == 2 * 12288
    assert count.per_pp_rank() == [c.per_tp_rank for c in count.chunks]
