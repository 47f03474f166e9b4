"""--profile --use-pytorch-profiler counts global iterations: a run resumed at iteration 61 with
--profile-step-start 63 --profile-step-end 66 records 63, 64, 65 (62 as warm-up); a window already
behind the resumed iteration says so instead of recording nothing silently."""

from __future__ import annotations

import glob
import json
import os

import torch

from megatron_ext.training.profiling import ProfilerWindow


def _run(window: ProfilerWindow, first: int, last: int) -> None:
    for iteration in range(first, last + 1):
        with torch.profiler.record_function(f"iteration {iteration}"):
            torch.ones(8).sum()
        window.after_step(iteration)
    window.close()


def test_a_resumed_run_profiles_the_global_iterations(tmp_path):
    window = ProfilerWindow(63, 66, str(tmp_path), torch.device("cpu"))
    assert window.begin(61) is None
    _run(window, 62, 70)
    (trace,) = glob.glob(os.path.join(tmp_path, "*.pt.trace.json"))
    names = {e.get("name", "") for e in json.load(open(trace))["traceEvents"]}
    recorded = sorted(int(n.split()[1]) for n in names if n.startswith("iteration "))
    assert recorded == [63, 64, 65], recorded


def test_a_window_behind_the_resumed_iteration_is_named(tmp_path):
    window = ProfilerWindow(5, 8, str(tmp_path), torch.device("cpu"))
    warning = window.begin(61)
    assert warning and "past the window" in warning and "--profile-step-start 5" in warning
    _run(window, 62, 64)
    assert not glob.glob(os.path.join(tmp_path, "*.json"))
