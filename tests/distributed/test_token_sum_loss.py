"""Token-sum loss: one step's gradient is the gradient of the global mean over valid tokens.

Independent reference: one process, the unwrapped megatron-core GPTModel, the whole global batch
in one forward, ``loss = sum of valid token CE / number of valid tokens``, ``loss.backward()``:
no megatron-core schedule, DDP, finalize_model_grads or our loss code. Valid-token counts are
deliberately uneven per micro-batch and per DP rank (masked label prefixes of varying length,
whole samples masked). Gradients are compared after finalize and before the optimizer (Adam's
first update would hide the gradient's scale).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import IGNORE_INDEX, get_microbatch_indices
from megatron_ext.data.padding import collate
from megatron_ext.derived import resolve_config
from megatron_ext.model.gpt import build_model_chunks
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
from megatron_ext.testing import (
    VOCAB,
    MarkovDataset,
    build_tiny_run,
    fetch_step_microbatches,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.loop import train
from megatron_ext.training.step import run_forward_backward

pytestmark = pytest.mark.distributed

GBS, MBS, SEQ = 8, 2, 32
# Sample indices of a step with DP2, micro-batch 2: DP rank r, micro-batch j -> j*4 + r*2 + {0, 1}.
DATASETS = {
    "uneven": dict(mask_every=1, empty_samples=(0, 1)),  # + one empty micro-batch (DP rank 0, j=0)
    "empty DP rank": dict(mask_every=1, empty_samples=(2, 3, 6, 7)),  # DP rank 1 has no valid token
}
LAYOUTS = {
    "DP2": dict(),
    "PP2+VPP2": dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
}
LAYOUTS_8 = {
    "TP2xPP2xVPP2xDP2": dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1,
        use_distributed_optimizer=True,
    ),
}
VALUES = dict(global_batch_size=GBS, micro_batch_size=MBS, seq_length=SEQ, train_iters=1)


def _reference(rank: int, world_size: int) -> dict:
    """Plain single-process step on the whole global batch, for each dataset."""
    out = {}
    for name, kw in DATASETS.items():
        cfg = build_job_config(tiny_values(**VALUES))
        ctx = build_parallel_context(cfg, torch.device("cpu"))
        (model,) = build_model_chunks(
            cfg, resolve_config(cfg, ctx.world_size, VOCAB), ctx.placement, torch.device("cpu")
        )
        batch = collate([MarkovDataset(SEQ, **kw)[i] for i in range(GBS)])
        logits = model(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None)
        labels = batch.labels  # [b, s], IGNORE_INDEX where masked
        valid = labels != IGNORE_INDEX
        ce = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss = ce / valid.sum()
        loss.backward()
        offset = get_layer_offset(model)
        grads = {get_global_name(n, offset): p.grad.detach().clone() for n, p in model.named_parameters()}
        out[name] = {"loss": loss.item(), "grads": grads, "valid": int(valid.sum())}
        destroy_parallel_context()
    return out


def _layouts(rank: int, world_size: int, layouts: dict) -> dict:
    out = {}
    for lname, overrides in layouts.items():
        for dname, kw in DATASETS.items():
            for per_token in (True, False):
                values = tiny_values(**VALUES, **overrides, calculate_per_token_loss=per_token)
                run = build_tiny_run(values, MarkovDataset(SEQ, **kw))
                idx = get_microbatch_indices(0, GBS, MBS, run.ctx.dp_rank, run.ctx.dp_size)
                run_forward_backward(run.model, fetch_step_microbatches(run.train_ds, idx), SEQ)
                grads = gather_full_grads(run)
                train(run)  # one iteration: its logged loss
                keep = run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0
                out[(lname, dname, per_token)] = {
                    "grads": grads if keep else {},
                    "loss": [r["loss"] for r in run.records],
                }
                destroy_parallel_context()
    return out


def _merge(per_rank: list[dict]) -> dict:
    merged = {}
    for rank_out in per_rank:
        for key, v in rank_out.items():
            m = merged.setdefault(key, {"grads": {}, "loss": []})
            m["grads"].update(v["grads"])
            m["loss"] = m["loss"] or v["loss"]
    return merged


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


@pytest.fixture(scope="module")
def results():
    merged = _merge(run_ranks(_layouts, 2, LAYOUTS))
    merged.update(_merge(run_ranks(_layouts, 8, LAYOUTS_8)))
    return merged


def _max_relative(grads: dict, ref: dict) -> float:
    assert set(grads) == set(ref)
    return max(float((grads[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref)


ALL = [(layout, d) for layout in [*LAYOUTS, *LAYOUTS_8] for d in DATASETS]


def test_reference_counts_are_uneven(reference):
    ds = MarkovDataset(SEQ, **DATASETS["uneven"])
    counts = [int(ds[i]["loss_mask"].sum()) for i in range(GBS)]
    assert counts[0] == counts[1] == 0 and len(set(counts)) >= 4, counts
    assert reference["uneven"]["valid"] == sum(counts)


@pytest.mark.parametrize("layout, dataset", ALL)
def test_gradient_is_that_of_the_global_token_mean(layout, dataset, results, reference):
    got = results[(layout, dataset, True)]["grads"]
    rel = _max_relative(got, reference[dataset]["grads"])
    assert rel <= 1e-5, f"{layout}/{dataset}: max relative gradient error {rel:.2e}"
    assert all(torch.isfinite(g).all() for g in got.values())


@pytest.mark.parametrize("layout, dataset", ALL)
def test_mean_of_means_differs_measurably(layout, dataset, results, reference):
    got = results[(layout, dataset, False)]["grads"]
    assert all(torch.isfinite(g).all() for g in got.values()), "zero-token micro-batch gave NaN"
    assert _max_relative(got, reference[dataset]["grads"]) > 1e-2


@pytest.mark.parametrize("layout, dataset", ALL)
def test_logged_loss_is_the_global_token_mean(layout, dataset, results, reference):
    (logged,) = results[(layout, dataset, True)]["loss"]
    assert math.isfinite(logged)
    assert logged == pytest.approx(reference[dataset]["loss"], rel=1e-6)
