"""Deferred weight gradients: the W of a zero-bubble schedule's B/W split.

A backward pass computes two things per linear layer: the input gradient (B), which the previous
pipeline stage waits for, and the weight gradient (W), which nothing waits for until the optimizer
step. A zero-bubble schedule runs B at once and W later, in a bubble. While a backward runs inside
``queue.capture(key)``, a layer that supports deferral hands its W to ``queue.defer(fn)`` instead of
running it; ``queue.run(key)`` runs them later, in the order they were deferred.

Invariant: every deferred W runs exactly once, in the order it was deferred within its key; keys
run in the order the schedule asks (a schedule runs micro-batch i's W before micro-batch i+1's on
the same chunk, so each gradient buffer accumulates micro-batches in 1F1B's order); ``pending()``
is 0 at the end of every step (the runtime checks it).

Why a plain attribute and not a thread-local: on CUDA, autograd runs a backward on its device
thread while the calling thread waits, so the queue a layer sees must not depend on the thread.
Layers get the queue passed in (an attribute set when the schedule is built), not from a global.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator


class WeightGradQueue:
    """Deferred weight-gradient work, grouped by a key (e.g. (chunk, micro-batch))."""

    def __init__(self) -> None:
        self._pending: OrderedDict[Hashable, list[Callable[[], None]]] = OrderedDict()
        self._capturing: Hashable | None = None

    @property
    def capturing(self) -> bool:
        return self._capturing is not None

    @contextlib.contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Defer the W of backward passes run inside this block under ``key``."""
        if self._capturing is not None:
            raise RuntimeError(f"W capture for {key!r} started inside the capture for {self._capturing!r}")
        if key in self._pending:
            raise RuntimeError(f"W of {key!r} captured twice before it ran")
        self._pending[key] = []
        self._capturing = key
        try:
            yield
        finally:
            self._capturing = None

    def defer(self, fn: Callable[[], None]) -> bool:
        """Queue ``fn`` under the key being captured; False (and nothing queued) outside a capture,
        where the caller runs its W itself, at once."""
        if self._capturing is None:
            return False
        self._pending[self._capturing].append(fn)
        return True

    def run(self, key: Hashable) -> int:
        """Run (and forget) the W deferred under ``key``, in order; returns how many ran."""
        if key not in self._pending:
            raise RuntimeError(f"no W captured for {key!r}")
        if self._capturing == key:
            raise RuntimeError(f"W of {key!r} run inside its own capture")
        work = self._pending.pop(key)
        for fn in work:
            fn()
        return len(work)

    def pending(self) -> int:
        """Keys captured whose W has not run yet."""
        return len(self._pending)

    def pending_keys(self) -> list[Hashable]:
        return list(self._pending)

    def pending_work(self) -> list[Callable[[], None]]:
        """The deferred W not run yet, all keys, in order (for inspection: what they hold)."""
        return [fn for work in self._pending.values() for fn in work]
