"""bench/cp.py on tiny shapes: every part runs (timed variants, balance, collectives, memory) and its
deterministic figures hold; its times are not checked (a benchmark's figures, not a test's)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.distributed  # the bench forks 4 gloo ranks

TINY = [
    "--rounds",
    "1",
    "--warmup",
    "0",
    "--layers",
    "2",
    "--seq-length",
    "1024",
    "--time-scale",
    "0.01",
    "--balance-tokens",
    "65536",
    "--gloo-iters",
    "1",
]


def test_cp_bench_runs_every_part_on_tiny_shapes(capsys):
    from bench import cp

    assert cp.main(TINY) == 0
    out = capsys.readouterr().out
    for variant in cp.get_variants():
        assert f"| {variant.name} |" in out, (variant.name, out)
    # CP collectives per layer and micro-batch: one all-gather forward and one reduce-scatter backward,
    # one more all-gather when core attention is recomputed; none at CP 1
    rows = re.findall(
        r"^\| (kept|recomputed) \| (\d) \| ([\d/]+) \| ([\d/]+) \| \d+ \| ([\d.]+) \|.*\| (\w+) \|", out, re.M
    )
    counts = {(kind, int(c)): (gathers, scatters) for kind, c, gathers, scatters, _, _ in rows}
    assert counts == {
        ("kept", 1): ("0", "0"),
        ("kept", 2): ("1", "1"),
        ("kept", 4): ("1", "1"),
        ("recomputed", 1): ("0", "0"),
        ("recomputed", 2): ("2", "1"),
        ("recomputed", 4): ("2", "1"),
    }, out
    # saved bytes per rank against CP 1: exact for the stand-ins, whatever the load
    ratios = {(kind, int(c)): float(ratio) for kind, c, _, _, ratio, _ in rows}
    assert ratios[("recomputed", 2)] == 0.5 and ratios[("recomputed", 4)] == 0.25, out
    assert ratios[("kept", 2)] == pytest.approx(37 / 72, abs=1e-4) and ratios[("kept", 4)] == pytest.approx(
        19.5 / 72, abs=1e-4
    ), out
    assert all(verdict == "PASS" for *_, verdict in rows), out
    # the per-document layout's balance: 1.000 on every mix and c
    balance = re.findall(r"^\| \d+k, median .*\| (\d\.\d{3}) / (\d\.\d{3}) \| \+[\d.]+% \| (\w+) \|$", out, re.M)
    assert len(balance) == len(cp.BALANCE_MIXES) * len(cp.BALANCE_CP), out
    assert all(a == "1.000" and w == "1.000" and v == "PASS" for a, w, v in balance), out
