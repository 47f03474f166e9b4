"""The loss-spike guard (--skip-spiky-loss-factor, ours) skips a spiky step exactly as the non-finite
guard skips a NaN step.

TP2 x PP2 x VPP2 x DP2 (8 forked ranks, the non-finite guard's test layout), with and without the
distributed optimizer, 6 iterations, factor 5 over a window of 2 applied steps. A forward hook on the last stage's GPTModel multiplies the token losses
of micro-batch 1 on DP rank 1 at iteration 4 by 1000 (a spike) or by NaN (the existing guard's
case). The spiky run must end with weights and optimizer state bit-equal to the NaN run's (the
same step skipped by the other mechanism), count one skipped iteration and no nan iteration, and
name DP rank 1, micro-batch 1 in its warning, and leave weights and optimizer state as they were
before the step (also with --no-check-for-nan-in-loss-and-grad, where megatron-core's own optimizer
step is vetoed); the same run without the hook skips nothing and ends elsewhere, its guard holding the
logged losses (the global token means, whatever the TP repetition in the all-reduce).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train
from megatron_ext.training.step import unwrap_model

pytestmark = pytest.mark.distributed

SPIKE_AT, MICROBATCH, DP_RANK = 4, 1, 1
# the non-finite guard's test layout: the loss stage's TP ranks repeat its values in the all-reduce
LAYOUT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)


def inject(run, factor: float) -> None:
    """Token losses of micro-batch MICROBATCH on DP rank DP_RANK times ``factor`` at SPIKE_AT."""
    if not run.ctx.is_last_stage or run.ctx.dp_rank != DP_RANK:
        return
    seen = {"step": None, "index": -1}

    def hook(module, inputs, output):
        step = run.state.iteration + 1
        if seen["step"] != step:
            seen.update(step=step, index=-1)
        seen["index"] += 1
        if step == SPIKE_AT and seen["index"] == MICROBATCH and module.training:
            return output * factor
        return output

    unwrap_model(run.model[-1]).register_forward_hook(hook)


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


def _run(distributed_optimizer: bool, factor: float | None, check: bool = True) -> dict:
    values = tiny_values(
        **LAYOUT,
        train_iters=6,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_loss_and_grad=check,
        skip_spiky_loss_factor=5.0,
        skip_spiky_loss_window=2,
    )
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    lines: list[str] = []
    run.log = lines.append
    if factor is not None:
        inject(run, factor)
    run.cfg.training.train_iters = SPIKE_AT - 1
    train(run)
    before = _snapshot(run)
    run.cfg.training.train_iters = SPIKE_AT
    train(run)
    unchanged = _same(before, _snapshot(run))
    run.cfg.training.train_iters = 6
    train(run)
    out = {
        "snapshot": _snapshot(run),
        "unchanged_by_step": unchanged,
        "spikes": run.spike_guard.skipped,
        "skipped": run.state.skipped_iterations,
        "nan": run.state.nan_iterations,
        "ratio": run.spike_guard.largest_ratio,
        "warnings": [line for line in lines if line.startswith("WARNING") and "--skip-spiky-loss-factor" in line],
        # the guard's last two losses and the logged ones of iterations 5 and 6 (the last stage's)
        "window": list(run.spike_guard.losses),
        "logged": [r["loss"] for r in run.records[-2:]],
    }
    destroy_parallel_context()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _world(rank: int, world_size: int) -> dict:
    out = {}
    for dist_opt in (False, True):
        runs = {name: _run(dist_opt, f) for name, f in (("spike", 1000.0), ("nan", float("nan")), ("clean", None))}
        runs["unguarded spike"] = _run(dist_opt, 1000.0, check=False)  # megatron-core's own step
        spike, nan, clean = runs["spike"], runs["nan"], runs["clean"]
        out[dist_opt] = {
            "equal_to_nan_skip": _same(spike["snapshot"], nan["snapshot"]),
            "differs_from_clean": not _same(spike["snapshot"], clean["snapshot"]),
            "unchanged_by_step": {n: r["unchanged_by_step"] for n, r in runs.items()},
            "counts": {n: (r["spikes"], r["skipped"], r["nan"]) for n, r in runs.items()},
            "warnings": spike["warnings"],
            "clean_ratio": clean["ratio"],
            "window": clean["window"],
            "logged": clean["logged"],
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 8, timeout=600)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_spiky_step_is_skipped_as_a_nan_step_is(results, dist_opt):
    per_rank = [r[dist_opt] for r in results]
    assert all(r["equal_to_nan_skip"] for r in per_rank), "weights differ from the NaN-skipped run's"
    assert all(r["differs_from_clean"] for r in per_rank)
    for r in per_rank:  # (spikes skipped, skipped iterations, nan iterations)
        assert r["counts"] == {"spike": (1, 1, 0), "nan": (0, 0, 1), "clean": (0, 0, 0), "unguarded spike": (1, 1, 0)}
        # the spiky step left weights and optimizer state as they were, with megatron-core's step too
        assert r["unchanged_by_step"] == {"spike": True, "nan": True, "clean": False, "unguarded spike": True}


def test_the_guard_sees_the_logged_global_loss(results):
    last = results[-1][False]  # the logging rank; every rank holds the same window
    assert last["window"] == pytest.approx(last["logged"], rel=1e-12)
    assert all(r[False]["window"] == last["window"] for r in results)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_warning_names_the_rank_and_micro_batch_and_nothing_fires_without_the_spike(results, dist_opt):
    logging_rank = results[-1][dist_opt]
    assert len(logging_rank["warnings"]) == 1
    warning = logging_rank["warnings"][0]
    assert warning.startswith(f"WARNING: iteration {SPIKE_AT}: loss ")
    assert f"data-parallel rank {DP_RANK}, micro-batch {MICROBATCH})" in warning and "pipeline stage 1" in warning
    assert all(not r[dist_opt]["warnings"] for r in results[:-1])  # logged once
    assert 0 < logging_rank["clean_ratio"] < 5.0


def _exit_interval_world(rank: int, world_size: int) -> dict:
    """DP2, a spike at SPIKE_AT, --exit-interval SPIKE_AT before --train-iters 6: train() stops at
    the agreed exit, a second train() reaches --train-iters."""
    values = tiny_values(train_iters=6, exit_interval=SPIKE_AT, skip_spiky_loss_factor=5.0, skip_spiky_loss_window=2)
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    lines: list[str] = []
    run.log = lines.append
    inject(run, 1000.0)
    train(run)
    exited_at = run.state.iteration
    train(run)
    destroy_parallel_context()
    return {
        "lines": lines,
        "exited_at": exited_at,
        "iteration": run.state.iteration,
        "skipped": run.spike_guard.skipped,
    }


def test_summary_is_printed_at_an_exit_interval_and_at_train_iters():
    """The guard's summary ends every normal end of the loop once (an --exit-interval exit as well as
    --train-iters), on the logging rank, with the count of the steps its warnings skipped."""
    results = run_ranks(_exit_interval_world, 2, timeout=300)
    assert [(r["exited_at"], r["iteration"], r["skipped"]) for r in results] == [(SPIKE_AT, 6, 1)] * 2
    lines = results[-1]["lines"]
    summaries = [i for i, line in enumerate(lines) if line.startswith("> loss-spike guard:")]
    warned = sum(line.startswith("WARNING") and "--skip-spiky-loss-factor" in line for line in lines)
    assert warned == 1 and len(summaries) == 2, lines
    exit_line = next(i for i, line in enumerate(lines) if line.startswith(f"exiting after iteration {SPIKE_AT}:"))
    assert exit_line < summaries[0] < len(lines) - 1  # after the exit, before the resumed steps' lines
    assert all(lines[i].startswith(f"> loss-spike guard: {warned} step(s) skipped") for i in summaries), lines
    assert not any(line.startswith("> loss-spike guard:") for line in results[0]["lines"])  # logging rank only
