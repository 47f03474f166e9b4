"""Repository-wide pytest setup: one thread per process, repo root importable, quiet megatron."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
