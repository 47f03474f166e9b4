"""One small runtime: executes this rank's action list (``actions.py``) on megatron-core model chunks.

Per action, on local chunk c of stage s, micro-batch mb:
- F: megatron-core's ``schedules.forward_step`` (our forward_step_func, the chunk's own data
  iterator, set_input_tensor, Float16Module, the loss and its token count on the last stage), then
  the output goes to stage s+1 (P2P send or local hand-over) and is deallocated as megatron-core does.
- B: ``schedules.backward_step`` inside ``queue.capture((c, mb))``: layers that defer their weight
  gradient queue it; the input gradient goes to stage s-1. On stage 0 nothing waits for the input
  gradient, so its B does nothing and its W runs the whole backward, B part (captured) then W
  (torch.distributed.pipelining's choice, which the orders are generated for).
- W: ``queue.run((c, mb))`` (through ``weight_step``, which ``--pp-timeline`` wraps).
- BW: the whole backward (orders that do not split it).

DDP (agreed with the model side): every B and W of a chunk runs inside that chunk's ``no_sync()``
except the B and the W of its last micro-batch, so non-deferred parameters (hooks in B) are ready
in the last B and deferred ones (hooks moved to W) in the last W: no bucket's reduce starts before
its last W. ``config.param_sync_func`` (--overlap-param-gather) is dispatched for every chunk at the
step's start, ``config.grad_sync_func`` after a chunk's last W. Then ``finalize_model_grads_func``
with the step's token count, as megatron-core's schedules call it. ``queue.pending() == 0`` at the
end of every step (raised otherwise).

P2P: ``p2p.py`` (megatron-core's P2PCommunicator, non-blocking sends, receives posted in the
sender's order ``LOOKAHEAD`` actions ahead). Refused here (``validate.py`` says so earlier, by
flag): megatron-core's variable-length shape handshake (blocking, it would deadlock out of order).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_ext.pipeline.actions import BW, Action, B, F, PipelineOrder, W
from megatron_ext.pipeline.p2p import P2PChannels, P2PPlan, build_p2p_plan, get_input_message, get_output_message
from megatron_ext.pipeline.schedules import get_order
from megatron_ext.pipeline.wgrad_queue import WeightGradQueue

LOOKAHEAD = 4  # actions whose receives are posted ahead (a posted receive costs one [s, b, h] buffer)
# where run.py leaves a rank's runtime: on the TransformerConfig its model chunks share, so that every
# caller of training/step.py's run_forward_backward with these chunks runs the chosen schedule
RUNTIME_ATTR = "megatron_ext_schedule_runtime"


def attach_schedule_runtime(model: list[torch.nn.Module], runtime: ScheduleRuntime | None) -> None:
    from megatron.core.utils import get_model_config

    setattr(get_model_config(model[0]), RUNTIME_ATTR, runtime)


def get_schedule_runtime(model: list[torch.nn.Module]) -> ScheduleRuntime | None:
    """The runtime ``attach_schedule_runtime`` left on ``model`` (None: megatron-core's schedules)."""
    from megatron.core.utils import get_model_config

    return getattr(get_model_config(model[0]), RUNTIME_ATTR, None)


def weight_step(queue: WeightGradQueue, key: tuple[int, int]) -> int:
    """Run the W deferred under ``key`` = (chunk, micro-batch), with grad mode off as inside autograd's
    backward (the output gradients it holds may require grad: a received P2P buffer does, and a W
    computed under grad mode would build a graph that keeps its inputs alive). A module function so
    that the timeline can wrap it (``training/timeline.py``)."""
    with torch.no_grad():
        return queue.run(key)


@dataclasses.dataclass
class _Step:
    """One step's state on this rank (the runtime itself keeps none between steps)."""

    order: PipelineOrder
    model: list[torch.nn.Module]
    iterators: list[Iterator]
    forward_step_func: Callable
    forward_only: bool
    channels: P2PChannels
    total_num_tokens: torch.Tensor
    forward_data_store: list = dataclasses.field(default_factory=list)
    saved: dict[tuple[int, int], tuple[Any, Any]] = dataclasses.field(default_factory=dict)  # (input, output)
    local: dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)  # hand-overs on this rank


class ScheduleRuntime:
    """Runs schedule ``name`` on this pipeline rank (``pp_rank`` of ``pp_group``, ``vp`` chunks).

    ``tensor_shape_divisor``: the activation's sequence dimension is divided by it on the wire
    (TP size with sequence parallelism, else 1), as megatron-core's ``get_tensor_shapes``."""

    def __init__(
        self,
        name: str,
        pp_group: Any,
        pp_rank: int,
        pp_size: int,
        vp_size: int,
        queue: WeightGradQueue,
        tensor_shape_divisor: int = 1,
        cp_size: int = 1,
    ):
        self.name, self.pp_group = name, pp_group
        self.pp_rank, self.pp_size, self.vp_size = pp_rank, pp_size, vp_size
        self.queue = queue
        self.shape_divisor, self.cp_size = tensor_shape_divisor, cp_size
        self._communicator = None
        self._plans: dict[tuple[str, int], P2PPlan] = {}  # (order's name, micro-batches) -> this rank's

    def get_order(self, num_microbatches: int, forward_only: bool = False) -> PipelineOrder:
        order = get_order(self.name, self.pp_size, self.vp_size, num_microbatches)
        return order.forward_only() if forward_only else order

    def run(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: list[Iterator],
        model: list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        forward_only: bool = False,
    ) -> list:
        """One step over ``num_microbatches``; returns the last stage's loss reports (megatron-core's
        ``forward_data_store``), empty elsewhere. Arguments as ``get_forward_backward_func()``'s."""
        from megatron.core.utils import get_model_config

        config = get_model_config(model[0])
        order = self.get_order(num_microbatches, forward_only)
        shape = [seq_length // self.shape_divisor // self.cp_size, micro_batch_size, config.hidden_size]
        device = next(p.device for chunk in model for p in chunk.parameters())
        step = _Step(
            order,
            model,
            list(data_iterator),
            forward_step_func,
            forward_only,
            self._build_channels(config, order, shape),
            torch.zeros([], dtype=torch.int, device=device),
        )
        if not forward_only:
            self._dispatch_param_sync(config, model)
        actions = order.ranks[self.pp_rank]
        for i, action in enumerate(actions):
            for ahead in actions[i : i + LOOKAHEAD]:
                msg = get_input_message(order, ahead)
                if msg is not None and msg not in step.channels.plan.local:
                    step.channels.post_until(msg)
            self._run_action(step, config, action)
        step.channels.finish()
        if not forward_only:
            self._finish_step(config, step)
        return step.forward_data_store

    # ---- one action ----

    def _run_action(self, step: _Step, config: Any, action: Action) -> None:
        if action.kind == F:
            self._forward(step, config, action)
            return
        chunk = step.order.chunk_of(action.stage)
        last = action.mb == step.order.num_microbatches - 1
        with contextlib.nullcontext() if last else _no_sync(config, chunk, len(step.model)):
            if action.kind == W:
                self._weight(step, config, action)
            else:
                self._backward(step, config, action)
        if last and action.kind in (W, BW) and config.grad_sync_func is not None:
            sync = config.grad_sync_func[chunk] if isinstance(config.grad_sync_func, list) else config.grad_sync_func
            sync(step.model[chunk].parameters())

    def _forward(self, step: _Step, config: Any, action: Action) -> None:
        from megatron.core.pipeline_parallel import schedules

        order, c = step.order, step.order.chunk_of(action.stage)
        input_tensor = self._take_input(step, action)
        output, num_tokens = schedules.forward_step(
            step.forward_step_func,
            step.iterators[c],
            step.model[c],
            order.num_microbatches,
            input_tensor,
            step.forward_data_store,
            config,
            self.cp_size,
            is_first_microbatch=action.mb == 0,
            current_microbatch=action.mb,
            vp_stage=c if len(step.model) > 1 else None,
            is_last_stage=action.stage == order.num_stages - 1,
        )
        step.total_num_tokens += num_tokens
        self._give_output(step, action, output)
        if not step.forward_only:
            step.saved[(action.stage, action.mb)] = (input_tensor, output)
            schedules.deallocate_output_tensor(output, config.deallocate_pipeline_outputs)

    def _backward(self, step: _Step, config: Any, action: Action) -> None:
        """B (input gradient, W captured) or BW (the whole backward)."""
        if action.kind == B and action.stage == 0:
            return  # stage 0's backward runs whole in its W (module docstring)
        c = step.order.chunk_of(action.stage)
        capture = self.queue.capture((c, action.mb)) if action.kind == B else contextlib.nullcontext()
        with capture:
            grad = self._backward_step(step, config, action)
        self._give_output(step, action, grad)

    def _weight(self, step: _Step, config: Any, action: Action) -> None:
        key = (step.order.chunk_of(action.stage), action.mb)
        if action.stage == 0:  # its B did nothing: the input-gradient part first, captured as any B's
            with self.queue.capture(key):
                self._backward_step(step, config, action)
        weight_step(self.queue, key)

    def _backward_step(self, step: _Step, config: Any, action: Action) -> Any:
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.utils import get_model_type

        input_tensor, output = step.saved.pop((action.stage, action.mb))
        grad_output = self._take_input(step, Action(B, action.stage, action.mb))
        model = step.model[step.order.chunk_of(action.stage)]
        return schedules.backward_step(input_tensor, output, grad_output, get_model_type(model), config)

    # ---- data between stages ----

    def _take_input(self, step: _Step, action: Action) -> torch.Tensor | None:
        """The activation (F) or output gradient (B) ``action`` consumes: None for the first stage's
        forward and the last stage's backward, else a local hand-over or a received message."""
        msg = get_input_message(step.order, action)
        if msg is None:
            return None
        if msg in step.channels.plan.local:
            return step.local.pop(msg)
        return step.channels.receive(msg)

    def _give_output(self, step: _Step, action: Action, tensor: torch.Tensor | None) -> None:
        msg = get_output_message(step.order, action)
        if msg is None or (step.forward_only and action.kind != F):
            return
        assert tensor is not None, f"{action} made no tensor for {msg}"
        if msg in step.channels.plan.local:
            # a new leaf on its own alias: the producer's output may be deallocated
            step.local[msg] = tensor.detach().requires_grad_(action.kind == F)
        else:
            step.channels.send(msg, step.order.rank_of(msg[1]), tensor)

    # ---- step start and end ----

    def _build_channels(self, config: Any, order: PipelineOrder, shape: list[int]) -> P2PChannels:
        if self._communicator is None and self.pp_size > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            # non-blocking sends and receives return their handles only without batching
            p2p_config = copy.copy(config)
            p2p_config.batch_p2p_comm = False
            self._communicator = P2PCommunicator(pp_group=self.pp_group, config=p2p_config)
        key = (order.name, order.num_microbatches)  # forward_only() renames the order
        if key not in self._plans:
            self._plans[key] = build_p2p_plan(order, self.pp_rank)
        p = self.pp_size
        return P2PChannels(self._communicator, self._plans[key], shape, (self.pp_rank + 1) % p, (self.pp_rank - 1) % p)

    @staticmethod
    def _dispatch_param_sync(config: Any, model: list[torch.nn.Module]) -> None:
        """--overlap-param-gather: start every chunk's all-gather now; DDP's forward pre-hooks wait."""
        sync = config.param_sync_func
        if sync is None:
            return
        for c, chunk in enumerate(model):
            (sync[c] if isinstance(sync, list) else sync)(chunk.parameters())

    def _finish_step(self, config: Any, step: _Step) -> None:
        if self.queue.pending():
            raise RuntimeError(
                f"{self.name}: weight gradients of {self.queue.pending_keys()} were deferred and never "
                f"run in this step (the order lost a W)"
            )
        assert not step.saved and not step.local, f"unconsumed: {sorted(step.saved)} {sorted(step.local)}"
        if config.finalize_model_grads_func is not None:
            num_tokens = step.total_num_tokens if config.calculate_per_token_loss else None
            config.finalize_model_grads_func(step.model, num_tokens)


def _no_sync(config: Any, chunk: int, num_chunks: int) -> contextlib.AbstractContextManager:
    """Chunk ``chunk``'s DDP ``no_sync()`` from megatron-core's ``config.no_sync_func`` (one per
    chunk as a list, or one function for a single chunk)."""
    func = config.no_sync_func
    if func is None:
        return contextlib.nullcontext()
    if isinstance(func, list):
        return func[chunk]()
    assert num_chunks == 1, "one no_sync_func for several model chunks: pass one per chunk"
    return func()
