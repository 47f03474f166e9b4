"""scripts/gpu_checks.sh (run on GPU machines only): every check it lists is a command that exists
and whose flags its bench accepts, so the script does not rot between GPU sessions."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def listed_rows() -> list[tuple[str, int, int, list[str]]]:
    """(name, limit s, group, command) of every check ``--list`` prints."""
    out = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "--list"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    rows = []
    for line in out.splitlines():
        name, limit, group_word, group, *cmd = line.split()
        assert group_word == "group", line
        rows.append((name, int(limit.rstrip("s")), int(group), cmd))
    return rows


def listed_checks() -> list[tuple[str, list[str]]]:
    return [(name, cmd) for name, _, _, cmd in listed_rows()]


def test_groups_fit_a_call_and_the_first_three_one_device_session():
    """A device call runs at most 10 minutes and a session holds 30 minutes of device time (the machine's
    start included): each group's limits add up to at most 570 s, groups 1-3 to at most 1500 s."""
    groups = {}
    for _, limit, group, _ in listed_rows():
        groups[group] = groups.get(group, 0) + limit
    assert all(total <= 570 for total in groups.values()), groups
    assert sum(groups.get(g, 0) for g in (1, 2, 3)) <= 1500, groups


def test_fails_fast_without_megatron_core(tmp_path):
    """Before any check (and any device time): a clear exit 3 when megatron-core cannot be imported."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")  # a megatron package without core
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "--group", "1"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 3 and "megatron-core is not importable" in proc.stderr, proc.stderr


def test_every_listed_bench_accepts_its_flags():
    checks = listed_checks()
    assert {name for name, _ in checks} >= {
        "tests",
        "1.3b",
        "profile-llama",
        "ablation",
        "packed-llama-graphs",
        "memory-model",
    }
    for name, cmd in checks:
        if cmd[:3] == ["python", "-m", "pytest"]:
            assert all(os.path.exists(os.path.join(ROOT, a)) for a in cmd[3:] if a.startswith("tests/")), cmd
            continue
        assert cmd[:2] == ["python", "-m"] and cmd[2].startswith("bench."), cmd
        module = importlib.import_module(cmd[2])
        # --help last: argparse rejects an unknown flag or choice before it reaches --help (exit 2)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            with pytest.raises(SystemExit) as exited:
                module.main(cmd[3:] + ["--help"])
        assert exited.value.code == 0, f"{name}: {shlex.join(cmd)} -> {err.getvalue()}"


def test_unknown_check_is_named_before_anything_runs():
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "tests", "typo"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "no check named 'typo'" in proc.stderr, proc.stderr
