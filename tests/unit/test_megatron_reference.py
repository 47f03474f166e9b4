"""Megatron-LM's theoretical memory re-derived (megatron_ext/planning/megatron_reference.py): its parameter
closed form against our exact meta-device counts, and its activation formula against Table 2 of Korthikanti
et al. worked by hand for the reference configs' layouts."""

from __future__ import annotations

import os

import pytest

from megatron_ext.arguments import parse_args
from megatron_ext.derived import get_num_microbatches, get_padded_vocab_size
from megatron_ext.planning.megatron_reference import theoretical_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# config -> (world size of its layout, the model's exact parameters: tests/unit/test_reference_configs.py)
REFERENCE = {"llama3-8b.yaml": (8, 8_030_261_248), "llama3-70b.yaml": (64, 70_553_706_496)}


def load(name: str):
    return parse_args(["--config", os.path.join(ROOT, "configs", name)])


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_megatron_lms_parameter_closed_form_equals_our_exact_count_for_llama(name):
    """Llama has no linear biases (which the formula leaves out), so the formula's count is ours but for
    its norms: it counts each norm as a LayerNorm (weight and bias: 2 (2 L + 1) h), RMSNorm has a weight
    only ((2 L + 1) h); exactly that much more."""
    world, exact = REFERENCE[name]
    cfg = load(name)
    vocab = cfg.data.vocab_size  # the real tokenizer's 128,256 ids (already a multiple of 128)
    ref = theoretical_memory(cfg, world, vocab, get_num_microbatches(cfg, world))
    m = cfg.model
    assert m.normalization == "RMSNorm"
    assert ref.parameters == exact + (2 * m.num_layers + 1) * m.hidden_size


def test_the_70b_layouts_figures_worked_by_hand():
    """Llama 3 70B as configured (TP4 x PP8 x VPP5 x DP2, distributed optimizer, s 8192, b 1)."""
    cfg = load("llama3-70b.yaml")
    padded = get_padded_vocab_size(cfg.data.vocab_size, cfg)  # 128,512
    ref = theoretical_memory(cfg, 64, padded, get_num_microbatches(cfg, 64))
    h, L, ffn, s = 8192, 80, 28672, 8192
    # attention (GQA 8 of 64), SwiGLU MLP, two norms counted as LayerNorms (weight and bias)
    layer = 2 * h * h * (1 + 8 / 64) + 3 * h * ffn + 4 * h
    transformer = L * layer + 2 * h
    shard = (transformer / 8 + h * padded) / 4
    assert ref.shard_parameters == pytest.approx(shard, rel=1e-12)
    assert ref.weights_and_optimizer == pytest.approx(shard * (6 + 12 / 2), rel=1e-12)
    per_layer = s * h * (18 + 4 * ffn / h)
    activations = (per_layer * L + 8 * s * 8 + s * h * 8) * (1 + 7 / 40) / 4
    assert ref.activations == pytest.approx(activations, rel=1e-12)


def test_without_interleaving_fewer_micro_batches_than_stages_discount_and_pp1_adds_the_output_layer():
    cfg = load("llama3-70b.yaml")
    padded = get_padded_vocab_size(cfg.data.vocab_size, cfg)
    plain = parse_args(
        ["--config", os.path.join(ROOT, "configs", "llama3-70b.yaml"), "--num-virtual-stages-per-pipeline-rank", "0"]
    )
    full = theoretical_memory(plain, 64, padded, 16).activations
    assert theoretical_memory(plain, 64, padded, 4).activations == pytest.approx(full * 4 / 8, rel=1e-12)
    assert theoretical_memory(cfg, 64, padded, 16).activations == pytest.approx(full * (1 + 7 / 40), rel=1e-12)
    one = parse_args(["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml")])
    s, b, h = 8192, 1, 4096
    padded8 = get_padded_vocab_size(one.data.vocab_size, one)
    layers = s * b * h * (18 + 4 * 14336 / h) * 32 + 8 * s * b + s * b * h
    assert theoretical_memory(one, 8, padded8, 16).activations == pytest.approx(
        layers + s * b * h * 4 * (1 + padded8 / h), rel=1e-12
    )
