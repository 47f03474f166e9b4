"""What context parallelism changes around the training loop, as pure logic (no process group): the
checkpoint's layout record, the dropout seeds, how a rank is named, the one logging rank, and the
pipelines of ``--pp-timeline``. The distributed side is tests/distributed/test_cp_training.py."""

from __future__ import annotations

import itertools
import json

import torch

from megatron_ext.checkpoint.state import get_layout, is_same_layout
from megatron_ext.heartbeat import Heartbeat
from megatron_ext.parallel import CP_SEED_STRIDE, ParallelContext, get_dropout_seed
from megatron_ext.training.timeline import build_pp_timeline


def build_context(tp=1, cp=1, pp=1, dp=1, tp_rank=0, cp_rank=0, pp_rank=0, dp_rank=0, placement="loop"):
    """The ``ParallelContext`` of one rank of a TP x CP x PP x DP world, in megatron-core's order
    tp-cp-ep-dp-pp (TP fastest), without groups."""
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    return ParallelContext(
        device=torch.device("cpu"),
        rank=rank,
        world_size=tp * cp * pp * dp,
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=pp,
        dp_rank=dp_rank,
        dp_size=dp,
        vp_size=None,
        tp_group=None,
        pp_group=None,
        dp_group=None,
        mp_group=None,
        stage_placement=placement,
        cp_rank=cp_rank,
        cp_size=cp,
    )


def every_rank(tp, cp, pp, dp, placement="loop"):
    for t, c, p, d in itertools.product(range(tp), range(cp), range(pp), range(dp)):
        yield build_context(tp, cp, pp, dp, t, c, p, d, placement)


def test_the_layout_record_gains_cp_and_a_record_without_it_was_saved_at_cp_1():
    """RNG states (per rank) are restored only in the same layout: CP 2 -> CP 1 or 4 is another layout
    even at the same world size; a checkpoint written before CP (no "cp") is a CP 1 one."""
    cp2 = build_context(cp=2, pp=2)
    assert get_layout(cp2) == {"world_size": 4, "tp": 1, "cp": 2, "pp": 2, "dp": 1, "vp": 1}
    assert is_same_layout(get_layout(cp2), cp2)
    assert not is_same_layout(get_layout(cp2), build_context(pp=2, dp=2))  # same world, TP, PP
    assert not is_same_layout(get_layout(cp2), build_context(cp=4, pp=2))
    old = {"world_size": 4, "tp": 1, "pp": 2, "dp": 2, "vp": 1}
    assert is_same_layout(old, build_context(pp=2, dp=2)) and not is_same_layout(old, cp2)
    assert not is_same_layout(None, cp2)


def test_the_dropout_seed_is_offset_per_cp_rank_and_cp_rank_0_keeps_the_seed():
    assert get_dropout_seed(1234, 0) == 1234  # a run without CP draws what it drew before
    seeds = [get_dropout_seed(1234, r) for r in range(8)]
    assert len(set(seeds)) == 8
    # megatron-core's TP tracker seeds (seed + 2718 + TP rank) of two CP ranks never meet for TP < stride
    tracker = {s + 2718 + t for s in seeds for t in range(CP_SEED_STRIDE)}
    assert len(tracker) == 8 * CP_SEED_STRIDE


def test_a_rank_is_named_with_its_cp_rank_under_cp_only():
    place = build_context(tp=2, cp=2, pp=2, tp_rank=1, cp_rank=1, pp_rank=1).describe_place()
    assert place == "pipeline stage 1 of 2, tensor rank 1, context-parallel rank 1, data-parallel rank 0"
    assert (
        build_context(pp=2, pp_rank=1).describe_place() == "pipeline stage 1 of 2, tensor rank 0, data-parallel rank 0"
    )
    beat = Heartbeat(rank=3, host="h", pp_size=2, cp_rank=1, cp_size=2)
    assert beat.describe_rank() == (
        "rank 3 (pipeline stage 0 of 2, tensor rank 0, context-parallel rank 1, data-parallel rank 0, host h)"
    )
    # a heartbeat published without CP fields (an older rank, or no CP) reads as before
    assert "context-parallel" not in Heartbeat.from_json(json.dumps({"rank": 1})).describe_rank()


def test_one_logging_rank_under_either_placement_with_cp():
    for placement in ("loop", "v"):
        logging = [c.rank for c in every_rank(2, 2, 2, 2, placement) if c.is_logging_rank]
        assert len(logging) == 1, (placement, logging)
    # V: the loss is on pipeline rank 0; its last TP, CP and DP rank logs
    (v,) = [c for c in every_rank(2, 2, 2, 2, "v") if c.is_logging_rank]
    assert (v.pp_rank, v.tp_rank, v.cp_rank, v.dp_rank) == (0, 1, 1, 1)


def test_each_cp_rank_runs_a_pipeline_of_its_own_in_the_timeline(tmp_path):
    """--pp-timeline: the ranks of one pipeline share its id; CP peers hold other tokens of the same
    micro-batches, each a pipeline of its own (tools/timeline_analysis.py groups by the id)."""
    ids: dict[int, set[int]] = {}
    for c in every_rank(2, 2, 2, 2):
        ids.setdefault(build_pp_timeline(str(tmp_path), c).meta["pipeline"], set()).add(c.pp_rank)
    assert len(ids) == 2 * 2 * 2 and all(stages == {0, 1} for stages in ids.values())
