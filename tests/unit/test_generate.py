"""tools/generate.py's sampling (pure): the nucleus is the smallest most-likely set reaching p,
top-k keeps k tokens, temperature 0 is the argmax, a seed repeats its draws; and what a user sees
first: no import warnings, a --load that is not our checkpoint named as such."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.generate import get_nucleus, sample_next_token


def test_nucleus_is_the_smallest_most_likely_set_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    assert get_nucleus(probs, 0.4).nonzero().flatten().tolist() == [1]  # 0.4 reaches 0.4
    assert get_nucleus(probs, 0.5).nonzero().flatten().tolist() == [1, 3]
    assert get_nucleus(probs, 0.71).nonzero().flatten().tolist() == [1, 3, 4]
    assert get_nucleus(probs, 0.01).nonzero().flatten().tolist() == [1]  # never empty


def test_sampling_stays_inside_and_repeats_with_a_seed():
    logits = torch.tensor([0.0, 2.0, -1.0, 1.5, 0.5])
    draws = [sample_next_token(logits, 1.0, 0.8, 0, torch.Generator().manual_seed(s)) for s in range(200)]
    allowed = set(get_nucleus(torch.softmax(logits, -1), 0.8).nonzero().flatten().tolist())
    assert set(draws) == allowed and len(allowed) > 1
    again = [sample_next_token(logits, 1.0, 0.8, 0, torch.Generator().manual_seed(s)) for s in range(200)]
    assert draws == again
    top2 = {sample_next_token(logits, 1.0, 1.0, 2, torch.Generator().manual_seed(s)) for s in range(200)}
    assert top2 == {1, 3}
    assert sample_next_token(logits, 0.0) == 1


def test_help_prints_no_megatron_core_import_warnings():
    # megatron-core warns about Transformer Engine/Apex at import, before main() silenced them: four
    # warnings above every spot check's output on a CPU machine
    tool = Path(__file__).resolve().parents[2] / "tools" / "generate.py"
    done = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--load" in done.stdout, done.stderr
    assert "Warning" not in done.stderr, done.stderr


def test_load_errors_say_what_the_directory_is(tmp_path):
    # both read "--load X: no complete checkpoint", for a typo and for Megatron-LM's own checkpoint alike
    from tools.generate import load_model

    with pytest.raises(ValueError, match=r"--load .*/nope does not exist"):
        load_model(str(tmp_path / "nope"), torch.device("cpu"))
    (tmp_path / "mlm" / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds no complete checkpoint \(iter_0000100 has no complete.json: "):
        load_model(str(tmp_path / "mlm"), torch.device("cpu"))
