"""Regression: exact resume when a padded bucket end precedes a parameter (megatron-core 0.16.1).

With the distributed optimizer each bucket's end is padded and the tied embedding gets its own
bucket; megatron-core gathers optimizer state without that padding but locates parameters with
it, so the embedding's saved Adam state was shifted (resume not exact at vocab 8192, hidden 128,
TP2 x PP2 x VPP2 x DP2; the tiny model of test_checkpoint.py happens to need no padding).
``checkpoint.optimizer_state.apply_optimizer_state_offset_fix`` makes both agree. Reference: the
uninterrupted run.
"""

from __future__ import annotations

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

PADDED_VOCAB = 8192
# 8191 ids + EOD, padded to a multiple of 4096 x TP 2: PADDED_VOCAB rows
VALUES = dict(
    vocab_size=PADDED_VOCAB - 1,
    make_vocab_size_divisible_by=PADDED_VOCAB // 2,
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    num_layers=4,
    num_layers_per_virtual_pipeline_stage=1,
    hidden_size=128,
    use_distributed_optimizer=True,
    global_batch_size=8,
    micro_batch_size=2,
    train_iters=5,
    clip_grad=0.3,
)


def _world(rank: int, world_size: int, root: str) -> dict:
    data = MarkovDataset(32, mask_every=1)
    run = build_tiny_run(tiny_values(**VALUES), data)
    assert run.checkpoint_meta.padded_vocab_size == PADDED_VOCAB
    train(run)
    reference = [r["loss"] for r in run.records]
    destroy_parallel_context()
    run = build_tiny_run(tiny_values(**VALUES, save=root, exit_interval=3), data)
    train(run)
    destroy_parallel_context()
    run = build_tiny_run(tiny_values(**VALUES), data)
    loaded = load_checkpoint(run, root)
    train(run)
    destroy_parallel_context()
    return {"reference": reference, "resumed": [r["loss"] for r in run.records], "loaded": loaded}


def test_resume_is_exact_after_a_padded_bucket(tmp_path):
    out = run_ranks(_world, 8, str(tmp_path / "ckpt"), timeout=300)[-1]  # last rank: last stage
    assert out["loaded"] == 3
    assert out["resumed"] == out["reference"][3:], (out["resumed"], out["reference"])
