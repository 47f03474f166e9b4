"""The checking reader on a torch DCP checkpoint written without a process group.

A checkpoint of two tensors and a byte item is written by torch DCP itself; its checksum table is
computed here from the file (the reference: one hash of each item's stored bytes, independent of
the writer's streaming hash). Loaded through ``VerifyingFileSystemReader`` it must give the saved
values and count every item; one flipped byte anywhere in an item (its zip header, its pickle, its
tensor data, a byte item) must be ``ChecksumMismatch`` naming the file and byte range, whatever
torch's parser would have said; without checksums, a flip that breaks the item's zip archive (its
signature, its directory, a member's CRC-32) is named damage too. A parse error under a matching
checksum is not damage.

Nothing in a checkpoint runs (issue 45, issue 43 item 6): a forged ``.metadata`` (a pickle that runs a
command, then gives the real Metadata) is refused by every reader built on torch's (ours, torch's,
megatron-core's cached one, megatron-core's ``load_tensors_metadata``); a byte item or ``common.pt``
holding objects a checkpoint never holds is refused before anything in it runs, megatron-core's
process-wide allowlist (``argparse.Namespace`` ...) included, and megatron-core's own
``load_common`` refuses too, even where torch's default is the full unpickler; a Transformer Engine
extra state whose inner pickle names a global is refused. No message advises turning torch's safe
loader off.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import zipfile

import pytest
import torch
from torch.distributed import checkpoint as dcp

from megatron_ext.checkpoint import reader as cr
from megatron_ext.checkpoint.checksum import DEFAULT_ALGORITHM, new_hasher
from megatron_ext.testing import RunsThenReturns

DAMAGED_RANGE = r"damaged checkpoint file \(checksum mismatch\): .*\.distcp bytes (\d+)\.\.(\d+)"


class _RunsCode:
    """A pickle that calls os.system when unpickled by a full unpickler."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _state() -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(7), "note": "abc"}


def _digest(data: bytes) -> int:
    h = new_hasher(DEFAULT_ALGORITHM)
    h.update(data)
    return h.intdigest()


@pytest.fixture
def saved(tmp_path):
    """(directory, {fqn: (file path, offset, length)}, checksum table) of a DCP checkpoint."""
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    metadata = dcp.FileSystemReader(path).read_metadata()
    items, table = {}, {}
    for index, info in metadata.storage_data.items():
        file = os.path.join(path, info.relative_path)
        with open(file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        items[index.fqn] = (file, info.offset, info.length)
        table.setdefault(info.relative_path, {})[str(info.offset)] = [info.length, _digest(data)]
    return path, items, table


def _load(path: str, table: dict | None, stats: cr.VerifyStats | None = None) -> dict:
    state = {"w": torch.zeros(64, 64), "b": torch.zeros(7), "note": None}
    reader = cr.VerifyingFileSystemReader(path, table, DEFAULT_ALGORITHM, stats)
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except BaseException as err:  # torch's CheckpointException wraps what the reader raised
        found = cr.find_named_failure(err)
        if found is None:
            raise
        raise found from None
    return state


def _patch(file: str, offset: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(file: str, offset: int) -> None:
    with open(file, "rb") as f:
        f.seek(offset)
        byte = f.read(1)
    _patch(file, offset, bytes([byte[0] ^ 0x5A]))


def _record_offsets(item: tuple[str, int, int]) -> dict[str, int]:
    """Offsets in the file of parts of one stored item (a torch.save zip): its end-of-central-
    directory record, the start of its pickle and the middle of its tensor data."""
    file, offset, length = item
    with open(file, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    out = {"zip header": offset + data.rindex(b"PK\x05\x06")}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            # the local header's own name and extra lengths (torch pads records with a local extra field)
            name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            if info.filename.endswith("data.pkl"):
                out["pickle"] = offset + start
            elif info.filename.endswith("data/0"):
                out["tensor data"] = offset + start + info.file_size // 2
    return out


def test_clean_load_gives_the_saved_values_and_counts_every_item(saved):
    path, items, table = saved
    stats = cr.VerifyStats()
    state = _load(path, table, stats)
    expected = _state()
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
    assert state["note"] == "abc"
    assert (stats.verified, stats.byte_items, stats.unverified) == (len(items), 1, 0)


@pytest.mark.parametrize("where", ["zip header", "pickle", "tensor data", "byte item"])
def test_a_flipped_byte_anywhere_in_an_item_is_named_damage(saved, where):
    path, items, table = saved
    if where == "byte item":
        file, offset, length = items["note"]
        target, span = offset + length // 2, (offset, offset + length)
    else:
        file, offset, length = items["w"]
        target, span = _record_offsets(items["w"])[where], (offset, offset + length)
    _flip(file, target)
    with pytest.raises(cr.ChecksumMismatch) as err:
        _load(path, table)
    found = re.search(DAMAGED_RANGE, str(err.value))
    assert found and (int(found[1]), int(found[2])) == span, str(err.value)
    assert os.path.basename(file) in str(err.value)
    if where in ("zip header", "pickle"):  # the flip breaks torch's parser: unchecked, the zip archive names it
        with pytest.raises(cr.ChecksumMismatch) as err:
            _load(path, None)
        reason = (
            "not a readable zip archive" if where == "zip header" else "zip member archive/data.pkl fails its CRC-32"
        )
        assert f"damaged checkpoint file ({reason}" in str(err.value) and f"bytes {span[0]}..{span[1]}" in str(
            err.value
        )


def test_without_checksums_a_flipped_tensor_byte_loads_silently(saved):
    """The control: the damage above is only seen through the checksums."""
    path, items, _ = saved
    _flip(items["w"][0], _record_offsets(items["w"])["tensor data"])
    assert not torch.equal(_load(path, None)["w"], _state()["w"])


def test_a_parse_error_under_a_matching_checksum_is_not_damage(saved):
    path, items, table = saved
    file, offset, length = items["w"]
    _flip(file, _record_offsets(items["w"])["zip header"])
    with open(file, "rb") as f:
        f.seek(offset)
        table[os.path.basename(file)][str(offset)] = [length, _digest(f.read(length))]
    with pytest.raises(cr.UnreadableCheckpointItem, match=r"unreadable checkpoint item: .* \(its checksum matches\)"):
        _load(path, table)


@pytest.mark.parametrize("verify", [True, False])
def test_an_item_that_would_run_code_is_refused_and_nothing_runs(saved, tmp_path, verify):
    path, items, table = saved
    sentinel = tmp_path / "ran"
    file, offset, length = items["note"]
    payload = pickle.dumps(_RunsCode(str(sentinel)), protocol=2)  # DCP's load_bytes would run it
    payload += b"\0" * (length - len(payload))
    _patch(file, offset, payload)
    table[os.path.basename(file)][str(offset)] = [length, _digest(payload)]  # as a tamperer would
    with pytest.raises(cr.UnsafeCheckpointFile) as err:
        _load(path, table if verify else None)
    message = str(err.value)
    assert not sentinel.exists()
    assert f"bytes {offset}..{offset + length}" in message and cr.UNSAFE in message
    assert "weights_only" not in message and re.search(r"GLOBAL (posix|os)\.system", message), message
    assert ("checksum matches" in message) == verify


def test_common_file_that_would_run_code_is_refused(tmp_path):
    sentinel = tmp_path / "ran"
    torch.save({"args": _RunsCode(str(sentinel))}, tmp_path / cr.COMMON_FILE)
    with pytest.raises(cr.UnsafeCheckpointFile, match=r"common\.pt holds objects a checkpoint never holds") as err:
        cr.read_common(str(tmp_path))
    assert not sentinel.exists() and "weights_only" not in str(err.value)


def test_truncated_shard_is_named(saved):
    path, items, table = saved
    file = items["w"][0]
    os.truncate(file, os.path.getsize(file) - 10)
    with pytest.raises(cr.ChecksumMismatch, match=r"damaged checkpoint file \(truncated\): .*\.distcp has \d+ bytes"):
        _load(path, None)


def _forge_metadata(path: str, sentinel) -> None:
    """Replace ``.metadata`` with a pickle that runs ``touch sentinel``, then gives the real Metadata."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        real = pickle.load(f)  # written by this test's own dcp.save
    with open(file, "wb") as f:
        pickle.dump(RunsThenReturns(f"touch {sentinel}", real), f)


@pytest.mark.parametrize(
    "how", ["our reader", "torch's reader", "megatron-core's cached reader", "load_tensors_metadata"]
)
def test_a_forged_metadata_file_is_refused_by_every_reader_and_nothing_runs(saved, tmp_path, how):
    """torch's FileSystemReader reads .metadata with pickle.load: every reader built on it (ours, the
    cached one megatron-core's load uses, megatron-core's load_tensors_metadata) reads it through the
    allowlist instead."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    path, _, table = saved
    sentinel = tmp_path / "ran"
    _forge_metadata(path, sentinel)
    with pytest.raises(cr.UnsafeCheckpointFile) as err:
        if how == "our reader":
            _load(path, table)
        elif how == "torch's reader":
            dcp.FileSystemReader(path).read_metadata()
        elif how == "megatron-core's cached reader":
            CachedMetadataFileSystemReader(path).read_metadata()
        else:
            save_config(CheckpointingConfig("torch_dist"), path)  # makes it a megatron-core checkpoint
            dist_checkpointing.load_tensors_metadata(path)
    assert not sentinel.exists(), "the pickle ran"
    message = str(err.value)
    assert re.search(
        r"/\.metadata holds objects a checkpoint never holds \(Unsupported global: GLOBAL operator\.itemgetter\)",
        message,
    )
    assert cr.UNSAFE in message and "weights_only" not in message, message


def test_the_metadata_allowlist_reads_what_torch_writes_and_refuses_the_rest(saved):
    """The .metadata torch's own dcp.save writes loads (it records its path as a PosixPath, which our
    saves do not); os.system, and a class of ours, are refused before they are resolved."""
    from megatron_ext.checkpoint.unpickler import RefusedGlobal, load_metadata_pickle

    with open(os.path.join(saved[0], ".metadata"), "rb") as f:
        assert set(load_metadata_pickle(f).state_dict_metadata) == set(_state())
    for obj, name in ((_RunsCode("/nonexistent/x"), "posix.system"), (_Custom(), f"{__name__}._Custom")):
        with pytest.raises(RefusedGlobal, match=re.escape(f"GLOBAL {name}")):
            load_metadata_pickle(io.BytesIO(pickle.dumps(obj)))


@pytest.mark.parametrize("what", ["tensor item", "byte item"])
def test_a_flipped_zip_signature_is_named_damage_without_checksums(saved, what):
    """Issue 45: it was taken for tampering ("may have been tampered with", an empty reason), so
    --ckpt-fallback-on-corruption did not fall back. Every torch.save archive starts PK\\x03\\x04."""
    path, items, _ = saved
    file, offset, length = items["w" if what == "tensor item" else "note"]
    _flip(file, offset)
    with pytest.raises(cr.ChecksumMismatch) as err:
        _load(path, None)
    assert "damaged checkpoint file (bad zip signature 0a4b0304, every torch.save archive starts 504b0304): " in str(
        err.value
    )
    assert f"{os.path.basename(file)} bytes {offset}..{offset + length}" in str(err.value)


def test_common_file_holding_what_megatron_core_allowlists_is_refused_and_the_allowlist_restored(tmp_path):
    """Importing megatron-core adds 16 classes to torch's weights-only allowlist process-wide
    (argparse.Namespace among them); our reads allow torch's own only, and leave megatron-core's
    registrations as they were."""
    import argparse

    registered = torch.serialization.get_safe_globals()
    assert argparse.Namespace in registered  # megatron-core's, since it was imported
    torch.save({"args": argparse.Namespace(lr=1.0)}, tmp_path / cr.COMMON_FILE)
    with pytest.raises(
        cr.UnsafeCheckpointFile, match=r"common\.pt holds objects a checkpoint never holds \(.*argparse\.Namespace"
    ):
        cr.read_common(str(tmp_path))
    assert set(torch.serialization.get_safe_globals()) == set(registered)
    sentinel = tmp_path / "ran"
    torch.save({"args": _RunsCode(str(sentinel))}, tmp_path / cr.COMMON_FILE)  # refused either way
    with pytest.raises(cr.UnsafeCheckpointFile, match=r"GLOBAL (posix|os)\.system"):
        cr.read_common(str(tmp_path))
    assert not sentinel.exists()


def test_megatron_core_load_common_reads_through_the_allowlist(tmp_path, monkeypatch):
    """megatron-core's load_common calls torch.load with torch's default, which this variable turns
    into the full unpickler: a forged common.pt ran its command there."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    sentinel = tmp_path / "ran"
    torch.save(RunsThenReturns(f"touch {sentinel}", {"iteration": 3}), tmp_path / cr.COMMON_FILE)
    with pytest.raises(cr.UnsafeCheckpointFile, match=r"common\.pt holds objects a checkpoint never holds"):
        TorchCommonLoadStrategy().load_common(tmp_path)
    assert not sentinel.exists(), "the pickle ran"


@pytest.mark.parametrize("held", ["code", "plain"])
def test_a_transformer_engine_extra_state_holding_code_is_refused(tmp_path, held):
    """Transformer Engine's set_extra_state unpickles a non-empty byte-tensor extra state with
    pickle.loads: the pickle inside it may resolve no global. Without FP8, TE pickles None there
    (the control: it loads)."""
    path, sentinel = str(tmp_path / "ckpt"), tmp_path / "ran"
    dcp.save(
        {"w": torch.ones(3), "layer._extra_state": "x" * 3000}, storage_writer=dcp.FileSystemWriter(path), no_dist=True
    )
    ((index, info),) = [
        (i, v) for i, v in dcp.FileSystemReader(path).read_metadata().storage_data.items() if i.fqn != "w"
    ]
    inner = pickle.dumps(RunsThenReturns(f"touch {sentinel}", None) if held == "code" else None)
    buffer = io.BytesIO()
    torch.save(torch.frombuffer(bytearray(inner), dtype=torch.uint8), buffer)  # TE's format
    payload = buffer.getvalue()
    _patch(os.path.join(path, info.relative_path), info.offset, payload + b"\0" * (info.length - len(payload)))
    state = {"w": torch.zeros(3), "layer._extra_state": None}
    try:
        dcp.load(state, storage_reader=cr.VerifyingFileSystemReader(path), no_dist=True)
    except BaseException as err:  # torch's CheckpointException wraps what the reader raised
        found = cr.find_named_failure(err)
        assert held == "code" and isinstance(found, cr.UnsafeCheckpointFile), err
        assert re.search(
            r"\(the layer\._extra_state Transformer Engine unpickles\) holds objects .*GLOBAL operator\.itemgetter",
            str(found),
        )
    else:
        assert held == "plain" and pickle.loads(state["layer._extra_state"].numpy().tobytes()) is None
    assert not sentinel.exists()


class _Custom:
    """A class torch's weights-only unpickler does not allow (its module is not blocked)."""


def test_the_refusal_reason_keeps_torch_s_reason_and_drops_its_advice():
    for obj in (_RunsCode("/nonexistent/x"), _Custom()):
        buffer = io.BytesIO()
        torch.save({"x": obj}, buffer)
        with pytest.raises(pickle.UnpicklingError) as err:
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        assert "weights_only" in str(err.value)  # torch's own message advises it
        reason = cr.describe_refusal(err.value)
        assert "GLOBAL" in reason and "weights_only" not in reason and "add_safe_globals" not in reason, reason


@pytest.mark.parametrize("mapped", [True, False])
def test_hash_in_chunks_equals_one_hash(tmp_path, monkeypatch, mapped):
    monkeypatch.setattr(cr, "_HASH_CHUNK", 1000)
    if not mapped:  # a file system that cannot map files: read with pread instead
        monkeypatch.setattr(cr.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError("no mmap")))
    data = os.urandom(12_345)
    (tmp_path / "f").write_bytes(b"x" * 77 + data + b"y" * 5)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert cr.hash_file_range(fd, 77, len(data), "f", DEFAULT_ALGORITHM) == _digest(data)
        with pytest.raises(cr.ChecksumMismatch, match="truncated"):
            cr.hash_file_range(fd, 77, len(data) + 6, "f", DEFAULT_ALGORITHM)
    finally:
        os.close(fd)
