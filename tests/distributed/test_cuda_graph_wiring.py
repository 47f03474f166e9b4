"""--cuda-graph-impl local, wired as far as a CPU build of torch can check (issue 30).

The CPU build cannot construct megatron-core's ``CudaGraphManager`` (it asks
``torch.cuda.get_device_capability()`` and ``torch.cuda.graph_pool_handle()``), so no layer is built with
the flag here: the flag reaching megatron-core's config, the graph-safe RNG tracker asked for, the real
arguments a layer receives passing megatron-core's own argument check, their shapes bounded, and no sync
inside a layer. Capture, replay and equality with eager are ``gpu`` tests (tests/gpu/test_gpu.py); the
flags' refusals and their reaching megatron-core's config are unit tests (tests/unit/test_compile_flags.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.config import build_job_config
from megatron_ext.testing import LLAMA_STYLE, PackedMarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

LLAMA = dict(LLAMA_STYLE, group_query_attention=True, num_query_groups=2)


def _seed_call(rank, world_size, values):
    from megatron.core import tensor_parallel

    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context

    calls = []
    original = tensor_parallel.model_parallel_cuda_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: calls.append(k) or original(*a)
    try:
        build_parallel_context(build_job_config(values), torch.device("cpu"))
    finally:
        tensor_parallel.model_parallel_cuda_manual_seed = original
        destroy_parallel_context()
    return calls


def test_the_seed_call_asks_for_the_graph_safe_rng_tracker():
    assert run_ranks(_seed_call, 1, tiny_values(cuda_graph_impl="local"))[0] == [{"use_cudagraphable_rng": True}]
    assert run_ranks(_seed_call, 1, tiny_values())[0] == [{}]


def _tracker_beside(rank, world_size, first, second):
    from megatron.core.tensor_parallel import random

    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context, ensure_rng_tracker

    build_parallel_context(build_job_config(first), torch.device("cpu"))
    calls, original = [], random.model_parallel_cuda_manual_seed
    # the CPU build cannot make the graph-safe tracker (megatron-core asserts CUDA graph support): record
    random.model_parallel_cuda_manual_seed = lambda *a, **k: calls.append(k)
    try:
        ensure_rng_tracker(build_job_config(second))  # what build_training_run(ctx=...) does
    finally:
        random.model_parallel_cuda_manual_seed = original
        destroy_parallel_context()
    return calls


def test_a_graphed_run_built_beside_an_eager_one_reseeds_the_graph_safe_tracker():
    """bench/gpu_throughput.py builds its CUDA-graph side on the eager side's groups (``ctx=``): megatron-
    core's CudaGraphManager asserted 'RNG tracker does not support cudagraphs!' on the H100 until the
    reused context re-seeded the tracker."""
    eager, graphed = tiny_values(), tiny_values(cuda_graph_impl="local")
    reseed = [{"use_cudagraphable_rng": True, "force_reset_rng": True}]
    assert run_ranks(_tracker_beside, 1, eager, graphed)[0] == reseed
    assert run_ranks(_tracker_beside, 1, eager, eager)[0] == []


def _layer_calls(rank, world_size, steps, fixed_documents=None):
    """What the first layer receives over ``steps`` packed micro-batches with static shapes, megatron-
    core's argument check on each, and the syncs a layer's forward and backward make. ``fixed_documents``:
    what --cuda-graph-impl local sets up on CUDA (static padding, boundaries padded to a fixed count);
    without it, the bucketed shapes of --torch-compile."""
    from megatron.core.transformer.cuda_graphs import ArgMetadata, _check_supported_type

    from megatron_ext.model.attention import bucket_max_seqlen, document_bound
    from megatron_ext.model.compile import mark_static_shapes
    from megatron_ext.training.step import build_step_microbatches, forward_step, unwrap_model
    from megatron_ext.training.sync_counter import SyncCounter

    values = tiny_values(
        num_layers=2,
        seq_length=64,
        micro_batch_size=1,
        global_batch_size=1,
        packed_sequences=True,
        sequence_padding="static" if fixed_documents else "negotiated",
        pad_to_multiple_of=16,
        pad_length_bucket="power-of-two",
        **LLAMA,
    )
    dataset = PackedMarkovDataset(64, median=3.0)
    run = build_tiny_run(values, dataset)
    mark_static_shapes([run.model[0].module], fixed_documents)
    layer = unwrap_model(run.model[0]).decoder.layers[0]
    signatures, rejected, syncs = set(), [], 0

    def check(value, where):
        meta = ArgMetadata(value)
        try:
            _check_supported_type(meta)
        except AssertionError as err:
            rejected.append(f"{where}: {err}")
        if dataclasses.is_dataclass(value):
            return tuple(check(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value))
        return (meta.type.__name__, tuple(meta.shape), meta.dtype) if torch.is_tensor(value) else value

    def record(module, args, kwargs):
        signatures.add(
            (
                tuple(check(a, f"args[{i}]") for i, a in enumerate(args)),
                tuple((k, check(v, k)) for k, v in sorted(kwargs.items())),
            )
        )

    layer.register_forward_pre_hook(record, with_kwargs=True)
    raw, bucketed = set(), set()
    for step in range(steps):
        microbatches, _ = build_step_microbatches(run, dataset, step)
        cu = microbatches[0].cu_seqlens_host
        t, longest = cu[-1], max(b - a for a, b in zip(cu, cu[1:]))
        if fixed_documents:  # static padding: the last document grows to the micro-batch's length
            assert t == microbatches[0].tokens.shape[1] == 64, (t, microbatches[0].tokens.shape)
        raw.add((t, longest, len(cu) - 1))
        bucketed.add((t, bucket_max_seqlen(longest, t), document_bound(len(cu) - 1)))
        output, loss_func = forward_step(iter(microbatches), run.model[0])
        with SyncCounter() as counter:  # the layers' backward (the loss's own work is outside)
            loss_func(output)[0].backward()
        syncs += counter.total
    return len(signatures), len(bucketed), len(raw), rejected, syncs


def test_recorded_layer_arguments_pass_megatron_cores_check_in_a_few_shapes():
    """Over 20 packed micro-batches: every argument passes ``_check_supported_type`` (the host tuple and
    the dict of ``PackedMicrobatchParams`` did not), one argument signature (what a CUDA graph is keyed
    on) per (padded length, max_seqlen bucket, document bound), fewer than the raw document layouts, and
    the layers' backward reads nothing on the host."""
    signatures, bucketed, raw, rejected, syncs = run_ranks(_layer_calls, 1, 20)[0]
    assert not rejected, rejected
    assert signatures == bucketed < raw, (signatures, bucketed, raw)
    assert syncs == 0


def test_cuda_graph_layers_see_one_argument_signature_for_the_whole_run():
    """megatron-core 0.16.1 replays a layer's training graphs in capture order and matches every call's
    arguments exactly (``_CudaGraphRunner.get_mismatch_errors``: shapes, and a dataclass's ints): on the
    H100 a packed run with bucketed shapes stopped at its first new bucket ('no matching cudagraph
    runners'). With CUDA graphs' fixed shapes (static padding, boundaries padded to a fixed document
    count, max_seqlen the micro-batch's length), 20 micro-batches of many document layouts are one
    signature, and every argument still passes megatron-core's check."""
    signatures, _, raw, rejected, syncs = run_ranks(_layer_calls, 1, 20, 32)[0]
    assert not rejected, rejected
    assert signatures == 1 < raw, (signatures, raw)
    assert syncs == 0


def test_a_micro_batch_over_the_fixed_document_count_names_the_flag():
    import pytest as _pytest

    from megatron_ext.model.attention import MASKED, PackedMicrobatchParams, prepare_static_packed_params

    cu = torch.tensor([0, 1, 2, 3, 8], dtype=torch.int32)
    params = PackedMicrobatchParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=5,
        max_seqlen_kv=5,
        cu_seqlens_host=(0, 1, 2, 3, 8),
    )
    fixed = prepare_static_packed_params(params, 8, torch.float32, False, MASKED, fixed_documents=4)
    assert fixed.cu_seqlens_q.tolist() == [0, 1, 2, 3, 8] and fixed.max_seqlen_q == 8
    with _pytest.raises(ValueError, match="--cuda-graph-max-documents to at least 16"):
        prepare_static_packed_params(params, 8, torch.float32, False, MASKED, fixed_documents=3)


def _forward_syncs(rank, world_size):
    """Syncs of one packed forward through the model with static shapes (a layer's own, and the loss's)."""
    from megatron_ext.model.compile import mark_static_shapes
    from megatron_ext.training.step import build_step_microbatches, get_packed_seq_params
    from megatron_ext.training.sync_counter import SyncCounter

    values = tiny_values(
        num_layers=2, seq_length=64, micro_batch_size=1, global_batch_size=1, packed_sequences=True, **LLAMA
    )
    dataset = PackedMarkovDataset(64)
    run = build_tiny_run(values, dataset)
    mark_static_shapes([run.model[0].module])
    mb = build_step_microbatches(run, dataset, 0)[0][0]
    params = get_packed_seq_params(mb, run.model[0])  # outside the layers: host reads allowed here
    with SyncCounter() as counter:
        run.model[0](
            input_ids=mb.tokens,
            position_ids=mb.position_ids,
            attention_mask=None,
            labels=mb.labels.clamp(min=0),
            packed_seq_params=params,
        ).sum().backward()
    return dict(counter.by_site)


def test_no_sync_inside_a_layer():
    assert run_ranks(_forward_syncs, 1)[0] == {}
