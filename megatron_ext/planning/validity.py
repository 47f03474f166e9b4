"""Whether a layout the planning tools consider is valid: ``validation.validate``'s problems, less
the refusals of what is planned for but not yet wired into training, which are kept as notes.

Context parallelism (issue 42) is planned before it trains: its flags, length rules and process
groups are in, and the launch refuses --context-parallel-size > 1 until the CP attention and data
path are wired. The rehearsal, the layout planner and ``tools/print_topology.py`` check and price a
CP layout anyway (its groups, its memory, its step time) and say that a launch refuses it today.

Invariant: a problem is deferred only when it is one of ``NOT_WIRED_YET``'s refusals; every other
problem of ``validate`` stays a problem. When the refusal goes (CP wired), nothing is deferred and
these functions are ``validate`` itself.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.config import ConfigError, JobConfig
from megatron_ext.validation import validate

# validation.py's words for a feature whose flags and rules are in but whose training is not
NOT_WIRED_YET = ("context parallelism is not wired into training",)


@dataclasses.dataclass(frozen=True)
class LayoutCheck:
    problems: tuple[str, ...]  # what makes the layout invalid (empty: valid)
    deferred: tuple[str, ...]  # refusals of what is not wired into training yet (a launch refuses them today)


def check_layout(cfg: JobConfig, world_size: int, cuda: bool = True) -> LayoutCheck:
    """``validate(cfg, world_size, cuda)``'s problems, split into real ones and deferred ones."""
    try:
        validate(cfg, world_size, cuda=cuda)
    except ConfigError as err:
        deferred = tuple(p for p in err.problems if any(words in p for words in NOT_WIRED_YET))
        return LayoutCheck(tuple(p for p in err.problems if p not in deferred), deferred)
    return LayoutCheck((), ())


def validate_for_planning(cfg: JobConfig, world_size: int, cuda: bool = True) -> tuple[str, ...]:
    """Raise ConfigError with every real problem; return the deferred refusals (to be printed)."""
    check = check_layout(cfg, world_size, cuda)
    if check.problems:
        raise ConfigError(list(check.problems))
    return check.deferred
