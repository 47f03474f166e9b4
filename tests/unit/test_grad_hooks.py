"""The lean grad-ready hook (``model/grad_hooks.py``) against megatron-core's own, case by case.

Both hooks are built for the same stand-in DDP (what ``_make_backward_post_hook`` reads: the
parameter-to-bucket-group map, ``ddp_config.overlap_grad_reduce``, ``force_all_reduce``) around a
real ``_ParamAndGradBucketGroup.register_grad_ready``, and run on twin parameters over every
combination of: a CUDA graph being captured, ``param.grad`` set or not, ``grad_added_to_main_grad``,
``zero_out_wgrad``, overlap, the last micro-batch or not, the first batch or not, a parameter without
a bucket. ``main_grad``, ``param.grad``, the ready counts and the reductions started must agree.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
from megatron.core.transformer import cuda_graphs

from megatron_ext.model.grad_hooks import build_grad_ready_hook


def _param(grad: bool, added: bool, zero_out: bool) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(3))
    param.main_grad = torch.arange(3.0)
    param.grad_added_to_main_grad = added
    if zero_out:
        param.zero_out_wgrad = True
    if grad:
        param.grad = torch.full((3,), 0.5)
    return param


def _bucket_group(param, overlap: bool, last: bool, first: bool):
    """A real bucket group's register_grad_ready over the state it reads; start_grad_sync recorded."""
    group = object.__new__(_ParamAndGradBucketGroup)
    group.ddp_config = types.SimpleNamespace(overlap_grad_reduce=overlap)
    group.is_last_microbatch, group.is_first_batch = last, first
    group.params, group.param_to_bucket = [param], {param: None}
    group.per_param_grad_ready_counts = {}
    group.golden_per_param_grad_ready_counts = {param: 1}
    group.started = []
    group.start_grad_sync = lambda force_all_reduce: group.started.append(force_all_reduce)
    return group


def _run(make_hook, case: dict) -> dict:
    param = _param(case["grad"], case["added"], case["zero_out"])
    group = _bucket_group(param, case["overlap"], case["last"], case["first"])
    ddp = types.SimpleNamespace(
        param_to_bucket_group={param: group} if case["in_bucket"] else {},
        ddp_config=types.SimpleNamespace(overlap_grad_reduce=case["overlap"]),
        force_all_reduce=True,
    )
    hook = make_hook(ddp, param)
    cuda_graphs._IS_GRAPH_CAPTURING = case["capturing"]
    try:
        hook(None, None)
    finally:
        cuda_graphs._IS_GRAPH_CAPTURING = False
    return {
        "main_grad": param.main_grad.tolist(),
        "grad": None if param.grad is None else param.grad.tolist(),
        "counts": list(group.per_param_grad_ready_counts.values()),
        "started": group.started,
    }


KEYS = ("capturing", "grad", "added", "zero_out", "overlap", "last", "first", "in_bucket")
CASES = [
    dict(zip(KEYS, values))
    for values in itertools.product((False, True), repeat=len(KEYS))
    if not (values[KEYS.index("overlap")] and not values[KEYS.index("grad")])  # upstream asserts
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(k for k in KEYS if c[k]) or "none")
def test_lean_hook_has_megatron_cores_effects(case):
    got = _run(build_grad_ready_hook, case)
    assert got == _run(DistributedDataParallel._make_backward_post_hook, case)


def test_the_cases_reach_every_effect():
    """The comparison above is not vacuous: some case adds, some starts a reduction."""
    runs = [_run(DistributedDataParallel._make_backward_post_hook, c) for c in CASES]
    assert any(r["main_grad"] != [0.0, 1.0, 2.0] for r in runs)
    assert any(r["started"] for r in runs) and any(r["counts"] for r in runs)
    assert any(r["grad"] is not None for r in runs) and any(r["grad"] is None for r in runs)


def test_overlap_without_a_gradient_fails_as_megatron_cores():
    case = dict(dict.fromkeys(KEYS, False), overlap=True, in_bucket=True)
    for make_hook in (build_grad_ready_hook, DistributedDataParallel._make_backward_post_hook):
        with pytest.raises(AssertionError, match="overlap_grad_reduce"):
            _run(make_hook, case)
