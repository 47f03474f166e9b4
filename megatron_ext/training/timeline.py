"""Per-rank pipeline timeline: start/end of every forward and backward per (micro-batch, virtual
stage), and of the step's tail (grad finalize + optimizer), as JSON lines.

Invariant: events are only appended to an in-memory list while a step runs (no sync, no file IO,
no device work); the step's lines are written to ``DIR/rank<N>.jsonl`` in one write when the step
ends. Cost per event: two ``time.time()`` calls and a list append (~1 us), negligible next to a
micro-batch, so the trace can be left on.

How it hooks: inside :meth:`PipelineTimeline.trace_step` (a context manager around one training
step) megatron-core's ``schedules.forward_step`` and ``schedules.backward_step`` are replaced by
timing wrappers and restored on exit, and so is our runtime's ``weight_step`` (the W of a
zero-bubble schedule, ``pipeline/runtime.py``). Every schedule (no pipelining, 1F1B, interleaved,
ours) resolves these module globals at call time. ``forward_step`` is given ``current_microbatch`` and
``vp_stage`` (None without VPP: chunk 0); ``backward_step`` is not told its micro-batch, so the
forward's output tensor (the object the schedule hands back to ``backward_step``) is mapped to
its (chunk, micro-batch).

Clock: ``time.time()`` in every rank, so traces of ranks on one host share one clock and the
renderer can align them. It is the host's clock: on CUDA a span is when the host issued the work
(kernels run asynchronously), not when the GPU ran it (torch.profiler shows that). Across nodes it is only as good as NTP (typically 0.1-1 ms): fine for
a picture, not for cross-node dependency checks.

Records (one JSON object per line), per step:
  {"kind": "step", "step", "rank", "pp_rank", "pp_size", "vp_size", "pipeline" (one id per
   pipeline: (dp_rank * cp_size + cp_rank) * tp_size + tp_rank), "num_microbatches", "start", "end",
   "schedule" (--pipeline-schedule, null: megatron-core's default), "placement" ("loop" | "v")}
   -- the whole step (the context manager's enter -> exit)
  {"kind": "F" | "B" | "W", "step", "chunk", "mb", "start", "end"}  -- one forward / backward (the
   whole backward under megatron-core's schedules, the input gradient under ours) / weight gradient
  {"kind": "optimizer", "step", "start", "end"}  -- last backward's end -> step end: megatron-core's
   finalize_model_grads (DP grad reduce, tied-embedding sync), the optimizer step (clipping
   inside) and the LR schedule. It cannot be separated further without editing ``train_step``.
Forward spans cover megatron-core's ``forward_step`` (set_input_tensor, our forward_step_func,
the loss on the last stage); backward spans cover ``backward_step``; W spans our runtime's
``weight_step`` (stage 0's W slot holds its whole backward: a B span, then the W span). P2P
communication happens between them and shows as idle time.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

SCHEDULE_MODULE = "megatron.core.pipeline_parallel.schedules"
RUNTIME_MODULE = "megatron_ext.pipeline.runtime"


class PipelineTimeline:
    """Records one rank's forward/backward spans per training step (see the module docstring)."""

    def __init__(
        self,
        out_dir: str,
        rank: int,
        pp_rank: int,
        pp_size: int,
        vp_size: int | None,
        pipeline_id: int = 0,
        schedule: str | None = None,
        placement: str = "loop",
    ):
        self.path = os.path.join(out_dir, f"rank{rank}.jsonl")
        self.meta = {
            "rank": rank,
            "pp_rank": pp_rank,
            "pp_size": pp_size,
            "vp_size": vp_size or 1,
            "pipeline": pipeline_id,
            "schedule": schedule,
            "placement": placement,
        }
        os.makedirs(out_dir, exist_ok=True)
        open(self.path, "w").close()  # a new run starts a new trace
        self._events: list[tuple[str, int, int, float, float]] = []
        self._pending: dict[int, tuple[Any, int, int]] = {}  # id(output) -> (output, chunk, mb)
        self._num_microbatches = 0
        self._active = False

    @contextlib.contextmanager
    def trace_step(self, iteration: int) -> Iterator[None]:
        """Wraps one training step (``TrainingRun.schedule_context``)."""
        import importlib

        if self._active:
            raise RuntimeError("PipelineTimeline.trace_step is not re-entrant")
        schedules = importlib.import_module(SCHEDULE_MODULE)
        runtime = importlib.import_module(RUNTIME_MODULE)
        orig_forward, orig_backward, orig_weight = schedules.forward_step, schedules.backward_step, runtime.weight_step
        schedules.forward_step = self._wrap_forward(orig_forward)
        schedules.backward_step = self._wrap_backward(orig_backward)
        runtime.weight_step = self._wrap_weight(orig_weight)
        self._active = True
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            schedules.forward_step, schedules.backward_step = orig_forward, orig_backward
            runtime.weight_step = orig_weight
            self._active = False
            self._flush(iteration, start, end)

    def _wrap_forward(self, orig):
        events, pending = self._events, self._pending

        def forward_step(*args, **kwargs):
            t0 = time.time()
            out = orig(*args, **kwargs)
            t1 = time.time()
            chunk = kwargs.get("vp_stage") or 0
            mb = kwargs.get("current_microbatch")
            if mb is None:  # every 0.16 call site passes it; schedules run a chunk's mbs in order
                mb = sum(1 for e in events if e[0] == "F" and e[1] == chunk)
            self._num_microbatches = args[3] if len(args) > 3 else kwargs.get("num_microbatches", 0)
            events.append(("F", chunk, mb, t0, t1))
            output = out[0]
            key = output[0] if isinstance(output, list) else output
            pending[id(key)] = (key, chunk, mb)  # keeps the object alive: its id stays unique
            return out

        return forward_step

    def _wrap_backward(self, orig):
        events, pending = self._events, self._pending

        def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
            key = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
            _, chunk, mb = pending.pop(id(key), (None, -1, -1))
            t0 = time.time()
            grad = orig(input_tensor, output_tensor, output_tensor_grad, model_type, config)
            events.append(("B", chunk, mb, t0, time.time()))
            return grad

        return backward_step

    def _wrap_weight(self, orig):
        events = self._events

        def weight_step(queue, key):
            t0 = time.time()
            out = orig(queue, key)
            events.append(("W", key[0], key[1], t0, time.time()))
            return out

        return weight_step

    def _flush(self, iteration: int, start: float, end: float) -> None:
        step = {
            "kind": "step",
            "step": iteration,
            **self.meta,
            "num_microbatches": self._num_microbatches,
            "start": start,
            "end": end,
        }
        lines = [step]
        lines += [
            {"kind": k, "step": iteration, "chunk": c, "mb": mb, "start": t0, "end": t1}
            for k, c, mb, t0, t1 in self._events
        ]
        backwards = [e[4] for e in self._events if e[0] in ("B", "W")]
        if backwards:
            lines.append({"kind": "optimizer", "step": iteration, "start": max(backwards), "end": end})
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))
        self._events.clear()
        self._pending.clear()


def build_pp_timeline(out_dir: str, ctx: Any, schedule: str | None = None) -> PipelineTimeline:
    """The tracer for this rank of a ``ParallelContext``; ``schedule``: --pipeline-schedule."""
    # ranks of one pipeline share (dp_rank, cp_rank, tp_rank): CP peers run pipelines of their own
    pipeline_id = (ctx.dp_rank * ctx.cp_size + ctx.cp_rank) * ctx.tp_size + ctx.tp_rank
    return PipelineTimeline(
        out_dir, ctx.rank, ctx.pp_rank, ctx.pp_size, ctx.vp_size, pipeline_id, schedule, ctx.stage_placement
    )
