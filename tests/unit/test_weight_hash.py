"""The cross-replica weight check's pure parts (``training/weight_hash.py``,
``checkpoint/replica_check.py``): the digest is the exact integer function its docstring states and
changes with any flipped bit; the verdict names the outlier; a checkpoint records the last checked
iteration, --keep-last keeps the newest checkpoint at or before it, a restart after a mismatch loads
that one (or, with none, the worker says not to retry) and the exit code is the documented one."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

import pretrain_gpt
from megatron_ext.checkpoint.directory import apply_retention
from megatron_ext.checkpoint.listing import COMPLETE_MARKER, list_complete_checkpoints
from megatron_ext.checkpoint.replica_check import (
    CHECKED_KEY,
    MISMATCH_FILE,
    find_checked_checkpoint,
    read_pending_mismatch,
    select_checked,
    write_mismatch_record,
)
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.restart import MARKER_DIR_ENV, RESUME_ENV, apply_restart
from megatron_ext.testing import tiny_values
from megatron_ext.training import weight_hash as wh
from megatron_ext.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tables():
    return wh.build_digest_tables(torch.device("cpu"))


def reference_digest(tensor: torch.Tensor, t: wh.DigestTables) -> list[int]:
    """The digest in Python integers, word by word, as the module docstring states it."""
    words = wh.get_words(tensor).tolist()
    m = t.multipliers.to(torch.int64).tolist()
    a, b, primes = t.row_a.tolist(), t.row_b.tolist(), t.primes.tolist()
    out = []
    for k, p in enumerate(primes):
        total = 0
        for row in range(0, (len(words) + wh.ROW - 1) // wh.ROW):
            chunk = words[row * wh.ROW : (row + 1) * wh.ROW]
            row_sum = sum(w * m[k][j] for j, w in enumerate(chunk))
            total += (row_sum % p) * (1 + (row * a[k] + b[k]) % (p - 1))
        out.append(total % p)
    return out


@pytest.mark.parametrize("dtype, numel", [(torch.float32, 5000), (torch.bfloat16, 4097), (torch.float16, 7)])
def test_the_digest_is_the_exact_integer_function(tables, dtype, numel):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    assert wh.digest_tensor(x, tables).tolist() == reference_digest(x, tables)


def test_the_digest_does_not_depend_on_the_slices(tables, monkeypatch):
    x = torch.randn(5 * wh.ROW + 17)
    whole = wh.digest_tensor(x, tables)
    monkeypatch.setattr(wh, "SLICE", 2 * wh.ROW)  # three slices and a partial row
    assert torch.equal(wh.digest_tensor(x, tables), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_flipped_bit_changes_every_lane(tables, dtype):
    x = torch.randn(3 * wh.ROW + 100).to(dtype)
    base = wh.digest_tensor(x, tables)
    bits = 8 * x.element_size()
    rng = random.Random(0)
    places = [(0, 0), (x.numel() - 1, bits - 1), (3 * wh.ROW + 5, 0)] + [
        (rng.randrange(x.numel()), rng.randrange(bits)) for _ in range(40)
    ]
    for index, bit in places:
        y = x.clone()
        words = wh.get_words(y)
        words[index] ^= torch.tensor(1 << bit if bit < bits - 1 else -(1 << bit), dtype=words.dtype)
        assert (wh.digest_tensor(y, tables) != base).all(), (index, bit)


def test_a_word_moved_by_a_lane_prime_still_changes_the_digest(tables):
    x = torch.zeros(10, dtype=torch.int32).view(torch.float32)
    base = wh.digest_tensor(x, tables)
    y = x.clone()
    y.view(torch.int32)[3] = wh.PRIMES[0]  # a multiple of lane 0's prime: that lane alone keeps its value
    changed = wh.digest_tensor(y, tables) != base
    assert not changed[0] and changed[1:].all()


def test_digests_of_many_tensors_stack_in_order(tables):
    xs = [torch.randn(3), torch.randn(0), torch.randn(2, 2).t(), torch.randn(wh.ROW + 1).bfloat16()]
    got = wh.compute_param_digests(xs, tables)
    assert got.shape == (4, wh.LANES) and got.dtype == torch.int64
    assert all(torch.equal(got[i], wh.digest_tensor(x, tables)) for i, x in enumerate(xs))
    assert wh.compute_param_digests([], tables).shape == (0, wh.LANES)


def _gathered(*per_member: list[int]) -> torch.Tensor:
    """[members, parameters, LANES]: member m's parameter i holds digest value v in every lane."""
    return torch.tensor([[[v] * wh.LANES for v in values] for values in per_member], dtype=torch.int64)


def test_the_verdict_names_the_outlier_of_three_or_more():
    got = wh.find_mismatches(_gathered([1, 2, 3], [1, 9, 3], [1, 2, 3]))
    assert got == [wh.Mismatch(1, [1], [0, 2])]
    members = [(0, 0, 0), (4, 1, 0), (8, 2, 0)]
    assert wh.describe_mismatch("w", got[0], members, cp=False) == (
        "w: rank 4 (data-parallel rank 1) differs from the other 2 replicas, which agree: ranks 0, 8 "
        "(data-parallel ranks 0, 2)"
    )
    assert wh.find_mismatches(_gathered([1], [1], [1])) == []


def test_two_replicas_or_no_majority_name_every_member():
    (two,) = wh.find_mismatches(_gathered([5], [6]))
    assert two == wh.Mismatch(0, [0, 1], [])
    text = wh.describe_mismatch("w", two, [(1, 0, 0), (3, 1, 0)], cp=False)
    assert (
        text == "w: ranks 1, 3 (data-parallel ranks 0, 1) differ (with two replicas, which one drifted cannot be told)"
    )
    (split,) = wh.find_mismatches(_gathered([5], [5], [6], [6]))
    assert split.outliers == [0, 1, 2, 3] and not split.majority
    members = [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert wh.describe_mismatch("w", split, members, cp=True).endswith(
        "(data-parallel ranks 0, 0, 1, 1, context-parallel ranks 0, 1, 0, 1) disagree with no majority"
    )


def test_the_interval_must_be_positive():
    validate(build_job_config(tiny_values(check_weight_hash_across_dp_replicas_interval=5)), 2)
    with pytest.raises(ConfigError, match="--check-weight-hash-across-dp-replicas-interval must be a positive"):
        validate(build_job_config(tiny_values(check_weight_hash_across_dp_replicas_interval=0)), 2)
    assert wh.build_weight_hash_check(build_job_config(tiny_values()).training) is None


def _fake_checkpoint(root: str, iteration: int, checked: int | None = None, when: float | None = None) -> str:
    path = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(path)
    marker = {"iteration": iteration, "time": time.time() if when is None else when}
    if checked is not None:
        marker[CHECKED_KEY] = checked
    with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
        json.dump(marker, f)
    return path


def test_keep_last_keeps_the_newest_checkpoint_at_or_before_the_last_check(tmp_path):
    root = str(tmp_path)
    for it, checked in ((2, 2), (3, 2), (4, 2), (5, 4)):
        path = _fake_checkpoint(root, it, checked)
        apply_retention(root, 1, path)
    # after iteration 4: 2 (the last checked) kept besides the newest; after 5 (checked at 4): 4 kept, 2 goes
    assert [it for it, _ in list_complete_checkpoints(root)] == [4, 5]
    assert select_checked(list_complete_checkpoints(root), 3) is None
    assert find_checked_checkpoint(root, 4) == (4, os.path.join(root, "iter_0000004"))
    assert wh.WeightHashCheck(10, last_passed=7).get_marker_record() == {CHECKED_KEY: 7}
    assert wh.WeightHashCheck(10).get_marker_record() == {}


def test_keep_last_without_the_check_is_unchanged(tmp_path):
    root = str(tmp_path)
    for it in (1, 2, 3):
        apply_retention(root, 1, _fake_checkpoint(root, it))
    assert [it for it, _ in list_complete_checkpoints(root)] == [3]


def _restart(save: str, **flags) -> tuple[str | None, object]:
    cfg = build_job_config(tiny_values(save=save, **flags))
    return apply_restart(cfg, {RESUME_ENV: "1", "MEGATRON_EXT_RESTART_ATTEMPT": "1"}), cfg.checkpoint


def test_a_restart_after_a_mismatch_loads_the_last_checked_checkpoint(tmp_path):
    save = str(tmp_path)
    for it in (2, 4, 6):
        _fake_checkpoint(save, it, checked=4, when=time.time() - 10)
    write_mismatch_record(save, iteration=7, last_passed=5, checkpoint=4)
    note, c = _restart(save, finetune=True)
    assert (c.load, c.ckpt_step, c.finetune) == (save, 4, False)
    assert note.startswith(
        f"> restart 1: resuming from iteration 4 in --save {save}, the newest checkpoint at or before iteration 5, "
        "the last whose replicas' weights were checked equal: a weight-hash mismatch stopped iteration 7"
    ), note
    # once the run published a checkpoint after the mismatch, the record is history: the newest loads
    _fake_checkpoint(save, 8, checked=8)
    note, c = _restart(save)
    assert c.ckpt_step is None and "(iteration 8)" in note and read_pending_mismatch(save) is None


def test_a_restart_refuses_when_the_checked_checkpoint_is_gone(tmp_path):
    save = str(tmp_path)
    _fake_checkpoint(save, 6, checked=4, when=time.time() - 10)
    write_mismatch_record(save, iteration=7, last_passed=5, checkpoint=4)
    with pytest.raises(ConfigError, match=f"{MISMATCH_FILE} there names iteration 4 to resume from"):
        _restart(save)


@pytest.mark.parametrize("checkpoint", [None, (4, "/save/iter_0000004")])
def test_a_mismatch_exits_with_its_documented_code(tmp_path, monkeypatch, capsys, checkpoint):
    def main(argv=None):
        raise wh.WeightHashMismatch("weight-hash mismatch at iteration 7: ...", 7, 5, checkpoint)

    monkeypatch.setattr(pretrain_gpt, "main", main)
    monkeypatch.setenv(MARKER_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert pretrain_gpt.run_cli([]) == wh.WEIGHT_HASH_EXIT_CODE == 3
    assert "weight-hash mismatch at iteration 7" in capsys.readouterr().err
    marker = tmp_path / "rank0.noretry"
    if checkpoint is None:  # nothing checked to resume from: the launcher must not restart
        assert marker.read_text().startswith("3 a weight-hash mismatch with no checked checkpoint")
    else:  # the restart resumes from the checkpoint its record names
        assert not marker.exists()
    with open(os.path.join(ROOT, "docs", "failures.md")) as f:
        assert "| 3 | the data-parallel replicas' weights differ" in f.read()
