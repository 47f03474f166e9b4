"""tools/print_topology.py with context parallelism: each rank's JSON names its CP and DP x CP groups
as megatron-core builds them, against the rank order tp-cp-ep-dp-pp computed by hand (4 forked gloo
ranks: CP 2 x DP 2, so that DP, CP and DP x CP are three different groups)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.testing import run_ranks
from tools.print_topology import write_topology

pytestmark = pytest.mark.distributed


def _write(rank: int, world_size: int, output_dir: str) -> dict:
    return write_topology(1, 1, output_dir, cp=2)


def test_cp_and_dp_x_cp_groups_in_the_topology(tmp_path):
    records = run_ranks(_write, 4, str(tmp_path))
    for rank, r in enumerate(records):
        assert json.load(open(os.path.join(tmp_path, f"rank{rank}.json"))) == r
        cp_rank, dp_rank = rank % 2, rank // 2  # rank = tp + TP x (cp + CP x dp), TP 1
        assert (r["cp_rank"], r["dp_rank"], r["tp_rank"], r["pp_rank"]) == (cp_rank, dp_rank, 0, 0)
        assert r["cp_ranks"] == [2 * dp_rank, 2 * dp_rank + 1]
        assert r["dp_ranks"] == [cp_rank, cp_rank + 2]
        assert r["dp_cp_ranks"] == [0, 1, 2, 3]
        assert r["tp_ranks"] == [rank] == r["pp_ranks"]
