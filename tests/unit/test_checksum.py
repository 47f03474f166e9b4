"""Checkpoint checksums (pure): streaming digests equal one-shot ones, both algorithms; a file's
digest; an algorithm this machine lacks is reported as unavailable, not guessed."""

from __future__ import annotations

import os
import zlib

import pytest

from megatron_ext.checkpoint import checksum


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3_64"])
def test_streaming_digest_equals_one_shot(algorithm, tmp_path):
    if not checksum.is_available(algorithm):
        pytest.skip(f"{algorithm} needs xxhash")
    data = os.urandom(3 << 20)
    h = checksum.new_hasher(algorithm)
    for i in range(0, len(data), 777_777):
        h.update(memoryview(data)[i : i + 777_777])
    one = checksum.new_hasher(algorithm)
    one.update(data)
    assert h.intdigest() == one.intdigest()
    (tmp_path / "f").write_bytes(data)
    assert checksum.file_digest(str(tmp_path / "f"), algorithm) == one.intdigest()
    flipped = bytearray(data)
    flipped[12345] ^= 1
    other = checksum.new_hasher(algorithm)
    other.update(flipped)
    assert other.intdigest() != one.intdigest()


def test_crc32_is_zlib_and_unknown_algorithms_are_refused():
    h = checksum.new_hasher("crc32")
    h.update(b"megatron")
    assert h.intdigest() == zlib.crc32(b"megatron")
    assert not checksum.is_available("sha3_1024")
    with pytest.raises(ValueError, match="not available"):
        checksum.new_hasher("sha3_1024")
