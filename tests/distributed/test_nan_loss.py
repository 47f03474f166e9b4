"""A non-finite loss with finite gradients is a non-finite step on every rank.

One 4-rank world (TP1 x PP2 x DP2), with the fp32 optimizer and with the distributed optimizer. A
forward hook on the last stage's model adds +inf to one valid token's loss of micro-batch 1 of
data-parallel rank 1 at iteration 3: the loss becomes inf, the gradients stay what they were (adding
a constant changes no derivative; the unguarded control below checks it bit for bit). Then:
- every rank skips the update (weights and optimizer state bit-identical to before), counts one nan
  iteration and trains on, bit-identically to a run whose iteration 3 was skipped by the existing
  non-finite-gradient guard (a NaN put into the gradients of the same micro-batch, its loss finite);
- a checkpoint saved after the skipped step resumes bit-identically;
- with --no-check-for-nan-in-loss-and-grad the update is applied (the old behaviour) and equals a
  run without the injection: the injection leaves the gradients finite and unchanged;
- an inf loss in every iteration from 2 stops the run with TrainingDiverged after
  --max-nan-iterations, naming the rank, pipeline stage and micro-batch, having saved nothing after 1;
- with --fp16 (megatron-core's dynamic loss scaler, whose overflow skips are not nan iterations) the
  inf-loss step is a nan iteration and the loss scaler's skips stay counted apart.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.checkpoint.directory import list_complete_checkpoints
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import TrainingDiverged, train
from megatron_ext.training.step import unwrap_model

pytestmark = pytest.mark.distributed

BASE = dict(num_layers=2, pipeline_model_parallel_size=2, global_batch_size=8, micro_batch_size=2, train_iters=6)
BAD_DP_RANK, BAD_MICROBATCH, BAD_ITERATION, SAVE_AT = 1, 1, 3, 4


def _microbatch_counter(run):
    """A function telling, at each forward call in training, (the step in progress, the micro-batch
    index within it): one model chunk per stage here, so forward calls are micro-batches in order."""
    seen = {"step": None, "index": -1}

    def count() -> tuple[int, int]:
        step = run.state.iteration + 1
        if seen["step"] != step:
            seen.update(step=step, index=-1)
        seen["index"] += 1
        return step, seen["index"]

    return count


def inject_inf_loss(run, iterations: set[int]) -> None:
    """+inf added to the last valid token's loss of BAD_MICROBATCH on BAD_DP_RANK's last stage."""
    if not (run.ctx.is_last_stage and run.ctx.dp_rank == BAD_DP_RANK):
        return
    count = _microbatch_counter(run)

    def hook(module, inputs, output):  # output: per-token loss [b, s]
        if not module.training:
            return output
        step, index = count()
        if step in iterations and index == BAD_MICROBATCH:
            bump = torch.zeros_like(output)
            bump[0, -1] = float("inf")  # the last position is a valid label in every sample here
            return output + bump  # a constant: the gradient of output is unchanged
        return output

    unwrap_model(run.model[-1]).register_forward_hook(hook)


def inject_nan_gradient(run, iterations: set[int]) -> None:
    """The existing guard's case: NaN gradients through BAD_MICROBATCH's embedding output on
    BAD_DP_RANK's first stage, its loss finite."""
    if not (run.ctx.pp_rank == 0 and run.ctx.dp_rank == BAD_DP_RANK):
        return
    count = _microbatch_counter(run)

    def hook(module, inputs, output):
        if module.training:
            step, index = count()
            if step in iterations and index == BAD_MICROBATCH:
                output.register_hook(lambda grad: grad * float("nan"))

    unwrap_model(run.model[0]).embedding.register_forward_hook(hook)


def _snapshot(run) -> dict[str, torch.Tensor]:
    """Model parameters, torch optimizer state and main parameters of this rank."""
    out = {f"p{i}.{n}": p.detach().clone() for i, c in enumerate(run.model) for n, p in c.named_parameters()}
    inner = run.optimizer.optimizer
    for k, state in enumerate(inner.state.values()):
        out.update({f"opt{k}.{name}": v.clone() for name, v in state.items() if torch.is_tensor(v)})
    for g, group in enumerate(inner.param_groups):
        out.update({f"main{g}.{k}": p.detach().clone() for k, p in enumerate(group["params"])})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _build(**values):
    return build_tiny_run(tiny_values(**{**BASE, **values}), MarkovDataset(32, mask_every=1))


def _train_in_stages(run, stops: tuple[int, ...]) -> list[dict]:
    """Train to each of ``stops`` in turn; the snapshot at each."""
    snaps = []
    for stop in stops:
        run.cfg.training.train_iters = stop
        train(run)
        snaps.append(_snapshot(run))
    return snaps


def _summary(run) -> dict:
    return {
        "nan": run.state.nan_iterations,
        "skipped": run.state.skipped_iterations,
        "records": [(r["iteration"], r["loss"], r["lr"]) for r in run.records],
    }


def _skip_and_resume(root: str, **opt) -> dict:
    run = _build(save=root, save_interval=SAVE_AT, **opt)
    inject_inf_loss(run, {BAD_ITERATION})
    before, after, final = _train_in_stages(run, (BAD_ITERATION - 1, BAD_ITERATION, BASE["train_iters"]))
    out = {"inf loss": _summary(run), "unchanged": _same(before, after), "finite": _finite(final)}
    destroy_parallel_context()

    run = _build(**opt)
    inject_nan_gradient(run, {BAD_ITERATION})
    (reference,) = _train_in_stages(run, (BASE["train_iters"],))
    out["nan gradient"] = _summary(run)
    out["same as nan gradient"] = _same(final, reference)
    destroy_parallel_context()

    run = _build(**opt)
    assert load_checkpoint(run, root, step=SAVE_AT) == SAVE_AT
    train(run)
    out["resumed"] = _summary(run)
    out["resume bit-identical"] = _same(final, _snapshot(run))
    destroy_parallel_context()
    return out


def _finite(snap: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in snap.values())


def _unguarded() -> dict:
    """Without the guard the inf-loss update is applied, and equals the update without injection."""
    snaps = {}
    for name, inject in (("inf loss", True), ("clean", False)):
        run = _build(check_for_nan_in_loss_and_grad=False)
        if inject:
            inject_inf_loss(run, {BAD_ITERATION})
        (snaps[name],) = _train_in_stages(run, (BAD_ITERATION,))
        snaps[name + " summary"] = _summary(run)
        destroy_parallel_context()
    return {"applied and equal": _same(snaps["inf loss"], snaps["clean"]), "summary": snaps["inf loss summary"]}


def _diverge(root: str) -> dict:
    run = _build(train_iters=10, save=root, save_interval=1, max_nan_iterations=3)
    inject_inf_loss(run, set(range(2, 11)))
    try:
        train(run)
        message = ""
    except TrainingDiverged as err:
        message = str(err)
    ctx = run.ctx
    out = {
        "message": message,
        "iteration": run.state.iteration,
        "nan": run.state.nan_iterations,
        "where": (ctx.rank, ctx.pp_rank, ctx.dp_rank, ctx.is_last_stage),
    }
    destroy_parallel_context()
    return out


def _fp16() -> dict:
    out = {}
    for name, iterations in (("inf loss", {5}), ("clean", set())):
        run = _build(fp16=True, initial_loss_scale=2.0**14, hysteresis=1, train_iters=5)
        inject_inf_loss(run, iterations)
        before, after = _train_in_stages(run, (4, 5))
        out[name] = {**_summary(run), "unchanged": _same(before, after)}
        destroy_parallel_context()
    return out


def _world(rank: int, world_size: int, root: str) -> dict:
    return {
        "fp32": _skip_and_resume(os.path.join(root, "fp32")),
        "distributed": _skip_and_resume(os.path.join(root, "distributed"), use_distributed_optimizer=True),
        "unguarded": _unguarded(),
        "diverge": _diverge(os.path.join(root, "diverge")),
        "fp16": _fp16(),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nanloss"))
    return root, run_ranks(_world, 4, root, timeout=600)


@pytest.mark.parametrize("kind", ["fp32", "distributed"])
def test_inf_loss_skips_the_update_on_every_rank_and_counts_it(results, kind):
    per_rank = [r[kind] for r in results[1]]
    assert all(r["unchanged"] for r in per_rank), "an update was applied from a step whose loss was inf"
    assert all(r["inf loss"]["nan"] == 1 and r["inf loss"]["skipped"] == 0 for r in per_rank)
    assert all(r["finite"] for r in per_rank)
    records = per_rank[-1]["inf loss"]["records"]  # the last rank is on the last stage
    assert [it for it, _, _ in records] == list(range(1, 7))
    assert records[BAD_ITERATION - 1][1] == float("inf")


@pytest.mark.parametrize("kind", ["fp32", "distributed"])
def test_training_goes_on_as_after_a_skip_for_non_finite_gradients(results, kind):
    per_rank = [r[kind] for r in results[1]]
    assert all(r["same as nan gradient"] for r in per_rank)
    assert all(r["nan gradient"]["nan"] == 1 for r in per_rank)
    ours, reference = per_rank[-1]["inf loss"]["records"], per_rank[-1]["nan gradient"]["records"]
    assert ours[BAD_ITERATION:] == reference[BAD_ITERATION:]


@pytest.mark.parametrize("kind", ["fp32", "distributed"])
def test_resume_after_the_skipped_step_is_bit_identical(results, kind):
    per_rank = [r[kind] for r in results[1]]
    assert all(r["resume bit-identical"] for r in per_rank)
    last = per_rank[-1]
    assert last["resumed"]["records"] == last["inf loss"]["records"][SAVE_AT:]
    assert all(r["resumed"]["nan"] == 1 for r in per_rank)  # the count is part of the saved state


def test_without_the_guard_the_update_is_applied_and_the_gradients_were_finite(results):
    per_rank = [r["unguarded"] for r in results[1]]
    assert all(r["applied and equal"] for r in per_rank), "the injection changed the gradients"
    assert all(r["summary"]["nan"] == 0 for r in per_rank)
    assert per_rank[-1]["summary"]["records"][BAD_ITERATION - 1][1] == float("inf")


def test_repeated_inf_loss_stops_naming_rank_stage_and_microbatch(results):
    root, per_rank = results
    d = [r["diverge"] for r in per_rank]
    assert all(r["iteration"] == 4 and r["nan"] == 3 for r in d)
    message = d[0]["message"]
    assert all(r["message"] == message for r in d)
    (bad,) = [r["where"] for r in d if r["where"][3] and r["where"][2] == BAD_DP_RANK]
    assert "3 consecutive iterations up to 4" in message and "first at iteration 2" in message, message
    assert (
        f"the loss was not finite on rank {bad[0]} (pipeline stage {bad[1]} of 2, tensor rank 0, data-parallel "
        f"rank {bad[2]}, micro-batch {BAD_MICROBATCH})"
    ) in message, message
    assert message.count("rank ") == 3  # one rank named (with its tensor and data-parallel ranks)
    assert [it for it, _ in list_complete_checkpoints(os.path.join(root, "diverge"))] == [1]


def test_fp16_inf_loss_is_a_nan_iteration_not_a_loss_scaler_skip(results):
    per_rank = [r["fp16"] for r in results[1]]
    for r in per_rank:
        assert r["inf loss"]["unchanged"] and r["inf loss"]["nan"] == 1, r["inf loss"]
        assert r["clean"]["nan"] == 0 and not r["clean"]["unchanged"], r["clean"]
        assert r["inf loss"]["skipped"] == r["clean"]["skipped"]  # the same overflows before iteration 5
