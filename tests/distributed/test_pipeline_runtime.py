"""The schedule runtime on small megatron-core-compatible chunks with a split backward (no GPT, no DDP):
every schedule's gradients and losses equal one process running the same 8 layers with plain autograd;
deferred W's run inside W actions, none is left at the step's end; the DDP contract (every B and W
inside its chunk's ``no_sync`` but the last micro-batch's) holds; forward-only gives the same losses.

Layers: tanh(x @ A_l), A_l a function of the global layer index only, so every placement (loop, V)
and every number of chunks builds the same model. The backward is two autograd nodes (input path,
weight path), the weight path deferring its GEMM to the rank's WeightGradQueue under a capture.
Worlds: 4 ranks (PP 4) and 2 ranks (PP 2), each running all its cases in one fork.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

H, S, LAYERS = 8, 4, 8
CASES = {
    4: [
        ("1F1B", 1, 4),
        ("Interleaved1F1B", 2, 8),
        ("ZBH1", 1, 8),
        ("ZBH1", 1, 5),
        ("InterleavedZeroBubble", 2, 8),
        ("ZBVZeroBubble", 2, 8),
        ("ZBVZeroBubble", 2, 6),
    ],
    2: [("ZBH1", 1, 4), ("InterleavedZeroBubble", 2, 4), ("ZBVZeroBubble", 2, 4), ("ZBVZeroBubble", 2, 3)],
}


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, layer):  # a detached: this node gives x's gradient only
        y = torch.tanh(x @ a)
        ctx.save_for_backward(y, a)
        ctx.layer = layer
        return y

    @staticmethod
    def backward(ctx, g):
        y, a = ctx.saved_tensors
        ctx.layer.record("B")
        return (g * (1 - y * y)) @ a.t(), None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, layer):  # x detached: this node gives a's gradient only
        ctx.save_for_backward(x, a)
        ctx.layer = layer
        return torch.zeros(x.shape[:-1] + a.shape[1:])

    @staticmethod
    def backward(ctx, g):
        x, a = ctx.saved_tensors
        layer = ctx.layer

        def run_w():
            layer.record("W")
            y = torch.tanh(x @ a)
            grad = x.reshape(-1, H).t() @ (g * (1 - y * y)).reshape(-1, H)
            layer.weight.grad = grad if layer.weight.grad is None else layer.weight.grad + grad

        if layer.wgrad_queue is not None and layer.wgrad_queue.defer(run_w):
            return None, None, None
        run_w()
        return None, None, None


class Layer(torch.nn.Module):
    def __init__(self, index: int, chunk):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + index)
        self.weight = torch.nn.Parameter(torch.randn(H, H, generator=gen) / H**0.5)
        self.wgrad_queue, self.chunk, self.events = None, chunk, None

    def record(self, kind: str) -> None:
        if self.events is not None:
            self.events.append((kind, self.chunk.current, self.chunk.in_no_sync))

    def forward(self, x):  # [s, b, h]: tanh(x @ A) = input path + weight path (which adds 0)
        return _InputPath.apply(x, self.weight.detach(), self) + _WeightPath.apply(x.detach(), self.weight, self)


class Chunk(torch.nn.Module):
    """A megatron-core pipeline chunk (``config``, ``model_type``, ``set_input_tensor``)."""

    def __init__(self, config, first_layer: int, num_layers: int, pre_process: bool):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config, self.model_type, self.pre_process = config, ModelType.encoder_or_decoder, pre_process
        self.layers = torch.nn.ModuleList(Layer(first_layer + i, self) for i in range(num_layers))
        self.input_tensor, self.current, self.in_no_sync = None, None, False

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0]

    def forward(self, batch):
        x = batch if self.pre_process else self.input_tensor
        for layer in self.layers:
            x = layer(x)
        return x

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


def _batches(m: int) -> list[torch.Tensor]:
    return [torch.randn(S, 1, H, generator=torch.Generator().manual_seed(mb)) for mb in range(m)]  # [s, b, h]


def _loss_func(output):
    loss = output.float().pow(2).mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch if model.pre_process else None), _loss_func


def _reference(m: int) -> tuple[dict[int, torch.Tensor], list[float]]:
    """One process, plain autograd: {global layer: grad}, per-micro-batch losses."""
    layers = [Layer(i, None) for i in range(LAYERS)]
    losses = []
    for batch in _batches(m):
        x = batch
        for layer in layers:
            x = torch.tanh(x @ layer.weight)
        loss = x.float().pow(2).mean()
        (loss / m).backward()
        losses.append(loss.item())
    return {i: layer.weight.grad.clone() for i, layer in enumerate(layers)}, losses


def _run_case(rank: int, p: int, name: str, vp: int, m: int, deallocate: bool, forward_only: bool) -> dict:
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.pipeline import runtime as rt
    from megatron_ext.pipeline.names import get_schedule_placement
    from megatron_ext.pipeline.placement import get_stage_index
    from megatron_ext.pipeline.wgrad_queue import WeightGradQueue

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=1,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=p,
        deallocate_pipeline_outputs=deallocate,
    )
    placement, per_stage = get_schedule_placement(name), LAYERS // (p * vp)
    stages = [get_stage_index(rank, c, p, vp, placement) for c in range(vp)]
    model = [Chunk(config, s * per_stage, per_stage, s == 0) for s in stages]
    queue, events = WeightGradQueue(), []
    for chunk in model:
        for layer in chunk.layers:
            layer.wgrad_queue, layer.events = queue, events
    config.no_sync_func = [chunk.no_sync for chunk in model]
    runtime = rt.ScheduleRuntime(name, torch.distributed.group.WORLD, rank, p, vp, queue)

    # know which action runs: F maps its output to (chunk, mb), B finds it, W is told its key
    outputs = {}
    orig_f, orig_b, orig_w = schedules.forward_step, schedules.backward_step, rt.weight_step

    def forward_step(*args, **kwargs):
        out = orig_f(*args, **kwargs)
        outputs[id(out[0])] = (kwargs["vp_stage"] or 0, kwargs["current_microbatch"])
        return out

    def backward_step(input_tensor, output, *args):
        c, mb = outputs[id(output)]
        model[c].current = ("B", mb)
        return orig_b(input_tensor, output, *args)

    def weight_step(q, key):
        model[key[0]].current = ("W", key[1])
        return orig_w(q, key)

    schedules.forward_step, schedules.backward_step, rt.weight_step = forward_step, backward_step, weight_step
    try:
        reports = runtime.run(
            forward_step_func=_forward_step,
            data_iterator=[iter(_batches(m)) for _ in model],
            model=model,
            num_microbatches=m,
            seq_length=S,
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        schedules.forward_step, schedules.backward_step, rt.weight_step = orig_f, orig_b, orig_w
    grads = {
        s * per_stage + i: layer.weight.grad for s, chunk in zip(stages, model) for i, layer in enumerate(chunk.layers)
    }
    return {
        "grads": grads,
        "losses": [float(r["loss"]) for r in reports],
        "events": events,
        "pending": queue.pending(),
        "order": runtime.get_order(m).ranks[rank],
    }


def _worker(rank: int, world_size: int) -> list[dict]:
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    out = []
    for name, vp, m in CASES[world_size]:
        for deallocate, forward_only in ((False, False), (True, False), (False, True)):
            out.append(_run_case(rank, world_size, name, vp, m, deallocate, forward_only))
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def world(request):
    p = request.param
    per_rank = run_ranks(_worker, p, timeout=300)
    return p, per_rank


def test_every_schedule_equals_one_process(world):
    p, per_rank = world
    i = 0
    for name, vp, m in CASES[p]:
        ref_grads, ref_losses = _reference(m)
        for deallocate, forward_only in ((False, False), (True, False), (False, True)):
            case = f"{name} p={p} v={vp} m={m} deallocate={deallocate} forward_only={forward_only}"
            results = [r[i] for r in per_rank]
            i += 1
            losses = [loss for r in results for loss in r["losses"]]  # only the last stage's rank reports
            assert losses == pytest.approx([x / m for x in ref_losses], rel=1e-6), case
            assert all(r["pending"] == 0 for r in results), case
            grads = {k: g for r in results for k, g in r["grads"].items()}
            if forward_only:
                assert all(g is None for g in grads.values()), case
                continue
            assert sorted(grads) == list(range(LAYERS)), case
            for k in range(LAYERS):
                torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=case)
            _check_ddp_contract(case, results, m, splits="Zero" in name or "ZB" in name)


def _check_ddp_contract(case: str, results: list[dict], m: int, splits: bool) -> None:
    """Every layer event (input path "B", weight path "W") ran inside its action, and inside its chunk's
    no_sync exactly when that action's micro-batch is not the last; split schedules deferred W's."""
    deferred = 0
    for r in results:
        for kind, current, in_no_sync in r["events"]:
            assert current is not None, case
            action_kind, mb = current
            assert in_no_sync == (mb != m - 1), (case, kind, current)
            deferred += action_kind == "W" and kind == "W"
    assert (deferred > 0) == splits, case
