"""tools/plan_layout.py on the Llama 3 70B reference config at 512 GPUs: it finishes within the
issue's 30 s (the planning itself, after imports), every printed layout's flags parse through
pretrain_gpt.py's own parser over the same config and pass ``validation.validate`` at that world
size, and a layout pinned with --show that cannot fit says why."""

from __future__ import annotations

import os
import re
import time

from megatron_ext.arguments import parse_args
from megatron_ext.validation import validate
from tools.plan_layout import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "llama3-70b.yaml")


def test_plan_layout_prints_valid_flags_in_time(capsys):
    start = time.perf_counter()
    assert (
        main(["--config", CONFIG, "--gpus", "512", "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--top", "3"]) == 0
    )
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    print(out)
    assert elapsed < 30, f"planning took {elapsed:.1f} s"
    flags = [line.split("flags: ", 1)[1].split() for line in out.splitlines() if "flags: " in line]
    assert len(flags) == 3
    for argv in flags:
        validate(parse_args(["--config", CONFIG, *argv]), 512)


def test_show_says_why_a_layout_does_not_fit(capsys):
    main(["--config", CONFIG, "--gpus", "512", "--show", "tp=8 pp=1 recompute=none mbs=1"])
    out = capsys.readouterr().out
    assert re.search(r"does not fit: needs [\d.]+ GiB on its fullest GPU, 80 GiB available", out), out
    main(["--config", CONFIG, "--gpus", "512", "--show", "tp=1 pp=1 mbs=1"])  # DP 512 > global batch 128
    assert "invalid: --global-batch-size 128 is not divisible" in capsys.readouterr().out
