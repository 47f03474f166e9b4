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


def listed_checks() -> list[tuple[str, list[str]]]:
    out = subprocess.run(["bash", "scripts/gpu_checks.sh", "--list"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    checks = []
    for line in out.splitlines():
        name, _limit, *cmd = line.split()
        checks.append((name, cmd))
    return checks


def test_every_listed_bench_accepts_its_flags():
    checks = listed_checks()
    assert {name for name, _ in checks} >= {"tests", "1.3b", "profile-llama", "ablation"}
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
