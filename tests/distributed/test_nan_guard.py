"""The non-finite guard: a NaN in one micro-batch of one DP rank skips the update on every rank.

TP2 x PP2 x VPP2 x DP2 (8 forked ranks), with and without the distributed optimizer (megatron-core's
found-inf skip with a constant scaler, and our check of the fp32 optimizer's global grad norm):
a forward hook turns the embedding output of one micro-batch on DP rank 1 into NaN at iteration 3.
Every rank must skip that update (weights and optimizer state bit-identical to before), count one
nan iteration, and train on. A run whose every step from iteration 2 on is NaN stops with
TrainingDiverged at --max-nan-iterations, naming where it appeared, having saved nothing after
iteration 1. With --no-check-for-nan-in-loss-and-grad the NaN reaches the weights (the control).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.checkpoint.directory import list_complete_checkpoints
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import TrainingDiverged, train

pytestmark = pytest.mark.distributed

LAYOUT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
BASE = dict(global_batch_size=8, micro_batch_size=2, **LAYOUT)


def _embedding(run):
    module = run.model[0].module
    while not hasattr(module, "embedding") and hasattr(module, "module"):
        module = module.module
    return getattr(module, "embedding", None)


def inject_nan(run, dp_rank: int, iterations: set[int], microbatch: int = 1) -> None:
    """NaN embedding output for one micro-batch of ``dp_rank`` in the given iterations."""
    embedding = _embedding(run)
    if embedding is None or run.ctx.dp_rank != dp_rank:
        return
    seen = {"step": None, "index": -1}

    def hook(module, inputs, output):
        step = run.state.iteration + 1  # the step in progress
        if seen["step"] != step:
            seen.update(step=step, index=-1)
        seen["index"] += 1  # the micro-batch of this step, in schedule order (one chunk here)
        if step in iterations and seen["index"] == microbatch and module.training:
            return output * float("nan")
        return output

    embedding.register_forward_hook(hook)


def _snapshot(run) -> dict:
    out = {f"p{i}.{n}": p.detach().clone() for i, c in enumerate(run.model) for n, p in c.named_parameters()}
    inner = run.optimizer.optimizer
    for k, state in enumerate(inner.state.values()):
        for name, value in state.items():
            if torch.is_tensor(value):
                out[f"opt{k}.{name}"] = value.clone()
    for g, group in enumerate(inner.param_groups):
        for k, param in enumerate(group["params"]):
            out[f"main{g}.{k}"] = param.detach().clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _skip_one(distributed_optimizer: bool, check: bool = True) -> dict:
    values = tiny_values(
        **BASE, train_iters=2, use_distributed_optimizer=distributed_optimizer, check_for_nan_in_loss_and_grad=check
    )
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    inject_nan(run, dp_rank=1, iterations={3})
    train(run)
    before = _snapshot(run)
    run.cfg.training.train_iters = 3
    train(run)
    after_nan = _snapshot(run)
    run.cfg.training.train_iters = 5
    train(run)
    out = {
        "unchanged": _same(before, after_nan),
        "nan_iterations": run.state.nan_iterations,
        "skipped": run.state.skipped_iterations,
        "losses": [r["loss"] for r in run.records],
        "finite_after": all(bool(torch.isfinite(v).all()) for v in _snapshot(run).values()),
    }
    destroy_parallel_context()
    return out


def _diverge(root: str) -> dict:
    values = tiny_values(**BASE, train_iters=10, save=root, save_interval=1, max_nan_iterations=3)
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    inject_nan(run, dp_rank=1, iterations=set(range(2, 11)))
    try:
        train(run)
        message = ""
    except TrainingDiverged as err:
        message = str(err)
    out = {"message": message, "iteration": run.state.iteration, "nan_iterations": run.state.nan_iterations}
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int, root: str) -> dict:
    return {
        "distributed optimizer": _skip_one(True),
        "fp32 optimizer": _skip_one(False),
        "unguarded": _skip_one(False, check=False),
        "diverge": _diverge(root),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nan"))
    return root, run_ranks(_world, 8, root, timeout=300)


@pytest.mark.parametrize("kind", ["distributed optimizer", "fp32 optimizer"])
def test_nan_in_one_microbatch_of_one_rank_skips_the_update_everywhere(results, kind):
    per_rank = [r[kind] for r in results[1]]
    assert all(r["unchanged"] for r in per_rank), "an update was applied from a non-finite step"
    assert all(r["nan_iterations"] == 1 and r["skipped"] == 0 for r in per_rank)
    assert all(r["finite_after"] for r in per_rank)
    losses = per_rank[-1]["losses"]  # last stage
    assert len(losses) == 5 and torch.isnan(torch.tensor(losses[2])) and torch.isfinite(torch.tensor(losses[3:])).all()


def test_without_the_guard_the_nan_reaches_the_weights(results):
    assert not any(r["unguarded"]["finite_after"] for r in results[1])


def test_diverging_run_stops_naming_where_and_saves_nothing_after(results):
    root, per_rank = results
    d = per_rank[0]["diverge"]
    assert d["iteration"] == 4 and d["nan_iterations"] == 3
    assert "3 consecutive iterations up to 4" in d["message"] and "first at iteration 2" in d["message"]
    assert "data-parallel rank 1" in d["message"] and "pipeline stage 1" in d["message"]
    assert "data-parallel rank 0" not in d["message"]
    assert all(r["diverge"]["message"] == d["message"] for r in per_rank)
    assert [it for it, _ in list_complete_checkpoints(root)] == [1]
    assert os.listdir(root)
