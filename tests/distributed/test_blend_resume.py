"""A packed run over a weighted blend resumes mid-epoch exactly: 2 ranks (DP2), 6 steps saving at
step 3; the run resumed from step 3 logs the same losses for steps 4-6 and reads the same samples
as the uninterrupted run (which is far from the end of any corpus' epoch), also when worker
processes (--num-workers 1) read them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.run import build_training_run
from megatron_ext.testing import VOCAB, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

EOD = VOCAB - 1


def _corpora(root) -> list[str]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    out = []
    for k, (lo, hi) in enumerate([(0, 60), (60, 120)]):
        prefix = str(root / f"part{k}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        rng = np.random.default_rng(k)
        for _ in range(200):
            doc = np.append(rng.integers(lo, hi, rng.integers(5, 60)), EOD).astype(np.uint16)
            builder.add_document(doc, [len(doc)])
        builder.finalize(prefix + ".idx")
        out.append(prefix)
    return out


def _world(rank: int, world_size: int, root: str, prefixes: list[str]) -> dict:
    common = tiny_values(
        mock_data=False,
        data_path=["0.3", prefixes[0], "0.7", prefixes[1]],
        packed_sequences=True,
        seq_length=64,
        num_layers=2,
        train_iters=6,
        global_batch_size=8,
        micro_batch_size=2,
        split="100,0,0",
        data_cache_path=root + "/cache",
    )

    def build(**extra):
        return build_training_run(
            build_job_config(dict(common, **extra)), device=torch.device("cpu"), log=lambda s: None, metrics=False
        )

    def seen(run, steps) -> list[list[int]]:  # the token sums of this rank's samples, step by step
        ctx = run.ctx
        return [
            [
                int(run.train_ds[i]["tokens"].sum())
                for mb in get_microbatch_indices(s * 8, 8, 2, ctx.dp_rank, 2)
                for i in mb
            ]
            for s in steps
        ]

    out = {}
    run = build(save=root + "/ckpt", save_interval=3)
    train(run)
    out["full"] = [(r["iteration"], r["loss"]) for r in run.records]
    out["full_samples"] = seen(run, range(3, 6))
    out["bins"] = [d.index.num_bins for d in run.train_ds.datasets]
    destroy_parallel_context()
    run = build(load=root + "/ckpt")
    load_checkpoint(run, root + "/ckpt", step=3)
    train(run)
    out["resumed"] = [(r["iteration"], r["loss"]) for r in run.records]
    out["resumed_samples"] = seen(run, range(3, 6))
    destroy_parallel_context()
    run = build(load=root + "/ckpt", num_workers=1)  # worker processes start at the resumed sample
    load_checkpoint(run, root + "/ckpt", step=3)
    train(run)
    out["resumed_workers"] = [(r["iteration"], r["loss"]) for r in run.records]
    destroy_parallel_context()
    return out


def test_packed_blend_resumes_mid_epoch_exactly(tmp_path):
    prefixes = _corpora(tmp_path)
    results = run_ranks(_world, 2, str(tmp_path), prefixes, timeout=300)
    for r in results:
        assert r["resumed_samples"] == r["full_samples"]
    r = results[-1]
    assert [i for i, _ in r["full"]] == list(range(1, 7))
    assert r["resumed"] == r["full"][3:] == r["resumed_workers"]
    assert 6 * 8 < min(r["bins"])  # mid-epoch: no corpus was read to its end
