"""Pipeline timeline on real 4-rank runs of the tiny model: the trace is a valid megatron-core
schedule, and ``tools/pp_timeline.py`` renders it.

Layouts (4 forked gloo ranks each, 2 training steps, the training loop's own timeline, as
``--pp-timeline`` sets it): PP=4 1F1B with m=8; PP=4 x VPP=2 (8 layers) with m=8;
PP=2 x VPP=2 x DP=2 with m=4 (two pipelines traced side by side).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.pipeline.validate import get_schedule_name
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train
from megatron_ext.training.timeline import build_pp_timeline
from tools.timeline_analysis import check_schedule, get_bubble_theory, read_timeline

pytestmark = pytest.mark.distributed

STEPS = 2
LAYOUTS = {
    # name: (overrides, m, p, v)
    "PP4": (dict(pipeline_model_parallel_size=4, global_batch_size=16), 8, 4, 1),
    "PP4xVPP2": (
        dict(
            pipeline_model_parallel_size=4, num_layers=8, num_layers_per_virtual_pipeline_stage=1, global_batch_size=16
        ),
        8,
        4,
        2,
    ),
    "PP2xVPP2xDP2": (
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, global_batch_size=16),
        4,
        2,
        2,
    ),
    # ours: F, B and W spans (stage 0's whole backward in its W slot: a B span, then the W span)
    "ZBH1 PP4": (dict(pipeline_model_parallel_size=4, global_batch_size=16, pipeline_schedule="ZBH1"), 8, 4, 1),
    "ZBV PP4": (
        dict(pipeline_model_parallel_size=4, num_layers=8, global_batch_size=16, pipeline_schedule="ZBVZeroBubble"),
        8,
        4,
        2,
    ),
}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _traced_runs(rank: int, world_size: int, root: str) -> None:
    for name, (overrides, *_) in LAYOUTS.items():
        run = build_tiny_run(tiny_values(train_iters=STEPS, **overrides), MarkovDataset(32))
        run.timeline = build_pp_timeline(os.path.join(root, name), run.ctx, get_schedule_name(run.cfg))
        train(run)
        destroy_parallel_context()


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("pp_timeline"))
    run_ranks(_traced_runs, 4, root)
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trace_is_valid_schedule(name, traces):
    _, m, p, v = LAYOUTS[name]
    steps = read_timeline(os.path.join(traces, name))
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, by_rank in steps.items():
        assert sorted(by_rank) == [0, 1, 2, 3]
        for recs in by_rank.values():
            (meta,) = [r for r in recs if r["kind"] == "step"]
            assert (meta["num_microbatches"], meta["pp_size"], meta["vp_size"]) == (m, p, v)
            # exactly m forwards and m backwards (and, ours, m W's) per virtual stage, one optimizer span
            for kind in "FBW" if meta["schedule"] else "FB":
                assert len([r for r in recs if r["kind"] == kind]) == m * v
            (opt,) = [r for r in recs if r["kind"] == "optimizer"]
            assert meta["start"] <= opt["start"] <= opt["end"] == meta["end"]
        assert check_schedule(by_rank) == [], f"{name} step {step}"


def test_checker_catches_a_swapped_pair(traces):
    """The checks are not vacuous: swapping two backwards of one rank's real trace is reported."""
    by_rank = read_timeline(os.path.join(traces, "PP4"))[1]
    recs = by_rank[1]
    b = [r for r in recs if r["kind"] == "B"]
    b[0]["mb"], b[1]["mb"] = b[1]["mb"], b[0]["mb"]
    problems = check_schedule(by_rank)
    assert any("out of micro-batch order" in msg for msg in problems), problems


@pytest.mark.parametrize("name", ["PP4xVPP2", "ZBV PP4"])
def test_render_png(traces, tmp_path, name):
    _, m, p, v = LAYOUTS[name]
    out = tmp_path / "timeline.png"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "pp_timeline.py"),
            os.path.join(traces, name),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    # one row per rank: "rank R pp R  v V  m M  bubble X  model Y  theory Z ..."
    rows = re.findall(
        r"^rank\s+(\d+)\s+pp\s+(\d+)\s+v\s+(\d+)\s+m\s+(\d+)\s+bubble\s+([\d.]+)\s+"
        r"model\s+([\d.]+)\s+theory\s+([\d.]+)",
        proc.stdout,
        re.M,
    )
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], proc.stdout
    for _, _pp, vv, mm, measured, model, theory in rows:
        assert (int(vv), int(mm)) == (v, m)
        assert float(theory) == pytest.approx(get_bubble_theory(p, m, v), abs=5e-4)
        assert float(measured) >= 0.0 and float(model) >= 0.0
