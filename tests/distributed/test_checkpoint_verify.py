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

Forged files (a pickle that runs a command and then gives the file's real content, so that a load
running it succeeds; its checksum updated in complete.json, as a forger would): ``.metadata``,
``common.pt``, the RNG item and an ``_extra_state`` item, each loaded by --load, --ckpt-verify and
--finetune, and given to tools/generate.py and tools/convert_checkpoint.py. Each is refused by name
(exit 2), the command never runs, and no message advises loading with ``weights_only=False``; the
tools read tensors only (a forged byte item is never unpickled: exit 0), and --finetune does not read
the RNG state. A flipped zip signature in a tensor item, without --ckpt-verify, is named damage (not
possible tampering) and --ckpt-fallback-on-corruption alone falls back from it.
tools/convert_checkpoint.py (megatron-to-hf) refuses a damaged shard and the tampered common.pt,
naming the file, and writes nothing; the clean checkpoint converts (the control).
"""

from __future__ import annotations

import contextlib
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
from megatron_ext.testing import MarkovDataset, RunsThenReturns, build_tiny_run, run_ranks, tiny_values
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
        finetune = run.cfg.checkpoint.finetune  # what plan_load makes of --finetune
        try:
            loaded = load_checkpoint(run, path, step=step, weights_only=finetune, load_rng=not finetune)
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


def _damage_target(ckpt: str) -> tuple[str, int, int]:
    """A plain tensor item of rank 0's shard file: the first after the byte items."""
    return min(
        (
            v
            for k, v in _items(ckpt).items()
            if k.startswith("decoder.") and "_extra_state" not in k and v[0].endswith("__0_0.distcp")
        ),
        key=lambda v: v[1],
    )


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
    else:
        item, part = _damage_target(ckpt), what
    _flip(item[0], _in_item(item, part))
    return os.path.basename(item[0]), item[1], item[1] + item[2]


def _digest(algorithm: str, data: bytes) -> int:
    h = new_hasher(algorithm)
    h.update(data)
    return h.intdigest()


# what is forged -> the stored item it replaces (rank 0's RNG state; an _extra_state of its shard file,
# which every load of the model reads, --finetune's too), or the coordinator's file
FORGED = ("metadata", "common", "rng", "extra state")
# how each entry point is asked to load: the flags of the run (--load is the copy's directory)
ENTRIES = {"load": {}, "ckpt-verify": dict(ckpt_verify=True), "finetune": dict(finetune=True)}


def _forged_item(ckpt: str, what: str) -> tuple[str, int, int]:
    items = _items(ckpt)
    if what == "rng":
        return items["rng_state/shard_0_2@"]
    return min(
        (v for k, v in items.items() if "_extra_state" in k and v[0].endswith("__0_0.distcp")), key=lambda v: v[1]
    )


def _tamper(ckpt: str, what: str, sentinel: str) -> None:
    """Replace one file of ``ckpt`` with a pickle that runs ``touch sentinel`` and then gives the
    file's real content (so a load that runs it succeeds), and update its checksum in complete.json,
    as someone who meant it would. ``what``: one of FORGED; a byte item keeps its length (what
    follows the pickle is never read)."""
    marker_path = os.path.join(ckpt, COMPLETE_MARKER)
    marker = json.load(open(marker_path))
    algorithm, command = marker["checksums"]["algorithm"], f"touch {sentinel}"
    if what in ("metadata", "common"):
        name = ".metadata" if what == "metadata" else "common.pt"
        path = os.path.join(ckpt, name)
        with open(path, "rb") as f:  # the real content (our own save's, read before it is replaced)
            real = pickle.load(f) if what == "metadata" else torch.load(f, weights_only=True)
        with open(path, "wb") as f:
            pickle.dump(RunsThenReturns(command, real), f) if what == "metadata" else torch.save(
                RunsThenReturns(command, real), f
            )
        marker["checksums"]["files"][name] = file_digest(path, algorithm)
    else:
        file, offset, length = _forged_item(ckpt, what)
        payload = pickle.dumps(RunsThenReturns(command, None), protocol=2)
        payload += b"\0" * (length - len(payload))
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(payload)
        marker["checksums"]["items"][os.path.basename(file)][str(offset)] = [length, _digest(algorithm, payload)]
    json.dump(marker, open(marker_path, "w"))


def _where(what: str) -> str:
    """The file (pattern) a refusal of ``what`` forged names."""
    return {"metadata": r"\.metadata", "common": r"common\.pt"}.get(what, r"__0_0\.distcp bytes \d+\.\.\d+")


def _flip_zip_signature(ckpt: str) -> tuple[str, int, int]:
    """Flip the first byte of a tensor item of rank 0's shard file (its zip signature); the item."""
    item = _damage_target(ckpt)
    _flip(item[0], item[1])
    return os.path.basename(item[0]), item[1], item[1] + item[2]


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
    for what in FORGED:
        for entry, flags in ENTRIES.items():
            name = f"forged {what} at {entry}"
            path = _copy(root, "tp2", os.path.join(tmp, name.replace(" ", "_")))
            sentinels[name] = os.path.join(tmp, f"{name.replace(' ', '_')}.ran")
            _tamper(os.path.join(path, "iter_0000004"), what, sentinels[name])
            cases.append((name, "tp2", path, flags, None, False))
    for name, flags in (("zip signature", {}), ("zip signature fallback", dict(ckpt_fallback_on_corruption=True))):
        path = _copy(root, "tp2", os.path.join(tmp, name.replace(" ", "_")))  # --ckpt-verify off: torch parses it
        named[name] = _flip_zip_signature(os.path.join(path, "iter_0000004"))
        cases.append((name, "tp2", path, flags, None, name.endswith("fallback")))
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


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("what", FORGED)
def test_a_forged_file_is_refused_at_every_load_and_nothing_runs(loads, what, entry):
    """--load, --ckpt-verify, --finetune: a forged .metadata, common.pt or byte item is refused by
    name on every rank (exit 2: a ConfigError) and its command never runs; --finetune never reads
    the RNG state, so a forged one is not read at all."""
    results, _, sentinels = loads
    name = f"forged {what} at {entry}"
    assert not os.path.exists(sentinels[name]), "the pickle ran"
    if (what, entry) == ("rng", "finetune"):
        assert [out[name].get("loaded") for out in results] == [4, 4], results[0][name]
        return
    for rank, out in enumerate(results):
        error = out[name].get("error", "")
        assert re.search(
            rf"unsafe checkpoint file: \S*/iter_0000004/{_where(what)} holds objects a checkpoint never "
            rf"holds \((Unsupported global: )?GLOBAL (operator\.itemgetter|posix\.system)\).*may have been tampered with",
            error,
        ), (rank, out[name])
        assert "weights_only" not in error, error


def test_a_flipped_zip_signature_is_damage_and_falls_back_without_verification(saved, loads):
    """--ckpt-fallback-on-corruption alone: a tensor item whose zip signature is flipped is named
    damage (not possible tampering), with the file, byte range and reason; the fallback loads
    iteration 2 and resumes exactly."""
    _, reference = saved
    results, named, _ = loads
    file, start, end = named["zip signature"]
    needle = rf"damaged checkpoint file \(bad zip signature 0a4b0304, .*\): \S*/iter_0000004/{re.escape(file)} bytes {start}\.\.{end}"
    for rank, out in enumerate(results):
        error = out["zip signature"].get("error", "")
        assert re.search(needle, error) and "--ckpt-fallback-on-corruption" in error, (rank, out["zip signature"])
        assert out["zip signature fallback"].get("loaded") == 2, (rank, out["zip signature fallback"])
    (warning,) = [
        x for out in results for x in out["zip signature fallback"]["log"] if x.startswith("WARNING: damaged")
    ]
    assert re.search(needle, warning), warning
    assert results[-1]["zip signature fallback"]["losses"] == reference["tp2"][2:]


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


# ----------------------------------------------------------------------------- the tools


def _tool_world(rank: int, world_size: int, cases: list[tuple]) -> dict:
    """Each case: (name, tool, argv); what the tool's main returned and wrote to stderr. One rank:
    tools/generate.py joins the world the test forked instead of making its own."""
    from tools import convert_checkpoint, generate

    out = {}
    for name, tool, argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = (generate if tool == "generate" else convert_checkpoint).main(argv)
        out[name] = (rc, err.getvalue())
        destroy_parallel_context()  # generate built one for its model
    return out


@pytest.fixture(scope="module")
def tool_runs(saved, tmp_path_factory):
    """tools/generate.py and tools/convert_checkpoint.py (megatron-to-hf) on a copy with each file forged."""
    pytest.importorskip("safetensors")
    root, _ = saved
    tmp = str(tmp_path_factory.mktemp("tools"))
    cases, sentinels = [], {}
    for what in FORGED:
        for tool in ("generate", "convert"):
            name = f"{tool} {what}"
            path = _copy(root, "tp2", os.path.join(tmp, name.replace(" ", "_")))
            sentinels[name] = os.path.join(tmp, f"{name.replace(' ', '_')}.ran")
            _tamper(os.path.join(path, "iter_0000004"), what, sentinels[name])
            argv = (
                ["--load", path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy"]
                if tool == "generate"
                else ["megatron-to-hf", "--load", path, "--hf-dir", os.path.join(tmp, f"{name}.hf")]
            )
            cases.append((name, tool, argv))
    return run_ranks(_tool_world, 1, cases, timeout=300)[0], sentinels


@pytest.mark.parametrize("tool", ["generate", "convert"])
@pytest.mark.parametrize("what", FORGED)
def test_the_tools_refuse_a_forged_file_and_nothing_runs(tool_runs, what, tool):
    """A forged .metadata or common.pt is refused by name, exit 2; the tools read tensors only, so a
    forged byte item is never unpickled (exit 0). Never does the command run."""
    results, sentinels = tool_runs
    rc, err = results[f"{tool} {what}"]
    assert not os.path.exists(sentinels[f"{tool} {what}"]), "the pickle ran"
    if what in ("rng", "extra state"):
        assert rc == 0, err
        return
    assert rc == 2, err
    assert re.search(
        rf"error: --load \S+: unsafe checkpoint file: \S*/iter_0000004/{_where(what)} holds objects a "
        rf"checkpoint never holds .*may have been tampered with",
        err,
    ), err
    assert "weights_only" not in err and "Traceback" not in err, err
