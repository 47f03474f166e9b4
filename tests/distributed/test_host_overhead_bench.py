"""bench/host_overhead.py: its CPU run (every eager figure, as the issue-30 report takes them) runs here on
tiny shapes, and ``--device cuda`` is one clear error without a GPU and skips the forked TP-2 part with one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.distributed  # the CPU run joins a one-rank gloo world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--skip-compiled", "--steps", "3", "--num-layers", "1", "--microbatches", "2"]


def test_the_cpu_run_prints_every_eager_figure_and_target():
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.host_overhead", *TINY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("host ms/mb") == 2 and "wall ms/mb" not in out and "CUDA" not in out, out
    assert out.count("targets: eager Python calls <= 2x transformers eager") == 2, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: --device cuda would run")
def test_device_cuda_without_a_gpu_is_one_error_before_any_work(capsys):
    from bench import host_overhead

    assert host_overhead.main(["--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert "--device cuda: torch sees no CUDA GPU here" in err and "leave --device out" in err
    assert not torch.distributed.is_initialized()


def test_device_cuda_skips_the_forked_tp2_part_and_says_so(monkeypatch, capsys):
    """Forked ranks cannot run dynamo once the parent has initialised CUDA: on CUDA the TP-2 part is not
    started (run_ranks would fork it) and the output says where to measure it."""
    import megatron_ext.testing
    from bench import host_overhead

    class Stop(Exception):
        pass

    def forbidden(*args, **kwargs):
        raise AssertionError("the TP-2 ranks were forked on CUDA")

    def measured(args, style, ctx):
        assert args.device == "cuda"
        raise Stop

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main's, kept from this test process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(megatron_ext.testing, "run_ranks", forbidden)
    monkeypatch.setattr(host_overhead, "start_cuda_world", lambda: None)
    monkeypatch.setattr(host_overhead, "measure_style", measured)
    with pytest.raises(Stop):
        host_overhead.main(["--device", "cuda"])
    out = capsys.readouterr().out
    assert "TP 2 with sequence parallelism: skipped on CUDA" in out and "| a GPU" in out, out
