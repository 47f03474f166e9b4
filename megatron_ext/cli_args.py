"""The command-line tools' arguments (``tools/*.py``), checked as argparse reads them: a user's
mistake is one ``error:`` line on stderr naming the argument and the fix, exit status 2, before any
work (as ``pretrain_gpt.py`` reports a ConfigError), never a traceback.

Numbers: ``integer(low, high)`` and ``real(low, high)`` refuse text that is not a number, nan and
inf, and values outside the range; an integer also refuses anything beyond 64 bits (torch and
numpy keep counts, sizes and seeds in int64: a bigger one wraps or overflows far from its flag).
Paths: ``input_file`` (exists, a file, readable), ``input_dir`` (an existing directory) and
``output_file`` (not a directory; its directory is created if missing).

Imports nothing of ours and nothing outside the standard library: the data tools that must not
import torch use it too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

INT64_MAX = 2**63 - 1


class ToolParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``error: argument --gpus: ...``) and exit status 2,
    without the usage block above it: the line names the argument, ``--help`` the rest."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (--help lists the arguments)")


def fail(message: str) -> NoReturn:
    """A user's mistake: ``error: message`` on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _describe_range(kind: str, low: float | None, high: float | None, low_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"<= {high:g}")
    return f"{kind} {' and '.join(parts)}".strip()


def integer(low: int | None = None, high: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse ``type``: a whole number in [low, high] (and within int64); ``what`` says what it
    counts, for the error's fix."""
    wanted = _describe_range("a whole number", low, min(high, INT64_MAX) if high is not None else None, False)
    hint = f" ({what})" if what else ""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give {wanted}{hint}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {wanted}{hint}")
        if abs(value) > INT64_MAX:
            raise argparse.ArgumentTypeError(f"{text} does not fit in 64 bits: give {wanted}{hint}")
        return value

    parse.__name__ = "integer"
    return parse


def real(
    low: float | None = None, high: float | None = None, what: str = "", low_open: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [low, high] (``low_open``: (low, high])."""
    wanted = _describe_range("a number", low, high, low_open)
    hint = f" ({what})" if what else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give {wanted}{hint}") from None
        below = low is not None and (value <= low if low_open else value < low)
        if not math.isfinite(value) or below or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {wanted}{hint}")
        return value

    parse.__name__ = "number"
    return parse


def input_file(text: str) -> str:
    """An argparse ``type``: an existing, readable file."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} does not exist: give the path of an existing file")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file in it")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text} is not readable: give a file you may read, or fix its permissions")
    return text


def input_dir(text: str) -> str:
    """An argparse ``type``: an existing directory."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} does not exist: give an existing directory")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory: give the directory")
    return text


def _check_writable_parent(text: str, path: str) -> None:
    """The nearest existing directory above ``path`` is one, and writable (missing ones are made)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a directory: give a path under a directory")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not writable: give a path you may write to")


def output_file(text: str) -> str:
    """An argparse ``type``: a file to write: not a directory, under a writable directory."""
    if os.path.isdir(text) or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name (e.g. {os.path.join(text, 'out')})")
    _check_writable_parent(text, text)
    return text


def output_dir(text: str) -> str:
    """An argparse ``type``: a directory to write into (existing, or created): not a file, nor under one."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory: give a directory (new or existing)")
    if os.path.isdir(text):
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text} is not writable: give a directory you may write to")
        return text
    _check_writable_parent(text, text)
    return text
