"""The B/W split of our linear layers (model/wgrad_deferral.py), checked without any schedule.

A two-stage pipeline by hand in one process (stage 0: embedding + 2 layers, stage 1: 2 layers +
the output layer, tied to the embedding or not): every micro-batch's forward, then the backwards
in zero-bubble order (B0 B1 B2, each inside ``queue.capture``, then W0 W1 W2 with ``queue.run``)
against the plain backward in 1F1B order (F0 B0 F1 B1 ...) without the deferral. Every gradient
(``main_grad`` under DDP, ``param.grad`` without it) and the stage boundary's input gradient must
be bitwise equal (fp32 and bf16), with gradient-accumulation fusion, without it and without DDP,
with full and selective recompute, and on TP 2 with sequence parallelism. Between B and W the
deferred weights' gradients must still be zero (the W really waited).

On DP 2 under --overlap-grad-reduce (and the distributed optimizer), the sync contract of the
runtime (every B and W inside the chunk's ``no_sync`` but the last micro-batch's) must start each
bucket's reduce only after the W that writes its last deferred weight: the bucket groups'
``start_grad_sync`` calls are logged against the phase that runs.

Memory: a deferred W with sequence parallelism holds the local input shard [s/tp, b, h] and the
output gradient, never the gathered input; the bytes the queue holds are compared with that count.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.derived import get_padded_vocab_size, resolve_config
from megatron_ext.model.compile import install_compilable_linears
from megatron_ext.model.gpt import apply_mixed_precision, build_model_chunks, wrap_with_ddp
from megatron_ext.model.wgrad_deferral import apply_weight_grad_deferral, check_weight_grad_deferral
from megatron_ext.parallel import StagePlacement, build_parallel_context, destroy_parallel_context
from megatron_ext.pipeline.wgrad_queue import WeightGradQueue
from megatron_ext.testing import VOCAB, MarkovDataset, fetch_step_microbatches, run_ranks, tiny_values
from megatron_ext.training.step import forward_step, unwrap_model

pytestmark = pytest.mark.distributed

SEQ, MICRO, NUM_MB = 32, 2, 3
BASE = dict(num_layers=2, global_batch_size=MICRO * NUM_MB, micro_batch_size=MICRO, seq_length=SEQ)


class HandPipeline:
    """Two stages (pre-process chunk, post-process chunk) of one model, in one process."""

    def __init__(self, values: dict, defer: bool, ddp: bool):
        self.cfg = cfg = build_job_config(tiny_values(**BASE, **values))
        resolved = resolve_config(cfg, torch.distributed.get_world_size(), VOCAB - 1)
        tp = cfg.parallel.tensor_model_parallel_size
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        chunks = [
            build_model_chunks(cfg, resolved, StagePlacement(r, 2, tp_rank, tp, None), torch.device("cpu"))[0]
            for r in range(2)
        ]
        self.queue = WeightGradQueue()
        self.num_deferred = apply_weight_grad_deferral(chunks, self.queue) if defer else 0
        chunks = apply_mixed_precision(cfg.training, chunks)
        self.chunks = wrap_with_ddp(cfg.parallel, chunks, cfg.training.gradient_accumulation_fusion) if ddp else chunks
        self.ddp = ddp
        for chunk in self.chunks:
            if ddp:
                chunk.zero_grad_buffer()
        self.boundary_grads: list[torch.Tensor] = []

    def forward(self, mb):
        """Stage 0 then stage 1 on one micro-batch: (stage-0 output, stage-1 input, loss)."""
        hidden, _ = forward_step(iter([mb]), self.chunks[0])
        # (in a one-rank world Float16Module upcasts every chunk's output: back to the P2P dtype)
        dtype = torch.bfloat16 if self.cfg.training.bf16 else torch.float32
        received = hidden.detach().to(dtype).requires_grad_()
        unwrap_model(self.chunks[1]).set_input_tensor(received)
        output, loss_func = forward_step(iter([mb]), self.chunks[1])
        loss, _, _ = loss_func(output)
        return hidden, received, loss

    def backward(self, state, i: int, capture: bool, sync: bool = True):
        """B of both stages for micro-batch i (the last stage first)."""
        hidden, received, loss = state
        for c, run in ((1, lambda: loss.backward()), (0, lambda: hidden.backward(received.grad.to(hidden.dtype)))):
            with self._sync(c, sync), self.queue.capture((c, i)) if capture else contextlib.nullcontext():
                run()
        self.boundary_grads.append(received.grad.clone())

    def weight_grads(self, i: int, sync: bool = True) -> int:
        ran = 0
        for c in (1, 0):
            with self._sync(c, sync):
                ran += self.queue.run((c, i))
        return ran

    def _sync(self, chunk: int, sync: bool):
        return self.chunks[chunk].no_sync() if (self.ddp and not sync) else contextlib.nullcontext()

    def grads(self) -> dict[str, torch.Tensor]:
        out = {}
        for c, chunk in enumerate(self.chunks):
            for name, p in unwrap_model(chunk).named_parameters():
                g = p.main_grad if self.ddp else p.grad
                out[f"{c}/{name}"] = g.detach().clone() if g is not None else None
        return out

    def deferred_weights(self) -> dict[str, torch.nn.Parameter]:
        return {
            f"{c}/{n}": p
            for c, chunk in enumerate(self.chunks)
            for n, p in unwrap_model(chunk).named_parameters()
            if getattr(p, "skip_backward_post_hook", False)
        }


def _microbatches(dp_rank: int = 0, dp_size: int = 1):
    indices = get_microbatch_indices(0, MICRO * NUM_MB * dp_size, MICRO, dp_rank, dp_size)
    return fetch_step_microbatches(MarkovDataset(SEQ, mask_every=1), indices)


def run_1f1b(values: dict, ddp: bool, microbatches) -> dict:
    pipe = HandPipeline(values, defer=False, ddp=ddp)
    for i, mb in enumerate(microbatches):
        pipe.backward(pipe.forward(mb), i, capture=False)
    return {"grads": pipe.grads(), "boundary": pipe.boundary_grads}


def run_zero_bubble(values: dict, ddp: bool, microbatches) -> dict:
    """F0 F1 F2, B0 B1 B2 (captured), then W0 W1 W2."""
    pipe = HandPipeline(values, defer=True, ddp=ddp)
    states = [pipe.forward(mb) for mb in microbatches]
    for i, state in enumerate(states):
        pipe.backward(state, i, capture=True)
    deferred = pipe.deferred_weights()
    grads = pipe.grads()
    untouched_before_w = all(grads[n] is None or not grads[n].any() for n in deferred)
    held = get_held_bytes(pipe.queue)
    ran = [pipe.weight_grads(i) for i in range(len(states))]
    return {
        "grads": pipe.grads(),
        "boundary": pipe.boundary_grads,
        "untouched_before_w": untouched_before_w,
        "num_deferred": pipe.num_deferred,
        "ran": ran,
        "pending": pipe.queue.pending(),
        "held": held,
        "deferred": sorted(deferred),
    }


def run_installed_1f1b(values: dict, microbatches) -> dict:
    """The deferral installed but no capture (1F1B order): every W runs at once, in B."""
    pipe = HandPipeline(values, defer=True, ddp=True)
    for i, mb in enumerate(microbatches):
        pipe.backward(pipe.forward(mb), i, capture=False)
    return {"grads": pipe.grads(), "boundary": pipe.boundary_grads, "pending": pipe.queue.pending()}


def describe_plain_build(values: dict) -> dict:
    """What a build without the deferral looks like: megatron-core's linears and DDP untouched."""
    pipe = HandPipeline(values, defer=False, ddp=True)
    layers = [m for chunk in pipe.chunks for m in chunk.modules() if hasattr(m, "gradient_accumulation_fusion")]
    return {
        "patched": [type(m).__name__ for m in layers if "_forward_impl" in vars(m) or hasattr(m, "wgrad_queue")],
        "skip_flags": any(getattr(p, "skip_backward_post_hook", False) for c in pipe.chunks for p in c.parameters()),
        "delay_wgrad_compute": any(c.ddp_config.delay_wgrad_compute for c in pipe.chunks),
        "num_layers": len(layers),
    }


def get_held_bytes(queue: WeightGradQueue) -> int:
    """Bytes of the distinct tensors the queue's deferred W keep alive."""
    seen, total = set(), 0
    for work in queue.pending_work():
        for t in work.held_tensors:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


VARIANTS = {
    "fused fp32": (dict(), True),
    "fused bf16": (dict(bf16=True), True),
    "unfused fp32": (dict(gradient_accumulation_fusion=False), True),
    "unfused bf16": (dict(bf16=True, gradient_accumulation_fusion=False), True),
    "no DDP": (dict(), False),
    "untied, swiglu, biases off": (
        dict(untie_embeddings_and_output_weights=True, swiglu=True, disable_bias_linear=True),
        True,
    ),
    "full recompute": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), True),
    "selective recompute": (
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"]),
        True,
    ),
}


def _one_rank_world(rank: int, world_size: int) -> dict:
    out = {}
    cfg = build_job_config(tiny_values(**BASE))
    build_parallel_context(cfg, torch.device("cpu"))
    mbs = _microbatches()
    for name, (values, ddp) in VARIANTS.items():
        out[name] = (run_1f1b(values, ddp, mbs), run_zero_bubble(values, ddp, mbs))
    out["installed, no capture"] = (out["fused fp32"][0], run_installed_1f1b({}, mbs))
    out["plain build"] = describe_plain_build({})
    out["refusal"] = _refusal_message(cfg)
    out["ours refused"] = _traceable_linear_refusal(cfg)
    destroy_parallel_context()
    return out


def _refusal_message(cfg) -> str:
    chunks = build_model_chunks(
        cfg,
        resolve_config(cfg, torch.distributed.get_world_size(), VOCAB - 1),
        StagePlacement(0, 1, 0, 1, None),
        torch.device("cpu"),
    )
    try:
        check_weight_grad_deferral(chunks)
    except ValueError as e:
        return str(e)
    return ""


def _traceable_linear_refusal(cfg) -> str:
    """The deferral asked to take a chunk whose first layer runs our traceable linear (--torch-compile's,
    or the lean TP-1 eager one: model/compile.py), untied so that nothing else is refused."""
    cfg = build_job_config(tiny_values(**BASE, untie_embeddings_and_output_weights=True))
    chunks = build_model_chunks(
        cfg,
        resolve_config(cfg, torch.distributed.get_world_size(), VOCAB - 1),
        StagePlacement(0, 1, 0, 1, None),
        torch.device("cpu"),
    )
    check_weight_grad_deferral(chunks)  # megatron-core's linears: accepted
    assert install_compilable_linears(unwrap_model(chunks[0]).decoder.layers[0]) == 4
    try:
        apply_weight_grad_deferral(chunks, WeightGradQueue())
    except ValueError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def one_rank():
    (out,) = run_ranks(_one_rank_world, 1, timeout=300)
    return out


def _assert_bitwise(reference: dict, deferred: dict):
    assert reference["grads"].keys() == deferred["grads"].keys()
    for name, g in reference["grads"].items():
        d = deferred["grads"][name]
        assert (g is None) == (d is None), name
        if g is not None:
            assert g.abs().sum() > 0, name
            assert torch.equal(g, d), f"{name}: max diff {(g - d).abs().max()}"
    for a, b in zip(reference["boundary"], deferred["boundary"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deferred_weight_gradients_equal_1f1b_bitwise(one_rank, variant):
    reference, deferred = one_rank[variant]
    # QKV, proj, fc1, fc2 of the 2 layers of each stage, and the output layer: one W each per micro-batch
    assert deferred["num_deferred"] == 2 * 4 * 2 + 1
    assert deferred["untouched_before_w"], "a deferred weight's gradient was written in B"
    assert deferred["ran"] == [2 * 4 * 2 + 1] * NUM_MB and deferred["pending"] == 0
    assert any(name.endswith("output_layer.weight") for name in deferred["deferred"])
    assert not any("layernorm" in name or "embedding" in name or name.endswith("bias") for name in deferred["deferred"])
    _assert_bitwise(reference, deferred)


def test_installed_but_not_capturing_equals_1f1b_bitwise(one_rank):
    reference, installed = one_rank["installed, no capture"]
    assert installed["pending"] == 0
    _assert_bitwise(reference, installed)


def test_without_deferral_megatron_cores_path_is_untouched(one_rank):
    plain = one_rank["plain build"]
    assert plain["num_layers"] == 17 and plain["patched"] == []
    assert not plain["skip_flags"] and not plain["delay_wgrad_compute"]


def test_a_chunk_with_the_tied_embedding_and_output_layer_is_refused(one_rank):
    assert "--pipeline-model-parallel-size > 1" in one_rank["refusal"]


def test_our_traceable_linear_is_refused_rather_than_bypassing_the_queue(one_rank):
    """Our linear accumulates the weight gradient inside its own backward: deferral over it would put
    nothing in the W queue (and the 1F1B-equality tests above would not see it at TP 1)."""
    assert (
        "'s decoder.layers.0." in one_rank["ours refused"] and "runs our traceable linear" in one_rank["ours refused"]
    )
    assert "drop --torch-compile" in one_rank["ours refused"]


# ----------------------------------------------------------------------------- two ranks


TP_VARIANTS = {
    "TP 2, SP": dict(sequence_parallel=True),
    "TP 2 (dgrad all-reduce)": dict(),
    "TP 2, SP, full recompute": dict(
        sequence_parallel=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
}


def _tp_layout(rank: int) -> dict:
    """TP 2 with and without sequence parallelism: bitwise equality and the bytes a deferred W holds."""
    cfg = build_job_config(tiny_values(**BASE, tensor_model_parallel_size=2))
    build_parallel_context(cfg, torch.device("cpu"))
    mbs = _microbatches()
    out = {}
    for name, flags in TP_VARIANTS.items():
        values = dict(tensor_model_parallel_size=2, **flags)
        out[name] = {"reference": run_1f1b(values, True, mbs), "deferred": run_zero_bubble(values, True, mbs)}
    out["expected_held"] = expected_held_bytes(cfg, NUM_MB, tp=2)
    destroy_parallel_context()
    return out


def expected_held_bytes(cfg, num_microbatches: int, tp: int) -> int:
    """fp32 bytes the deferred W of a micro-batch hold with SP: each linear's local input (the
    sequence shard [s/tp, b, in] for the column-parallel QKV, fc1 and output layer; [s, b, in/tp]
    for the row-parallel proj and fc2) and its output gradient [s, b, out]. The shared input of the
    output layer is counted once per micro-batch (it is one tensor)."""
    m = cfg.model
    s, b, h = SEQ, MICRO, m.hidden_size
    ffn = 4 * h
    vocab = get_padded_vocab_size(VOCAB - 1, cfg)
    per_layer = (
        s // tp * b * h
        + s * b * 3 * h // tp  # QKV
        + s * b * h // tp
        + s * b * h  # proj
        + s // tp * b * h
        + s * b * ffn // tp  # fc1
        + s * b * ffn // tp
        + s * b * h
    )  # fc2
    output_layer = s // tp * b * h + s * b * vocab // tp
    return 4 * num_microbatches * (2 * m.num_layers * per_layer + output_layer)


def _overlap_layout(rank: int, distributed_optimizer: bool, fused: bool = True) -> dict:
    """DP 2 under --overlap-grad-reduce: when each bucket's reduce starts, and the reduced grads."""
    values = dict(
        overlap_grad_reduce=True,
        use_distributed_optimizer=distributed_optimizer,
        ddp_bucket_size=4000,
        gradient_accumulation_fusion=fused,
    )
    cfg = build_job_config(tiny_values(**BASE, **values))
    build_parallel_context(cfg, torch.device("cpu"))
    mbs = _microbatches(rank, 2)
    reference = _overlap_steps(values, mbs, defer=False)
    deferred = _overlap_steps(values, mbs, defer=True)
    destroy_parallel_context()
    return {"reference": reference, "deferred": deferred}


def _overlap_steps(values: dict, microbatches, defer: bool) -> dict:
    """Two steps (the first records DDP's per-parameter counts; the second overlaps), each in the
    runtime's sync contract; the second step's bucket starts, tagged with the phase that ran."""
    pipe = HandPipeline(values, defer=defer, ddp=True)
    log: list[tuple] = []
    phase = ["idle"]
    for c, chunk in enumerate(pipe.chunks):
        for g, group in enumerate(chunk.bucket_groups):
            deferred = any(getattr(p, "skip_backward_post_hook", False) for p in group.params)
            original = group.start_grad_sync

            def start(*args, _orig=original, _tag=(c, g, deferred), **kwargs):
                log.append((_tag, phase[0]))
                return _orig(*args, **kwargs)

            group.start_grad_sync = start
    last = len(microbatches) - 1
    for _ in range(2):
        log.clear()
        for chunk in pipe.chunks:
            chunk.zero_grad_buffer()
        pipe.boundary_grads.clear()
        states = [pipe.forward(mb) for mb in microbatches]
        for i, state in enumerate(states):
            phase[0] = f"B{i}"
            pipe.backward(state, i, capture=defer, sync=i == last)
        for i in range(len(states)):
            phase[0] = f"W{i}"
            if defer:
                pipe.weight_grads(i, sync=i == last)
        phase[0] = "finish"
        for chunk in pipe.chunks:
            chunk.finish_grad_sync()
    groups = sorted(
        {
            (c, g, d)
            for c, chunk in enumerate(pipe.chunks)
            for g, group in enumerate(chunk.bucket_groups)
            for d in [any(getattr(p, "skip_backward_post_hook", False) for p in group.params)]
        }
    )
    grads = {n: g for n, g in pipe.grads().items()}
    return {
        "log": list(log),
        "groups": groups,
        "grads": grads,
        "boundary": pipe.boundary_grads,
        "pending": pipe.queue.pending(),
    }


def _two_rank_world(rank: int, world_size: int) -> dict:
    return {
        "tp": _tp_layout(rank),
        "overlap": _overlap_layout(rank, distributed_optimizer=False),
        "overlap distopt": _overlap_layout(rank, distributed_optimizer=True),
        "overlap unfused": _overlap_layout(rank, distributed_optimizer=False, fused=False),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_world, 2, timeout=300)


@pytest.mark.parametrize("variant", list(TP_VARIANTS))
def test_tp2_deferred_equals_1f1b_bitwise(two_ranks, variant):
    for rank_out in two_ranks:
        out = rank_out["tp"][variant]
        assert out["deferred"]["untouched_before_w"] and out["deferred"]["pending"] == 0
        _assert_bitwise(out["reference"], out["deferred"])


def test_tp2_sequence_parallel_w_holds_the_input_shard_not_the_gathered_input(two_ranks):
    out = two_ranks[0]["tp"]
    assert out["TP 2, SP"]["deferred"]["held"] == out["expected_held"]
    # the same W with the gathered input kept: each column-parallel input tp times larger
    assert out["TP 2, SP"]["deferred"]["held"] < out["TP 2 (dgrad all-reduce)"]["deferred"]["held"]


@pytest.mark.parametrize("layout", ["overlap", "overlap distopt", "overlap unfused"])
def test_no_bucket_reduce_starts_before_its_last_w(two_ranks, layout):
    for rank_out in two_ranks:
        out = rank_out[layout]
        deferred, reference = out["deferred"], out["reference"]
        assert deferred["pending"] == 0
        started = {tag: phase for tag, phase in deferred["log"]}
        assert set(started) == set(deferred["groups"]), "every bucket group starts its reduce once"
        with_deferred = [tag for tag in deferred["groups"] if tag[2]]
        assert with_deferred
        for tag in with_deferred:
            assert started[tag] == f"W{NUM_MB - 1}", f"bucket group {tag} started in {started[tag]}"
        for tag in deferred["groups"]:
            assert started[tag] in (f"B{NUM_MB - 1}", f"W{NUM_MB - 1}"), (tag, started[tag])
        # the reference overlaps too (its reduce starts in the last B), and the reduced grads agree
        assert all(phase == f"B{NUM_MB - 1}" for _, phase in reference["log"])
        _assert_bitwise(reference, deferred)
