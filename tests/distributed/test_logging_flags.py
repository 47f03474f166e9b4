"""Megatron-LM's logging flags (LoggerConfig, core_v0.16.1) against independent references.

- --log-params-norm: Megatron-LM's ``calc_params_l2_norm`` counts every parameter of the model once
  whatever the layout. Reference: the L2 norm of the one-process model's parameters (the initial
  weights do not depend on the layout: model/init_weights.py), at TP2, at PP2 with the word
  embedding tied to the output layer (the last stage's copy must not count), and at DP2 with the
  distributed optimizer under --bf16 (the fp32 main-parameter shards, summed over DP); and the value
  on the log line and in TensorBoard is the norm of the weights the run ends with.
- --log-num-zeros-in-grad: the zeros of the step's whole gradient, counted in the gradients gathered
  from the TP ranks.
- --log-world-size-to-tensorboard, --log-validation-ppl-to-tensorboard, the loss scale (default on,
  --fp16's static scale; off with --no-log-loss-scale-to-tensorboard).
"""

from __future__ import annotations

import math

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import (
    MarkovDataset,
    ScalarRecorder,
    build_tiny_run,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.loop import train
from megatron_ext.training.params_norm import calc_params_l2_norm

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2 tied": dict(pipeline_model_parallel_size=2),
    "dp2 distopt bf16": dict(use_distributed_optimizer=True, bf16=True),
}


def _initial_norm(rank: int, world_size: int, layout: dict) -> float:
    run = build_tiny_run(tiny_values(**layout), MarkovDataset(32))
    norm = calc_params_l2_norm(run.model, run.ctx, run.cfg.training.bf16)
    destroy_parallel_context()
    return norm


def _one_process_norm(rank: int, world_size: int, bf16: bool) -> float:
    """The reference: sqrt(sum of squares) over the one-process model's distinct parameters."""
    run = build_tiny_run(tiny_values(bf16=bf16), MarkovDataset(32))
    params = {id(p): p for chunk in run.model for p in chunk.parameters()}.values()
    norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in params))
    destroy_parallel_context()
    return norm


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_params_norm_counts_every_parameter_once_in_any_layout(name):
    layout = LAYOUTS[name]
    expected = run_ranks(_one_process_norm, 1, bool(layout.get("bf16")))[0]
    norms = run_ranks(_initial_norm, 2, layout)
    assert norms[0] == pytest.approx(norms[1], rel=1e-12)  # every rank gets the global norm
    assert norms[-1] == pytest.approx(expected, rel=1e-6)


def _trained(rank: int, world_size: int, values: dict) -> dict:
    run = build_tiny_run(
        tiny_values(train_iters=2, eval_interval=2, eval_iters=1, **values),
        MarkovDataset(32, mask_every=1),
        MarkovDataset(32, seed=1),
    )
    lines: list[str] = []
    run.log, run.writer = lines.append, ScalarRecorder()
    train(run)
    out = {
        "lines": [line for line in lines if "lm loss:" in line or "validation" in line],
        "written": run.writer.written,
    }
    if values.get("log_params_norm"):
        out["final norm"] = calc_params_l2_norm(run.model, run.ctx, run.cfg.training.bf16)
    if values.get("log_num_zeros_in_grad"):  # the last step's gradients are still in the buffers
        out["zeros"] = sum(int((g == 0).sum()) for g in gather_full_grads(run).values())
    destroy_parallel_context()
    return out


def _field(line: str, name: str) -> str:
    return line.split(f"{name}: ")[1].split(" |")[0]


@pytest.fixture(scope="module")
def tp2():
    values = dict(
        tensor_model_parallel_size=2,
        log_params_norm=True,
        log_num_zeros_in_grad=True,
        log_world_size_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True,
        untie_embeddings_and_output_weights=True,  # unseen tokens' embedding rows: zero gradients
    )
    return run_ranks(_trained, 2, values)[-1]  # the logging rank


def test_the_logged_params_norm_is_the_norm_of_the_weights(tp2):
    last = [line for line in tp2["lines"] if "lm loss:" in line][-1]
    assert float(_field(last, "params norm")) == pytest.approx(tp2["final norm"], abs=5e-4)
    at_log_lines = {step: v for step, v in tp2["written"] if "params norm" in v}
    assert sorted(at_log_lines) == [1, 2]
    assert at_log_lines[2]["params norm"] == pytest.approx(tp2["final norm"], rel=1e-12)


def test_the_logged_zeros_are_the_zeros_of_the_whole_gradient(tp2):
    last = [line for line in tp2["lines"] if "lm loss:" in line][-1]
    assert tp2["zeros"] > 0 and float(_field(last, "num zeros")) == tp2["zeros"]
    per_iteration = {step: v["num zeros"] for step, v in tp2["written"] if "num zeros" in v}
    assert sorted(per_iteration) == [1, 2] and per_iteration[2] == tp2["zeros"]


def test_world_size_validation_perplexity_and_loss_scale_reach_tensorboard(tp2):
    written = {step: v for step, v in tp2["written"] if "world size" in v}
    assert {step: v["world size"] for step, v in written.items()} == {1: 2, 2: 2}
    assert {step: v["loss scale"] for step, v in written.items()} == {1: 1.0, 2: 1.0}  # no scaler: 1.0
    validation = [v for _, v in tp2["written"] if "lm loss validation" in v]
    assert len(validation) == 1
    loss = validation[0]["lm loss validation"]
    assert validation[0]["lm loss validation ppl"] == pytest.approx(math.exp(loss), rel=1e-12)
    line = next(line for line in tp2["lines"] if "validation loss" in line)
    assert float(_field(line, "lm loss PPL")) == pytest.approx(math.exp(loss), rel=1e-6)


def _loss_scales(rank: int, world_size: int) -> dict:
    return {
        "fp16 static 64": _trained(rank, world_size, dict(fp16=True, loss_scale=64.0))["written"],
        "off": _trained(rank, world_size, dict(log_loss_scale_to_tensorboard=False))["written"],
    }


def test_the_loss_scale_is_fp16s_and_can_be_turned_off():
    runs = run_ranks(_loss_scales, 1)[0]
    scales = [v["loss scale"] for _, v in runs["fp16 static 64"] if "loss scale" in v]
    assert scales == [64.0, 64.0]
    assert not [v for _, v in runs["off"] if "loss scale" in v]
    assert not [v for _, v in runs["off"] if "lm loss validation ppl" in v]  # off by default
