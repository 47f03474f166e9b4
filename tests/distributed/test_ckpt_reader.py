"""Our load strategy (megatron-core's reader with our checks) against megatron-core's own, on 2 gloo ranks.

A checkpoint with fp32/bf16/int64 tensors, a row-sharded matrix, a large sharded vector and
per-rank objects is saved by megatron-core (``torch_dist``) and loaded per layout through
``VerifyingTorchDistLoadStrategy``, with and without the checksum table (computed here from the
files: one hash per stored item), and through megatron-core's ``TorchDistLoadShardedStrategy``.
All must give the saved values, in the saved layout and resharded (columns instead of rows: every
rank reads part of both ranks' items; the sharded vector whole on every rank), and with checksums
every stored item each rank touches is counted as verified, the object (byte) items too. A rank
that fails to plan its load must make every rank raise, without a hang.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

BIG = 2**20 + 5  # per rank: a sharded item of over 4 MiB


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w_row": torch.randn(8, 6, generator=g),
        "w_rep": torch.randn(4, 6, generator=g),
        "big": torch.randn(2 * BIG, generator=g),
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (7,), generator=g),
    }


def _saved_layout(rank: int, tensors: dict) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rows = tensors["w_row"][4 * rank : 4 * rank + 4]
    return {
        "w_row": ShardedTensor.from_rank_offsets("w_row", rows, (0, rank, 2), replica_id=0),
        "w_rep": ShardedTensor.from_rank_offsets("w_rep", tensors["w_rep"], replica_id=rank),
        "big": ShardedTensor.from_rank_offsets(
            "big", tensors["big"][BIG * rank : BIG * (rank + 1)], (0, rank, 2), replica_id=0
        ),
        "bf16": ShardedTensor.from_rank_offsets("bf16", tensors["bf16"], replica_id=rank),
        "ids": ShardedTensor.from_rank_offsets("ids", tensors["ids"], replica_id=rank),
        "obj": ShardedObject("obj", {"rank": rank}, (2,), (rank,), replica_id=0),
    }


def _resharded_layout(rank: int, tensors: dict) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    cols = tensors["w_row"][:, 3 * rank : 3 * rank + 3].contiguous()
    return {
        "w_row": ShardedTensor.from_rank_offsets("w_row", cols, (1, rank, 2), replica_id=0),
        "w_rep": ShardedTensor.from_rank_offsets("w_rep", tensors["w_rep"], replica_id=rank),
        "big": ShardedTensor.from_rank_offsets("big", tensors["big"], replica_id=rank),
        "bf16": ShardedTensor.from_rank_offsets("bf16", tensors["bf16"], replica_id=rank),
        "ids": ShardedTensor.from_rank_offsets("ids", tensors["ids"], replica_id=rank),
        "obj": ShardedObject("obj", None, (2,), (1 - rank,), replica_id=0),
    }


def _empty_like(state: dict) -> dict:
    for sh in state.values():
        if hasattr(sh, "data") and isinstance(sh.data, torch.Tensor):
            sh.data = torch.full_like(sh.data, -1)
    return state


def _checksum_table(root: str) -> dict:
    """relative path -> str(offset) -> [length, digest] of every stored item, hashed from the files."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ext.checkpoint.checksum import DEFAULT_ALGORITHM, new_hasher

    table = {}
    for info in FileSystemReader(root).read_metadata().storage_data.values():
        with open(os.path.join(root, info.relative_path), "rb") as f:
            f.seek(info.offset)
            h = new_hasher(DEFAULT_ALGORITHM)
            h.update(f.read(info.length))
        table.setdefault(info.relative_path, {})[str(info.offset)] = [info.length, h.intdigest()]
    return table


def _world(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from megatron_ext.checkpoint.checksum import DEFAULT_ALGORITHM
    from megatron_ext.checkpoint.reader import VerifyingTorchDistLoadStrategy
    from megatron_ext.checkpoint.writer import InProcessTorchDistSaveStrategy
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    full = _full()
    dist_checkpointing.save(_saved_layout(rank, full), root, sharded_strategy=InProcessTorchDistSaveStrategy())
    dist.barrier()
    table = _checksum_table(root)
    out = {}
    for name, layout in (("saved", _saved_layout), ("resharded", _resharded_layout)):
        expected = {k: v.data for k, v in layout(rank, full).items() if k != "obj"}
        reference = dist_checkpointing.load(
            _empty_like(layout(rank, full)), root, sharded_strategy=TorchDistLoadShardedStrategy()
        )
        for verify in (False, True):
            strategy = VerifyingTorchDistLoadStrategy(table if verify else None, DEFAULT_ALGORITHM)
            ours = dist_checkpointing.load(_empty_like(layout(rank, full)), root, sharded_strategy=strategy)
            out[name, verify] = {
                "equal_expected": {k: torch.equal(ours[k], v) for k, v in expected.items()},
                "equal_reference": {k: torch.equal(ours[k], reference[k]) for k in expected},
                "obj": (ours["obj"], reference["obj"]),
                "stats": dataclasses.astuple(strategy.stats),
            }

    # rank 1 asks for a key the checkpoint lacks: its planning fails, both ranks must raise
    state = _empty_like(_saved_layout(rank, full))
    if rank == 1:
        state["absent"] = dist_checkpointing.ShardedTensor.from_rank_offsets("absent", torch.zeros(3), replica_id=0)
    try:
        dist_checkpointing.load(state, root, sharded_strategy=VerifyingTorchDistLoadStrategy())
        out["error"] = None
    except BaseException as exc:  # noqa: BLE001 - torch raises CheckpointException (a BaseException)
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# stored items each rank reads: (tensors, of them byte items) per layout
READ_ITEMS = {"saved": (6, 1), "resharded": (8, 1)}


def test_our_strategy_matches_megatron_core_verifies_everything_and_agrees_on_failure(tmp_path):
    results = run_ranks(_world, 2, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for layout in ("saved", "resharded"):
            for verify in (False, True):
                r = out[layout, verify]
                assert all(r["equal_expected"].values()), (rank, layout, verify, r["equal_expected"])
                assert all(r["equal_reference"].values()), (rank, layout, verify, r["equal_reference"])
                items, byte_items = READ_ITEMS[layout]
                assert r["stats"] == ((items, byte_items, 0) if verify else (0, 0, 0)), (rank, layout, r["stats"])
        assert out["saved", True]["obj"] == ({"rank": rank}, {"rank": rank})
        assert out["resharded", True]["obj"] == ({"rank": 1 - rank}, {"rank": 1 - rank})
    for rank in (0, 1):  # torch's collective planning reports rank 1's failure on every rank
        assert "absent" in results[rank]["error"], results[rank]["error"]
