"""The variables a launcher gives each worker (torchrun, Slurm through launch/torchrun.sh, or a
user by hand for ``--rehearse`` or a one-process run), checked once at start-up.

Invariant: after ``check_launch_env``, every variable of ``COUNTS`` that is set is a whole decimal
number in its range, so the ``int(os.environ[...])`` of the code that reads them later never
raises; a value set wrong (``WORLD_SIZE=abc``, ``OMP_NUM_THREADS=0``, a rank outside the world) is
one ConfigError naming the variable and the fix, before any work.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_ext.config import ConfigError

# The largest world we accept: beyond it a value is a typo (a million ranks; --rehearse enumerates
# every rank's groups)
MAX_WORLD_SIZE = 2**20
# name -> (smallest value, what it is)
COUNTS = {
    "WORLD_SIZE": (1, "the number of processes of the job (torchrun sets it)"),
    "RANK": (0, "this process's rank, 0 to WORLD_SIZE - 1 (torchrun sets it)"),
    "LOCAL_WORLD_SIZE": (1, "the processes on this node (torchrun's --nproc-per-node)"),
    "LOCAL_RANK": (0, "this process's rank on its node, 0 to LOCAL_WORLD_SIZE - 1"),
    "OMP_NUM_THREADS": (1, "CPU threads per process (launch/torchrun.sh sets 1)"),
}


def read_count(env: Mapping[str, str], name: str) -> tuple[int | None, str | None]:
    """(value, None) of ``name`` in ``env`` (None when unset), or (None, the problem)."""
    text = env.get(name)
    if text is None or text == "":
        return None, None
    low, what = COUNTS[name]
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdecimal()) or int(stripped) < low or int(stripped) > MAX_WORLD_SIZE:
        return None, (
            f"{name}={text!r} is not a whole number from {low} to {MAX_WORLD_SIZE:,}: set it to {what}, or unset it"
        )
    return int(stripped), None


def check_launch_env(env: Mapping[str, str]) -> None:
    """ConfigError listing each variable of ``COUNTS`` set to something unusable, and a rank outside
    its world."""
    values, problems = {}, []
    for name in COUNTS:
        values[name], problem = read_count(env, name)
        problems += [problem] if problem else []
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if values[rank] is not None and values[size] is not None and values[rank] >= values[size]:
            problems.append(f"{rank}={values[rank]} is outside {size}={values[size]}: give {rank} below {size}")
    if problems:
        raise ConfigError(problems)
