"""Layout-independent initialisation: pure functions of (seed, global name, full shape)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.model.init_weights import build_full_tensor, get_global_name, slice_for_tp


def test_global_names_shift_layer_index_only_once():
    assert get_global_name("decoder.layers.0.mlp.linear_fc1.weight", 3) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert get_global_name("decoder.layers.1.self_attention.linear_qkv.weight", 2).startswith("decoder.layers.3.")
    assert get_global_name("embedding.word_embeddings.weight", 5) == "embedding.word_embeddings.weight"


def test_values_depend_on_seed_name_and_shape_only():
    a = build_full_tensor(1, "decoder.layers.0.mlp.linear_fc1.weight", (64, 16), 0.02, 4)
    b = build_full_tensor(1, "decoder.layers.0.mlp.linear_fc1.weight", (64, 16), 0.02, 4)
    c = build_full_tensor(2, "decoder.layers.0.mlp.linear_fc1.weight", (64, 16), 0.02, 4)
    d = build_full_tensor(1, "decoder.layers.1.mlp.linear_fc1.weight", (64, 16), 0.02, 4)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_conventions():
    big = (256, 256)
    plain = build_full_tensor(0, "decoder.layers.0.self_attention.linear_qkv.weight", big, 0.02, 8)
    scaled = build_full_tensor(0, "decoder.layers.0.self_attention.linear_proj.weight", big, 0.02, 8)
    assert plain.std().item() == pytest.approx(0.02, rel=0.02)
    assert scaled.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    assert torch.all(build_full_tensor(0, "decoder.final_layernorm.weight", (8,), 0.02, 8) == 1)
    assert torch.all(build_full_tensor(0, "decoder.layers.0.mlp.linear_fc1.bias", (8,), 0.02, 8) == 0)
    with pytest.raises(ValueError, match="no initialisation rule"):
        build_full_tensor(0, "decoder.layers.0.mystery.weight", (2, 2), 0.02, 8)


def _param(shape, dim):
    p = torch.nn.Parameter(torch.empty(shape))
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


def test_tp_slices_reassemble_the_full_tensor():
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    shards = [slice_for_tp(full, _param((4, 3), 0), r, 2, gated=False) for r in range(2)]
    assert torch.equal(torch.cat(shards, 0), full)


def test_gated_fc1_is_sharded_as_gate_and_up_halves():
    ffn = 4
    gate, up = torch.zeros(ffn, 2), torch.ones(ffn, 2)
    gate[:, 0] = torch.arange(ffn)
    up[:, 0] = 100 + torch.arange(ffn)
    full = torch.cat([gate, up])  # [2 * ffn, h] = [gate; up], one process
    r0 = slice_for_tp(full, _param((ffn, 2), 0), 0, 2, gated=True)
    r1 = slice_for_tp(full, _param((ffn, 2), 0), 1, 2, gated=True)
    # each rank holds [its gate shard; its up shard]
    assert r0[:, 0].tolist() == [0, 1, 100, 101]
    assert r1[:, 0].tolist() == [2, 3, 102, 103]
