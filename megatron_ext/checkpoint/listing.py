"""Finding checkpoints under a ``--save`` / ``--load`` directory: read-only (``directory.py`` writes them).

A complete checkpoint is a directory ``iter_XXXXXXX`` carrying ``complete.json`` (the marker a
publish writes last); a ``.tmp-`` directory never counts. An iteration whose ``iter_XXXXXXX`` is
missing but whose earlier copy a re-save moved to ``iter_XXXXXXX.replaced-<nonce>`` (a kill between
``publish_checkpoint``'s two renames) is found there until retention renames it back.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "complete.json"
ITER_DIR = re.compile(r"^iter_(\d{7})$")
RELEASE_DIR = "release"  # Megatron-LM's weights-only checkpoint, named by its tracker as "release"
# a re-saved iteration's earlier copy, moved aside for the rename of the new one (``publish_checkpoint``)
REPLACED_DIR = re.compile(r"^iter_(\d{7})\.replaced-[0-9a-f]+$")


def get_checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def list_complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(iteration, path) of every complete checkpoint under ``root``, oldest first. An iteration with
    no complete ``iter_XXXXXXX`` but a complete ``iter_XXXXXXX.replaced-<nonce>`` (a re-save killed
    between its two renames: ``publish_checkpoint``) is found there, read-only; the next retention
    renames it back (``restore_replaced_checkpoints``)."""
    if not os.path.isdir(root):
        return []
    found, replaced = {}, {}
    for name in sorted(os.listdir(root)):
        match = ITER_DIR.match(name) or REPLACED_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            (found if match.re is ITER_DIR else replaced).setdefault(int(match.group(1)), path)
    return sorted({**replaced, **found}.items())


def list_megatron_lm_entries(root: str) -> list[str]:
    """The names under ``root`` that Megatron-LM's saves write and ours never leave: ``iter_XXXXXXX``
    directories without our ``complete.json`` (our saves give a directory that name only once it is
    marked, so these are Megatron-LM's, or damaged) and its ``release`` directory. Empty when
    ``root`` is not a directory."""
    if not os.path.isdir(root):
        return []
    return [
        name
        for name in sorted(os.listdir(root))
        if (ITER_DIR.match(name) or name == RELEASE_DIR)
        and os.path.isdir(os.path.join(root, name))
        and not os.path.isfile(os.path.join(root, name, COMPLETE_MARKER))
    ]


def describe_megatron_lm_entries(root: str) -> str:
    """ "iter_0000100, iter_0000200 and 3 more" naming ``list_megatron_lm_entries``, or ""."""
    names = list_megatron_lm_entries(root)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def describe_unmarked_iterations(root: str) -> str:
    """ " (iter_X has no complete.json: ...)" naming the ``iter_XXXXXXX`` directories under ``root``
    without the marker, or "" (``list_megatron_lm_entries``): for a tool that reads only ours."""
    names = list_megatron_lm_entries(root)
    if not names:
        return ""
    return (
        f" ({describe_megatron_lm_entries(root)} {'has' if len(names) == 1 else 'have'} no {COMPLETE_MARKER}: this "
        f"tool reads checkpoints this framework's --save completed; one written by Megatron-LM loads with "
        f"pretrain_gpt.py --load, or convert it with tools/convert_checkpoint.py megatron-lm-to-megatron)"
    )


def find_latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest complete checkpoint, or None. Incomplete and ``.tmp-`` directories are ignored."""
    complete = list_complete_checkpoints(root)
    return complete[-1] if complete else None


def find_last_published_checkpoint(root: str) -> tuple[int, str] | None:
    """The complete checkpoint published last (by its marker's time): the newest one, unless a
    --ckpt-step resume rolled back below it and has published since; then the newest of those saves
    (the run's own), not the rolled-back-from run's later iteration. The newest one whenever its
    marker has no readable time."""
    complete = list_complete_checkpoints(root)
    if not complete:
        return None
    newest = complete[-1]

    def published(path: str) -> float | None:
        marker = read_marker(path)
        when = marker.get("time") if isinstance(marker, dict) else None
        return when if isinstance(when, (int, float)) else None

    newest_time = published(newest[1])
    if newest_time is None:
        return newest
    later = [(when, it, path) for it, path in complete if (when := published(path)) is not None and when > newest_time]
    return max(later)[1:] if later else newest


def resolve_load_path(path: str, step: int | None = None) -> tuple[tuple[int, str] | None, str | None]:
    """The checkpoint ``--load path`` names, and a warning to print: ``path`` is a save directory
    (its newest complete checkpoint, or iteration ``step``) or one checkpoint's own ``iter_XXXXXXX``
    directory. The warning says when the pointer file names another iteration than the one loaded
    (one that is not a complete checkpoint here, or an older one)."""
    if step is not None:
        return next(((it, p) for it, p in list_complete_checkpoints(path) if it == step), None), None
    name = os.path.basename(os.path.normpath(path))
    match = ITER_DIR.match(name)
    if match and os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return (int(match.group(1)), os.path.normpath(path)), None
    found = find_latest_checkpoint(path)
    pointer = read_tracker(path)
    if found is None or pointer is None or pointer == found[0]:
        return found, None
    tracker = os.path.join(path, TRACKER_FILE)
    if pointer not in {it for it, _ in list_complete_checkpoints(path)}:
        return found, (
            f"{tracker} names iteration {pointer}, which is not a complete checkpoint here: "
            f"loading iteration {found[0]} instead"
        )
    # a pointer behind the newest checkpoint: a crash between the publish and the pointer update,
    # or a pointer edited by hand to roll back (which Megatron-LM would follow)
    return found, (
        f"{tracker} names iteration {pointer}, but iteration {found[0]} is the newest complete "
        f"checkpoint here and is loaded: give --ckpt-step {pointer} to load iteration {pointer}"
    )


def read_tracker(root: str) -> int | None:
    """The iteration in ``latest_checkpointed_iteration.txt`` (informational; Megatron-LM's file)."""
    try:
        with open(os.path.join(root, TRACKER_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def read_marker(ckpt_dir: str) -> dict[str, Any]:
    """A complete checkpoint's marker ({} when it cannot be read: an old or damaged marker)."""
    try:
        with open(os.path.join(ckpt_dir, COMPLETE_MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
