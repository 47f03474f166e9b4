"""The optimizer step's one device-to-host copy and one-kernel weight copies give megatron-core's results.

References are megatron-core's own code paths, run in the same process on a second, identical run:
- its ``optimizer.step()`` (found-inf ``.item()``, norm ``.item()``, the loss scaler's update in
  ``prepare_grads``) against ``step_optimizer_fetching`` driven by the real loop (``train_one``) over
  10 steps: per-step losses, update applied, grad norm and loss scale, then every model parameter,
  bit for bit. --fp16 from a loss scale of 2**13 (two overflows, a back-off, growth after a window of 3 and
  overflows again: skipped steps at 1, 2, 7, 8), with the non-distributed and the distributed optimizer; and fp32 / bf16
  with --no-check-for-nan-in-loss-and-grad, whose last step has a NaN loss that both apply;
- its main-to-model weight copies (``_multi_tensor_copy_this_to_that``'s per-parameter ``copy_`` loop
  with --bf16, ``DistributedOptimizer._copy_main_params_to_model_params``) against our
  ``torch._foreach_copy_``, counted at the aten level (a TorchDispatchMode) after an optimizer step.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from tests.distributed.test_nan_guard import inject_nan

pytestmark = pytest.mark.distributed

STEPS = 10
BASE = dict(num_layers=2, global_batch_size=4, micro_batch_size=2, train_iters=100, log_interval=1000)


class AtenOps(TorchDispatchMode):
    """Counts the aten ops run inside it by name (``copy_``, ``_foreach_copy_``, ...)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def megatron_core_step(optimizer, check_for_nan, fetch=(), veto=None):
    """The reference: megatron-core's own step, then the loss reports copied (as before issue 30)."""
    from megatron_ext.training.optimizer import fetch_to_host

    assert veto is None
    success, grad_norm, _ = optimizer.step()
    return bool(success), grad_norm, fetch_to_host(fetch)[1]


def _train(values: dict, reference: bool, nan_at: int | None = None) -> tuple[list, list[torch.Tensor]]:
    from megatron_ext.training import step
    from megatron_ext.training.loop import LogWindow, train_one

    ours = step.step_optimizer_fetching
    step.step_optimizer_fetching = megatron_core_step if reference else ours
    run = None
    try:
        run = build_tiny_run(tiny_values(**BASE, **values), MarkovDataset(32, mask_every=1))
        if nan_at is not None:
            inject_nan(run, dp_rank=0, iterations={nan_at})
        window, history, per_step = LogWindow(), [], []
        for _ in range(STEPS):
            train_one(run, window, history)
            loss = [float(x) for x in window.iteration_losses[-1]]
            norm = window.iteration_scalars[-1][2]
            per_step.append((loss, window.advanced[-1], norm, float(run.optimizer.get_loss_scale())))
        params = [p.detach().clone() for chunk in run.model for p in chunk.parameters()]
    finally:
        step.step_optimizer_fetching = ours
        if run is not None and run.prefetcher is not None:
            run.prefetcher.close()
        destroy_parallel_context()
    return per_step, params


def _against_megatron_core(rank, world_size, values, nan_at):
    return [_train(values, reference, nan_at) for reference in (False, True)]


def _same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "values,nan_at",
    [
        (dict(fp16=True, initial_loss_scale=2.0**13, loss_scale_window=3), None),
        (dict(fp16=True, initial_loss_scale=2.0**13, loss_scale_window=3, use_distributed_optimizer=True), None),
        (dict(check_for_nan_in_loss_and_grad=False), STEPS),
        (dict(bf16=True, check_for_nan_in_loss_and_grad=False), STEPS),
    ],
    ids=["fp16", "fp16-distributed-optimizer", "fp32-no-nan-check", "bf16-no-nan-check"],
)
def test_one_copy_step_gives_megatron_cores_step(values, nan_at):
    (ours, ours_params), (upstream, upstream_params) = run_ranks(_against_megatron_core, 1, values, nan_at)[0]
    assert _same_value(ours, upstream), (ours, upstream)
    assert len(ours_params) == len(upstream_params)
    for a, b in zip(ours_params, upstream_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    applied = [s[1] for s in ours]
    if values.get("fp16"):  # the case covers overflows, their skip, back-off and growth
        scales = [s[3] for s in ours]
        assert not all(applied) and any(applied), ours
        assert min(scales) < 2.0**13 and any(b > a for a, b in zip(scales, scales[1:])), scales
    else:  # the NaN loss's update is applied, as megatron-core's step applies it with the guard off
        assert all(applied) and math.isnan(ours[-1][2]), ours
        assert any(bool(p.isnan().any()) for p in ours_params)


def _copies(child, ours, upstream, main_groups, destinations) -> dict:
    """Perturbs the main parameters, then runs ``ours`` and ``upstream`` (each from the same
    destinations) counting aten ops; returns the counts and whether the results agree."""
    g = torch.Generator().manual_seed(0)
    for group in main_groups:
        for p in group:
            p.data.add_(torch.randn(p.shape, generator=g) * 1e-2)
    before = [d.clone() for d in destinations]
    results = {}
    for name, copy in (("ours", ours), ("upstream", upstream)):
        for d, b in zip(destinations, before):
            d.copy_(b)
        with AtenOps() as counter:
            copy(child)
        results[name] = ([d.clone() for d in destinations], dict(counter.ops))
    (mine, mine_ops), (theirs, theirs_ops) = results["ours"], results["upstream"]
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(mine, theirs)),
        "changed": any(not torch.equal(a, b) for a, b in zip(mine, before)),
        "ours": mine_ops,
        "upstream": theirs_ops,
        "num_copies": sum(len(group) for group in main_groups),
    }


def _float16_optimizer_copy(rank, world_size):
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from megatron_ext.training.loop import LogWindow, train_one
    from megatron_ext.training.optimizer import _UPSTREAM_COPY_THIS_TO_THAT

    run = build_tiny_run(tiny_values(**BASE, bf16=True), MarkovDataset(32, mask_every=1))
    train_one(run, LogWindow(), [])  # an optimizer step: main parameters and Adam state exist
    (child,) = run.optimizer.chained_optimizers
    upstream_function = _UPSTREAM_COPY_THIS_TO_THAT[0]
    assert type(child).__name__ == "Float16OptimizerWithFloat16Params"
    assert upstream_function.__module__ == "megatron.core.optimizer.optimizer"

    def upstream(child):
        mcore_optimizer._multi_tensor_copy_this_to_that, ours = (
            upstream_function,
            mcore_optimizer._multi_tensor_copy_this_to_that,
        )
        try:
            child._copy_main_params_to_model_params()
        finally:
            mcore_optimizer._multi_tensor_copy_this_to_that = ours

    model_params = [p.data for group in child.float16_groups for p in group]
    out = _copies(
        child, type(child)._copy_main_params_to_model_params, upstream, child.fp32_from_float16_groups, model_params
    )
    destroy_parallel_context()
    return out


def _distributed_optimizer_copy(rank, world_size, bf16):
    from megatron_ext.training.loop import LogWindow, train_one
    from megatron_ext.training.optimizer import _UPSTREAM_COPY, foreach_copy_main_params_to_model_params

    values = tiny_values(**BASE, bf16=bf16, use_distributed_optimizer=True)
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    train_one(run, LogWindow(), [])
    (child,) = run.optimizer.chained_optimizers
    assert _UPSTREAM_COPY[0].__qualname__ == "DistributedOptimizer._copy_main_params_to_model_params"
    buffers = [bucket.param_data for buffer in child.buffers for bucket in buffer.buckets]
    mains = child.shard_fp32_from_float16_groups if bf16 else child.shard_fp32_groups
    out = _copies(child, foreach_copy_main_params_to_model_params, _UPSTREAM_COPY[0], mains, buffers)
    destroy_parallel_context()
    return out


def _check_copies(out, changes=True):
    assert out["num_copies"] > 1 and out["changed"] == changes and out["equal"], out
    assert out["ours"].get("_foreach_copy_") == 1 and "copy_" not in out["ours"], out["ours"]
    assert out["upstream"].get("copy_") == out["num_copies"], out["upstream"]  # the loop it replaces


def test_float16_optimizer_copies_main_to_model_in_one_foreach_copy():
    _check_copies(run_ranks(_float16_optimizer_copy, 1)[0])


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_distributed_optimizer_copies_main_to_model_in_one_foreach_copy(bf16):
    for out in run_ranks(_distributed_optimizer_copy, 2, bf16):  # DP = 2: each rank its own shard
        # (fp32 main shards are views of the parameter buffer: both copies write what is there)
        _check_copies(out, changes=bf16)
