"""Pipeline timeline analysis (pure): schedule orders, the validity checks, bubble statistics,
the discrete-event model; the tracer's hook on a stand-in schedule; the simulated device's meter."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from megatron_ext.training.timeline import PipelineTimeline
from tools import timeline_analysis as ppt

CASES = [(4, 1, 8), (4, 2, 8), (4, 2, 16), (2, 2, 4), (4, 1, 4), (1, 1, 4), (8, 1, 32), (4, 3, 12)]


def _records(p, v, m, hop=0.0):
    return ppt.to_records(ppt.simulate_schedule(p, v, m, 1.0 / v, 2.0 / v, hop=hop), p, v, m)


def test_schedule_order_1f1b_small():
    # PP=2, m=4, rank 0: one warm-up forward, then 1F1B, then one cool-down backward
    assert ppt.get_schedule_order(0, 2, 1, 4) == [
        ("F", 0, 0),
        ("F", 0, 1),
        ("B", 0, 0),
        ("F", 0, 2),
        ("B", 0, 1),
        ("F", 0, 3),
        ("B", 0, 2),
        ("B", 0, 3),
    ]
    # the last rank alternates from the start
    assert ppt.get_schedule_order(1, 2, 1, 4)[:4] == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]


def test_schedule_order_interleaved_small():
    # PP=2, v=2, m=4, rank 1: warm-up 2*(2-1-1) + (2-1)*2 = 2 forwards of chunk 0, then
    # F chunk 1 / B chunk 1 (the mirrored chunk) pairs
    order = ppt.get_schedule_order(1, 2, 2, 4)
    assert order[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0)]
    assert sorted(order) == sorted([(k, c, mb) for k in "FB" for c in range(2) for mb in range(4)])


@pytest.mark.parametrize("p,v,m", CASES)
def test_simulated_schedule_is_valid_and_matches_theory(p, v, m):
    recs = _records(p, v, m)
    assert ppt.check_schedule(recs) == []
    theory = ppt.get_bubble_theory(p, m, v)
    warm_all = v > 1 and 2 * (p - 1) + (v - 1) * p >= m * v  # m = p: megatron runs every forward first
    for b in ppt.get_bubble_stats(recs):
        if not warm_all:
            assert b.idle_over_busy == pytest.approx(theory, abs=1e-9)
            assert b.idle_over_span == pytest.approx((p - 1) / (m * v + p - 1), abs=1e-9)


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 2, 8), (4, 1, 16)])
def test_in_flight_bound(p, v, m):
    ops = ppt.simulate_schedule(p, v, m, 1.0, 2.0)
    for r in range(p):
        assert ppt.get_max_in_flight(ops[r]) == ppt.get_in_flight_bound(r, p, v, m)
    if v == 1:
        assert [ppt.get_in_flight_bound(r, p, 1, m) for r in range(p)] == [p - r for r in range(p)]


def test_hops_add_overhead_and_interleaving_pays_more_of_them():
    base = {
        v: max(op.end for ops in ppt.simulate_schedule(4, v, 8, 1.0 / v, 2.0 / v).values() for op in ops)
        for v in (1, 2)
    }
    hop = {
        v: max(op.end for ops in ppt.simulate_schedule(4, v, 8, 1.0 / v, 2.0 / v, hop=0.01).values() for op in ops)
        for v in (1, 2)
    }
    assert base[1] == pytest.approx(8 * 3 * (1 + 3 / 8)) and base[2] == pytest.approx(8 * 3 * (1 + 3 / 16))
    assert hop[1] > base[1] and hop[2] > base[2]
    assert hop[1] / hop[2] < base[1] / base[2]


def _find(recs, rank, kind, chunk, mb):
    return next(r for r in recs[rank] if r["kind"] == kind and r["chunk"] == chunk and r["mb"] == mb)


def test_check_reports_a_missing_backward():
    recs = _records(4, 1, 8)
    recs[2].remove(_find(recs, 2, "B", 0, 5))
    assert any("B micro-batches" in msg for msg in ppt.check_schedule(recs))


def test_check_reports_backward_before_forward():
    recs = _records(4, 1, 8)
    f, b = _find(recs, 0, "F", 0, 3), _find(recs, 0, "B", 0, 3)
    b["start"] = f["end"] - 0.5
    problems = ppt.check_schedule(recs)
    assert any("starts before its forward ended" in msg for msg in problems), problems


def test_check_reports_a_different_order():
    """Two ranks' op times swapped in a way that keeps per-chunk order but is not 1F1B."""
    recs = _records(4, 1, 8)
    # rank 3 (last) runs F1 before B0: still per-chunk ordered, but 1F1B would run B0 first
    f1, b0 = _find(recs, 3, "F", 0, 1), _find(recs, 3, "B", 0, 0)
    f1["start"], b0["start"] = b0["start"], f1["start"] + 1e-6
    f1["end"], b0["end"] = f1["start"] + 1.0, b0["start"] + 2.0
    problems = ppt.check_schedule(recs)
    assert any("megatron-core's schedule runs" in msg for msg in problems), problems


def test_check_reports_a_cross_rank_dependency_violation():
    recs = _records(4, 2, 8)
    f = _find(recs, 1, "F", 0, 0)  # stage 1 forward of mb 0 cannot start before stage 0's ended
    f["start"] -= 0.9
    problems = ppt.check_schedule(recs)
    assert any("before ('F', 0, 0) ended" in msg for msg in problems), problems


def test_check_reports_overlap_and_in_flight_excess():
    recs = _records(4, 1, 8)
    bad = copy.deepcopy(recs)
    _find(bad, 0, "F", 0, 1)["start"] -= 0.5  # overlaps F0
    assert any("starts before F0.0 ended" in msg for msg in ppt.check_schedule(bad))
    # GPipe order on rank 0 (all forwards first) exceeds the 1F1B bound p - r = 4
    gpipe = {r: [x for x in recs[r] if x["kind"] == "step"] for r in recs}
    t = 0.0
    for kind, dur in (("F", 1.0), ("B", 2.0)):
        for mb in range(8):
            gpipe[0].append({"kind": kind, "step": 1, "chunk": 0, "mb": mb, "start": t, "end": t + dur})
            t += dur
    problems = ppt.check_rank_step(ppt.parse_rank_step(gpipe[0]))
    assert any("in flight, bound 4" in msg for msg in problems), problems


class _FakeSchedules:
    """Stands in for megatron-core's schedule functions (same call shapes)."""

    @staticmethod
    def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, *args, **kwargs):
        return torch.ones(2, requires_grad=True) * 2, torch.tensor(0)

    @staticmethod
    def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        return None


def test_tracer_hooks_schedule_and_restores(tmp_path, monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.setattr(schedules, "forward_step", _FakeSchedules.forward_step)
    monkeypatch.setattr(schedules, "backward_step", _FakeSchedules.backward_step)
    from megatron_ext.pipeline import runtime

    original_weight_step = runtime.weight_step
    tracer = PipelineTimeline(str(tmp_path), rank=3, pp_rank=1, pp_size=2, vp_size=2)
    for step in (1, 2):
        with tracer.trace_step(step):
            outs = {}
            for c, mb in ((0, 0), (0, 1), (1, 0), (1, 1)):  # what an interleaved schedule calls
                outs[c, mb] = schedules.forward_step(
                    None, None, None, 2, None, None, None, 1, current_microbatch=mb, vp_stage=c
                )
            for c, mb in ((1, 0), (0, 0), (1, 1), (0, 1)):
                schedules.backward_step(None, outs[c, mb][0], None, None, None)
        assert schedules.forward_step is _FakeSchedules.forward_step  # restored
        assert schedules.backward_step is _FakeSchedules.backward_step
        assert runtime.weight_step is original_weight_step
    lines = [json.loads(x) for x in (tmp_path / "rank3.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines].count(2) == 1 + 8 + 1  # meta, 4 F + 4 B, optimizer
    step2 = [x for x in lines if x["step"] == 2]
    assert step2[0] | {"start": 0, "end": 0} == {
        "kind": "step",
        "step": 2,
        "rank": 3,
        "pp_rank": 1,
        "pp_size": 2,
        "vp_size": 2,
        "pipeline": 0,
        "num_microbatches": 2,
        "start": 0,
        "end": 0,
        "schedule": None,
        "placement": "loop",
    }
    assert [(x["kind"], x["chunk"], x["mb"]) for x in step2[1:9]] == [
        ("F", 0, 0),
        ("F", 0, 1),
        ("F", 1, 0),
        ("F", 1, 1),
        ("B", 1, 0),
        ("B", 0, 0),
        ("B", 1, 1),
        ("B", 0, 1),
    ]
    assert step2[-1]["kind"] == "optimizer" and step2[-1]["start"] == step2[8]["end"]
    assert ppt.read_timeline(str(tmp_path))[2][3] == step2


def test_saved_tensor_meter_counts_activations_exactly():
    from bench.simdevice import SavedTensorMeter, SimLayer

    layers = [SimLayer(0.0) for _ in range(3)]
    x = torch.randn(16, 2, 8)  # [s, b, h]
    meter = SavedTensorMeter()
    with meter.track():
        y = x
        for layer in layers:
            y = layer(y)
        assert meter.live == 3 * x.numel() * 4  # each layer saves its input; weights are not counted
        y.sum().backward()
    assert meter.live == 0 and meter.peak == 3 * x.numel() * 4
    assert all(layer.weight.grad is not None for layer in layers)


def test_pp_timeline_tool_names_a_wrong_directory_or_a_missing_matplotlib_in_one_line(tmp_path, monkeypatch, capsys):
    """A typo in the trace directory, one without traces, one whose run stopped before a step and a
    machine without matplotlib are one 'error:' line each and exit 2, not a traceback."""
    from tools import pp_timeline

    def message(*argv):
        with pytest.raises(SystemExit) as exc:
            pp_timeline.main([*argv, "--output", str(tmp_path / "t.png")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    assert message(str(tmp_path / "nope")).startswith(f"error: {tmp_path / 'nope'}: no such directory")
    assert "no rank<N>.jsonl files" in message(str(tmp_path))
    (tmp_path / "rank0.jsonl").write_text("")
    assert "hold no step yet" in message(str(tmp_path))
    monkeypatch.setattr(pp_timeline.importlib.util, "find_spec", lambda name: None)
    assert "pip install -e '.[plots]'" in message(str(tmp_path))
    assert not (tmp_path / "t.png").exists()
