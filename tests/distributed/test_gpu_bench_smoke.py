"""bench/gpu_throughput.py can only measure on a GPU; its code paths (our run on synthetic rows and
packs, the transformers reference step, the side-by-side timing and the report) run here on tiny
shapes so that the benchmark does not rot on CPU-only machines. Its figures are not checked."""

from __future__ import annotations

import contextlib
import io

import pytest

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed


def _smoke(rank: int, world_size: int) -> str:
    from bench import gpu_throughput

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu_throughput.main(["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "0",
                                    "--only", "gpt2", "packed-llama"])
    return f"exit {code}\n{out.getvalue()}"


def test_gpu_benchmark_code_paths_run_on_tiny_shapes():
    pytest.importorskip("transformers")
    report = run_ranks(_smoke, 1, timeout=300)[0]
    assert report.startswith("exit 0"), report
    assert "A/C =" in report and report.count("packed/unpacked real tokens/s =") == 2, report
