"""CPU/gloo platform layer: megatron-core's training stack on a machine with no GPU.

Invariant: while the layer is active, every device that megatron-core names as CUDA
(``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, an integer ordinal) resolves to the CPU,
``torch.cuda.current_device()`` answers the CPU device itself (so that code running outside the
mode, such as a custom autograd backward, allocates there too), the few ``torch.cuda`` helpers the
schedules, DDP and optimizer call are harmless stand-ins, and megatron-core's model-parallel
RNG tracker keeps its named states as CPU generator states. When a CUDA device is used the
layer does nothing at all (``apply_cpu_platform`` returns without touching anything).

Mechanism (see ``docs/megatron-core-on-cpu.md``): one process-wide
``TorchFunctionMode`` rewrites CUDA device arguments and answers the optimizer's
``param.type() == 'torch.cuda.FloatTensor'`` checks; a handful of ``torch.cuda`` attributes are
replaced; the RNG tracker is our CPU subclass. Measured cost: per-call interception is within
noise at the op sizes we train with.

The call sites this was checked against are registered in ``megatron_ext/compat.py`` with the
megatron-core version they were checked against; ``tests/unit/test_compat.py`` fails loudly when
another version is installed or a call site moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.config import ConfigError

# (module attribute path, replacement) pairs installed on torch.cuda while active.
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda


def is_cuda_device(device: Any) -> bool:
    """True when ``device`` names a CUDA device (string, torch.device or integer ordinal)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An integer device means a CUDA ordinal in torch (device=0 is cuda:0); bool is not a device.
    return isinstance(device, int) and not isinstance(device, bool)


def cuda_type_name(type_name: str) -> str:
    """Map a CPU tensor type name to the CUDA name megatron-core's checks expect.

    >>> cuda_type_name("torch.FloatTensor")
    'torch.cuda.FloatTensor'
    """
    if type_name.startswith("torch.") and not type_name.startswith("torch.cuda."):
        return "torch.cuda." + type_name[len("torch.") :]
    return type_name


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TO:
            args = tuple("cpu" if (i > 0 and is_cuda_device(a)) else a for i, a in enumerate(args))
        elif func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            # megatron-core's optimizers accept only 'torch.cuda.*Tensor' parameters.
            return cuda_type_name(func(*args))
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()


class _NullEvent:
    """Stand-in for torch.cuda.Event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _make_noop(name: str) -> Callable[..., None]:
    # One function object per replaced name: torch._dynamo keys its rules by function object
    # and asserts when one object stands for names with different rules.
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_{name}"
    return noop


def _cuda_stand_ins() -> dict[str, Any]:
    return {
        # The CPU itself, not ordinal 0: code that runs outside the mode (a custom autograd
        # backward runs inside the mode's own handler of torch.autograd.backward, where the mode is
        # off) allocates on it as given, e.g. megatron-core's linear backward under
        # gradient-accumulation fusion: torch.empty(..., device=torch.cuda.current_device()).
        "current_device": lambda: torch.device("cpu"),
        "synchronize": _make_noop("synchronize"),
        "empty_cache": _make_noop("empty_cache"),
        "Stream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda *a, **k: _NullStream(),
        "default_stream": lambda *a, **k: _NullStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "set_device": _make_noop("set_device"),
    }


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def build_cpu_rng_tracker_class() -> type:
    """megatron-core's RNG tracker with named states kept as CPU generator states.

    ``fork(name)`` swaps the CPU generator to the named state and back, exactly as the CUDA
    tracker does with the device generator (the CPU generator plays the device's role here).
    """
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            generator = torch.Generator().manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


@dataclasses.dataclass
class PlatformHandle:
    """What ``apply_cpu_platform`` changed, so that ``remove`` can put it back."""

    active: bool
    restore: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    mode: CudaToCpuMode | None = None

    def remove(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        for undo in reversed(self.restore):
            undo()
        self.restore.clear()
        self.active = False


_ACTIVE: PlatformHandle | None = None


def _set_attr(handle: PlatformHandle, obj: Any, name: str, value: Any) -> None:
    had = hasattr(obj, name)
    old = getattr(obj, name, None)
    setattr(obj, name, value)
    handle.restore.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))


def apply_cpu_platform(device: torch.device) -> PlatformHandle:
    """Make megatron-core run on the CPU when ``device`` is the CPU; no-op for a CUDA device.

    Idempotent: a second call while active returns the active handle.
    """
    global _ACTIVE
    if device.type == "cuda":
        return PlatformHandle(active=False)
    if _ACTIVE is not None and _ACTIVE.active:
        return _ACTIVE
    import warnings

    from megatron.core.tensor_parallel import random as mcore_random

    # megatron-core's TP linear layers advise CUDA_DEVICE_MAX_CONNECTIONS=1: meaningless on the CPU
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    handle = PlatformHandle(active=True)
    for name, value in _cuda_stand_ins().items():
        _set_attr(handle, torch.cuda, name, value)
    _set_attr(handle, mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _set_attr(handle, mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    _set_attr(handle, mcore_random, "CudaRNGStatesTracker", build_cpu_rng_tracker_class())
    # Replace any tracker built before we were applied.
    _set_attr(handle, mcore_random, "_CUDA_RNG_STATE_TRACKER", None)
    _set_attr(handle, mcore_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    handle.mode = CudaToCpuMode()
    handle.mode.__enter__()
    _ACTIVE = handle
    return handle


def remove_cpu_platform() -> None:
    """Undo ``apply_cpu_platform`` (tests use it to check the layer leaves no trace)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.remove()
        _ACTIVE = None


def quiet_known_warnings() -> None:
    """Silence the warnings megatron-core and torch print on every CPU run, all expected here:
    no Transformer Engine/Apex, deprecated gloo collective names, the non-leaf ``.grad``
    access megatron-core's schedules make, and torch's ShardedTensor and ``load_state_dict``
    deprecations, which every rank printed on every resume (megatron-core's torch_dist load goes
    through both; nothing a user can change). (CUDA tuning advice is silenced by ``apply_cpu_platform``, on the
    CPU only: on a GPU it is advice worth reading.)"""
    import warnings

    for pattern in (
        ".*Transformer Engine and Apex are not installed.*",
        ".*Apex is not installed.*",
        ".*is deprecated. Please use `torch.distributed.*",
        ".*The .grad attribute of a Tensor that is not a leaf Tensor.*",
        ".*full scope is deprecated.*",
        ".*Please use DTensor instead and we are deprecating ShardedTensor.*",
        ".*`load_state_dict` is deprecated and will be removed in future versions.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def select_device(requested: str = "auto") -> torch.device:
    """The device this process trains on (``--device``): ``auto`` is its local CUDA device when
    CUDA is available, else the CPU; ``cpu`` forces the CPU/gloo path; ``cuda`` insists on a GPU."""
    import os

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            [
                f"--device {requested}: no CUDA device is visible (torch {torch.__version__}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): use --device cpu"
            ]
        )
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:  # more processes on this node than GPUs (torch.cuda.set_device: invalid device ordinal)
        # the same text on every surplus rank, so that it is reported once per node
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        started = (
            f"{local_world} processes on this node (LOCAL_WORLD_SIZE)" if local_world else f"LOCAL_RANK {local_rank}"
        )
        raise ConfigError(
            [
                f"{started}, {count} CUDA devices visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start one process per GPU "
                f"(NPROC_PER_NODE={count} launch/torchrun.sh, torchrun --nproc-per-node {count}), "
                f"or --device cpu"
            ]
        )
    return torch.device("cuda", local_rank)


def get_collective_device(group: Any = None) -> torch.device:
    """Where a small tensor for a collective over ``group`` must live: NCCL needs the current
    CUDA device, gloo the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
