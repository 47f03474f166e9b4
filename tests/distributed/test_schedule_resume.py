"""A run counted in samples with a WSD schedule trains as its iteration-counted twin and resumes
exactly (the WSD phase, which megatron-core does not save, is saved and restored by us).

2 ranks (DP2): --train-samples 48 (6 steps of 8) with --lr-warmup-samples 8, --lr-decay-style WSD
--lr-wsd-decay-samples 16, saving at step 3; its twin --train-iters 6 --lr-warmup-iters 1
--lr-wsd-decay-iters 2. Both log the same learning rates and losses; resuming the sample-counted
run at step 3 reproduces steps 4-6 exactly.
"""

from __future__ import annotations

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

COMMON = dict(num_layers=2, global_batch_size=8, micro_batch_size=2, lr=3e-3, min_lr=3e-4, lr_decay_style="WSD")
BY_SAMPLES = dict(COMMON, train_iters=None, train_samples=48, lr_warmup_samples=8, lr_wsd_decay_samples=16)
BY_ITERS = dict(COMMON, train_iters=6, lr_warmup_iters=1, lr_wsd_decay_iters=2)


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, values in (("samples", dict(BY_SAMPLES, save=root, save_interval=3)), ("iters", BY_ITERS)):
        run = build_tiny_run(tiny_values(**values), MarkovDataset(32, mask_every=1))
        train(run)
        out[name] = [(r["iteration"], r["lr"], r["loss"]) for r in run.records]
        destroy_parallel_context()
    run = build_tiny_run(tiny_values(**BY_SAMPLES, load=root, ckpt_step=3), MarkovDataset(32, mask_every=1))
    load_checkpoint(run, root, step=3)
    train(run)
    out["resumed"] = [(r["iteration"], r["lr"], r["loss"]) for r in run.records]
    destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_world, 2, str(tmp_path_factory.mktemp("schedule") / "ckpt"), timeout=300)[-1]


def test_sample_counted_run_trains_as_its_iteration_twin(results):
    assert [r[0] for r in results["samples"]] == list(range(1, 7))
    assert results["samples"] == results["iters"]
    lrs = [r[1] for r in results["samples"]]
    assert lrs[0] == pytest.approx(3e-3) and lrs[3] == pytest.approx(3e-3)  # warm-up 1 step, stable to step 4
    assert lrs[4] < lrs[3] and lrs[5] == pytest.approx(3e-4)  # WSD decay over the last 2 steps to --min-lr


def test_resume_of_a_sample_counted_wsd_run_is_exact(results):
    assert results["resumed"] == results["samples"][3:]
