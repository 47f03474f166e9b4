"""The direct-read load strategy against megatron-core's own, on 2 gloo ranks.

A checkpoint with fp32/bf16/int64 tensors, a row-sharded matrix, a large sharded vector and
per-rank objects is saved by megatron-core (``torch_dist``) and loaded twice per layout: through
``DirectReadTorchDistLoadStrategy`` and through megatron-core's ``TorchDistLoadShardedStrategy``
(torch's reader, torch's collective planning). Both must give the saved values, in the saved layout
and resharded (columns instead of rows: strided regions, which must take torch's path; the sharded
vector whole on every rank: read from both ranks' files, with threads). A rank that fails to plan
its load must make every rank raise, without a hang.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

BIG = 2**20 + 5  # per rank: over ckpt_reader._PARALLEL_MIN bytes, so the threaded path runs


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

    rows = tensors["w_row"][4 * rank:4 * rank + 4]
    return {
        "w_row": ShardedTensor.from_rank_offsets("w_row", rows, (0, rank, 2), replica_id=0),
        "w_rep": ShardedTensor.from_rank_offsets("w_rep", tensors["w_rep"], replica_id=rank),
        "big": ShardedTensor.from_rank_offsets("big", tensors["big"][BIG * rank:BIG * (rank + 1)],
                                               (0, rank, 2), replica_id=0),
        "bf16": ShardedTensor.from_rank_offsets("bf16", tensors["bf16"], replica_id=rank),
        "ids": ShardedTensor.from_rank_offsets("ids", tensors["ids"], replica_id=rank),
        "obj": ShardedObject("obj", {"rank": rank}, (2,), (rank,), replica_id=0),
    }


def _resharded_layout(rank: int, tensors: dict) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    cols = tensors["w_row"][:, 3 * rank:3 * rank + 3].contiguous()
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


def _world(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ext.checkpoint import reader as ckpt_reader
    from megatron_ext.checkpoint.writer import InProcessTorchDistSaveStrategy
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    full = _full()
    dist_checkpointing.save(_saved_layout(rank, full), root, sharded_strategy=InProcessTorchDistSaveStrategy())

    via_torch_reader: list[str] = []  # keys of the items our reader handed to torch's
    original_read_data = FileSystemReader.read_data

    def spy(self, plan, planner):
        via_torch_reader.extend(item.dest_index.fqn for item in plan.items)
        return original_read_data(self, plan, planner)

    FileSystemReader.read_data = spy
    pools = []
    original_pool = ckpt_reader._pool
    ckpt_reader._pool = lambda threads: pools.append(threads) or original_pool(threads)
    out = {}
    for name, layout in (("saved", _saved_layout), ("resharded", _resharded_layout)):
        via_torch_reader.clear()
        ours = dist_checkpointing.load(_empty_like(layout(rank, full)), root,
                                       sharded_strategy=ckpt_reader.DirectReadTorchDistLoadStrategy(2))
        ours_fallback = sorted(set(via_torch_reader))
        reference = dist_checkpointing.load(_empty_like(layout(rank, full)), root,
                                            sharded_strategy=TorchDistLoadShardedStrategy())
        expected = {k: v.data for k, v in layout(rank, full).items() if k != "obj"}
        out[name] = {
            "equal_expected": {k: torch.equal(ours[k], v) for k, v in expected.items()},
            "equal_reference": {k: torch.equal(ours[k], reference[k]) for k in expected},
            "obj": (ours["obj"], reference["obj"]),
            "fallback": ours_fallback,
        }
    out["pools"] = pools

    # rank 1 asks for a key the checkpoint lacks: its planning fails, both ranks must raise
    state = _empty_like(_saved_layout(rank, full))
    if rank == 1:
        state["absent"] = dist_checkpointing.ShardedTensor.from_rank_offsets("absent", torch.zeros(3), replica_id=0)
    try:
        dist_checkpointing.load(state, root, sharded_strategy=ckpt_reader.DirectReadTorchDistLoadStrategy())
        out["error"] = None
    except BaseException as exc:  # noqa: BLE001 - torch raises CheckpointException (a BaseException)
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def test_direct_reader_matches_megatron_core_and_agrees_on_failure(tmp_path):
    results = run_ranks(_world, 2, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for layout in ("saved", "resharded"):
            r = out[layout]
            assert all(r["equal_expected"].values()), (rank, layout, r["equal_expected"])
            assert all(r["equal_reference"].values()), (rank, layout, r["equal_reference"])
        assert out["saved"]["obj"] == ({"rank": rank}, {"rank": rank})
        assert out["resharded"]["obj"] == ({"rank": 1 - rank}, {"rank": 1 - rank})
        # plain contiguous tensors were read directly; objects and strided regions went to torch
        assert out["saved"]["fallback"] == ["obj/shard_0_2" if rank == 0 else "obj/shard_1_2"]
        assert [k for k in out["resharded"]["fallback"] if not k.startswith("obj")] == ["w_row"]
        assert out["pools"], "the large vector should have been read with threads"
    assert "absent" in results[1]["error"], results[1]["error"]
    assert "failed on another rank" in results[0]["error"], results[0]["error"]
