"""The direct checkpoint reader's pure parts, against torch's own zip reader and plain file reads.

``_locate_fast`` parses the zip that ``torch.save`` writes from an item's two edges; the reference
is ``_locate`` (torch's ``PyTorchFileReader``). ``_read_all`` must put the same bytes in every
destination as one plain read of the file, with or without threads.
"""

from __future__ import annotations

import io
import struct

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _create_file_view

from megatron_ext.checkpoint import reader as cr

PREFIX, SUFFIX = b"z" * 123, b"q" * 77  # other items around this one in the rank's file


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _item(tmp_path, data: bytes):
    path = tmp_path / "item.distcp"
    path.write_bytes(PREFIX + data + SUFFIX)
    f = open(path, "rb")
    return f, cr._ItemFile(f.fileno(), len(PREFIX), len(data))


TENSORS = {
    "small fp32": lambda: torch.randn(10),
    "one edge": lambda: torch.randn(1500),
    "large fp32": lambda: torch.randn(300_000),
    "transposed view": lambda: torch.randn(5, 7, 300).transpose(0, 2),
    "offset view": lambda: torch.arange(100)[10:20],
    "scalar": lambda: torch.tensor(3.0),
    "empty": lambda: torch.empty(0, 4),
    "bf16": lambda: torch.ones(2, 3, dtype=torch.bfloat16),
    "bool": lambda: torch.zeros(5000, dtype=torch.bool),
    "fp16 large": lambda: torch.randn(2**20).half(),
}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_fast_locate_matches_torch_zip_reader(tmp_path, name):
    tensor = TENSORS[name]()
    data = _saved(tensor)
    f, item = _item(tmp_path, data)
    with f:
        fast = cr._locate_fast(item)
        reference = cr._locate(_create_file_view(f, len(PREFIX), len(data)))
    assert fast == reference
    stored, data_offset = fast
    assert stored.dtype == tensor.dtype and stored.size == tuple(tensor.shape)
    # the located bytes are the tensor's storage
    nbytes = stored.storage_numel * stored.dtype.itemsize
    storage = tensor.untyped_storage()
    assert data[data_offset:data_offset + nbytes] == bytes(storage)


def test_zip_with_a_comment_goes_to_torch_reader(tmp_path):
    data = bytearray(_saved(torch.randn(64)))
    comment = b"not written by torch.save"
    struct.pack_into("<H", data, len(data) - 2, len(comment))
    data = bytes(data) + comment
    f, item = _item(tmp_path, data)
    with f:
        with pytest.raises(cr._ZipLayout):
            cr._locate_fast(item)
        stored, _ = cr._locate(_create_file_view(f, len(PREFIX), len(data)))  # still readable
    assert stored.size == (64,)


@pytest.mark.parametrize("obj", [{"a": torch.ones(2)}, [1, 2], torch.nn.Parameter(torch.ones(3))])
def test_anything_but_a_plain_tensor_is_refused(tmp_path, obj):
    f, item = _item(tmp_path, _saved(obj))
    with f, pytest.raises(cr._Unsupported):
        cr._locate_fast(item)


def test_truncated_item_is_refused(tmp_path):
    data = _saved(torch.randn(3000))
    f, item = _item(tmp_path, data[:-30])
    with f, pytest.raises(cr._Unsupported):
        cr._locate_fast(item)


@pytest.mark.parametrize("threads", [1, 2])
def test_read_all_fills_destinations_like_a_plain_read(tmp_path, threads, monkeypatch):
    monkeypatch.setattr(cr, "_PARALLEL_MIN", 1)  # split even these few MiB across the threads
    monkeypatch.setattr(cr, "_PIECE_MIN", 4096)
    tensors = [torch.randn(n) for n in (3, 700, 1_000_003, 2**20)]
    path = tmp_path / "rank.distcp"
    blobs, reads = [], []
    with open(path, "wb") as out:
        for t in tensors:
            data = _saved(t)
            blobs.append((out.tell(), data))
            out.write(data)
    with open(path, "rb") as f:
        targets = []
        for t, (base, data) in zip(tensors, blobs):
            item = cr._ItemFile(f.fileno(), base, len(data))
            stored, data_offset = cr._locate_fast(item)
            half = t.numel() // 2  # read the second half, as a shard of it would be
            target = torch.full((t.numel() - half,), float("nan"))
            buffer = memoryview(target.numpy()).cast("B")
            reads.append(cr._DirectRead(None, target, item, buffer, data_offset + half * 4))
            targets.append((target, t[half:]))
        cr._read_all(reads, threads)
    for target, expected in targets:
        assert torch.equal(target, expected)


@pytest.mark.parametrize("offsets,lengths,expected", [
    ((0, 0), (4, 6), (0, (4, 6))),  # the whole tensor
    ((1, 0), (2, 6), (6, (2, 6))),  # whole rows: contiguous
    ((0, 2), (4, 3), None),  # a column block: strided
    ((2, 2), (1, 3), (14, (1, 3))),  # part of one row
])
def test_contiguous_run(offsets, lengths, expected):
    stored = cr._StoredTensor(torch.float32, 24, 0, (4, 6), (6, 1))
    assert cr._contiguous_run(stored, offsets, lengths) == expected
