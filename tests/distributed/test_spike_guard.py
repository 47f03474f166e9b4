"""The loss-spike guard (--skip-spiky-loss-factor, ours) skips a spiky step exactly as the non-finite
guard skips a NaN step.

DP2 x PP2 (4 forked ranks), with and without the distributed optimizer, 6 iterations, factor 5 over
a window of 2 applied steps. A forward hook on the last stage's GPTModel multiplies the token losses
of micro-batch 1 on DP rank 1 at iteration 4 by 1000 (a spike) or by NaN (the existing guard's
case). The spiky run must end with weights and optimizer state bit-equal to the NaN run's (the
same step skipped by the other mechanism), count one skipped iteration and no nan iteration, and
name DP rank 1, micro-batch 1 in its warning; the same run without the hook skips nothing and ends
elsewhere.
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


def _run(distributed_optimizer: bool, factor: float | None) -> dict:
    values = tiny_values(
        pipeline_model_parallel_size=2,
        train_iters=6,
        use_distributed_optimizer=distributed_optimizer,
        skip_spiky_loss_factor=5.0,
        skip_spiky_loss_window=2,
    )
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    lines: list[str] = []
    run.log = lines.append
    if factor is not None:
        inject(run, factor)
    train(run)
    out = {
        "snapshot": _snapshot(run),
        "spikes": run.spike_guard.skipped,
        "skipped": run.state.skipped_iterations,
        "nan": run.state.nan_iterations,
        "ratio": run.spike_guard.largest_ratio,
        "warnings": [line for line in lines if "--skip-spiky-loss-factor" in line],
        "lr": run.optimizer.param_groups[0]["lr"],
    }
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int) -> dict:
    out = {}
    for dist_opt in (False, True):
        runs = {name: _run(dist_opt, f) for name, f in (("spike", 1000.0), ("nan", float("nan")), ("clean", None))}
        spike, nan, clean = runs["spike"], runs["nan"], runs["clean"]
        out[dist_opt] = {
            "equal_to_nan_skip": spike["snapshot"].keys() == nan["snapshot"].keys()
            and all(torch.equal(spike["snapshot"][k], nan["snapshot"][k]) for k in spike["snapshot"]),
            "differs_from_clean": any(
                not torch.equal(spike["snapshot"][k], clean["snapshot"][k]) for k in spike["snapshot"]
            ),
            "counts": {n: (r["spikes"], r["skipped"], r["nan"]) for n, r in runs.items()},
            "warnings": spike["warnings"],
            "clean_ratio": clean["ratio"],
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 4, timeout=300)


@pytest.mark.parametrize("dist_opt", [False, True])
def test_spiky_step_is_skipped_as_a_nan_step_is(results, dist_opt):
    per_rank = [r[dist_opt] for r in results]
    assert all(r["equal_to_nan_skip"] for r in per_rank), "weights differ from the NaN-skipped run's"
    assert all(r["differs_from_clean"] for r in per_rank)
    for r in per_rank:  # (spikes skipped, skipped iterations, nan iterations)
        assert r["counts"] == {"spike": (1, 1, 0), "nan": (0, 0, 1), "clean": (0, 0, 0)}


@pytest.mark.parametrize("dist_opt", [False, True])
def test_warning_names_the_rank_and_micro_batch_and_nothing_fires_without_the_spike(results, dist_opt):
    logging_rank = results[-1][dist_opt]
    assert len(logging_rank["warnings"]) == 1
    warning = logging_rank["warnings"][0]
    assert warning.startswith(f"WARNING: iteration {SPIKE_AT}: loss ")
    assert f"data-parallel rank {DP_RANK}, micro-batch {MICROBATCH})" in warning and "pipeline stage 1" in warning
    assert all(not r[dist_opt]["warnings"] for r in results[:-1])  # logged once
    assert 0 < logging_rank["clean_ratio"] < 5.0
