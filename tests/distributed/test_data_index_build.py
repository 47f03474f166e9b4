"""Building a packing index in a multi-rank run: rank 0 builds while the others wait on a gloo
group of their own (a large corpus may outlast --distributed-timeout-minutes); a failure on rank 0
(an unwritable cache directory) fails every rank, named, instead of leaving them in a barrier; a
rank that cannot see rank 0's file (a node-local --data-cache-path) builds the same index itself."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed


def _build(rank: int, world_size: int, prefix: str, cache_dirs: list[str]) -> dict:
    from megatron_ext.config import ConfigError
    from megatron_ext.data.packed_dataset import build_packed_datasets

    try:
        train, _, _ = build_packed_datasets(prefix, [1.0], 64, "best_fit", 0, [1, 1, 1], cache_dirs[rank])
    except ConfigError as err:
        return {"error": str(err)}
    return {"bins": train.index.bin_offsets.tolist(), "docs": train.index.piece_doc.tolist()}


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("data")
    builder = IndexedDatasetBuilder(str(root / "d_text_document.bin"), dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.integers(1, 1000, int(rng.integers(5, 90)))
        builder.add_document(torch.from_numpy(tokens.astype(np.int64)), [len(tokens)])
    builder.finalize(str(root / "d_text_document.idx"))
    return str(root / "d_text_document")


def test_a_failed_build_on_rank_0_fails_every_rank(prefix, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    out = run_ranks(_build, 2, prefix, [str(blocked / "cache")] * 2, timeout=120)
    assert "--data-cache-path" in out[0].get("error", ""), out[0]
    assert "rank 0 failed to build" in out[1].get("error", ""), out[1]


def test_a_rank_that_cannot_see_the_index_builds_the_same_one(prefix, tmp_path):
    out = run_ranks(_build, 2, prefix, [str(tmp_path / "node0"), str(tmp_path / "node1")], timeout=120)
    assert "error" not in out[0] and out[0] == out[1] and len(set(out[0]["docs"])) == 50, out
    assert (tmp_path / "node1").exists() and list((tmp_path / "node1").iterdir())
