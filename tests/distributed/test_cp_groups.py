"""Context parallelism's process groups (parallel.build_parallel_context): megatron-core's CP and
DP x CP groups, our TP x CP x PP replica group and the prefetcher's data group, against the rank
order tp-cp-ep-dp-pp computed by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.config import build_job_config
from megatron_ext.data.prefetch import build_data_group
from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

TP, CP, PP, DP = 2, 2, 2, 1


def _groups(rank: int, world_size: int) -> dict:
    cfg = build_job_config(
        dict(
            mock_data=True,
            tokenizer_type="NullTokenizer",
            vocab_size=128,
            tensor_model_parallel_size=TP,
            pipeline_model_parallel_size=PP,
            context_parallel_size=CP,
        )
    )
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    ranks = dist.get_process_group_ranks
    data = build_data_group(ctx)
    out = dict(
        cp=(ctx.cp_rank, ctx.cp_size, ranks(ctx.cp_group)),
        dp_cp=ranks(ctx.reduce_group),
        replica=ranks(ctx.data_group),
        prefetch=ranks(data),
        dp=(ctx.dp_rank, ctx.dp_size),
        tp=ranks(ctx.tp_group),
        pp=ranks(ctx.pp_group),
    )
    destroy_parallel_context()
    return out


def test_cp_groups_follow_megatron_cores_rank_order():
    results = run_ranks(_groups, TP * CP * PP * DP)
    for rank, got in enumerate(results):
        tp_rank, cp_rank, pp_rank = rank % TP, rank // TP % CP, rank // (TP * CP)  # order tp-cp-ep-dp-pp
        base = pp_rank * TP * CP + tp_rank
        assert got["cp"] == (cp_rank, CP, [base + c * TP for c in range(CP)])
        assert got["dp_cp"] == [base + c * TP for c in range(CP)]  # DP 1: DP x CP is the CP group
        assert got["replica"] == list(range(TP * CP * PP)) == got["prefetch"]  # everyone reads the same samples
        assert got["dp"] == (0, 1)
        assert got["tp"] == [rank - tp_rank + t for t in range(TP)]
        assert got["pp"] == [rank % (TP * CP) + p * TP * CP for p in range(PP)]
