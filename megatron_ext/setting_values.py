"""Every numeric setting holds a number a run can use, checked before the rules that compute with it.

Whatever else the rules of ``validation.validate`` say about a setting, its value must first be a
number in the sense they assume: a float is finite (nan slips through every comparison, so through
most range checks, and inf through the upper ones), an integer fits in 64 bits (torch, numpy and
megatron-core keep sizes, counts and seeds in int64: a bigger one wraps or overflows far from its
flag, as a traceback after the model is built), a few have a bound of their own (a timeout torch
turns into a ``timedelta``), and the counts no other rule bounds below are not negative. Pure: reads
the config only. ``validate`` adds these problems to its rules' for the settings no rule named
already (a rule's message says more: --step-timeout-minutes nan is "a positive number of minutes,
leave it out to turn the watchdog off").
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing

from megatron_ext.config import JobConfig

INT64_MAX = 2**63 - 1
# Bounds of their own, below int64's: (largest value, why)
MAXIMA = {
    # torch's process-group timeout is a datetime.timedelta (at most 999,999,999 days)
    "distributed_timeout_minutes": (10**9, "a timedelta of more would overflow"),
}
# Settings no other rule bounds below (each is a count, a step or a fraction, never below 0). Not
# --fp16's loss-scale flags: checked under --fp16, ignored with a notice without it (as Megatron-LM)
NOT_NEGATIVE = (
    "ckpt_step",
    "cuda_graph_max_documents",
    "exit_interval",
    "profile_step_start",
    "profile_step_end",
    "rope_scaling_factor",
    "rotary_percent",
    "tiktoken_num_special_tokens",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "microbatch_group_size_per_vp_stage",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_hint(f: dataclasses.Field) -> str:
    if f.default is None:
        return "leave it out for the default"
    return f"its default is {f.default}" if f.default is not dataclasses.MISSING else "see --help"


def check_value(f: dataclasses.Field, value: object, kind: object) -> str | None:
    """The problem with one setting's value, or None (``kind``: its annotation)."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or kind is bool:
        return None
    flag = _flag(f.name)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{flag} must be a finite number, got {value}: give a number ({_default_hint(f)})"
    if isinstance(value, int) and abs(value) > INT64_MAX:
        return (
            f"{flag} {value} does not fit in 64 bits (torch, numpy and megatron-core keep it as an int64): give a "
            f"value below 2**63 ({_default_hint(f)})"
        )
    if f.name in MAXIMA and value > MAXIMA[f.name][0]:
        top, why = MAXIMA[f.name]
        return f"{flag} {value} is above {top:,} ({why}): give a smaller value ({_default_hint(f)})"
    if f.name in NOT_NEGATIVE and value < 0:
        return f"{flag} must be >= 0, got {value}: give a value >= 0 ({_default_hint(f)})"
    return None


def names_flag(problem: str, flag: str) -> bool:
    """Whether ``problem`` names ``flag`` (not merely a longer flag it begins)."""
    return re.search(re.escape(flag) + r"(?![\w-])", problem) is not None


def check_setting_values(cfg: JobConfig, reported: list[str] = ()) -> list[str]:
    """One problem per numeric setting whose value is not a usable number (module docstring), but
    for the settings one of the ``reported`` problems names already."""
    problems = []
    for section in cfg.sections():
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            problem = check_value(f, getattr(section, f.name), hints[f.name])
            if problem and not any(names_flag(p, _flag(f.name)) for p in reported):
                problems.append(problem)
    return problems
