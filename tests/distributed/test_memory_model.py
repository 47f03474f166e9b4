"""The memory model (megatron_ext/planning) against measurement: per rank, the peak bytes saved for
the backward over a real training step (``SavedBytesMeter`` around our schedule, one count per
storage, plus what a zero-bubble B leaves for its W: the deferred ``WeightGradWork``'s tensors) and
the state bytes (weights, DDP gradient buffers, optimizer state after the step) within 5% of
``predict_memory``, on 4 forked gloo ranks, for layouts that exercise what the model claims: 1F1B's
in-flight count per stage (PP 4, PP 2 x DP 2), interleaving's (TP 2 x PP 2 x VPP 2 with sequence
parallelism, bf16), the zero-bubble orders' B/W split (ZBH1 at PP 4, InterleavedZeroBubble at TP 2 x
PP 2 x VPP 2 with SP, ZBVZeroBubble at PP 2 x DP 2: what B leaves for W held until W), selective
and full recompute (the checkpointed inputs in flight and the rebuilt layer during one backward),
an uneven split (--decoder-first/last-pipeline-num-layers), the distributed optimizer.

What this validates is what autograd saves and the W queue holds, and the state; not the
temporaries outside autograd or the margin (``memory.py`` states those).
"""

from __future__ import annotations

import contextlib

import pytest

from megatron_ext.model import wgrad_deferral
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.planning.meter import SavedBytesMeter, measure_state_bytes
from megatron_ext.planning.predict import predict_memory
from megatron_ext.testing import VOCAB, MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.step import build_step_microbatches, train_step

pytestmark = pytest.mark.distributed

LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    group_query_attention=True,
    num_query_groups=2,
    position_embedding_type="rope",
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
)
BASE = dict(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=1)
LAYOUTS = {
    "PP4 1F1B, GPT dropout, full recompute": dict(
        pipeline_model_parallel_size=4,
        global_batch_size=8,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    ),
    "PP2 x DP2 1F1B, Llama fp32": dict(pipeline_model_parallel_size=2, global_batch_size=8, **LLAMA),
    "PP2 x DP2, Llama bf16, selective recompute, distributed optimizer": dict(
        pipeline_model_parallel_size=2,
        global_batch_size=8,
        bf16=True,
        recompute_granularity="selective",
        use_distributed_optimizer=True,
        **LLAMA,
    ),
    "TP2 x PP2 x VPP2 with SP, Llama bf16": dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        sequence_parallel=True,
        global_batch_size=4,
        bf16=True,
        **LLAMA,
    ),
    "PP4 ZBH1, GPT": dict(pipeline_model_parallel_size=4, global_batch_size=8, pipeline_schedule="ZBH1"),
    "TP2 x PP2 x VPP2 InterleavedZeroBubble with SP, Llama bf16": dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        pipeline_schedule="InterleavedZeroBubble",
        sequence_parallel=True,
        global_batch_size=4,
        bf16=True,
        **LLAMA,
    ),
    "PP4 1F1B uneven (first stage 3 layers, last 1), Llama bf16": dict(
        pipeline_model_parallel_size=4,
        decoder_first_pipeline_num_layers=3,
        decoder_last_pipeline_num_layers=1,
        global_batch_size=8,
        bf16=True,
        **LLAMA,
    ),
    "PP2 x DP2 ZBVZeroBubble, Llama fp32": dict(
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        pipeline_schedule="ZBVZeroBubble",
        global_batch_size=8,
        **LLAMA,
    ),
}
# the TP2 x PP2 x VPP2 x DP2: an 8-rank world of its own
LAYOUTS_8_RANKS = {
    "TP2 x PP2 x VPP2 x DP2 with SP, Llama bf16, distributed optimizer": dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        sequence_parallel=True,
        use_distributed_optimizer=True,
        global_batch_size=8,
        bf16=True,
        **LLAMA,
    ),
}


@contextlib.contextmanager
def count_deferred_weight_grads(meter: SavedBytesMeter):
    """Count in ``meter`` what each deferred W holds (its input and output gradient), from B, where
    autograd still holds its saves (one count per storage), until it runs."""
    work = wgrad_deferral.WeightGradWork
    init, call = work.__init__, work.__call__

    def counted_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.tokens = [meter.hold(t) for t in self.held_tensors]

    def counted_call(self):
        call(self)
        self.tokens = []

    work.__init__, work.__call__ = counted_init, counted_call
    try:
        yield
    finally:
        work.__init__, work.__call__ = init, call


def _measure(rank: int, world_size: int) -> dict:
    out = {}
    for name, flags in (LAYOUTS if world_size == 4 else LAYOUTS_8_RANKS).items():
        run = build_tiny_run(tiny_values(**BASE, **flags), MarkovDataset(BASE["seq_length"]))
        mbs, length = build_step_microbatches(run, run.train_ds, 0)
        meter = SavedBytesMeter(p for chunk in run.model for p in chunk.parameters())
        with meter.track(), count_deferred_weight_grads(meter):
            train_step(run.model, run.optimizer, run.scheduler, mbs, length, flags["global_batch_size"], run.ctx)
        out[name] = dict(pp_rank=run.ctx.pp_rank, saved=meter.peak, state=measure_state_bytes(run.model, run.optimizer))
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_measure, 4)


@pytest.fixture(scope="module")
def measured_8_ranks():
    return run_ranks(_measure, 8)


@pytest.mark.parametrize("name", [*LAYOUTS, *LAYOUTS_8_RANKS])
def test_predicted_memory_within_5_percent(request, name):
    from megatron_ext.config import build_job_config

    world = 4 if name in LAYOUTS else 8
    measured = request.getfixturevalue("measured" if world == 4 else "measured_8_ranks")
    cfg = build_job_config(tiny_values(**BASE, **{**LAYOUTS, **LAYOUTS_8_RANKS}[name]))
    predicted = predict_memory(cfg, world, VOCAB - 1)
    for rank, result in enumerate(measured):
        got = result[name]
        want = predicted[got["pp_rank"]]
        saved_error = want.activations / got["saved"] - 1
        state = sum(got["state"])
        state_error = want.state.total / state - 1
        print(
            f"{name} | rank {rank} (pp {got['pp_rank']}): saved {got['saved']:,} predicted {want.activations:,.0f} "
            f"({saved_error:+.2%}); state {state:,} predicted {want.state.total:,} ({state_error:+.2%})"
        )
        assert abs(state_error) <= 0.05, (name, rank, got, want)
        assert abs(saved_error) <= 0.05, (name, rank, got, want)
