"""training/step.py's ``set_current_microbatch`` (installed in megatron-core's schedules) leaves every
layer as megatron-core 0.16.1's own function does, with fewer Python calls: checked against it."""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
from megatron.core.pipeline_parallel import schedules

from megatron_ext.training.step import install_lean_set_current_microbatch, set_current_microbatch

UPSTREAM = schedules.set_current_microbatch


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)


class _MtpLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_layer = _Layer()


class _Model(torch.nn.Module):
    """What get_attr_wrapped_model unwraps to: a decoder with layers (and, optionally, MTP layers)."""

    def __init__(self, mtp: bool):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_Layer() for _ in range(4))
        if mtp:
            self.mtp = torch.nn.Module()
            self.mtp.layers = torch.nn.ModuleList(_MtpLayer() for _ in range(2))


class _Wrapper(torch.nn.Module):
    """DDP / Float16Module's shape: the model under ``.module``."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.module = inner


def _marks(model: torch.nn.Module) -> list:
    return [(name, m.__dict__.get("current_microbatch", "unset")) for name, m in model.named_modules()]


def _calls(fn, *args) -> int:
    profiler = cProfile.Profile()
    profiler.enable()
    fn(*args)
    profiler.disable()
    return pstats.Stats(profiler).total_calls


@pytest.mark.parametrize("mtp", [False, True], ids=["decoder", "decoder+mtp"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
def test_the_same_marks_as_megatron_cores_with_fewer_calls(mtp, wrapped):
    assert UPSTREAM.__module__ == schedules.__name__  # megatron-core's own, not ours installed earlier
    models = [_Model(mtp), _Model(mtp)]
    theirs, ours = (_Wrapper(m) if wrapped else m for m in models)
    for microbatch in (0, 3, 7):
        UPSTREAM(theirs, microbatch)
        set_current_microbatch(ours, microbatch)
        assert _marks(ours) == _marks(theirs)
        assert {mark for _, mark in _marks(ours)} >= {microbatch}
    assert _calls(set_current_microbatch, ours, 1) < _calls(UPSTREAM, theirs, 1) / 2


def test_a_model_without_a_decoder_is_left_alone_as_upstream():
    theirs, ours = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    UPSTREAM(theirs, 5)
    set_current_microbatch(ours, 5)
    assert "current_microbatch" not in ours.__dict__ and "current_microbatch" not in theirs.__dict__


def test_installed_where_megatron_cores_forward_step_looks_it_up():
    try:
        install_lean_set_current_microbatch()
        assert schedules.set_current_microbatch is set_current_microbatch
    finally:
        schedules.set_current_microbatch = UPSTREAM
