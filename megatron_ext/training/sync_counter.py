"""Counting device-to-host synchronisations on a CPU build of torch (tests and ``bench/host_overhead.py``).

A CPU build has no device to wait for, so a sync is counted where one WOULD happen on a GPU: a call
that reads a tensor's values into Python. ``SyncCounter`` is a ``TorchFunctionMode`` entered on the
training thread (modes are per thread: the prefetch thread's copies are not seen, which is the
contract: only the training thread's syncs stall the GPU's launch queue) that records, per call site
(the innermost frame outside torch and this module), every call of:

- ``Tensor.item``, ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.__bool__`` / ``__float__`` / ``__int__``
  / ``__index__`` (``if t``, ``float(t)``, ``range(t)``), ``torch.equal``, ``torch.nonzero`` /
  ``Tensor.nonzero``;
- ``Tensor.cpu``, and ``Tensor.to`` with the string ``"cpu"`` (a device-to-host copy on a GPU). A
  ``torch.device`` target is a move to where another tensor lives (on a GPU run, the GPU): not counted.

Calls on tensors that live on the host on a GPU too cannot be told apart here. Calls made inside
torch's optimizers and ``clip_grad_norm_`` are not counted (their ``.item()`` reads the CPU step
counter of a non-capturable optimizer; on a GPU they make no device-to-host copy); ``exclude`` names
more call sites to leave out, and every count is reported by site so that a reader can check.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
SYNC_FUNCS = {
    _T.item: "item",
    _T.tolist: "tolist",
    _T.numpy: "numpy",
    _T.__bool__: "bool",
    _T.__float__: "float",
    _T.__int__: "int",
    _T.__index__: "index",
    torch.equal: "equal",
    torch.nonzero: "nonzero",
    _T.nonzero: "nonzero",
    _T.cpu: "cpu",
}
_SKIP = (os.path.dirname(torch.__file__), __file__)


_HOST_SIDE = tuple(
    os.path.join(os.path.dirname(torch.__file__), *p) for p in (("optim",), ("nn", "utils", "clip_grad.py"))
)


def _is_cpu_target(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str) and target.startswith("cpu")


def _inside_host_side_torch() -> bool:
    frame = sys._getframe(3)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_HOST_SIDE):
            return True
        frame = frame.f_back
    return False


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in ("site-packages/", "/megatron_ext/", "/bench/", "/tests/"):
        if marker in path:
            path = (
                marker.strip("/") + "/" + path.split(marker, 1)[1]
                if marker != "site-packages/"
                else path.split(marker, 1)[1]
            )
            break
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as c: ...`` -> ``c.total``, ``c.by_site`` {site: count}."""

    def __init__(self, exclude: tuple[str, ...] = ()):
        super().__init__()
        self.by_site: collections.Counter = collections.Counter()
        self.exclude = exclude
        self.thread = threading.get_ident()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = SYNC_FUNCS.get(func)
        if name is None and func is _T.to and _is_cpu_target(args, kwargs):
            name = "to(cpu)"
        if name is not None and threading.get_ident() == self.thread and not _inside_host_side_torch():
            site = _call_site()
            if not any(x in site for x in self.exclude):
                self.by_site[f"{name} @ {site}"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_site.values())
