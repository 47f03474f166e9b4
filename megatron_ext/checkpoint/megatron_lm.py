"""Megatron-LM's own checkpoints (core_v0.16.1, ``torch_dist``): which one loads, what it records, and
what of it a run here can take. Pure: files and values in, decisions and named problems out; the
collective load is ``megatron_lm_load.py``.

Invariant: a Megatron-LM checkpoint is loaded only as the model it is (its padded vocabulary, each of
its model settings mapped to our flag, ``MEGATRON_LM_ARGS``, and compared like our own checkpoints'),
and only when nothing in it is left behind unsaid: a model setting we do not implement
(``UNSUPPORTED_ARGS``), a format we do not read (legacy ``torch``, older than megatron-core 0.13,
Transformer Engine / FP8 layers), a save made mid-rerun is refused by name, before anything is read.

Which checkpoint: as Megatron-LM's ``load_checkpoint``: the iteration its
``latest_checkpointed_iteration.txt`` names (``release``: its weights-only ``release`` directory,
loaded with fine-tuning semantics), or ``--ckpt-step N``. Megatron-LM writes the tracker only after
every rank's save completed, so an ``iter_`` directory newer than the tracker may be a save cut short:
it is named and not loaded, and ``--ckpt-fallback-on-corruption`` falls back only to older ones (which
the tracker named once). Megatron-LM records no checksums: a load of it says it is unverified. In a
directory holding Megatron-LM's and our checkpoints (a run here resumed from its and saved beside),
the newest iteration loads; our saves there leave its tracker as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
from typing import Any

import torch

from megatron_ext.checkpoint.listing import (
    COMPLETE_MARKER,
    ITER_DIR,
    RELEASE_DIR,
    TRACKER_FILE,
    describe_megatron_lm_entries,
    list_complete_checkpoints,
    list_megatron_lm_entries,
    resolve_load_path,
)
from megatron_ext.checkpoint.reader import (
    COMMON_FILE,
    VerifyingFileSystemReader,
    load_torch_archive,
    read_common,
    read_full_tensors,
)
from megatron_ext.checkpoint.unpickler import allowing
from megatron_ext.config import ConfigError

METADATA_FILE = "metadata.json"  # megatron-core's dist-checkpoint marker: {"sharded_backend": "torch_dist", ...}
UNVERIFIED = "unverified: Megatron-LM records no checksums"


@dataclasses.dataclass(frozen=True)
class MegatronLMCheckpoint:
    """One of Megatron-LM's checkpoint directories: ``iter_XXXXXXX`` or ``release`` (iteration 0)."""

    path: str
    iteration: int
    release: bool = False


@dataclasses.dataclass(frozen=True)
class Selection:
    """What ``--load`` (and ``--ckpt-step``) names in a directory that holds Megatron-LM checkpoints:
    the one to load, and the lines to print (newer directories not loaded, a pointer of ours ignored).
    ``fallback``: older ones --ckpt-fallback-on-corruption may load instead, newest first."""

    checkpoint: MegatronLMCheckpoint
    notes: tuple[str, ...] = ()
    fallback: tuple[MegatronLMCheckpoint, ...] = ()


def read_tracker_text(root: str) -> str | None:
    """``latest_checkpointed_iteration.txt`` as Megatron-LM reads it (stripped), or None."""
    try:
        with open(os.path.join(root, TRACKER_FILE)) as f:
            return f.read().strip()
    except OSError:
        return None


def as_megatron_lm_checkpoint(path: str) -> MegatronLMCheckpoint | None:
    """``path`` itself when it is one of Megatron-LM's ``iter_XXXXXXX`` / ``release`` directories."""
    name = os.path.basename(os.path.normpath(path))
    match = ITER_DIR.match(name)
    if not (match or name == RELEASE_DIR) or not os.path.isdir(path):
        return None
    entries = os.listdir(path)
    if COMPLETE_MARKER in entries:
        return None  # one of ours
    if not (METADATA_FILE in entries or COMMON_FILE in entries or any(n.startswith("mp_rank_") for n in entries)):
        return None  # a directory of checkpoints that happens to be named so, not one checkpoint
    return MegatronLMCheckpoint(os.path.normpath(path), int(match.group(1)) if match else 0, release=not match)


def select_megatron_lm_checkpoint(root: str, step: int | None = None) -> Selection | None:
    """The Megatron-LM checkpoint ``--load root`` (``--ckpt-step step``) loads, or None when ``root``
    holds none. ConfigError when it holds some but names none of them (no tracker, a tracker naming
    a directory that is not there, a --ckpt-step that is not one of them)."""
    itself = as_megatron_lm_checkpoint(root)
    if itself is not None:
        return Selection(itself)
    names = list_megatron_lm_entries(root)
    if not names:
        return None
    iters = {int(m.group(1)): os.path.join(root, n) for n in names if (m := ITER_DIR.match(n))}
    tracker = read_tracker_text(root)
    held = f"{root} holds Megatron-LM checkpoints ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''})"
    if step is not None:
        if step not in iters:
            raise ConfigError([f"--ckpt-step {step}: {held}, none of iteration {step}"])
        return Selection(MegatronLMCheckpoint(iters[step], step))
    if tracker == RELEASE_DIR and RELEASE_DIR in names:
        return Selection(MegatronLMCheckpoint(os.path.join(root, RELEASE_DIR), 0, release=True))
    if tracker is None or not tracker.isdigit() or int(tracker) not in iters:
        what = "no " + TRACKER_FILE if tracker is None else f"{TRACKER_FILE} naming {tracker!r}, which is not there"
        raise ConfigError(
            [
                f"--load {held} and {what}: Megatron-LM would start from scratch here; give --ckpt-step N to "
                f"load iteration N"
            ]
        )
    named = int(tracker)
    newer = sorted(i for i in iters if i > named)
    notes = ()
    if newer:
        shown = ", ".join(os.path.basename(iters[i]) for i in newer[:3]) + (" ..." if len(newer) > 3 else "")
        notes = (
            f"WARNING: {shown} in {root} {'is' if len(newer) == 1 else 'are'} newer than iteration {named}, which "
            f"Megatron-LM's {TRACKER_FILE} names, and not loaded: its tracker moves only after a save completed, "
            f"so they may be cut short; --ckpt-step {newer[-1]} loads one if you know it is whole",
        )
    older = tuple(MegatronLMCheckpoint(iters[i], i) for i in sorted(iters, reverse=True) if i < named)
    return Selection(MegatronLMCheckpoint(iters[named], named), notes, older)


def select_load(root: str, step: int | None = None) -> Selection | None:
    """A Megatron-LM checkpoint to load from ``--load root``, or None when ours loads (or nothing):
    in a directory holding both, the newest iteration, ours on a tie (ours is a whole checkpoint by
    its marker). ``--ckpt-step N`` loads our complete iteration N if there is one, else Megatron-LM's."""
    if step is not None and any(it == step for it, _ in list_complete_checkpoints(root)):
        return None
    ours = resolve_load_path(root)[0] if step is None else None
    try:
        selection = select_megatron_lm_checkpoint(root, step)
    except ConfigError:
        if ours is not None:  # Megatron-LM's tracker names none of its own here; ours loads
            return None
        raise
    if selection is None:
        return None
    if ours is not None and (ours[0] >= selection.checkpoint.iteration or selection.checkpoint.release):
        return None
    return selection


# ----------------------------------------------------------------------------- reading


def get_common_safe_globals() -> list[type]:
    """The classes Megatron-LM's ``common.pt`` pickles besides tensors and containers (its ``args``
    Namespace holds enums): allowed for this one read, as megatron-core allows them process-wide
    (``megatron/core/safe_globals.py``, less numpy and BytesIO, which no common.pt holds)."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    return [
        argparse.Namespace,
        AttnBackend,
        CudaGraphScope,
        ModelType,
        RerunDiagnostic,
        RerunMode,
        RerunState,
        signal.Signals,
    ]


def get_rng_safe_globals() -> list[Any]:
    """What Megatron-LM's random-number states pickle besides tensors: NumPy's generator state (an
    array of uint32 and its dtype), as megatron-core allows it."""
    from numpy import dtype, ndarray
    from numpy.core.multiarray import _reconstruct
    from numpy.dtypes import UInt32DType

    return [_reconstruct, ndarray, dtype, UInt32DType]


def read_megatron_lm_common(ckpt_dir: str) -> dict[str, Any]:
    """A Megatron-LM checkpoint's ``common.pt`` through the allowlist of our reads
    (``reader.read_common``) widened by ``get_common_safe_globals`` for this read only.
    UnsafeCheckpointFile for anything else in it (nothing in it ran); ChecksumMismatch (``DAMAGED``)
    when it cannot be read."""
    with allowing(get_common_safe_globals()):
        return read_common(ckpt_dir, verified=None)


def read_sharded_object(ckpt_dir: str, key: str, allowed: list[Any] | tuple = ()) -> Any:
    """One small ShardedObject of a ``torch_dist`` checkpoint (e.g. the distributed optimizer's
    ``per_bucket_numel_unpadded``) by its stored key, read in this process through torch's
    weights-only unpickler (``allowed``: classes it may rebuild besides tensors and containers);
    KeyError when the checkpoint has no such item."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    reader = FileSystemReader(ckpt_dir)
    info = reader.read_metadata().storage_data[MetadataIndex(key)]
    path = os.path.join(ckpt_dir, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    with allowing(allowed):  # megatron-core stores a ShardedObject's data as a one-element list
        (value,) = load_torch_archive(data, f"{path} bytes {info.offset}..{info.offset + info.length}", None)
    return value


def check_format(ckpt_dir: str, common: dict[str, Any] | None) -> list[str]:
    """Problems with the checkpoint's format, each saying what it is and what to do: only megatron-core
    ``torch_dist`` checkpoints of megatron-core 0.13 or later (they record their content metadata)
    are read. ``common`` None: not read yet (only the files are checked)."""
    name = os.path.basename(ckpt_dir)
    entries = os.listdir(ckpt_dir)
    if any(n.startswith("mp_rank_") for n in entries):
        return [
            f"{name} is a legacy --ckpt-format torch checkpoint (mp_rank_XX/ files), which is not read here: "
            f"convert it with Megatron-LM (--ckpt-convert-format torch_dist --ckpt-convert-save DIR) and load that"
        ]
    try:
        with open(os.path.join(ckpt_dir, METADATA_FILE)) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if backend != "torch_dist" or COMMON_FILE not in entries:
        return [
            f"{name} is not a megatron-core torch_dist checkpoint (no {METADATA_FILE} naming torch_dist, or no "
            f"{COMMON_FILE}): Megatron-LM's --ckpt-format torch_dcp / fsdp_dtensor checkpoints are not read here; "
            f"re-save it with --ckpt-format torch_dist"
        ]
    if common is None:
        return []
    if common.get("content_metadata") is None:
        return [
            f"{name} records no content metadata: it was saved by megatron-core older than 0.13, whose "
            f"checkpoints are not covered here; re-save it with Megatron-LM core_v0.13 or later"
        ]
    if "rerun_state_machine" in common:
        state = (common["rerun_state_machine"] or {}).get("state")
        return [
            f"{name} was saved mid-rerun (Megatron-LM's rerun state machine, state {state}): it holds a step to "
            f"be re-run from it to check a result; finish that with Megatron-LM, or load an earlier checkpoint "
            f"with --ckpt-step"
        ]
    if not isinstance(common.get("args"), argparse.Namespace):
        return [f"{name}/{COMMON_FILE} holds no Megatron-LM args: it is not a checkpoint Megatron-LM's training saved"]
    return []


# ----------------------------------------------------------------------------- before the model is built

MEGATRON_LM_PADDING = "megatron-lm"  # CheckpointMeta.padded_vocab_from: padded by --make-vocab-size-divisible-by x TP


def get_padded_vocab(path: str, megatron_lm: bool) -> tuple[int, str] | None:
    """(rows, where they come from) of the vocabulary a checkpoint's model has, when the run must be
    built with it rather than its own padding: every Megatron-LM checkpoint (it pads by
    --make-vocab-size-divisible-by x its TP; ours by the multiple alone), and every checkpoint of ours
    that kept such a padding (``padded_vocab_from``). None otherwise, or when ``common.pt`` cannot be
    read (the load names why)."""
    try:
        if megatron_lm:
            return int(read_megatron_lm_common(path)["args"].padded_vocab_size), MEGATRON_LM_PADDING
        common = read_common(path)
    except Exception:  # noqa: BLE001 - damaged or unsafe: the load itself reports it
        return None
    source = common.get("padded_vocab_from") if isinstance(common, dict) else None
    return (int(common["padded_vocab_size"]), source) if source else None


def check_padded_vocab(padded: int, vocab_size: int, tp: int) -> str | None:
    """Why a model cannot be built with a checkpoint's padded vocabulary here, or None."""
    if padded < vocab_size:
        return (
            f"the checkpoint's model has {padded} vocabulary rows, fewer than this run's tokenizer's {vocab_size} "
            f"ids: use the checkpoint's tokenizer"
        )
    if padded % tp:
        return (
            f"the checkpoint's model has {padded} vocabulary rows (Megatron-LM pads to --make-vocab-size-divisible-by "
            f"x its TP size), which --tensor-model-parallel-size {tp} does not divide: use a TP size dividing {padded}"
        )
    return None


def check_megatron_lm_directories(load: str | None, save: str | None) -> None:
    """Megatron-LM's checkpoints are never trained over: saving into a directory that holds them is
    allowed only when the run continues from that directory (``--load`` is the same), and then never
    touches its tracker; anything else is a ConfigError naming the fix."""
    held = describe_megatron_lm_entries(save) if save else ""
    same = bool(load) and os.path.abspath(load) == os.path.abspath(save or "")
    if held and not same:
        raise ConfigError(
            [
                f"--save {save} holds Megatron-LM checkpoints ({held}) and this run does not continue from them: "
                f"add --load {save} to continue from them (ours are then saved beside them), or give another --save"
            ]
        )


def describe_save_beside(save: str | None) -> str | None:
    """The start-up line of a run saving into a directory that holds Megatron-LM checkpoints, or None."""
    if not save or not list_megatron_lm_entries(save):
        return None
    tracker = read_tracker_text(save)
    kept = f"naming {tracker!r}" if tracker else "absent"
    return (
        f"> --save {save} holds Megatron-LM checkpoints: ours are saved beside them (Megatron-LM cannot resume "
        f"from ours) and its {TRACKER_FILE} is left as it is ({kept}), so Megatron-LM still resumes from its "
        f"own; --load {save} resumes the newest of both here"
    )


# ----------------------------------------------------------------------------- tools


def read_megatron_lm_weights(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """{checkpoint key: full tensor} of the model's weights (not the optimizer's, RNG or extra
    state), read whole in this process without a process group (for tools), through our reader
    (every shard's size checked: ``reader.VerifyingFileSystemReader``; Megatron-LM records no checksums).
    Layer-stacked keys (``decoder.layers.*``) have the global layer index as dimension 0."""
    reader = VerifyingFileSystemReader(ckpt_dir)
    return read_full_tensors(reader, lambda key: not key.startswith(("optimizer.", "rng_state")))
