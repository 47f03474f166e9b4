"""With --ckpt-verify every byte a load uses is checked, in any layout; damage is named, unsafe files refused.

One forked 2-rank world trains a Llama-style model (RMSNorm, SwiGLU, RoPE, no biases; dropout, so
the RNG state matters) for 6 iterations at TP2 and again at TP1 x DP2, saving every 2. Copies of
those checkpoints are damaged here, in the test process: one flipped byte in a shard item's zip
header, in its pickle, in the RNG byte item, in common.pt, and in the word embedding's tensor data
of a checkpoint then loaded at another TP (TP2 -> TP1 and TP1 -> TP2: the embedding is read in part
by each rank). A second 2-rank world loads every copy in turn. Each must fail on every rank as a
``damaged checkpoint file`` error naming the file and byte range; with --ckpt-fallback-on-corruption
the same message is a warning, iteration 2 loads instead and training continues bit-identically to
a clean load of iteration 2 in that layout (the uninterrupted run's losses in the saved layout).

Files that hold objects a checkpoint never holds (a code-running pickle in common.pt, and in the RNG
item, their checksums updated in complete.json as a tamperer would) are refused by name, nothing in
them runs, and no message advises loading with ``weights_only=False``. tools/convert_checkpoint.py
(megatron-to-hf) refuses a damaged shard and the tampered common.pt, naming the file, and writes
nothing; the clean checkpoint converts (the control).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct
import zipfile

import pytest
import torch

from megatron_ext.checkpoint.checksum import file_digest, new_hasher
from megatron_ext.checkpoint.directory import COMPLETE_MARKER
from megatron_ext.config import ConfigError
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

VALUES = dict(
    num_layers=2,
    train_iters=6,
    global_batch_size=4,
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    position_embedding_type="rope",
    hidden_dropout=0.1,
)
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "tp1": {}}  # 2 ranks: TP1 is DP2
NAMED = r"damaged checkpoint file \(checksum mismatch\): \S*/iter_0000004/{file} bytes (\d+)\.\.(\d+)"
# damage -> (saved layout, loading layout, what is flipped)
DAMAGE = {
    "zip header": ("tp2", "tp2", "zip header"),
    "pickle": ("tp2", "tp2", "pickle"),
    "rng byte item": ("tp2", "tp2", "rng"),
    "common.pt": ("tp2", "tp2", "common"),
    "tp2 -> tp1": ("tp2", "tp1", "embedding"),
    "tp1 -> tp2": ("tp1", "tp2", "embedding"),
}


def _build(layout: str, **flags):
    return build_tiny_run(tiny_values(**VALUES, **LAYOUTS[layout], **flags), MarkovDataset(32, mask_every=1))


def _save_world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        run = _build(layout, save=os.path.join(root, layout), save_interval=2)
        train(run)
        out[layout] = [r["loss"] for r in run.records]
        destroy_parallel_context()
    return out


def _load_world(rank: int, world_size: int, cases: list[tuple]) -> dict:
    """Each case: (name, layout, path, flags, step, train); the outcome of loading it."""
    out = {}
    for name, layout, path, flags, step, do_train in cases:
        run = _build(layout, **flags)
        lines = []
        run.log = lines.append
        try:
            loaded = load_checkpoint(run, path, step=step)
        except ConfigError as err:
            out[name] = {"error": str(err)}
        else:
            if do_train:
                train(run)
            out[name] = {"loaded": loaded, "losses": [r["loss"] for r in run.records], "log": lines}
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("verify") / "ckpt")
    return root, run_ranks(_save_world, 2, root, timeout=300)[-1]


# ----------------------------------------------------------------------------- damaging copies


def _copy(root: str, layout: str, dest: str) -> str:
    """A copy of ``layout``'s checkpoints whose newest is iteration 4 (6 and the pointer removed)."""
    shutil.copytree(os.path.join(root, layout), dest)
    shutil.rmtree(os.path.join(dest, "iter_0000006"))
    os.remove(os.path.join(dest, "latest_checkpointed_iteration.txt"))
    return dest


def _items(ckpt: str) -> dict[str, tuple[str, int, int]]:
    """{fqn/offset: (file, byte offset, length)} of every stored item."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(ckpt).read_metadata()
    return {
        f"{i.fqn}@{tuple(i.offset) if i.offset is not None else ''}": (
            os.path.join(ckpt, s.relative_path),
            s.offset,
            s.length,
        )
        for i, s in metadata.storage_data.items()
    }


def _in_item(item: tuple[str, int, int], part: str) -> int:
    """The file offset of a part of one stored item (a torch.save zip): its end-of-central-directory
    record, the first byte of its pickle, or the middle of its first data record."""
    file, offset, length = item
    with open(file, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if part == "zip header":
        return offset + data.rindex(b"PK\x05\x06")
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            # the local header's own name and extra lengths (torch pads records with a local extra field)
            name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            if part == "pickle" and info.filename.endswith("data.pkl"):
                return offset + start
            if part == "data" and info.filename.endswith("data/0"):
                return offset + start + info.file_size // 2
    raise AssertionError(f"no {part} in {item}")


def _flip(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def _damage(ckpt: str, what: str) -> tuple[str, int, int]:
    """Flip one byte; (file name, item start, item end) that a load must name."""
    items = _items(ckpt)
    if what == "common":
        path = os.path.join(ckpt, "common.pt")
        _flip(path, os.path.getsize(path) // 2)
        return "common.pt", 0, os.path.getsize(path)
    if what == "rng":
        item, part = items["rng_state/shard_0_2@"], "data"
    elif what == "embedding":
        item, part = items["embedding.word_embeddings.weight@(0, 0)"], "data"
    else:  # a plain tensor item of rank 0's shard file: the first after the byte items
        item = min(
            (
                v
                for k, v in items.items()
                if k.startswith("decoder.") and "_extra_state" not in k and v[0].endswith("__0_0.distcp")
            ),
            key=lambda v: v[1],
        )
        part = what
    _flip(item[0], _in_item(item, part))
    return os.path.basename(item[0]), item[1], item[1] + item[2]


def _digest(algorithm: str, data: bytes) -> int:
    h = new_hasher(algorithm)
    h.update(data)
    return h.intdigest()


class _RunsCode:
    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _tamper(ckpt: str, what: str, sentinel: str) -> None:
    """Replace common.pt, or rank 0's RNG item (same length), with a pickle that runs a command, and
    update its checksum in complete.json, as someone who meant it would."""
    marker_path = os.path.join(ckpt, COMPLETE_MARKER)
    marker = json.load(open(marker_path))
    algorithm = marker["checksums"]["algorithm"]
    if what == "common":
        path = os.path.join(ckpt, "common.pt")
        torch.save({"args": _RunsCode(sentinel)}, path)
        marker["checksums"]["files"]["common.pt"] = file_digest(path, algorithm)
    else:
        file, offset, length = _items(ckpt)["rng_state/shard_0_2@"]
        payload = pickle.dumps([_RunsCode(sentinel)], protocol=2)
        payload += b"\0" * (length - len(payload))  # what follows the pickle is never read
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(payload)
        marker["checksums"]["items"][os.path.basename(file)][str(offset)] = [length, _digest(algorithm, payload)]
    json.dump(marker, open(marker_path, "w"))


# ----------------------------------------------------------------------------- the loads


@pytest.fixture(scope="module")
def loads(saved, tmp_path_factory):
    """Every damaged and tampered copy loaded in one 2-rank world."""
    root, _ = saved
    tmp = str(tmp_path_factory.mktemp("copies"))
    verify, fallback = dict(ckpt_verify=True), dict(ckpt_verify=True, ckpt_fallback_on_corruption=True)
    cases, named = [], {}
    for name, (saved_layout, layout, what) in DAMAGE.items():
        path = _copy(root, saved_layout, os.path.join(tmp, name.replace(" ", "_")))
        named[name] = _damage(os.path.join(path, "iter_0000004"), what)
        cases += [(name, layout, path, verify, None, False), (f"{name} fallback", layout, path, fallback, None, True)]
    for layout, saved_layout in (("tp1", "tp2"), ("tp2", "tp1")):  # the references of the reshard fallbacks
        cases.append((f"clean {saved_layout} at {layout}", layout, os.path.join(root, saved_layout), {}, 2, True))
    sentinels = {}
    for what, flags in (("common", {}), ("rng", verify), ("rng", {})):
        name = f"tampered {what}{' verified' if flags else ''}"
        path = _copy(root, "tp2", os.path.join(tmp, name.replace(" ", "_")))
        sentinels[name] = os.path.join(tmp, f"{name.replace(' ', '_')}.ran")
        _tamper(os.path.join(path, "iter_0000004"), what, sentinels[name])
        cases.append((name, "tp2", path, flags, None, False))
    results = run_ranks(_load_world, 2, cases, timeout=600)
    return results, named, sentinels


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damage_is_named_with_file_and_byte_range(loads, name):
    results, named, _ = loads
    file, start, end = named[name]
    pattern = NAMED.format(file=re.escape(file))
    for rank, out in enumerate(results):
        error = out[name].get("error", "")
        found = re.search(pattern, error)
        assert found and (int(found[1]), int(found[2])) == (start, end), (rank, out[name])
        assert "--ckpt-fallback-on-corruption" in error


@pytest.mark.parametrize("name", list(DAMAGE))
def test_fallback_loads_the_previous_checkpoint_and_resumes_bit_identically(saved, loads, name):
    _, reference = saved
    results, named, _ = loads
    saved_layout, layout, _ = DAMAGE[name]
    file = named[name][0]
    for out in results:
        got = out[f"{name} fallback"]
        assert got.get("loaded") == 2, got
    (warning,) = [x for out in results for x in out[f"{name} fallback"]["log"] if x.startswith("WARNING: damaged")]
    assert re.search(NAMED.format(file=re.escape(file)), warning), warning
    if saved_layout == layout:
        expected = reference[saved_layout][2:]
    else:
        expected = results[-1][f"clean {saved_layout} at {layout}"]["losses"]
    assert results[-1][f"{name} fallback"]["losses"] == expected


@pytest.mark.parametrize("name", ["tampered common", "tampered rng verified", "tampered rng"])
def test_a_file_that_would_run_code_is_refused_and_nothing_runs(loads, name):
    results, _, sentinels = loads
    where = r"common\.pt" if "common" in name else r"__0_0\.distcp bytes \d+\.\.\d+"
    for rank, out in enumerate(results):
        error = out[name].get("error", "")
        assert re.search(
            rf"unsafe checkpoint file: \S*/iter_0000004/{where} holds objects a checkpoint never "
            rf"holds .*may have been tampered with",
            error,
        ), (rank, out[name])
        assert "weights_only" not in error and "GLOBAL" in error, error
    assert not os.path.exists(sentinels[name]), "the pickle ran"


# ----------------------------------------------------------------------------- the converter


@pytest.mark.parametrize("how", ["damaged shard", "tampered common.pt", "clean"])
def test_converter_refuses_a_damaged_or_tampered_checkpoint_naming_the_file(saved, tmp_path, capsys, how):
    pytest.importorskip("safetensors")
    from tools.convert_checkpoint import main

    root, _ = saved
    path = _copy(root, "tp2", str(tmp_path / "ckpt"))
    ckpt = os.path.join(path, "iter_0000004")
    sentinel = str(tmp_path / "ran")
    if how == "damaged shard":
        file, start, end = _damage(ckpt, "embedding")
        needle = NAMED.format(file=re.escape(file))
    elif how == "tampered common.pt":
        _tamper(ckpt, "common", sentinel)
        needle = r"unsafe checkpoint file: \S*/iter_0000004/common\.pt .*may have been tampered with"
    out = str(tmp_path / "hf")
    rc = main(["megatron-to-hf", "--load", path, "--hf-dir", out])
    err = capsys.readouterr().err
    if how == "clean":
        assert rc == 0 and os.path.isfile(os.path.join(out, "model.safetensors")), err
        return
    assert rc == 2 and re.search(r"error: --load .*" + needle, err), err
    assert not os.path.exists(out) or not os.listdir(out), "an export was written"
    assert not os.path.exists(sentinel) and "weights_only" not in err
    if how == "damaged shard":
        assert re.search(needle, err).groups() == (str(start), str(end))
