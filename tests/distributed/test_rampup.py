"""Batch-size ramp-up (--rampup-batch-size) on every layout trains as one process does, step by step
with megatron-core's calculator, and resumes mid-ramp exactly.

The run: --train-samples 60, --global-batch-size 8, --rampup-batch-size 2 2 24, micro-batch 1, so the
steps take 2, 2, 2, 2, 4, 4, 6, 6 samples, then 8 (12 steps, megatron-core 0.16.1's
RampupBatchsizeNumMicroBatchesCalculator and Megatron-LM's update_train_iters count the same). Each
world records every step's (global batch, micro-batches on this rank) as the loop hands them to
``train_step``, the logged (loss, grad norm, learning rate) of every step, a validation loss (the
settled batch) and a checksum of the final weights. A one-process run is the reference for DP2 (with
and without DataLoader workers), PP2 under 1F1B and under ZBH1 (our runtime); a DP2 run saved after
step 5 (mid-ramp, 12 samples consumed) and resumed trains steps 6-12 bit for bit as the uninterrupted
run did. A one-process run under --step-batch-size-schedule takes main's calculator's batches. A
ramp of 2, 2, 2, 5, 5, then 8 (--rampup-batch-size 2 3 12) trained by one process and resumed on DP2
past the ramp trains on (the 5s it trained past would not divide), and is refused, writing nothing,
from a checkpoint with a 5 still to come.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

import megatron_ext.training.loop as loop
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.evaluation import evaluate
from megatron_ext.training.loop import train
from megatron_ext.validation import validate
from tests.unit.megatron_main_step_batch import StepBatchsizeNumMicroBatchesCalculator

pytestmark = pytest.mark.distributed

RAMP = dict(
    num_layers=2,
    micro_batch_size=1,
    global_batch_size=8,
    train_iters=None,
    train_samples=60,
    rampup_batch_size=["2", "2", "24"],
    lr=3e-3,
    min_lr=3e-4,
    lr_decay_style="cosine",
    lr_warmup_samples=8,
    untie_embeddings_and_output_weights=True,  # each weight on one stage: the weight checksum adds up
)
# Megatron-LM main's schedule: thresholds in tokens (32 per sample): batch 2, then 4 from sample 8,
# 8 from sample 24; the last entry is the global batch (no --global-batch-size)
STEP = dict(RAMP, rampup_batch_size=[], global_batch_size=None, step_batch_size_schedule="0:2 256:4 768:8")
LAYOUTS = {
    "DP2": {},
    "DP2 workers": dict(num_workers=2),
    "PP2 1F1B": dict(pipeline_model_parallel_size=2),
    "PP2 ZBH1": dict(pipeline_model_parallel_size=2, pipeline_schedule="ZBH1"),
}


def _train(values: dict, load: str | None = None, step: int | None = None) -> dict:
    """Train (after loading ``load`` at ``step``); the steps' batches, logs, eval loss, weights."""
    steps = []
    original = loop.train_step

    def spy(model, optimizer, scheduler, microbatches, length, global_batch_size, *args, **kwargs):
        steps.append((global_batch_size, len(microbatches)))
        return original(model, optimizer, scheduler, microbatches, length, global_batch_size, *args, **kwargs)

    loop.train_step = spy
    try:
        run = build_tiny_run(tiny_values(**values), MarkovDataset(32, mask_every=1), MarkovDataset(32, seed=7))
        if load is not None:
            load_checkpoint(run, load, step=step)
        train(run)
        val = evaluate(run, run.valid_ds, 0, run.cfg.training.eval_iters)
    finally:
        loop.train_step = original
    weights = torch.zeros(2, dtype=torch.float64)
    for chunk in run.model:
        for p in chunk.parameters():
            weights += torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
    torch.distributed.all_reduce(weights)  # over the stages (DP replicas count each weight dp times)
    out = dict(
        steps=steps,
        records=[(r["iteration"], r["loss"], r["grad_norm"], r["lr"]) for r in run.records],
        val=val,
        weights=(weights / run.ctx.dp_size).tolist(),
        consumed=run.state.consumed_samples,
    )
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int, root: str | None) -> dict:
    if world_size == 1:
        return {"one": _train(RAMP), "step": _train(STEP)}
    out = {name: _train(dict(RAMP, **values)) for name, values in LAYOUTS.items()}
    out["saved"] = _train(dict(RAMP, save=root, save_interval=5))
    out["resumed"] = _train(dict(RAMP, load=root), load=root, step=5)
    return out


@pytest.fixture(scope="module")
def ones():
    return run_ranks(_world, 1, None, timeout=300)[0]


@pytest.fixture(scope="module")
def one(ones):
    return ones["one"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_world, 2, str(tmp_path_factory.mktemp("rampup") / "ckpt"), timeout=600)


def _megatron_core_steps(dp: int, iters: int) -> list[tuple[int, int]]:
    calc = RampupBatchsizeNumMicroBatchesCalculator(8, 1, dp, False, 1, 2, 2, 24)
    out, consumed = [], 0
    for _ in range(iters):
        calc.update(consumed, True)
        out.append((calc.get_current_global_batch_size(), calc.get()))
        consumed += calc.get_current_global_batch_size()
    return out


def test_one_process_ramps_as_megatron_core(one):
    assert one["steps"] == _megatron_core_steps(1, 12)
    assert [b for b, _ in one["steps"]] == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8] and one["consumed"] == 60
    losses = [r[1] for r in one["records"]]
    assert losses[-1] < losses[0] - 0.1  # it learns: a wrong batch shows in the losses


def test_one_process_follows_megatron_lm_mains_step_schedule(ones):
    ref = StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 1, STEP["step_batch_size_schedule"], 32)
    steps, consumed = [], 0
    while consumed < 60:  # main's update_train_iters: steps until --train-samples are consumed
        ref.update(consumed, True)
        steps.append((ref.get_current_global_batch_size(), ref.get()))
        consumed += ref.get_current_global_batch_size()
    got = ones["step"]
    assert got["steps"] == steps and [b for b, _ in steps] == [2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 8]
    assert got["consumed"] == consumed == 64 and len(got["records"]) == len(steps)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_trains_the_ramp_as_one_process(one, two, name):
    dp = 1 if name.startswith("PP2") else 2
    for rank_out in two:
        assert rank_out[name]["steps"] == _megatron_core_steps(dp, 12)
    last = two[-1][name]  # the last stage logs
    assert [r[0] for r in last["records"]] == list(range(1, 13))
    for got, want in zip(last["records"], one["records"]):
        assert got[1:] == pytest.approx(want[1:], rel=1e-5), name
    assert last["val"] == pytest.approx(one["val"], rel=1e-5)
    assert two[0][name]["weights"] == pytest.approx(one["weights"], rel=1e-5)
    assert last["consumed"] == 60


def test_resume_mid_ramp_is_exact(two):
    for rank_out in two:
        assert rank_out["resumed"]["steps"] == rank_out["saved"]["steps"][5:]
        assert rank_out["resumed"]["records"] == rank_out["saved"]["records"][5:]
        assert rank_out["resumed"]["weights"] == rank_out["saved"]["weights"]
        assert rank_out["resumed"]["val"] == rank_out["saved"]["val"]


# --rampup-batch-size 2 3 12: steps of 2, 2, 2, 5, 5, then 8 from sample 16 (9 steps, 48 samples);
# DP 2 cannot take the 5s. Saved by one process every 3 steps: at 6 samples (a 5 to come) and at 24
RESUME = dict(RAMP, train_samples=48, rampup_batch_size=["2", "3", "12"])


def _save_at_dp1(rank: int, world_size: int, root: str) -> dict:
    return _train(dict(RESUME, save=root, save_interval=3))


def _resume_at_dp2(rank: int, world_size: int, root: str) -> dict:
    out = {"resumed": _train(dict(RESUME, load=root), load=root, step=6)}
    try:  # a save every step if it trained one: it must not
        _train(dict(RESUME, load=root, save=root, save_interval=1), load=root, step=3)
    except ConfigError as err:
        out["refused"] = err.problems
    destroy_parallel_context()
    return out


def _listing(root) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_resume_past_the_ramp_on_a_dp_its_ramp_does_not_divide(tmp_path):
    root = tmp_path / "ckpt"
    (saved,) = run_ranks(_save_at_dp1, 1, str(root), timeout=300)
    assert [b for b, _ in saved["steps"]] == [2, 2, 2, 5, 5, 8, 8, 8, 8] and saved["consumed"] == 48
    with pytest.raises(ConfigError, match="global batch 5 not divisible"):  # a new run at DP 2
        validate(build_job_config(tiny_values(**RESUME)), 2)
    validate(build_job_config(tiny_values(**RESUME, load=str(root))), 2)  # a resume: the steps left only
    validate(build_job_config(tiny_values(**RESUME, load=str(root), ckpt_step=6)), 2)  # 8s left: they divide
    with pytest.raises(ConfigError, match="resumed after 6 consumed samples: .*global batch 5 not divisible"):
        # from step 3 a 5 is still to come: refused before any model is built (the checkpoint's common.pt)
        validate(build_job_config(tiny_values(**RESUME, load=str(root), ckpt_step=3)), 2)
    before = _listing(root)
    two = run_ranks(_resume_at_dp2, 2, str(root), timeout=300)
    assert _listing(root) == before  # neither the resumed run nor the refused one wrote anything
    for rank_out in two:
        resumed = rank_out["resumed"]
        assert resumed["steps"] == [(8, 4)] * 3 and resumed["consumed"] == saved["consumed"]
        (problem,) = rank_out["refused"]  # every rank raised the same error: no rank left waiting
        assert rank_out["refused"] == two[0]["refused"] and problem.startswith(
            "--rampup-batch-size 2 3 12, resumed after 6"
        )
        assert "global batch 5 not divisible by --micro-batch-size 1 x data-parallel size 2" in problem
    records = two[0]["resumed"]["records"]
    assert [r[0] for r in records] == [7, 8, 9]
    for got, want in zip(records, saved["records"][6:]):
        assert got[1:] == pytest.approx(want[1:], rel=1e-5)
