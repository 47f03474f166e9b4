"""CPU platform layer: its megatron-core call sites still exist; maps CUDA devices to
the CPU while active; a no-op for a CUDA device; leaves no trace when removed."""

from __future__ import annotations

import torch

from megatron_ext import cpu_platform as platform


def test_cuda_call_sites_still_exist_where_checked():
    """The call sites the layer answers; if a release moves them, this fails loudly."""
    import inspect

    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random

    assert 'device="cuda"' in inspect.getsource(schedules.forward_backward_pipelining_with_interleaving)
    assert "torch.cuda.current_device()" in inspect.getsource(p2p_communication)
    assert "'torch.cuda.FloatTensor'" in inspect.getsource(optimizer.Float16OptimizerWithFloat16Params)
    assert "device='cuda'" in inspect.getsource(clip_grads.get_grad_norm_fp32)
    assert hasattr(random, "_get_cuda_rng_state") and hasattr(random, "_set_cuda_rng_state")
    assert hasattr(random, "CudaRNGStatesTracker")


def test_device_mapping_and_removal():
    platform.apply_cpu_platform(torch.device("cpu"))
    try:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1).to("cuda:0").device.type == "cpu"
        assert torch.nn.Parameter(torch.zeros(1)).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.float64).type(torch.float32).dtype == torch.float32
    finally:
        platform.remove_cpu_platform()
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert torch.cuda.Stream is not platform._NullStream
    try:
        torch.zeros(1, device="cuda")
        raised = False
    except (RuntimeError, AssertionError):
        raised = True
    assert raised, "after removal, CUDA devices must not silently map to the CPU"


def test_noop_for_cuda_device():
    before = (torch.cuda.current_device, torch.cuda.synchronize)
    handle = platform.apply_cpu_platform(torch.device("cuda", 0))
    assert handle.active is False and handle.mode is None
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before


def test_rng_tracker_forks_named_cpu_states():
    platform.apply_cpu_platform(torch.device("cpu"))
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("a", 7)
        torch.manual_seed(0)
        outer = torch.get_rng_state()
        with tracker.fork("a"):
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outer), "fork must restore the outer state"
        with tracker.fork("a"):
            second = torch.rand(3)
        expected = torch.rand(6, generator=torch.Generator().manual_seed(7))
        assert torch.equal(torch.cat([first, second]), expected)
    finally:
        platform.remove_cpu_platform()


def test_known_warnings_are_quiet_and_others_are_not():
    """torch's ShardedTensor and ``load_state_dict`` deprecations (printed by every rank on every
    resume: megatron-core's torch_dist load goes through both) are silenced; an unrelated warning
    still shows."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard._utils import DEPRECATE_MSG

    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        platform.quiet_known_warnings()
        warnings.warn(DEPRECATE_MSG, FutureWarning, stacklevel=1)
        # megatron-core 0.16.1's torch_dist load calls torch.distributed.checkpoint.load_state_dict
        warnings.warn(dcp.load_state_dict.__deprecated__, FutureWarning, stacklevel=1)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning, stacklevel=1)
        warnings.warn("something users should read", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something users should read"]
