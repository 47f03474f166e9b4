"""The V placement's pure pieces: which chunk is first/last, who holds the loss, the loop-equivalent
chunk that names a V chunk's layers, and the refusal of uneven splits under V."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.derived import get_stage_placement
from megatron_ext.model.v_placement import build_placed_float16_module, get_loop_equivalent
from megatron_ext.parallel import ParallelContext, StagePlacement
from megatron_ext.testing import tiny_values
from megatron_ext.validation import validate


@pytest.mark.parametrize("pp", [2, 4])
def test_v_puts_the_embedding_and_the_loss_on_rank_0(pp):
    places = [StagePlacement(r, pp, 0, 1, 2, "v") for r in range(pp)]
    assert [(p.pp_rank, c) for p in places for c in (0, 1) if p.is_first(c)] == [(0, 0)]
    assert [(p.pp_rank, c) for p in places for c in (0, 1) if p.is_last(c)] == [(0, 1)]
    loop = [StagePlacement(r, pp, 0, 1, 2) for r in range(pp)]
    assert [(p.pp_rank, c) for p in loop for c in (0, 1) if p.is_last(c)] == [(pp - 1, 1)]


def _ctx(pp_rank, tp_rank, dp_rank, placement, pp=4, tp=2, dp=2):
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)  # megatron-core's order tp-cp-ep-dp-pp
    return ParallelContext(
        None,
        rank,
        tp * dp * pp,
        tp_rank,
        tp,
        pp_rank,
        pp,
        dp_rank,
        dp,
        2,
        None,
        None,
        None,
        None,
        stage_placement=placement,
    )


def test_the_loss_rank_and_the_logging_rank_follow_the_placement():
    everyone = [(p, t, d) for p in range(4) for t in range(2) for d in range(2)]
    for placement, loss_rank in (("loop", 3), ("v", 0)):
        ctxs = [_ctx(p, t, d, placement) for p, t, d in everyone]
        assert {c.pp_rank for c in ctxs if c.is_last_stage} == {loss_rank}
        (logging,) = [c for c in ctxs if c.is_logging_rank]
        assert (logging.pp_rank, logging.tp_rank, logging.dp_rank) == (loss_rank, 1, 1)
    assert [c.rank for c in (_ctx(p, t, d, "loop") for p, t, d in everyone) if c.is_logging_rank] == [15]


@pytest.mark.parametrize("pp", [2, 4])
def test_a_v_chunk_is_named_as_the_same_stage_under_the_loop_placement(pp):
    config = types.SimpleNamespace(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2, pipeline_stage_placement="v"
    )
    for rank in range(pp):
        # chunk 0 is stage r (loop: rank r, chunk 0); chunk 1 is stage 2p-1-r (loop: rank p-1-r, chunk 1)
        assert get_loop_equivalent(config, 0, rank) == (0, rank)
        assert get_loop_equivalent(config, 1, rank) == (1, pp - 1 - rank)
    config.pipeline_stage_placement = "loop"
    assert get_loop_equivalent(config, 1, 0) == (1, 0)


def test_the_schedule_names_the_placement():
    assert get_stage_placement(build_job_config(tiny_values())) == "loop"
    assert get_stage_placement(build_job_config(tiny_values(pipeline_schedule="zbvzerobubble"))) == "v"
    assert get_stage_placement(build_job_config(tiny_values(pipeline_schedule="ZBH1"))) == "loop"


@pytest.mark.parametrize("flags", [dict(decoder_first_pipeline_num_layers=2), dict(decoder_last_pipeline_num_layers=2)])
def test_first_and_last_rank_layer_counts_are_refused_under_v(flags):
    values = {
        **tiny_values(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2, num_layers=8),
        **flags,
    }
    validate(build_job_config(values), 2)  # the loop placement takes them
    with pytest.raises(ConfigError, match="ZBVZeroBubble places the first and the last pipeline stage on rank 0"):
        validate(build_job_config({**values, "pipeline_schedule": "ZBVZeroBubble"}), 2)


def test_the_embedding_and_loss_counted_as_layers_are_taken_under_v():
    values = tiny_values(
        pipeline_model_parallel_size=2,
        num_layers=6,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
        pipeline_schedule="ZBVZeroBubble",
    )
    validate(build_job_config(values), 2)  # 6 layers + 2 = 8 units, 2 per stage (2 implied chunks per rank)
    with pytest.raises(ConfigError, match="virtual stages 2 = 4"):  # 4 + 2 units do not fill 4 stages evenly
        validate(build_job_config({**values, "num_layers": 4}), 2)


class _Stage(torch.nn.Module):
    def __init__(self, pre: bool, post: bool):
        super().__init__()
        self.pre_process, self.post_process = pre, post
        self.linear = torch.nn.Linear(4, 4)
        self.seen_dtype = None

    def forward(self, x):
        self.seen_dtype = x.dtype
        return self.linear(x)


@pytest.mark.parametrize("pre,post", [(True, False), (False, True), (False, False)])
def test_half_precision_casts_at_the_chunks_own_first_and_last_stage(pre, post):
    """Under V the last stage is chunk 1 of rank 0: Float16Module must upcast there, by the chunk's
    post_process, not by (last vp stage, last pp rank)."""
    config = types.SimpleNamespace(bf16=True, fp16=False, virtual_pipeline_model_parallel_size=2)
    stage = _Stage(pre, post)
    wrapped = build_placed_float16_module(config, stage)
    x = torch.randn(2, 4) if pre else torch.randn(2, 4).bfloat16()
    out = wrapped(x)
    assert stage.seen_dtype == torch.bfloat16
    assert out.dtype == (torch.float32 if post else torch.bfloat16)
