"""What a checkpoint load may unpickle: an allowlist for every pickle, and how to tell damage from forgery.

Invariant: no pickle a load reads can call anything outside an allowlist, so nothing in a checkpoint
runs, whoever wrote it (its checksums prove only that the bytes are those the marker records, and a
forger rewrites the marker too). There are two kinds of pickle in a ``torch_dist`` checkpoint:

- ``.metadata``, torch DCP's index of the checkpoint, written with plain ``pickle.dump`` (and read by
  torch's ``FileSystemReader.read_metadata`` with plain ``pickle.load``). ``load_metadata_pickle``
  reads it with ``MetadataUnpickler``, which resolves exactly ``METADATA_GLOBALS``: the classes found
  by reading every ``.metadata`` our saves write (TP, PP x VPP, DP with and without the distributed
  optimizer, fp32/bf16/fp16; ``tests/distributed/test_checkpoint_globals.py`` pins the list against
  them, and torch's own ``dcp.save``), torch dtypes and ``torch.Size``. Any other global is refused
  before it is resolved.
- ``torch.save`` archives (``common.pt``, every stored tensor and byte item): torch's weights-only
  unpickler. Its allowlist is process-wide, and importing megatron-core 0.16.1 adds 16 classes to it
  (``megatron/core/safe_globals.py``: ``Namespace``, ``BytesIO``, numpy arrays, enums, a config...),
  none of which our checkpoints hold; ``torch_allowlist_only`` narrows it to torch's own (tensors,
  storages, dtypes, plain containers) for the duration of a read and restores it after.

A third is read after the load, by Transformer Engine: its ``set_extra_state`` unpickles a non-empty
``_extra_state`` byte tensor with ``pickle.loads``; ``PlainUnpickler``, allowing no global, reads it
first while the item is loaded (without FP8, which we do not support, TE pickles ``None`` there or
nothing).

A file torch cannot read is damage when its zip structure says so (``describe_zip_damage``: every
``torch.save`` writes a zip archive whose members carry a CRC-32; a flipped byte breaks its
signature, its directory or a member's CRC). The named errors these lead to are ``reader.py``'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import pickle
import threading
import zipfile

import torch

_DCP = "torch.distributed.checkpoint"
# (module, name) of every global a .metadata our saves write holds: torch DCP's Metadata and the
# dataclasses inside it, megatron-core's ``all_local_plans`` (a SavePlan per rank, kept to reuse
# plans), a layout (pickled through torch's _get_layout(name): a dict lookup by name), torch.Size;
# and the PosixPath torch's own dcp.save records as the checkpoint's id (megatron-core's save, a str)
METADATA_GLOBALS = frozenset(
    {
        (f"{_DCP}.metadata", "Metadata"),
        (f"{_DCP}.metadata", "StorageMeta"),
        (f"{_DCP}.metadata", "MetadataIndex"),
        (f"{_DCP}.metadata", "TensorStorageMetadata"),
        (f"{_DCP}.metadata", "BytesStorageMetadata"),
        (f"{_DCP}.metadata", "ChunkStorageMetadata"),
        (f"{_DCP}.metadata", "TensorProperties"),
        (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        (f"{_DCP}.planner", "SavePlan"),
        (f"{_DCP}.planner", "WriteItem"),
        (f"{_DCP}.planner", "WriteItemType"),
        (f"{_DCP}.planner", "TensorWriteData"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
    }
)
ZIP_SIGNATURE = b"PK\x03\x04"  # the first bytes of every torch.save archive (a zip's first local header)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allowlist (worded as torch's weights-only unpickler words it)."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only ``METADATA_GLOBALS`` and torch dtypes: a pickle can call
    (REDUCE), build (NEWOBJ, BUILD) or hold nothing else, since every callable reaches the stack
    through ``find_class``; persistent ids are refused as ``pickle.Unpickler`` refuses them."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedGlobal(f"Unsupported global: GLOBAL {module}.{name}")


class PlainUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving no global at all: None, numbers, strings, bytes and containers
    of them only (what Transformer Engine pickles into its extra state when there is no FP8 state)."""

    def find_class(self, module: str, name: str):
        raise RefusedGlobal(f"Unsupported global: GLOBAL {module}.{name}")


def load_metadata_pickle(stream) -> object:
    """The object a ``.metadata`` pickle holds, through ``MetadataUnpickler``. Raises
    ``RefusedGlobal`` before anything outside the allowlist is resolved, and pickle's own errors
    (``UnpicklingError``, ``EOFError``, ...) for bytes that are not a pickle."""
    return MetadataUnpickler(stream).load()


_ALLOWLIST_LOCK = threading.RLock()
# classes that reads in this context may rebuild besides torch's own: set by ``allowing`` for a
# checkpoint another program wrote (Megatron-LM's args Namespace, its enums), empty for ours
_ALSO_ALLOWED: contextvars.ContextVar[tuple] = contextvars.ContextVar("also_allowed", default=())


@contextlib.contextmanager
def allowing(classes):
    """Within (this thread's context): ``torch_allowlist_only`` also allows ``classes``."""
    token = _ALSO_ALLOWED.set(_ALSO_ALLOWED.get() + tuple(classes))
    try:
        yield
    finally:
        _ALSO_ALLOWED.reset(token)


@contextlib.contextmanager
def torch_allowlist_only():
    """Within: torch's weights-only unpickler allows torch's own globals and nothing registered with
    ``torch.serialization.add_safe_globals`` (megatron-core's 16 included) but what ``allowing`` names
    in this context; after: the registrations are back. Process-wide while it lasts (torch keeps one set), so a load in another thread is
    narrowed too, never widened; nested uses are fine."""
    with _ALLOWLIST_LOCK:
        registered = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(_ALSO_ALLOWED.get()))  # ``allowing``'s, if any
        try:
            yield
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(registered)


def names_a_global(err: BaseException) -> bool:
    """Whether torch's weights-only unpickler (or ``MetadataUnpickler``) refused a global the pickle
    names, as opposed to bytes it could not parse ("Unsupported operand 10")."""
    return isinstance(err, RefusedGlobal) or "GLOBAL " in str(err)


def describe_zip_damage(data: bytes) -> str | None:
    """Why ``data`` is not the zip archive ``torch.save`` wrote (the signature, the directory, or the
    first member whose bytes fail their CRC-32), or None when it is a sound one."""
    if not data.startswith(ZIP_SIGNATURE):
        return f"bad zip signature {data[:4].hex()}, every torch.save archive starts {ZIP_SIGNATURE.hex()}"
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as err:
        return f"not a readable zip archive: {err}"
    return None if bad is None else f"zip member {bad} fails its CRC-32"
