"""Which tensors a rank adds to --log-params-norm (Megatron-LM's calc_params_l2_norm selection,
megatron/training/utils.py core_v0.16.1), without a process group."""

from __future__ import annotations

import torch

from megatron_ext.training.params_norm import select_params_to_norm, sum_of_squares


def _param(value: float, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.full((3,), value))
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def test_tp_duplicates_count_on_tp_rank_0_and_the_tied_copy_never():
    split, duplicate, tied_copy = _param(1.0, tensor_model_parallel=True), _param(2.0), _param(3.0, shared=True)
    for tp_rank, expected in ((0, [split, duplicate]), (1, [split])):
        whole, sharded = select_params_to_norm([split, duplicate, tied_copy], tp_rank, use_main_params=False)
        assert [t.data_ptr() for t in whole] == [p.data_ptr() for p in expected] and sharded == []


def test_bf16_reads_the_main_parameters_and_their_shards():
    shard = torch.ones(2)
    kept, sharded_param, none_here = _param(1.0), _param(2.0), _param(3.0)
    kept.main_param = torch.full((3,), 1.5)
    sharded_param.main_param, sharded_param.main_param_sharded = shard, True
    none_here.main_param, none_here.main_param_sharded = None, True  # another DP rank holds all of it
    whole, sharded = select_params_to_norm([kept, sharded_param, none_here], 0, use_main_params=True)
    assert [id(t) for t in whole] == [id(kept.main_param)] and [id(t) for t in sharded] == [id(shard)]
    whole, sharded = select_params_to_norm([kept], 0, use_main_params=False)  # fp16, fp32: the parameter
    assert torch.equal(whole[0], kept.detach()) and sharded == []


def test_the_sum_of_squares_is_the_squared_norm_of_all_tensors_together():
    tensors = [torch.randn(5, 7), torch.randn(11).bfloat16(), torch.randn(2, 3, 4)]
    reference = torch.cat([t.double().flatten() for t in tensors]).norm() ** 2
    got = sum_of_squares(tensors, torch.device("cpu"))
    assert got.dtype == torch.float64 and abs(float(got) - float(reference)) <= 1e-6 * float(reference)
    assert float(sum_of_squares([], torch.device("cpu"))) == 0.0
