"""Layout parity: every TP/PP/VPP/DP layout trains the same model as one process.

Same tiny model, data, seed, global batch and fp32 everywhere. For each layout:
(a) the step-1 gradient of every parameter, gathered to full tensors, equals the single-process
one; (b) the per-iteration loss over 20 iterations matches the single-process run; (c) gradient
clipping is active (clip threshold below the measured norms), so a wrong global grad norm shows.
The model must learn in those iterations, so that a wrong gradient shows in the losses too.

Worlds are forked from the test process: one 1-rank reference, one 2-rank world running its
layouts one after the other, one 8-rank world for TP2 x PP2 x VPP2 x DP2 (Llama style with
sequence parallelism).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import (
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

ITERS = 20
CLIP = 0.3  # below the grad norms of this model and data: clipping scales every step
BASE = dict(train_iters=ITERS, clip_grad=CLIP, global_batch_size=8, micro_batch_size=2)
# Llama style: RMSNorm, SwiGLU (gated fc1, sharded as [gate; up] per TP rank), RoPE, GQA, untied.
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    group_query_attention=True,
    num_query_groups=2,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    ffn_hidden_size=128,
)

TWO_RANK_LAYOUTS = {
    "TP2": (dict(tensor_model_parallel_size=2), 1e-5),
    "PP2": (dict(pipeline_model_parallel_size=2), 1e-6),
    "PP2+VPP2": (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1), 1e-6),
    "DP2+distopt": (dict(use_distributed_optimizer=True), 1e-5),
    "llama TP2": (dict(tensor_model_parallel_size=2, **LLAMA), 1e-5),
    # sequence parallelism on the local spec (model/norm.py): norm gradients summed over TP
    "TP2+SP": (dict(tensor_model_parallel_size=2, sequence_parallel=True), 1e-5),
    "llama TP2+SP": (dict(tensor_model_parallel_size=2, sequence_parallel=True, **LLAMA), 1e-5),
}
EIGHT_RANK_LAYOUTS = {
    "TP2xPP2xVPP2xDP2": (
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            use_distributed_optimizer=True,
        ),
        1e-5,
    ),
    "llama TP2xPP2xVPP2xDP2+SP": (
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=1,
            sequence_parallel=True,
            **LLAMA,
        ),
        1e-5,
    ),
}


def _run_layouts(rank: int, world_size: int, layouts: list[dict]) -> list[dict]:
    """Each layout: step-1 full grads of this rank's params, then 20 training iterations."""
    out = []
    for overrides in layouts:
        run = build_tiny_run(tiny_values(**BASE, **overrides), MarkovDataset(32, mask_every=1))
        indices = get_microbatch_indices(0, run.global_batch_size, 2, run.ctx.dp_rank, run.ctx.dp_size)
        run_forward_backward(run.model, fetch_step_microbatches(run.train_ds, indices), 32)
        grads = gather_full_grads(run)
        train(run)
        keep = run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0
        out.append({"grads": grads if keep else {}, "records": run.records})
        destroy_parallel_context()
    return out


def _merge(per_rank: list[list[dict]], i: int) -> tuple[dict, list[dict]]:
    grads, records = {}, []
    for rank_out in per_rank:
        grads.update(rank_out[i]["grads"])
        records = records or rank_out[i]["records"]
    return grads, records


@pytest.fixture(scope="module")
def reference():
    """Single-process results by model style."""
    (out,) = run_ranks(_run_layouts, 1, [{}, LLAMA])
    return {"gpt2": _merge([out], 0), "llama": _merge([out], 1)}


def _style(name: str) -> str:
    return "llama" if name.startswith("llama") else "gpt2"


@pytest.fixture(scope="module")
def two_rank_results():
    per_rank = run_ranks(_run_layouts, 2, [v[0] for v in TWO_RANK_LAYOUTS.values()])
    return {name: _merge(per_rank, i) for i, name in enumerate(TWO_RANK_LAYOUTS)}


@pytest.fixture(scope="module")
def eight_rank_results():
    per_rank = run_ranks(_run_layouts, 8, [v[0] for v in EIGHT_RANK_LAYOUTS.values()])
    return {name: _merge(per_rank, i) for i, name in enumerate(EIGHT_RANK_LAYOUTS)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_reference_learns_and_clips(style, reference):
    _, records = reference[style]
    losses = [r["loss"] for r in records]
    assert len(losses) == ITERS
    assert losses[-1] < losses[0] - 0.3, losses
    # clipping active: the measured (pre-clip) norm exceeds the threshold
    assert sum(r["grad_norm"] > CLIP for r in records) >= ITERS // 2


def _check_layout(name: str, result, reference, tol: float) -> None:
    grads, records = result
    ref_grads, ref_records = reference
    assert set(grads) == set(ref_grads), f"{name}: parameters differ"
    worst = max(ref_grads, key=lambda k: _relative(grads[k], ref_grads[k]))
    assert _relative(grads[worst], ref_grads[worst]) <= tol, (
        f"{name}: step-1 gradient of {worst} differs by {_relative(grads[worst], ref_grads[worst]):.2e}"
    )
    losses = torch.tensor([r["loss"] for r in records], dtype=torch.float64)
    ref_losses = torch.tensor([r["loss"] for r in ref_records], dtype=torch.float64)
    assert losses.shape == ref_losses.shape
    rel = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
    assert rel <= tol, f"{name}: losses differ by {rel:.2e}:\n{losses}\n{ref_losses}"
    norms = torch.tensor([r["grad_norm"] for r in records])
    ref_norms = torch.tensor([r["grad_norm"] for r in ref_records])
    # norms are more sensitive to summation order than losses; a miscounted shard is >> 1e-3
    assert ((norms - ref_norms).abs() / ref_norms).max().item() <= 1e-3


@pytest.mark.parametrize("name", list(TWO_RANK_LAYOUTS))
def test_two_rank_layouts_match_single_process(name, two_rank_results, reference):
    _check_layout(name, two_rank_results[name], reference[_style(name)], TWO_RANK_LAYOUTS[name][1])


@pytest.mark.parametrize("name", list(EIGHT_RANK_LAYOUTS))
def test_eight_rank_layout_matches_single_process(name, eight_rank_results, reference):
    _check_layout(name, eight_rank_results[name], reference[_style(name)], EIGHT_RANK_LAYOUTS[name][1])
