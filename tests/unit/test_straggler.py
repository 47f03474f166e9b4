"""The pure half of --log-straggler (megatron_ext/straggler.py): which ranks are slow given every
rank's timings, and the report's lines; the flags' checks. The gather and the loop: tests/distributed/
test_straggler.py."""

from __future__ import annotations

import pytest

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.straggler import RankTiming, find_slow_ranks, format_straggler_report, get_extremes
from megatron_ext.validation import validate


def _timings(own: dict[int, float], pp: int = 2, dp: int = 2, stage_cost: tuple[float, ...] = ()) -> list[RankTiming]:
    """PP x DP ranks (megatron-core's order at TP 1: rank = pp_rank * DP + dp_rank) whose compute is
    ``own[rank]`` (default 10 ms, plus ``stage_cost[pp_rank]``), 1 ms of optimizer and of data."""
    out = []
    for rank in range(pp * dp):
        p = rank // dp
        extra = stage_cost[p] if stage_cost else 0.0
        compute = own.get(rank, 10.0) + extra
        out.append(RankTiming(rank, p, 0, rank % dp, compute, 1.0, 1.0, compute + 5.0, node=f"n{rank // 2}"))
    return out


def test_the_slow_rank_is_named_and_no_other():
    (slow,) = find_slow_ranks(_timings({1: 20.0}), threshold=0.2)
    assert slow.timing.rank == 1 and slow.peers == "its stage" and slow.reference == 12.0
    text = slow.describe()
    assert "rank 1 (node n0, pipeline stage 0, DP rank 1, TP rank 0)" in text and "+83%" in text, text
    assert "most in compute, +10.0 ms" in text


def test_below_the_threshold_nobody_is_named():
    assert find_slow_ranks(_timings({1: 12.0}), threshold=0.2) == []  # 14 vs 12: +17%
    assert [s.timing.rank for s in find_slow_ranks(_timings({1: 12.0}), threshold=0.1)] == [1]


def test_stages_are_compared_with_their_own_peers_only():
    # the last stage holds the output layer: 3x the work of stage 0, on every one of its ranks
    timings = _timings({}, pp=2, dp=3, stage_cost=(0.0, 20.0))
    assert find_slow_ranks(timings, threshold=0.2) == []
    # a slow rank of the light stage, still faster than the heavy stage's ranks, is named
    (slow,) = find_slow_ranks(_timings({2: 18.0}, pp=2, dp=3, stage_cost=(0.0, 20.0)), threshold=0.2)
    assert slow.timing.rank == 2


def test_alone_in_its_stage_a_rank_is_compared_with_all_others():
    (slow,) = find_slow_ranks(_timings({3: 40.0}, pp=4, dp=1), threshold=0.2)
    assert slow.timing.rank == 3 and slow.peers == "all ranks"
    assert find_slow_ranks(_timings({}, pp=1, dp=1), threshold=0.2) == []  # one rank: no peers


def test_waiting_is_not_slowness():
    # rank 0 waits for its slow peer in the gradient reduce: a long forward-backward, short compute
    timings = _timings({1: 30.0})
    timings[0] = RankTiming(0, 0, 0, 0, 10.0, 1.0, 1.0, 60.0)
    assert timings[0].wait == 50.0
    assert [s.timing.rank for s in find_slow_ranks(timings, 0.2)] == [1]


def test_slow_data_and_optimizer_count_too():
    timings = _timings({})
    timings[2] = RankTiming(2, 1, 0, 0, 10.0, 1.0, 9.0, 15.0)  # a slow file system on one rank
    (slow,) = find_slow_ranks(timings, 0.2)
    assert slow.timing.rank == 2 and "most in data, +8.0 ms" in slow.describe(), slow.describe()


def test_extremes_and_report_lines():
    timings = _timings({1: 20.0, 3: 5.0})
    slowest, fastest = get_extremes(timings, 2)
    assert [t.rank for t in slowest] == [1, 0] and [t.rank for t in fastest] == [3, 0]
    assert [t.rank for t in get_extremes(timings, 9)[0]] == [1, 0, 2, 3]  # capped at the world
    lines = format_straggler_report(timings, 0.2, 1)
    assert lines[0].startswith("  stragglers: own work") and "slowest rank 1 (node n0, stage 0, DP 1) 22.0" in lines[0]
    assert "fastest rank 3 (node n1, stage 1, DP 1) 7.0" in lines[0]
    # rank 1 against rank 0 (its stage); rank 2 against rank 3 (12 vs 7: +71%) is slow too
    assert [line.split(":")[1].strip().split(" (")[0] for line in lines[1:]] == ["rank 1", "rank 2"]
    quiet = format_straggler_report(_timings({}), 0.2, 1)
    assert quiet[1] == "  stragglers: no rank more than 20% slower than its peers' median"


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(straggler_minmax_count=0), "--straggler-minmax-count must be a positive integer, got 0"),
        (dict(straggler_threshold=0.0), "--straggler-threshold must be a fraction > 0"),
        (dict(straggler_threshold=float("nan")), "--straggler-threshold must be a fraction > 0"),
    ],
)
def test_bad_straggler_flags_are_one_error_each(values, needle):
    cfg = build_job_config(
        dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=127, log_straggler=True, **values)
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert len(err.value.problems) == 1 and needle in err.value.problems[0], err.value.problems
