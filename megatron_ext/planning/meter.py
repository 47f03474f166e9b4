"""Exact bytes autograd keeps for the backward, counted once per storage, live and peak.

``SavedBytesMeter.track()`` installs ``torch.autograd.graph.saved_tensors_hooks``: every tensor an
autograd node saves is held by a token until autograd drops it (after the node's backward, or with
its graph). A storage counts once however many nodes save it or views of it (a residual saved by
the norm and by the add, q/k/v views of one QKV output): that is what the allocator holds, unlike a
per-tensor count (``bench/simdevice.SavedTensorMeter``), which counts a storage once per save.
Parameter storages (and views of them) are not activations and are left out; so is what lives
outside autograd (the schedule's own tensor lists, communication buffers, logits freed before the
loss's backward, allocator slack): the memory model states those separately.

``attribute(module, name)`` labels what is saved while ``module``'s forward runs (forward hooks);
``by_label`` then splits the bytes live now by the label they were first saved under (the innermost
labelled module wins, the rest is ``""``). Live, not ever saved: a checkpointed layer's forward
(full recompute) runs megatron-core's bias-dropout-add under ``enable_grad``, whose dropout masks
are saved and dropped with that inner graph before the layer returns; they are not held until the
backward. One meter per process; CPU and CUDA alike.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator

import torch


class _Token:
    """One saved tensor; its storage counts while any token of it lives."""

    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: SavedBytesMeter, tensor: torch.Tensor):
        self.meter, self.tensor, self.key = meter, tensor, None
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in meter.excluded or tensor.device.type == "meta":
            return
        self.key = (tensor.device, ptr)
        meter._acquire(self.key, storage.nbytes())

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class SavedBytesMeter:
    """Live and peak bytes of the storages autograd saved (module docstring)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.live = 0
        self.peak = 0
        self._count: dict[tuple, int] = collections.Counter()
        self._nbytes: dict[tuple, int] = {}
        self._label_of: dict[tuple, str] = {}
        self._labels: list[str] = []
        self.by_label: dict[str, int] = collections.Counter()  # live bytes by the label first saved under

    def reset_peak(self) -> None:
        self.peak = self.live

    def _acquire(self, key: tuple, nbytes: int) -> None:
        self._count[key] += 1
        if self._count[key] == 1:
            self._nbytes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            label = self._labels[-1] if self._labels else ""
            self._label_of[key] = label
            self.by_label[label] += nbytes

    def _release(self, key: tuple) -> None:
        self._count[key] -= 1
        if self._count[key] == 0:
            del self._count[key]
            nbytes = self._nbytes.pop(key)
            self.live -= nbytes
            self.by_label[self._label_of.pop(key)] -= nbytes

    def hold(self, tensor: torch.Tensor) -> object:
        """Count ``tensor``'s storage (once, as any save of it) while the returned token lives: what
        code outside autograd keeps for the backward (a deferred weight gradient's tensors)."""
        return _Token(self, tensor)

    @contextlib.contextmanager
    def track(self) -> Iterator[SavedBytesMeter]:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Token(self, t), lambda token: token.tensor):
            yield self

    def attribute(self, module: torch.nn.Module, label: str) -> list:
        """Label what ``module``'s forward saves; returns the hook handles (``remove()`` them)."""

        def enter(*_):
            self._labels.append(label)

        def leave(*_):
            self._labels.pop()

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def measure_state_bytes(model: Iterable[torch.nn.Module], optimizer) -> tuple[int, int, int]:
    """(weight, DDP gradient-buffer, optimizer-state bytes) this rank allocated, as ``memory.StateBytes``
    predicts them: the chunks' parameters, their DDP buffers' ``grad_data`` (bucket padding included),
    and every storage the optimizer holds that is not a model weight (fp32 main parameters, Adam's
    moments; a chained optimizer's children each), once per storage. Call after an optimizer step."""
    params = [p for chunk in model for p in chunk.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for chunk in model for b in chunk.buffers)
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    seen, held = set(), 0
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = child.optimizer
        tensors = [p for g in inner.param_groups for p in g["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in model_storages and ptr not in seen:
                seen.add(ptr)
                held += t.untyped_storage().nbytes()
    return weights, grads, held
