"""Our lean DDP grad-ready hooks (``model/grad_hooks.py``) train exactly as megatron-core's.

Two DP ranks, 3 steps of 2 micro-batches each, GPT-2 style (its tied embedding takes megatron-core's
``zero_out_wgrad`` path) and Llama style; with and without --overlap-grad-reduce (small buckets, so
several become ready one by one in the backward), with the distributed optimizer, and without
gradient-accumulation fusion (the hook adds each ``param.grad`` into ``main_grad``); and PP 2 under
ZBH1, whose layers run the deferred weights' hooks in W. Each run is made
twice: with our hooks and with megatron-core's (``DistributedDataParallel._make_backward_post_hook``
put back on our DDP class while it is built). At the entry of every step's finalize (after the last
hook, before the DP reduction ends) the gradient buffers, every ``param.grad`` and each bucket
group's readiness (its reduction started, its ready-count) must be the same, bit for bit, as must
the losses and the final parameters. A last check counts the Python calls of one step: ours make
fewer, by at least 3 per parameter.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import (
    LLAMA_STYLE,
    MarkovDataset,
    build_tiny_run,
    fetch_step_microbatches,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

LLAMA = LLAMA_STYLE
BASE = dict(num_layers=2, global_batch_size=8, micro_batch_size=2, train_iters=3, ddp_bucket_size=4000)
VARIANTS = {
    "plain": {},
    "llama": LLAMA,
    "--overlap-grad-reduce": dict(overlap_grad_reduce=True),
    "--use-distributed-optimizer": dict(use_distributed_optimizer=True),
    "distributed optimizer + overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True),
    "--no-gradient-accumulation-fusion": dict(gradient_accumulation_fusion=False, overlap_grad_reduce=True),
    # PP 2 x DP 1: the deferred weights' hooks are handed to their layers and run in W
    "ZBH1": dict(pipeline_model_parallel_size=2, pipeline_schedule="ZBH1", overlap_grad_reduce=True),
}


@contextlib.contextmanager
def megatron_core_hooks():
    """Our DDP class with megatron-core's grad-ready hooks while a run is built."""
    from megatron.core.distributed import DistributedDataParallel

    from megatron_ext.model.grad_hooks import LeanGradHookDDP

    ours = LeanGradHookDDP._make_backward_post_hook
    LeanGradHookDDP._make_backward_post_hook = DistributedDataParallel._make_backward_post_hook
    try:
        yield
    finally:
        LeanGradHookDDP._make_backward_post_hook = ours


def _snapshot(model) -> dict:
    params = [p for chunk in model for p in chunk.module.parameters()]
    groups = [g for chunk in model for g in chunk.bucket_groups]
    local = [] if model[0].ddp_config.overlap_grad_reduce else [b.grad_data.clone() for c in model for b in c.buffers]
    return {
        "local": local,  # the hooks' main_grads (under overlap, buckets may be reducing in place now)
        "grads": [p.grad for p in params],  # all None after the hooks
        "ready": [(g.grad_reduce_handle is not None, len(g.per_param_grad_ready_counts)) for g in groups],
    }


def _train(flags: dict, upstream: bool) -> dict:
    with megatron_core_hooks() if upstream else contextlib.nullcontext():
        run = build_tiny_run(tiny_values(**BASE, **flags), MarkovDataset(32, mask_every=1))
    config = run.model[0].config
    finalize, steps = config.finalize_model_grads_func, []

    def snapshotting_finalize(*args, **kwargs):
        step = _snapshot(run.model)
        out = finalize(*args, **kwargs)
        # after the reduction: a bucket that became ready in the backward may still be reducing at entry
        steps.append(dict(step, buffers=[b.grad_data.clone() for chunk in run.model for b in chunk.buffers]))
        return out

    config.finalize_model_grads_func = snapshotting_finalize
    train(run)
    config.finalize_model_grads_func = finalize
    params = {n: p.detach().clone() for chunk in run.model for n, p in chunk.named_parameters()}
    out = {"losses": [r["loss"] for r in run.records], "steps": steps, "params": params}
    if not flags:
        out["calls"] = _count_step_calls(run)
        out["num_params"] = len(params)
    destroy_parallel_context()
    return out


def _count_step_calls(run) -> int:
    """Python calls of one forward-backward (after a warm one)."""
    from megatron_ext.training.step import run_forward_backward

    rank, size = run.ctx.dp_rank, run.ctx.dp_size
    microbatches = fetch_step_microbatches(run.train_ds, [[4 * i + 2 * rank, 4 * i + 2 * rank + 1] for i in range(2)])
    run_forward_backward(run.model, microbatches, 32)
    profiler = cProfile.Profile()
    profiler.enable()
    run_forward_backward(run.model, microbatches, 32)
    profiler.disable()
    assert size == 2
    return pstats.Stats(profiler).total_calls


def _world(rank: int, world_size: int) -> dict:
    sides = ("ours", "megatron-core")
    return {name: {side: _train(flags, side == "megatron-core") for side in sides} for name, flags in VARIANTS.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 2, timeout=900)


def _assert_same(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", VARIANTS)
def test_lean_hooks_leave_megatron_cores_gradients_and_readiness(results, name):
    for rank in results:
        ours, ref = rank[name]["ours"], rank[name]["megatron-core"]
        assert len(ours["steps"]) == len(ref["steps"]) == BASE["train_iters"]
        for got, want in zip(ours["steps"], ref["steps"]):
            _assert_same(got["local"], want["local"])
            _assert_same(got["buffers"], want["buffers"])
            _assert_same(got["grads"], want["grads"])
            assert got["ready"] == want["ready"]
        assert ours["losses"] == ref["losses"]
        assert ours["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            assert torch.equal(ours["params"][k], v), k


def test_overlap_started_reductions_in_the_backward(results):
    """The readiness compared above is not vacuous: from the second step some bucket's reduction
    starts in the hooks."""
    for name in ("--overlap-grad-reduce", "distributed optimizer + overlap"):
        steps = results[0][name]["ours"]["steps"]
        assert any(started for started, _ in steps[-1]["ready"])
        assert len(steps[-1]["ready"]) > 1


def test_lean_hooks_make_fewer_python_calls(results):
    for rank in results:
        ours, ref = rank["plain"]["ours"], rank["plain"]["megatron-core"]
        # megatron-core's hook adds is_graph_capturing(), Tensor.__hash__ and id() per parameter
        # per micro-batch, getattr for each fused weight (2 micro-batches per rank)
        assert ref["calls"] - ours["calls"] >= 3 * 2 * ours["num_params"], (ref["calls"], ours["calls"])
