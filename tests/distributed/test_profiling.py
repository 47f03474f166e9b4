"""Step timers, the PyTorch profiler window, memory scalars and manual GC, on a 2-rank PP2 run.

--timing-log-level 2 prints data / forward-backward / grad-reduce / optimizer milliseconds that
add up to no more than the step; --log-timers-to-tensorboard and --log-memory-to-tensorboard write
those scalars; --profile --use-pytorch-profiler leaves one torch.profiler trace per profiled rank
in --tensorboard-dir holding the profiled iterations' work; --manual-gc turns automatic collection
off during training only.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import re

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed


def _world(rank: int, world_size: int, tb: str) -> dict:
    values = tiny_values(
        num_layers=2,
        pipeline_model_parallel_size=2,
        global_batch_size=4,
        train_iters=4,
        log_interval=2,
        timing_log_level=2,
        log_timers_to_tensorboard=True,
        log_memory_to_tensorboard=True,
        tensorboard_dir=tb,
        profile=True,
        use_pytorch_profiler=True,
        profile_step_start=1,
        profile_step_end=3,
        profile_ranks=["0", "1"],
        manual_gc=True,
        manual_gc_interval=2,
    )
    run = build_tiny_run(values, MarkovDataset(32))
    run.writer = type(run.writer)(run.cfg, enabled=run.ctx.is_logging_rank)  # the tiny run writes no scalars
    lines = []
    run.log = lines.append
    seen = []
    hook = run.model[0].module.register_forward_hook(lambda *a: seen.append(gc.isenabled()))
    train(run)
    hook.remove()
    run.writer.close()
    destroy_parallel_context()
    return {"lines": lines, "gc_in_training": set(seen), "gc_after": gc.isenabled()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tb = str(tmp_path_factory.mktemp("tb"))
    return tb, run_ranks(_world, 2, tb, timeout=300)


def test_timers_are_logged_and_fit_in_the_step(results):
    _, per_rank = results
    lines = per_rank[-1]["lines"]
    timer_lines = [x for x in lines if "timers (ms per iteration" in x]
    step_lines = [x for x in lines if "elapsed time per iteration (ms)" in x]
    assert len(timer_lines) == len(step_lines) == 2
    for timer, step in zip(timer_lines, step_lines):
        values = dict((k, float(v)) for k, v in re.findall(r"([a-z-]+) ([0-9.]+)", timer.split(":", 1)[1]))
        assert set(values) == {"data", "forward-backward", "grad-reduce", "optimizer"}
        assert all(v > 0 for v in values.values())
        elapsed = float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", step).group(1))
        assert values["data"] + values["forward-backward"] + values["optimizer"] <= elapsed * 1.05
        assert values["grad-reduce"] < values["forward-backward"]  # finalize runs inside the schedule


def test_timers_and_memory_reach_tensorboard(results):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, _ = results
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"timers/data", "timers/forward-backward", "timers/grad-reduce", "timers/optimizer"} <= tags
    assert "memory/max-rss-GiB" in tags and acc.Scalars("memory/max-rss-GiB")[-1].value > 0.05


def test_one_profiler_trace_per_profiled_rank(results):
    tb, _ = results
    traces = glob.glob(os.path.join(tb, "*.pt.trace.json"))
    assert len(traces) == 2, traces
    for path in traces:
        events = json.load(open(path))["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any("ProfilerStep#" in n for n in names) and any(n.startswith("aten::") for n in names)


def test_manual_gc_is_off_during_training_only(results):
    _, per_rank = results
    for r in per_rank:
        assert r["gc_in_training"] == {False} and r["gc_after"] is True
