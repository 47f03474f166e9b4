"""The lm loss and iteration counts of a log line over a --log-interval, as Megatron-LM's
``training_log`` (megatron/training/training.py, core_v0.16.1) reports them.

Megatron-LM's ``train_step`` makes each iteration's loss its global token mean (sum and count over
micro-batches and DP ranks); ``training_log`` adds those up over the interval's iterations whose
update was applied and divides by their number, and prints the skipped and NaN iterations of the
interval (reset at every log line). Reference: the same run logged every iteration. Valid-token
counts differ between iterations (masked label prefixes), so pooling the interval's tokens gives
another number; a NaN injected into one iteration's micro-batch on DP rank 1 makes that
iteration's update skipped. DP2, 2 forked ranks.
"""

from __future__ import annotations

import math

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, ScalarRecorder, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

BASE = dict(global_batch_size=8, micro_batch_size=2, train_iters=4)


def _inject_nan(run, iteration: int) -> None:
    """NaN embedding output for the second micro-batch of DP rank 1 in ``iteration``."""
    if run.ctx.dp_rank != 1:
        return
    seen = {"step": None, "index": -1}

    def hook(module, inputs, output):
        step = run.state.iteration + 1
        if seen["step"] != step:
            seen.update(step=step, index=-1)
        seen["index"] += 1
        return output * float("nan") if step == iteration and seen["index"] == 1 and module.training else output

    run.model[0].module.embedding.register_forward_hook(hook)


def _logged(
    log_interval: int,
    nan_at: int | None = None,
    tensorboard_log_interval: int = 1,
    eval_interval: int = 0,
    exit_interval: int | None = None,
) -> dict:
    evaluation = dict(eval_interval=eval_interval, eval_iters=1) if eval_interval else {}
    if exit_interval is not None:
        evaluation["exit_interval"] = exit_interval
    run = build_tiny_run(
        tiny_values(**BASE, log_interval=log_interval, tensorboard_log_interval=tensorboard_log_interval, **evaluation),
        MarkovDataset(32, mask_every=1),
        MarkovDataset(32, seed=1) if eval_interval else None,
    )
    lines: list[str] = []
    run.log = lines.append
    run.writer = ScalarRecorder()
    if nan_at is not None:
        _inject_nan(run, nan_at)
    train(run)
    out = {
        "records": [(r["iteration"], r["loss"]) for r in run.records],
        "lr": {r["iteration"]: r["lr"] for r in run.records},
        "grad_norm": {r["iteration"]: r["grad_norm"] for r in run.records},
        "lines": [line for line in lines if "lm loss:" in line],
        "written": {step: values for step, values in run.writer.written if "learning rate" in values},
        "steps": [step for step, _ in run.writer.written],
    }
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int) -> dict:
    return {
        "every": _logged(1),
        "pairs": _logged(2),
        "nan every": _logged(1, nan_at=1),
        "nan pairs": _logged(2, nan_at=1),
        "pairs, tb every 2": _logged(2, tensorboard_log_interval=2),
        "fours, eval every 2": _logged(4, eval_interval=2),
        "pairs, exit at 3": _logged(2, exit_interval=3),
    }


@pytest.fixture(scope="module")
def logged():
    per_rank = run_ranks(_world, 2, timeout=300)
    return per_rank[-1]  # the logging rank


def test_a_log_line_averages_its_iterations_losses(logged):
    every = dict(logged["every"]["records"])
    pairs = dict(logged["pairs"]["records"])
    assert sorted(pairs) == [2, 4]
    for last in (2, 4):
        assert pairs[last] == pytest.approx((every[last - 1] + every[last]) / 2, rel=1e-12, abs=0)


def test_a_skipped_iteration_is_left_out_of_the_loss_and_counted_in_its_interval_only(logged):
    every = dict(logged["nan every"]["records"])
    assert math.isnan(every[1]) and all(math.isfinite(every[i]) for i in (2, 3, 4))
    pairs = dict(logged["nan pairs"]["records"])
    assert pairs[2] == pytest.approx(every[2], rel=1e-12, abs=0)  # iteration 1 skipped: not averaged in
    assert pairs[4] == pytest.approx((every[3] + every[4]) / 2, rel=1e-12, abs=0)
    nan_counts = [
        int(line.split("number of nan iterations:")[1].split("|")[0]) for line in logged["nan every"]["lines"]
    ]
    assert nan_counts == [1, 0, 0, 0]  # per log interval, as Megatron-LM resets them at each line
    nan_counts = [
        int(line.split("number of nan iterations:")[1].split("|")[0]) for line in logged["nan pairs"]["lines"]
    ]
    assert nan_counts == [1, 0]


def test_tensorboard_gets_every_iterations_loss_lr_and_grad_norm_between_log_lines(logged):
    # Megatron-LM's --tensorboard-log-interval (default 1): per-iteration scalars, not one per log line
    every, pairs = logged["every"], logged["pairs"]
    assert sorted(pairs["written"]) == [1, 2, 3, 4]  # log lines at 2 and 4 only
    for iteration, values in pairs["written"].items():
        assert values["lm loss"] == pytest.approx(dict(every["records"])[iteration], rel=1e-12, abs=0)
        assert values["learning rate"] == every["lr"][iteration]
        assert values["grad norm"] == pytest.approx(every["grad_norm"][iteration], rel=1e-12)
    assert sorted(logged["pairs, tb every 2"]["written"]) == [2, 4]
    nan = logged["nan pairs"]["written"]
    assert (
        "lm loss" not in nan[1] and "lm loss" in nan[2]
    )  # a skipped update writes no loss (the log line leaves it out too)


def test_an_evaluation_between_log_lines_writes_after_the_iterations_before_it(logged):
    # wandb ignores a step below one it has logged: iteration 1's scalars, written at the log line of
    # iteration 4, were dropped after the validation loss of iteration 2 had been written
    evaluated, every = logged["fours, eval every 2"], dict(logged["every"]["records"])
    assert evaluated["steps"] == sorted(evaluated["steps"])
    assert sorted(evaluated["written"]) == [1, 2, 3, 4]
    for iteration, values in evaluated["written"].items():
        assert values["lm loss"] == pytest.approx(every[iteration], rel=1e-12, abs=0)
    assert evaluated["records"] == [(4, pytest.approx(sum(every.values()) / 4, rel=1e-12, abs=0))]


def test_an_exit_between_log_lines_writes_the_iterations_since_the_last_one(logged):
    # the resumed run starts after the exit's iteration: nothing would ever write iteration 3
    exited, every = logged["pairs, exit at 3"], dict(logged["every"]["records"])
    assert sorted(exited["written"]) == [1, 2, 3]
    assert exited["written"][3]["lm loss"] == pytest.approx(every[3], rel=1e-12, abs=0)
