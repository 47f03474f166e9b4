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


# ----------------------------------------------------------------------------- TP ranks vs one process

HIDDEN, FFN, VOCAB, LAYERS = 8, 12, 16, 2


def _param(shape: tuple[int, ...], partition_dim: int | None = None) -> torch.nn.Parameter:
    """A parameter carrying megatron-core's TP attributes when it is split (``partition_dim``)."""
    param = torch.nn.Parameter(torch.full(shape, float("nan")))
    if partition_dim is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, 1
    return param


def _module(**params: torch.nn.Parameter) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, param in params.items():
        setattr(module, name, param)
    return module


def build_chunk_stand_in(tp: int, swiglu: bool) -> torch.nn.Module:
    """An unwrapped GPTModel chunk (its second layer) as one TP rank of ``tp`` holds it: megatron-core's
    parameter names, local shapes and TP attributes (column-parallel: dim 0, row-parallel: dim 1)."""
    layer = torch.nn.Module()
    layer.layer_number = 2  # global layer 1: the chunk's layer offset
    layer.input_layernorm = _module(weight=_param((HIDDEN,)))
    layer.self_attention = torch.nn.Module()
    layer.self_attention.linear_qkv = _module(weight=_param((3 * HIDDEN // tp, HIDDEN), 0))
    layer.self_attention.linear_proj = _module(weight=_param((HIDDEN, HIDDEN // tp), 1))
    layer.mlp = torch.nn.Module()
    layer.mlp.linear_fc1 = _module(weight=_param(((2 if swiglu else 1) * FFN // tp, HIDDEN), 0))
    layer.mlp.linear_fc2 = _module(weight=_param((HIDDEN, FFN // tp), 1))
    chunk = torch.nn.Module()
    chunk.embedding = torch.nn.Module()
    chunk.embedding.word_embeddings = _module(weight=_param((VOCAB // tp, HIDDEN), 0))  # vocabulary-parallel
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([layer])
    return chunk


def reassemble(name: str, shards: list[torch.Tensor], params: list[torch.nn.Parameter], gated: bool) -> torch.Tensor:
    """The one-process tensor from the TP ranks' shards, placed where megatron-core's checkpoint
    sharding puts them (``ShardedTensor`` offsets; a gated fc1 through its own swiglu factory, which
    splits each rank's [gate; up] into the two halves of the full tensor): the layout a TP1 run
    loads, independent of our slicing."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    tp = len(shards)
    if not getattr(params[0], "tensor_model_parallel", False):
        assert all(torch.equal(s, shards[0]) for s in shards), name  # replicated: every rank alike
        return shards[0]
    pieces = []
    for rank, (shard, param) in enumerate(zip(shards, params)):
        sharded = ShardedTensor.from_rank_offsets(name, shard, (param.partition_dim, rank, tp), replica_id=0)
        pieces += apply_swiglu_sharded_factory(sharded, ()).build() if gated else [sharded]
    full = torch.full(pieces[0].global_shape, float("nan"))
    for piece in pieces:
        full[tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local_shape))] = piece.data
    return full


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_tp_ranks_reassemble_exactly_into_the_one_process_initialisation(swiglu):
    from megatron_ext.model.init_weights import apply_layout_independent_init

    def init(tp: int, rank: int) -> dict[str, torch.nn.Parameter]:
        chunk = build_chunk_stand_in(tp, swiglu)
        names = apply_layout_independent_init([chunk], 1234, 0.02, LAYERS, rank, tp, gated_mlp=swiglu)
        return {names[f"0/{local}"]: param for local, param in chunk.named_parameters()}

    one = init(1, 0)
    ranks = [init(2, 0), init(2, 1)]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in one  # global layer names
    for name, expected in one.items():
        shards = [r[name].detach() for r in ranks]
        gated = swiglu and "linear_fc1" in name
        assert not gated or shards[0].shape[0] == FFN  # each rank: its FFN / 2 gate rows, then its up rows
        got = reassemble(name, shards, [r[name] for r in ranks], gated)
        assert torch.equal(got, expected.detach()), name  # NaN left anywhere fails too
    assert torch.isfinite(one["embedding.word_embeddings.weight"]).all()
