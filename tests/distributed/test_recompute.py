"""Activation recomputation changes memory, never the gradients.

TP2 x PP2 x VPP2 (8 forked ranks), fp32, dropout on (hidden and attention 0.1, so recomputation
must replay megatron-core's model-parallel RNG streams, here on the CPU platform layer), packed
and unpacked data: the step-1 gradient of every parameter with selective recompute of each module
(core_attn, layernorm, mlp: the last without linear biases, see config._check_recompute) and with
full recompute (uniform and block) equals the run without recompute, and so does the step's loss. A control with a different dropout seed shows that the
comparison sees dropout masks.
"""

from __future__ import annotations

import pytest

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import (
    MarkovDataset,
    PackedMarkovDataset,
    build_tiny_run,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.step import build_step_microbatches, run_forward_backward

pytestmark = pytest.mark.distributed

LAYOUT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
BASE = dict(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=4, micro_batch_size=1, seq_length=32)
RECOMPUTE = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "none, no biases": dict(disable_bias_linear=True),
    "selective mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"], disable_bias_linear=True),
    "--recompute-activations": dict(recompute_activations=True),
    "full uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "control: other seed": dict(seed=4321),
}
DATA = {
    "unpacked": ({}, lambda: MarkovDataset(32, mask_every=1)),
    "packed": (dict(packed_sequences=True), lambda: PackedMarkovDataset(32)),
}


def _grads(rank: int, world_size: int) -> dict:
    out = {}
    for data_name, (data_flags, make) in DATA.items():
        for name, flags in RECOMPUTE.items():
            run = build_tiny_run(tiny_values(**BASE, **LAYOUT, **data_flags, **flags), make())
            mbs, length = build_step_microbatches(run, run.train_ds, 0)
            reports = run_forward_backward(run.model, mbs, length)
            loss = sum(float(r["lm loss"][0]) for r in reports) if run.ctx.is_last_stage else None
            grads = gather_full_grads(run)
            out[(data_name, name)] = {"grads": grads if run.ctx.tp_rank == 0 else {}, "loss": loss}
            destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(_grads, 8, timeout=600)
    merged = {}
    for key in per_rank[0]:
        grads, loss = {}, None
        for r in per_rank:
            grads.update(r[key]["grads"])
            loss = r[key]["loss"] if r[key]["loss"] is not None else loss
        merged[key] = (grads, loss)
    return merged


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("name", [n for n in RECOMPUTE if not n.startswith(("none", "control"))])
def test_recompute_gives_the_gradients_of_no_recompute(results, data, name):
    grads, loss = results[(data, name)]
    ref_grads, ref_loss = results[(data, "none, no biases" if name == "selective mlp" else "none")]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert _max_rel(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("data", list(DATA))
def test_the_comparison_sees_the_dropout_masks(results, data):
    assert _max_rel(results[(data, "control: other seed")][0], results[(data, "none")][0]) > 1e-2
