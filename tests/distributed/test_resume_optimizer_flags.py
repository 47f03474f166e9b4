"""A resumed run's optimizer settings are its flags' (--override-opt-param-scheduler), the
checkpoint's (--use-checkpoint-opt-param-scheduler), or an error naming the flag (neither).

One 4-rank world (PP2 x DP2), with the fp32 optimizer and with the distributed optimizer (whose
parameter groups live in its inner optimizer over the main-parameter shards). A run with a cosine
schedule saves at iteration 3 of 6 and goes on (the uninterrupted reference). Resumed at 3:
- with the same flags and --override-opt-param-scheduler, iterations 4-6 are bit-identical to the
  reference;
- with a new --lr, --min-lr, --adam-beta1/2, --adam-eps and --override-opt-param-scheduler, the
  update of every resumed step, on every rank and in every parameter group, runs the learning rate a
  fresh scheduler built from the new flags gives at that step, and the new betas and eps (recorded in
  a step pre-hook of the torch optimizer, i.e. what the update used); the log line's learning rate
  (group 0) is the fresh scheduler's too;
- with the new flags and --use-checkpoint-opt-param-scheduler, the checkpoint's schedule, betas and
  eps run (Megatron-LM's meaning of the flag);
- with new Adam options and neither flag, the load is refused naming each flag.
"""

from __future__ import annotations

import os
import types

import pytest

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.optim import torch_adam_optimizers
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train
from megatron_ext.training.optimizer import build_scheduler

pytestmark = pytest.mark.distributed

K, ITERS, GBS = 3, 6, 8
SAVED = dict(
    num_layers=2,
    pipeline_model_parallel_size=2,
    global_batch_size=GBS,
    micro_batch_size=2,
    train_iters=ITERS,
    lr=1e-3,
    min_lr=1e-4,
    lr_decay_style="cosine",
    lr_warmup_iters=1,
    lr_decay_iters=ITERS,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_eps=1e-8,
)
NEW = dict(SAVED, lr=4e-3, min_lr=2e-4, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)


def _build(values: dict, **extra):
    return build_tiny_run(tiny_values(**values, **extra), MarkovDataset(32, mask_every=1))


def _record_updates(run) -> list[list[tuple]]:
    """Per optimizer step, (lr, betas, eps) of every parameter group of every torch optimizer on
    this rank, as the update sees them (a step pre-hook)."""
    steps: list[list[tuple]] = []

    def hook(optimizer, args, kwargs):
        steps.append([(g["lr"], tuple(g["betas"]), g["eps"]) for g in optimizer.param_groups])

    for inner in torch_adam_optimizers(run.optimizer):
        inner.register_step_pre_hook(hook)
    return steps


def expected_updates(values: dict, num_groups: int, first: int, last: int) -> list[list[tuple]]:
    """What the flags in ``values`` describe for the updates of iterations first..last: a fresh
    scheduler built from them (over groups without settings of their own, so its fields decide),
    at the samples consumed before each update."""
    cfg = build_job_config(tiny_values(**values))
    stub = types.SimpleNamespace(param_groups=[{} for _ in range(num_groups)])
    scheduler = build_scheduler(cfg, stub, GBS)
    scheduler.step(increment=(first - 1) * GBS)
    out = []
    for _ in range(first, last + 1):
        betas = (cfg.training.adam_beta1, cfg.training.adam_beta2)
        out.append([(g["lr"], betas, cfg.training.adam_eps) for g in stub.param_groups])
        scheduler.step(increment=GBS)
    return out


def _resume(root: str, values: dict, **flags) -> dict:
    run = _build(values, **flags)
    logs: list[str] = []
    run.log = logs.append
    assert load_checkpoint(run, root, step=K) == K
    updates = _record_updates(run)
    train(run)
    out = {
        "updates": updates,
        "records": run.records,
        "num_groups": len(run.optimizer.param_groups),
        "rank": run.ctx.rank,
        "warnings": [line for line in logs if line.startswith("WARNING")],
    }
    destroy_parallel_context()
    return out


def _refused(root: str, values: dict) -> str:
    run = _build(values)
    try:
        load_checkpoint(run, root, step=K)
        message = ""
    except ConfigError as err:
        message = str(err)
    destroy_parallel_context()
    return message


def _one_optimizer(root: str, distributed: bool) -> dict:
    opt = dict(use_distributed_optimizer=distributed)
    run = _build(SAVED, save=root, save_interval=K, **opt)
    train(run)
    out = {"reference": run.records}
    destroy_parallel_context()
    out["same flags"] = _resume(root, SAVED, override_opt_param_scheduler=True, **opt)
    out["override"] = _resume(root, NEW, override_opt_param_scheduler=True, **opt)
    out["checkpoint's"] = _resume(root, NEW, use_checkpoint_opt_param_scheduler=True, **opt)
    out["refused"] = _refused(root, dict(SAVED, adam_beta1=0.8, adam_eps=1e-6, **opt))
    return out


def _world(rank: int, world_size: int, root: str) -> dict:
    return {
        name: _one_optimizer(os.path.join(root, name), distributed)
        for name, distributed in (("fp32", False), ("distributed", True))
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_world, 4, str(tmp_path_factory.mktemp("optflags")), timeout=600)


OPTIMIZERS = ["fp32", "distributed"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_with_the_same_flags_and_override_is_bit_identical(results, name):
    last = results[-1][name]  # the last rank is on the last stage: it records the losses
    assert [r["iteration"] for r in last["same flags"]["records"]] == list(range(K + 1, ITERS + 1))
    assert last["same flags"]["records"] == last["reference"][K:]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_override_runs_the_new_flags_from_the_first_resumed_step(results, name):
    for per_rank in results:
        got = per_rank[name]["override"]
        want = expected_updates(NEW, got["num_groups"], K + 1, ITERS)
        assert got["num_groups"] >= 2 and len(got["updates"]) == ITERS - K
        assert got["updates"] == want, (got["rank"], got["updates"], want)
        # and not the checkpoint's schedule (so this test can tell them apart)
        assert want != expected_updates(SAVED, got["num_groups"], K + 1, ITERS)
    last = results[-1][name]["override"]
    logged = [r["lr"] for r in last["records"]]
    after_each = expected_updates(NEW, 1, K + 2, ITERS + 1)  # group 0's lr after each update
    assert logged == [step[0][0] for step in after_each]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_use_checkpoint_keeps_the_checkpoints_schedule_and_adam_options(results, name):
    for per_rank in results:
        got = per_rank[name]["checkpoint's"]
        assert got["updates"] == expected_updates(SAVED, got["num_groups"], K + 1, ITERS)
    (warning,) = results[-1][name]["checkpoint's"]["warnings"]  # the logging rank says which values run
    assert warning == (
        "WARNING: --use-checkpoint-opt-param-scheduler keeps the checkpoint's optimizer settings: "
        "--adam-beta1: the checkpoint's Adam beta1 is 0.9, this run's flags give 0.8; --adam-beta2: "
        "the checkpoint's Adam beta2 is 0.999, this run's flags give 0.95; --adam-eps: the "
        "checkpoint's Adam epsilon is 1e-08, this run's flags give 1e-06"
    ), warning
    assert results[-1][name]["override"]["warnings"] == []


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_changed_adam_options_without_a_flag_are_refused_naming_them(results, name):
    message = results[0][name]["refused"]
    assert "--adam-beta1: the checkpoint's Adam beta1 is 0.9, this run's flags give 0.8" in message, message
    assert "--adam-eps: the checkpoint's Adam epsilon is 1e-08, this run's flags give 1e-06" in message, message
    assert "--adam-beta2" not in message and "--lr:" not in message
    assert "--override-opt-param-scheduler" in message and "--use-checkpoint-opt-param-scheduler" in message
    assert all(r[name]["refused"] == message for r in results)
