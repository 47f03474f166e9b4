"""Uneven pipeline splits train the model one process trains, and load checkpoints of even ones.

4 forked ranks, fp32: PP2 x DP2 with 1 and 3 layers; PP4 counting the embedding and the loss as
layers (6 layers: 1, 2, 2, 1); PP4 x VPP2 counting both (the first and the last virtual stage hold
no decoder layer at all); PP4 x VPP2 with 2, 2, 2 and 4 layers. Each: the step-1 gradient of every
parameter and 6 losses equal one process (layout-parity tolerance). Then a checkpoint saved under
an even PP2 x DP2 split at iteration 3 loads under the uneven 1/3 split and continues the same
losses.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import (
    MarkovDataset,
    build_tiny_run,
    fetch_step_microbatches,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train
from megatron_ext.training.step import run_forward_backward

pytestmark = pytest.mark.distributed

TOL, ITERS = 1e-5, 6
BASE = dict(train_iters=ITERS, clip_grad=0.3, global_batch_size=8, micro_batch_size=2)
LAYOUTS = {
    "PP2 1|3": dict(num_layers=4, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1),
    "PP4 embedding+loss": dict(
        num_layers=6,
        pipeline_model_parallel_size=4,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ),
    "PP4xVPP2 embedding+loss": dict(
        num_layers=6,
        pipeline_model_parallel_size=4,
        num_virtual_stages_per_pipeline_rank=2,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ),
    "PP4xVPP2 2|2|2|4": dict(
        num_layers=10,
        pipeline_model_parallel_size=4,
        num_virtual_stages_per_pipeline_rank=2,
        decoder_first_pipeline_num_layers=2,
        decoder_last_pipeline_num_layers=4,
    ),
}


def _run(values: dict) -> dict:
    run = build_tiny_run(tiny_values(**BASE, **values), MarkovDataset(32, mask_every=1))
    indices = get_microbatch_indices(0, run.global_batch_size, 2, run.ctx.dp_rank, run.ctx.dp_size)
    run_forward_backward(run.model, fetch_step_microbatches(run.train_ds, indices), 32)
    grads = gather_full_grads(run)
    layers = [len(getattr(getattr(c.module, "decoder", None), "layers", [])) for c in run.model]
    train(run)
    out = {
        "grads": grads if run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0 else {},
        "losses": [r["loss"] for r in run.records],
        "layers": layers,
    }
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {name: _run(values) for name, values in LAYOUTS.items()}
    even = dict(num_layers=4, pipeline_model_parallel_size=2)
    run = build_tiny_run(tiny_values(**BASE, **even, save=root, exit_interval=3), MarkovDataset(32, mask_every=1))
    train(run)
    destroy_parallel_context()
    run = build_tiny_run(tiny_values(**BASE, **LAYOUTS["PP2 1|3"]), MarkovDataset(32, mask_every=1))
    out["loaded"] = load_checkpoint(run, root)
    train(run)
    out["resumed"] = [r["loss"] for r in run.records]
    destroy_parallel_context()
    return out


def _reference(rank: int, world_size: int) -> dict:
    return {n: _run(dict(num_layers=n)) for n in (4, 6, 10)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    per_rank = run_ranks(_world, 4, str(tmp_path_factory.mktemp("uneven") / "ckpt"), timeout=600)
    reference = run_ranks(_reference, 1)[0]
    return per_rank, reference


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_split_trains_the_single_process_model(results, name):
    per_rank, reference = results
    ref = reference[LAYOUTS[name]["num_layers"]]
    grads = {}
    for r in per_rank:
        grads.update(r[name]["grads"])
    assert set(grads) == set(ref["grads"])
    worst = max(grads, key=lambda k: _rel(grads[k], ref["grads"][k]))
    assert _rel(grads[worst], ref["grads"][worst]) <= TOL, worst
    losses, ref_losses = torch.tensor(per_rank[-1][name]["losses"]), torch.tensor(ref["losses"])
    assert losses.shape == (ITERS,) and ((losses - ref_losses).abs() / ref_losses).max() <= TOL


def test_splits_are_the_ones_asked_for(results):
    per_rank, _ = results
    assert [r["PP2 1|3"]["layers"] for r in per_rank] == [[1], [1], [3], [3]]  # PP2 x DP2: ranks 0,1 first stage
    assert [r["PP4 embedding+loss"]["layers"] for r in per_rank] == [[1], [2], [2], [1]]
    vpp = [r["PP4xVPP2 embedding+loss"]["layers"] for r in per_rank]
    assert vpp[0][0] == 0 and vpp[-1][-1] == 0 and sum(map(sum, vpp)) == 6  # stages without a layer


def test_even_checkpoint_loads_into_an_uneven_split(results):
    per_rank, reference = results
    assert per_rank[-1]["loaded"] == 3
    got, ref = torch.tensor(per_rank[-1]["resumed"]), torch.tensor(reference[4]["losses"][3:])
    assert got.shape == ref.shape and ((got - ref).abs() / ref).max() <= TOL


def _losses(rank: int, world_size: int, values: dict) -> list[float]:
    run = build_tiny_run(tiny_values(**{**BASE, **values, "train_iters": 3}), MarkovDataset(32, mask_every=1))
    train(run)
    destroy_parallel_context()
    return [r["loss"] for r in run.records]


def test_one_virtual_stage_per_rank_trains_as_plain_1f1b():
    # a config's --num-layers-per-virtual-pipeline-stage that gives 1 virtual stage at this PP size
    # (the README's reshard of the default job to PP4) used to fail in megatron-core's layer build
    plain = run_ranks(_losses, 2, dict(num_layers=2, pipeline_model_parallel_size=2), timeout=300)
    one = run_ranks(
        _losses,
        2,
        dict(num_layers=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
        timeout=300,
    )
    assert one == plain and len(plain[-1]) == 3
