"""Megatron-LM's --decoupled-lr / --decoupled-min-lr and --grad-reduce-in-bf16 on a tiny one-rank job.

--decoupled-lr: megatron-core puts the word embedding and the output layer (found here by name, not
by megatron-core's mark) in their own parameter group with the given peak and final LR, on the
same schedule shape. --grad-reduce-in-bf16: the DDP gradient buffers (main_grad) are bf16; the
gradients of one step (4 micro-batches) agree with those of fp32 buffers to 1% of each tensor's
norm (measured: at most 0.4%), not exactly: every accumulation is rounded to bf16.
"""

from __future__ import annotations

import pytest

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
from megatron_ext.training.step import run_forward_backward

pytestmark = pytest.mark.distributed

EMBEDDING_AND_OUTPUT = {"embedding.word_embeddings.weight", "output_layer.weight"}
GRAD_TOL = 1e-2  # |g(bf16 buffers) - g(fp32 buffers)| / |g(fp32 buffers)|, per tensor


def _one_rank(rank: int, world_size: int) -> dict:
    out = {}
    run = build_tiny_run(
        tiny_values(
            untie_embeddings_and_output_weights=True,
            lr=3e-3,
            min_lr=3e-4,
            decoupled_lr=6e-3,
            decoupled_min_lr=6e-4,
            lr_warmup_iters=4,
            lr_decay_style="cosine",
            train_iters=10,
        ),
        MarkovDataset(32),
    )
    names = {id(p): n for chunk in run.model for n, p in chunk.module.named_parameters()}
    run.scheduler.step(increment=run.global_batch_size)  # one step into the warm-up
    out["groups"] = [
        (sorted(names[id(p)] for p in g["params"]), g["max_lr"], g["min_lr"], g["lr"])
        for g in run.optimizer.param_groups
        if g["params"]
    ]
    destroy_parallel_context()
    for bf16_grads in (False, True):
        run = build_tiny_run(tiny_values(bf16=True, grad_reduce_in_bf16=bf16_grads), MarkovDataset(32, mask_every=1))
        indices = get_microbatch_indices(0, run.global_batch_size, 2, run.ctx.dp_rank, run.ctx.dp_size)
        run_forward_backward(run.model, fetch_step_microbatches(run.train_ds, indices), 32)
        out[bf16_grads] = {
            "buffers": {str(b.grad_dtype) for chunk in run.model for b in chunk.buffers},
            "main_grads": {str(p.main_grad.dtype) for chunk in run.model for p in chunk.parameters()},
            "grads": {k: v.float() for k, v in gather_full_grads(run).items()},
        }
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def result():
    (out,) = run_ranks(_one_rank, 1)
    return out


def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule(result):
    decoupled = [g for g in result["groups"] if set(g[0]) & EMBEDDING_AND_OUTPUT]
    others = [g for g in result["groups"] if not set(g[0]) & EMBEDDING_AND_OUTPUT]
    assert len(decoupled) == 1 and set(decoupled[0][0]) == EMBEDDING_AND_OUTPUT, result["groups"]
    assert others and all((max_lr, min_lr) == (3e-3, 3e-4) for _, max_lr, min_lr, _ in others)
    _, max_lr, min_lr, lr = decoupled[0]
    assert (max_lr, min_lr) == (6e-3, 6e-4)
    # one step into a 4-step warm-up: a quarter of each group's own peak
    assert lr == pytest.approx(6e-3 / 4) and all(g[3] == pytest.approx(3e-3 / 4) for g in others)


def test_grad_reduce_in_bf16_keeps_gradient_buffers_in_bf16(result):
    assert result[False]["buffers"] == {"torch.float32"} and result[False]["main_grads"] == {"torch.float32"}
    assert result[True]["buffers"] == {"torch.bfloat16"} and result[True]["main_grads"] == {"torch.bfloat16"}
    fp32, bf16 = result[False]["grads"], result[True]["grads"]
    assert fp32.keys() == bf16.keys()
    errors = {k: float((bf16[k] - fp32[k]).norm() / fp32[k].norm()) for k in fp32 if fp32[k].norm() > 0}
    print("relative gradient differences, bf16 vs fp32 buffers:", max(errors.values()))
    assert 0 < max(errors.values()) <= GRAD_TOL, errors  # rounded (not exact), within bf16's precision
