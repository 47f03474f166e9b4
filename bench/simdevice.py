"""A simulated accelerator: layers whose forward sleeps t_f and backward 2 t_f, t proportional to
tokens, so that wall time on this 2-core machine reflects the schedule and the P2P, not CPU
contention (a sleeping rank releases the CPU the way a rank waiting on a GPU kernel does).

Invariant: the cost of a layer is a pure function of its input's token count
(``seconds_per_token * tokens``, optionally ``+ attention_seconds_per_token2 * tokens**2`` per
row), whatever schedule runs it; its activation is its input (saved for backward, counted by
:class:`SavedTensorMeter`), so activation memory follows the schedule exactly.

Pieces:
- :class:`SimulatedCompute`: the autograd Function (sleep in forward and in backward).
- :class:`SimLayer`: one layer with one scalar weight (so outputs need gradients).
- :class:`SimChunk`: a megatron-core pipeline model chunk of SimLayers (``config``,
  ``model_type``, ``set_input_tensor``): runs through ``get_forward_backward_func()``.
- :class:`SimStage`: the same layers as a plain module, for ``torch.distributed.pipelining``.
- :class:`SplitSimLayer`: the same layer with its backward split in two autograd nodes, an input
  path (``t_B``) and a weight path (``t_W``), so that torch.distributed.pipelining's zero-bubble
  schedules can run the weight path later; under a ``WeightGradQueue`` capture (our runtime's B) the
  weight path queues its work instead, as the model side's linears do.
- :class:`SavedTensorMeter`: exact live / peak bytes of saved activations.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

SPIN_S = 0.0005  # time.sleep wakes ~0.1-0.3 ms late here: sleep to 0.5 ms before, then spin


def busy_wait(seconds: float) -> None:
    """Return ``seconds`` after the call, sleeping for all but the last 0.5 ms (a kernel launch
    would also return on time; an unloaded rank overshoots by ~10 us instead of ~0.2 ms)."""
    deadline = time.perf_counter() + seconds
    remaining = seconds
    while remaining > 0:
        if remaining > SPIN_S:
            time.sleep(remaining - SPIN_S)
        remaining = deadline - time.perf_counter()


class SimulatedCompute(torch.autograd.Function):
    """y = x * w after ``seconds``; backward takes ``2 * seconds``. Saves x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        busy_wait(seconds)
        ctx.save_for_backward(x)
        ctx.weight, ctx.seconds = weight.detach(), seconds
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        busy_wait(2 * ctx.seconds)
        (x,) = ctx.saved_tensors
        return grad * ctx.weight, (grad * x).sum().reshape(ctx.weight.shape), None


class _InputPath(torch.autograd.Function):
    """y = x * w after ``t_forward``; backward: dx = g * w after ``t_input`` (w comes in detached)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, t_forward: float, t_input: float) -> torch.Tensor:
        busy_wait(t_forward)
        ctx.weight, ctx.t_input = weight, t_input
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        busy_wait(ctx.t_input)
        return grad * ctx.weight, None, None, None


class _FreeEmbedding(torch.autograd.Function):
    """y = x * w at no cost, saving nothing (a real embedding saves token ids, not activations); its
    weight's gradient is 0. It only makes the first layer's input require grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight.detach()
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.weight, torch.zeros_like(ctx.weight)


def embed(x: torch.Tensor, weight: torch.nn.Parameter | None) -> torch.Tensor:
    return x if weight is None else _FreeEmbedding.apply(x, weight)


class _WeightPath(torch.autograd.Function):
    """0 in forward (free); backward: dw = sum(g * x) after ``t_weight``, deferred to the layer's
    queue while one captures. Keeps x, the activation, until its W ran (counted by the active
    ``SavedTensorMeter`` all that time, whether autograd or our W queue holds it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, t_weight: float, layer: SplitSimLayer) -> torch.Tensor:
        # kept on the context (not save_for_backward) so that the count follows x wherever it goes
        ctx.x, ctx.held = x, SavedTensorMeter.hold(x)
        ctx.t_weight, ctx.layer = t_weight, layer
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, held = ctx.x, [ctx.held]
        ctx.x = ctx.held = None  # moved: into the deferred W, or dropped below
        t_weight, weight = ctx.t_weight, ctx.layer.weight

        @torch.no_grad()  # as inside autograd's backward (a received output gradient requires grad)
        def run_w() -> None:
            busy_wait(t_weight)
            dw = (grad * x).sum().reshape(weight.shape)
            weight.grad = dw if weight.grad is None else weight.grad + dw
            held.clear()

        queue = ctx.layer.wgrad_queue
        if queue is not None and queue.defer(run_w):
            return None, None, None, None
        busy_wait(t_weight)
        held.clear()
        return None, (grad * x).sum().reshape(weight.shape), None, None


class SplitSimLayer(torch.nn.Module):
    """A SimLayer whose backward is two autograd nodes: input path (``t_input`` per token) and weight
    path (``t_weight`` per token); ``wgrad_queue``: where a captured W goes (None: never deferred)."""

    def __init__(self, seconds_per_token: float, input_seconds_per_token: float, weight_seconds_per_token: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.rates = (seconds_per_token, input_seconds_per_token, weight_seconds_per_token)
        self.wgrad_queue = None

    def forward(self, x: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        t_f, t_b, t_w = (rate * tokens for rate in self.rates)
        y = _InputPath.apply(x, self.weight.detach(), t_f, t_b)
        return y + _WeightPath.apply(x.detach(), self.weight, t_w, self)


class SimLayer(torch.nn.Module):
    """One simulated layer on [..., h] activations: tokens = numel / h."""

    def __init__(self, seconds_per_token: float, attention_seconds_per_token2: float = 0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seconds_per_token = seconds_per_token
        self.attention_seconds_per_token2 = attention_seconds_per_token2

    def get_seconds(self, x: torch.Tensor, seq_dim: int) -> float:
        tokens = x.numel() // x.shape[-1]
        rows = tokens // x.shape[seq_dim]
        return self.seconds_per_token * tokens + self.attention_seconds_per_token2 * rows * x.shape[seq_dim] ** 2

    def forward(self, x: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
        return SimulatedCompute.apply(x, self.weight, self.get_seconds(x, seq_dim))


class SimChunk(torch.nn.Module):
    """A megatron-core model chunk of ``num_layers`` SimLayers on [s, b, h] activations.

    The first virtual stage takes its input from the batch (no embedding), the others from
    ``set_input_tensor`` (what the schedule received from the previous stage)."""

    def __init__(
        self,
        config,
        num_layers: int,
        seconds_per_token: float,
        pre_process: bool,
        split: tuple[float, float] | None = None,
        embed: bool = False,
    ):
        """``split`` = (input, weight) seconds per token: SplitSimLayers (else SimLayers, backward 2x);
        ``embed``: the first stage scales its batch by a free parameter (a zero-cost embedding), so
        that its first layer's input requires grad and that layer's input path runs, as elsewhere."""
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = pre_process
        self.layers = torch.nn.ModuleList(
            SplitSimLayer(seconds_per_token, *split) if split else SimLayer(seconds_per_token)
            for _ in range(num_layers)
        )
        self.embedding = torch.nn.Parameter(torch.ones(())) if embed and pre_process else None
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        self.input_tensor = input_tensor[0]

    def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
        x = embed(batch, self.embedding) if self.pre_process else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            x = layer(x, seq_dim=0)
        return x


class SimStage(torch.nn.Module):
    """The same layers for ``torch.distributed.pipelining`` (batch-first [b, s, h])."""

    def __init__(
        self, num_layers: int, seconds_per_token: float, split: tuple[float, float] | None = None, embed: bool = False
    ):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            SplitSimLayer(seconds_per_token, *split) if split else SimLayer(seconds_per_token)
            for _ in range(num_layers)
        )
        self.embedding = torch.nn.Parameter(torch.ones(())) if embed else None  # SimChunk's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = embed(x, self.embedding)
        for layer in self.layers:
            x = layer(x, seq_dim=1)
        return x


class _Held:
    """One tensor counted by ``meter`` while this object lives."""

    __slots__ = ("meter", "tensor", "nbytes")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor):
        self.meter, self.tensor = meter, tensor
        self.nbytes = 0 if isinstance(tensor, torch.nn.Parameter) else tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self):
        self.meter.live -= self.nbytes


class SavedTensorMeter:
    """Exact bytes of tensors saved for backward (parameters excluded), live and peak.

    A saved tensor counts from the moment autograd saves it until autograd frees it (after its
    backward, or when the graph is dropped). A weight gradient deferred to a W queue keeps its
    layer's input alive after autograd let it go: ``hold`` counts it until the W ran (torch's
    zero-bubble schedules keep the same tensor as a saved tensor of their retained graph)."""

    active: SavedTensorMeter | None = None  # the meter tracking now (one per process)

    def __init__(self):
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        self.live = self.peak = 0

    @classmethod
    def hold(cls, tensor: torch.Tensor) -> _Held | None:
        """Count ``tensor`` while the returned token lives (None when no meter tracks)."""
        return _Held(cls.active, tensor) if cls.active is not None else None

    @contextlib.contextmanager
    def track(self) -> Iterator[SavedTensorMeter]:
        previous, SavedTensorMeter.active = SavedTensorMeter.active, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(self, t), lambda held: held.tensor):
                yield self
        finally:
            SavedTensorMeter.active = previous
