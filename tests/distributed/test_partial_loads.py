"""Partial and fine-tuning loads: --ckpt-step, --finetune, --pretrained-checkpoint, --no-load-rng.

A 2-rank world (PP2, dropout 0.1 so the RNG states matter) saves at iterations 2, 4 and 6. Then:
--ckpt-step 2 resumes iteration 2 exactly; --finetune loads the weights of iteration 4 and nothing
else (iteration 0, Adam moments zero, the LR schedule at its start); --no-load-rng resumes weights
and optimizer but not the dropout streams (the losses then leave the uninterrupted run's, which an
exact resume reproduces). The start-up plan (which directory, which parts) is checked without a
process group in tests/unit/test_startup_checks.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.checkpoint.state import plan_load
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

VALUES = dict(
    num_layers=2,
    train_iters=6,
    pipeline_model_parallel_size=2,
    global_batch_size=4,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    run = build_tiny_run(tiny_values(**VALUES, save=root, save_interval=2), MarkovDataset(32, mask_every=1))
    train(run)
    out["reference"] = [r["loss"] for r in run.records]
    destroy_parallel_context()
    for name, flags in {
        "step 2": dict(ckpt_step=2),
        "finetune": dict(finetune=True, ckpt_step=4),
        "no rng": dict(no_load_rng=True, ckpt_step=4),
        "resume": dict(ckpt_step=4),
    }.items():
        cfg_values = tiny_values(**VALUES, load=root, **flags)
        run = build_tiny_run(cfg_values, MarkovDataset(32, mask_every=1))
        plan, _ = plan_load(run.cfg)
        loaded = load_checkpoint(run, plan.path, step=plan.step, weights_only=plan.weights_only, load_rng=plan.load_rng)
        params = {n: p.detach().clone() for c in run.model for n, p in c.named_parameters()}
        moments = [float(s["exp_avg"].abs().sum()) for s in run.optimizer.optimizer.state.values() if "exp_avg" in s]
        at_load = {
            "loaded": loaded,
            "iteration": run.state.iteration,
            "params": params,
            "moments": sum(moments),
            "lr": run.optimizer.param_groups[0]["lr"],
        }
        train(run)
        out[name] = {**at_load, "losses": [r["loss"] for r in run.records]}
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_world, 2, str(tmp_path_factory.mktemp("partial") / "ckpt"), timeout=300)


def test_ckpt_step_resumes_that_iteration_exactly(results):
    out = results[-1]
    assert out["step 2"]["loaded"] == 2 and out["step 2"]["iteration"] == 2
    assert out["step 2"]["losses"] == out["reference"][2:]


def test_finetune_loads_the_weights_and_nothing_else(results):
    for out in results:
        f, r = out["finetune"], out["resume"]
        assert f["loaded"] == 4 and f["iteration"] == 0 and r["iteration"] == 4
        assert f["params"].keys() == r["params"].keys()
        assert all(torch.equal(f["params"][k], r["params"][k]) for k in f["params"])  # the weights of iteration 4
        assert f["moments"] == 0.0 and r["moments"] > 0.0  # a fresh optimizer
    assert len(results[-1]["finetune"]["losses"]) == 6  # trains iterations 1..6 again


def test_no_load_rng_restores_all_but_the_random_streams(results):
    out = results[-1]
    assert out["resume"]["losses"] == out["reference"][4:]  # exact with the RNG states
    assert out["no rng"]["loaded"] == 4 and out["no rng"]["moments"] == out["resume"]["moments"]
    assert out["no rng"]["losses"] != out["reference"][4:]  # other dropout masks


def _weights_only_loads(rank: int, world_size: int, root: str, extra: dict) -> dict:
    """Train and save; then load the weights only (--finetune, --no-load-optim) and take one step
    at a learning rate too small to move them: the weights after it are the loaded ones."""
    values = dict(num_layers=2, train_iters=4, global_batch_size=4, **extra)
    run = build_tiny_run(tiny_values(**values, save=root), MarkovDataset(32, mask_every=1))
    train(run)
    saved = {n: p.detach().float().clone() for c in run.model for n, p in c.named_parameters()}
    destroy_parallel_context()
    out = {}
    for name, flags in {
        "finetune": dict(finetune=True, train_iters=1),
        "no-load-optim": dict(no_load_optim=True, train_iters=5),
    }.items():
        run = build_tiny_run(
            tiny_values(**{**values, **flags}, load=root, lr=1e-12, min_lr=1e-12), MarkovDataset(32, mask_every=1)
        )
        plan, _ = plan_load(run.cfg)
        load_checkpoint(
            run,
            plan.path,
            load_optimizer=not run.cfg.checkpoint.no_load_optim,
            weights_only=plan.weights_only,
            load_rng=plan.load_rng,
        )
        train(run)
        after = {n: p.detach().float() for c in run.model for n, p in c.named_parameters()}
        out[name] = max((after[n] - saved[n]).abs().max().item() for n in saved)
        destroy_parallel_context()
    return out


@pytest.mark.parametrize(
    "extra",
    [dict(bf16=True), dict(bf16=True, use_distributed_optimizer=True), {}],
    ids=["bf16", "bf16 distributed optimizer", "fp32"],
)
def test_weights_only_loads_keep_the_loaded_weights_after_a_step(tmp_path, extra):
    # with --bf16 the optimizer's fp32 main parameters must be refreshed from the loaded weights, or
    # its first step writes the initial random weights back (the loss jumped back to ~ln(vocab))
    out = run_ranks(_weights_only_loads, 1, str(tmp_path / "ckpt"), extra, timeout=300)[0]
    # the 4 training steps moved the weights by ~1e-2 from their initial values; the step at lr 1e-12 by ~1e-12
    assert set(out) == {"finetune", "no-load-optim"} and max(out.values()) < 1e-9, out
