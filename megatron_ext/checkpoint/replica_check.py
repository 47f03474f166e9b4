"""What checkpoints record of the cross-replica weight check, and what a mismatch leaves in --save.

Invariant: the checkpoint that a weight-hash mismatch's message names, that the automatic restart
loads and that --keep-last never deletes is one and the same: the newest complete checkpoint at or
before the last iteration whose check passed (``select_checked``), found from the files alone.

- Each checkpoint's marker (``complete.json``) records ``weight_hash_checked``: the last iteration at
  or before it whose check passed in the run that saved it (absent when the check is off). A
  checkpoint whose record equals its iteration holds weights every replica was checked to share.
- A mismatch leaves ``--save/weight_hash_mismatch.json`` (iteration, last passed, the checkpoint to
  resume from, time). A restart (launch/torchrun.sh's ``MAX_RESTARTS``, a Slurm requeue) that finds
  it newer than the checkpoint published last resumes from that checkpoint instead of the newest,
  which may hold the drift; once the run has published a checkpoint since, the record is history.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid

from megatron_ext.checkpoint.listing import find_last_published_checkpoint, list_complete_checkpoints, read_marker

CHECKED_KEY = "weight_hash_checked"
MISMATCH_FILE = "weight_hash_mismatch.json"


def select_checked(checkpoints: list[tuple[int, str]], checked: int | None) -> tuple[int, str] | None:
    """The newest of ``checkpoints`` ((iteration, path), oldest first) at or before iteration
    ``checked``; None when ``checked`` is None or none is that old (pure)."""
    if checked is None:
        return None
    return next(((it, path) for it, path in reversed(checkpoints) if it <= checked), None)


def read_checked_iteration(ckpt_dir: str) -> int | None:
    """The last iteration whose weight check passed, as the checkpoint's marker records it (None: the
    check was off, or an older marker)."""
    checked = read_marker(ckpt_dir).get(CHECKED_KEY)
    return checked if type(checked) is int else None


def find_checked_checkpoint(root: str, checked: int | None) -> tuple[int, str] | None:
    """The newest complete checkpoint under ``root`` at or before iteration ``checked`` among those of
    the run that published last (the checkpoints above it, which a --ckpt-step resume or a restart
    after a mismatch rolled back from, are not counted, as ``apply_retention`` does not count them)."""
    complete = list_complete_checkpoints(root)
    last = find_last_published_checkpoint(root)
    own = [(it, path) for it, path in complete if last is None or it <= last[0]]
    return select_checked(own, checked)


@dataclasses.dataclass(frozen=True)
class MismatchRecord:
    """``weight_hash_mismatch.json``: a mismatch at ``iteration``, the last check that passed before it,
    and the checkpoint to resume from (its iteration)."""

    iteration: int
    last_passed: int
    checkpoint: int
    time: float


def write_mismatch_record(root: str, iteration: int, last_passed: int, checkpoint: int) -> None:
    """Rank 0, after a mismatch, when a checked checkpoint exists: the record, written aside and renamed
    (a ``.tmp-`` name, which retention removes if a kill leaves it)."""
    record = MismatchRecord(iteration, last_passed, checkpoint, time.time())
    tmp = os.path.join(root, f".{MISMATCH_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(record), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MISMATCH_FILE))


def read_pending_mismatch(root: str) -> MismatchRecord | None:
    """The mismatch record of ``root`` when no checkpoint was published after it (the restart must
    resume from its checkpoint), else None. An unreadable record counts as none."""
    try:
        with open(os.path.join(root, MISMATCH_FILE)) as f:
            record = MismatchRecord(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None
    last = find_last_published_checkpoint(root)
    published = read_marker(last[1]).get("time") if last is not None else None
    if isinstance(published, (int, float)) and published > record.time:
        return None
    return record
