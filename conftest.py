"""Repository-wide pytest setup: the CPU test process never sees a GPU; one thread per process;
repo root importable; quiet megatron.

CPU/gloo worlds are forked from this process. On a GPU machine they would select cuda:0 (NCCL
refuses two ranks on one GPU) and a CUDA context created before a fork breaks the forked ranks, so
CUDA is hidden here before torch is imported. ``gpu``-marked tests (tests/gpu/) run their work in
subprocesses that get the original visibility back (``MEGATRON_EXT_VISIBLE_GPUS``), and are skipped
with the reason where no GPU exists.
"""

import os
import shutil
import subprocess
import sys

os.environ.setdefault("MEGATRON_EXT_VISIBLE_GPUS", os.environ.get("CUDA_VISIBLE_DEVICES", "all"))
os.environ["CUDA_VISIBLE_DEVICES"] = ""

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def get_gpu_count() -> int:
    """GPUs this machine would show the gpu tests (nvidia-smi; no CUDA context in this process)."""
    if not shutil.which("nvidia-smi"):
        return 0
    visible = os.environ["MEGATRON_EXT_VISIBLE_GPUS"]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    if visible not in ("all", "") and count:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count if visible != "" else 0


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and get_gpu_count() == 0:
        if os.environ.get("MEGATRON_EXT_REQUIRE_GPU"):  # scripts/gpu_checks.sh: a skip would read as a pass
            raise pytest.UsageError(
                "MEGATRON_EXT_REQUIRE_GPU is set but no GPU is visible to the gpu tests "
                "(nvidia-smi is missing or lists none, or CUDA_VISIBLE_DEVICES hides them)"
            )
        skip = pytest.mark.skip(
            reason="needs a CUDA GPU (none visible: nvidia-smi lists none or CUDA_VISIBLE_DEVICES hides them)"
        )
        for item in gpu_items:
            item.add_marker(skip)
