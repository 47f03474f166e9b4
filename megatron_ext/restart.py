"""The worker's side of launch/torchrun.sh's automatic restart (``MAX_RESTARTS``).

The launcher runs torchrun again after a failed attempt, up to ``MAX_RESTARTS`` times. It gives
each attempt a fresh marker directory (``MEGATRON_EXT_EXIT_MARKER_DIR``, so that an earlier
attempt's markers never count) in which every rank may leave:

- ``rank<R>.ok``: the rank ended cleanly (``pretrain_gpt.write_exit_marker``): "finished" at
  --train-iters, or "stopped <iteration>" when a signal or an exit flag ended it early (after its save);
- ``rank<R>.noretry``: "do not retry", with the exit code and the reason on one line: a user error
  (exit 2: configuration, data, tokenizer, checkpoint directories) or a diverged run (exit 1:
  ``--max-nan-iterations``, non-finite weights at a save) would fail the same way again;
- ``rank<R>.iteration``: the iteration this rank last started, rewritten in place at every step
  (one ``pwrite`` of a few bytes on an open file), so that the launcher can tell a failure that
  recurs at the same iteration from one that made progress.

On a restart (``MEGATRON_EXT_RESUME_FROM_SAVE=1``) the run resumes from the newest complete
checkpoint in ``--save``: ``--load`` becomes ``--save`` (as Megatron-LM users write a restartable
job) with the full state (optimizer, RNG, iteration), whatever ``--load``, ``--finetune``,
``--ckpt-step``, ``--no-load-optim`` and ``--no-load-rng`` said for the first start; while
``--save`` holds no complete checkpoint yet, the first start's flags load as given. After a
--ckpt-step resume rolled back below later checkpoints in ``--save`` and saved since, the newest is
the one published last (``find_last_published_checkpoint``), loaded as ``--ckpt-step``: not the
rolled-back-from run's later iteration, whose next save's --keep-last would delete the run's own.
After a weight-hash mismatch (``training/weight_hash.py``) and no save since, the restart loads the
checkpoint its record in ``--save`` names, the newest at or before the last iteration whose check
passed (``checkpoint/replica_check.py``), as ``--ckpt-step``: the ones after it may hold the drift.
A mismatch with no such checkpoint leaves ``rank<R>.noretry`` (exit 3) instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_ext.checkpoint.directory import (
    find_last_published_checkpoint,
    find_latest_checkpoint,
    list_complete_checkpoints,
)
from megatron_ext.checkpoint.replica_check import MISMATCH_FILE, read_pending_mismatch
from megatron_ext.config import ConfigError, JobConfig

MARKER_DIR_ENV = "MEGATRON_EXT_EXIT_MARKER_DIR"
RESUME_ENV = "MEGATRON_EXT_RESUME_FROM_SAVE"
ATTEMPT_ENV = "MEGATRON_EXT_RESTART_ATTEMPT"
MAX_RESTARTS_ENV = "MEGATRON_EXT_MAX_RESTARTS"
REQUEUE_ENV = "MEGATRON_EXT_REQUEUE"  # launch/slurm.sbatch: how many times Slurm requeued the job


def check_restart_settings(cfg: JobConfig, env: Mapping[str, str]) -> None:
    """A job the launcher may restart must save: a restart without --save would start from scratch."""
    max_restarts = env.get(MAX_RESTARTS_ENV, "0")
    if max_restarts.isdigit() and int(max_restarts) > 0 and not cfg.checkpoint.save:
        raise ConfigError(
            [
                f"MAX_RESTARTS={max_restarts} needs --save DIR: a restart resumes from the newest "
                f"complete checkpoint there (add --save and --save-interval, or MAX_RESTARTS=0)"
            ]
        )


def apply_restart(cfg: JobConfig, env: Mapping[str, str]) -> str | None:
    """On a restart, make ``cfg`` resume from --save's newest complete checkpoint (see the module
    docstring); returns the line to log, or None on a first start."""
    if env.get(RESUME_ENV) != "1" or not cfg.checkpoint.save:
        return None
    c = cfg.checkpoint
    newest = find_last_published_checkpoint(c.save)
    what = f"restart {env.get(ATTEMPT_ENV, '?')}"
    if env.get(ATTEMPT_ENV, "0") == "0" and env.get(REQUEUE_ENV):  # launch/slurm.sbatch's requeued job
        what = f"requeue {env[REQUEUE_ENV]}"
    if newest is None:
        return f"> {what}: --save {c.save} holds no complete checkpoint yet: starting as the first run did"
    replaced = [
        f"{flag} {value}"
        for flag, value in (
            ("--load", c.load if c.load and os.path.abspath(c.load) != os.path.abspath(c.save) else None),
            ("--ckpt-step", c.ckpt_step),
        )
        if value is not None
    ]
    replaced += [
        flag
        for flag, on in (
            ("--finetune", c.finetune),
            ("--no-load-optim", c.no_load_optim),
            ("--no-load-rng", c.no_load_rng),
        )
        if on
    ]
    highest = find_latest_checkpoint(c.save)
    step = newest[0] if newest != highest else None  # a rollback's own save, below the run it left
    mismatch = read_pending_mismatch(c.save)  # a weight-hash mismatch stopped the run, and no save since
    if mismatch is not None:
        step = get_checked_resume(c.save, mismatch.checkpoint)
    c.load, c.ckpt_step, c.finetune, c.no_load_optim, c.no_load_rng = c.save, step, False, False, False
    instead = f" (instead of the first start's {', '.join(replaced)})" if replaced else ""
    if mismatch is not None:
        return (
            f"> {what}: resuming from iteration {step} in --save {c.save}, the newest checkpoint at or before "
            f"iteration {mismatch.last_passed}, the last whose replicas' weights were checked equal: a weight-hash "
            f"mismatch stopped iteration {mismatch.iteration}, and the checkpoints after iteration "
            f"{mismatch.last_passed} may hold the drift (loaded as --ckpt-step {step}){instead}"
        )
    if step is not None:
        return (
            f"> {what}: resuming from the checkpoint published last in --save {c.save} (iteration {step}, as "
            f"--ckpt-step {step}; iteration {highest[0]} there is older, left by the run a --ckpt-step resume "
            f"rolled back from){instead}"
        )
    return f"> {what}: resuming from the newest complete checkpoint in --save {c.save} (iteration {newest[0]}){instead}"


def get_checked_resume(save: str, iteration: int) -> int:
    """``iteration``, which a weight-hash mismatch's record names to resume from, when it is still a
    complete checkpoint in ``save``; else a ConfigError (the newer checkpoints may hold the drift)."""
    if any(it == iteration for it, _ in list_complete_checkpoints(save)):
        return iteration
    raise ConfigError(
        [
            f"--save {save}: a weight-hash mismatch stopped the run, and {MISMATCH_FILE} there names iteration "
            f"{iteration} to resume from, the last checked checkpoint, which is not a complete checkpoint any more: "
            f"the newer ones may hold the drift; load one you trust by hand (--load {save} --ckpt-step N)"
        ]
    )


def write_no_retry_marker(code: int, reason: str, env: Mapping[str, str] | None = None) -> None:
    """Tell the launcher not to restart this job: it would fail the same way (see the module docstring)."""
    env = os.environ if env is None else env
    marker_dir = env.get(MARKER_DIR_ENV)
    if marker_dir and os.path.isdir(marker_dir):
        with open(os.path.join(marker_dir, f"rank{env.get('RANK', '0')}.noretry"), "w") as f:
            f.write(f"{code} {reason}\n")


class IterationRecord:
    """``rank<R>.iteration`` in the attempt's marker directory, rewritten in place at each step."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def record(self, iteration: int) -> None:
        os.pwrite(self.fd, f"{iteration:>12}\n".encode(), 0)  # fixed width: never a stale tail

    def close(self) -> None:
        os.close(self.fd)


def open_iteration_record(env: Mapping[str, str] | None = None) -> IterationRecord | None:
    """This rank's record under launch/torchrun.sh, else None."""
    env = os.environ if env is None else env
    marker_dir = env.get(MARKER_DIR_ENV)
    if not marker_dir or not os.path.isdir(marker_dir):
        return None
    return IterationRecord(os.path.join(marker_dir, f"rank{env.get('RANK', '0')}.iteration"))
