"""--torch-compile: layers compile whole at TP 1, train as eager does, keep eager's checkpoints, and see
a bounded set of shapes (model/compile.py).

Compile is slow on the CPU: graphs are traced with ``torch._dynamo.explain`` (no code generation) or
compiled with the ``aot_eager`` backend (dynamo + AOT autograd, the graphs inductor would get, run by
eager kernels); inductor's own code runs in ``bench/host_overhead.py``. Layers are tiny (2 layers,
hidden 64), and each case builds one model.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.testing import LLAMA_STYLE, MarkovDataset, PackedMarkovDataset, build_tiny_run, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

LLAMA = dict(LLAMA_STYLE, group_query_attention=True, num_query_groups=2)
SELECTIVE = dict(recompute_granularity="selective")
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SEQ = 32


def _values(style: str, packed: bool, **overrides) -> dict:
    values = tiny_values(num_layers=2, seq_length=SEQ, global_batch_size=2, micro_batch_size=1 if packed else 2)
    if style == "llama":
        values.update(LLAMA)
    if packed:
        values.update(packed_sequences=True)
    values.update(overrides)
    return values


def _dataset(packed: bool):
    return PackedMarkovDataset(SEQ) if packed else MarkovDataset(SEQ, mask_every=1)


def _record_layer_call(run, dataset, packed: bool, module=None):
    """The first layer (or ``module``) and the arguments it really receives in one training forward."""
    from megatron_ext.testing import fetch_step_microbatches
    from megatron_ext.training.step import forward_step, unwrap_model

    model = run.model[0]
    layer = module if module is not None else unwrap_model(model).decoder.layers[0]
    seen = {}
    handle = layer.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    forward_step(iter(fetch_step_microbatches(dataset, [[0]] if packed else [[0, 1]])), model)
    handle.remove()
    return layer, seen["args"], seen["kwargs"]


def _explain(rank, world_size, style, packed, overrides):
    """{"layer": (graphs, breaks, reasons)} of the first layer with what --torch-compile installs, and
    "block" of the whole decoder where --torch-compile compiles it whole (``compile_units``)."""
    import torch._dynamo

    from megatron_ext.model.compile import (
        compile_units,
        install_compilable_linears,
        install_compilable_recompute,
        mark_static_shapes,
        transformer_layers,
        viewless_block_input,
    )
    from megatron_ext.training.step import unwrap_model

    dataset = _dataset(packed)
    run = build_tiny_run(_values(style, packed, **overrides), dataset)
    chunk = run.model[0].module
    mark_static_shapes([chunk])  # what --torch-compile sets (layers stay eager here)
    for layer in transformer_layers([chunk]):
        install_compilable_linears(layer)
        install_compilable_recompute(layer)
    decoder = unwrap_model(run.model[0]).decoder
    out = {}
    for name, module in (("layer", None), ("block", decoder)):
        if name == "block" and compile_units([chunk]) != [decoder]:
            continue
        target, args, kwargs = _record_layer_call(run, dataset, packed, module)
        if module is not None:  # what compile_block does before the compiled call
            args, kwargs = viewless_block_input(args, kwargs)
        torch._dynamo.reset()
        result = torch._dynamo.explain(target)(*args, **kwargs)
        out[name] = (
            result.graph_count,
            result.graph_break_count,
            [b.reason.splitlines()[0] for b in result.break_reasons],
        )
    return out


CASES = {  # pairwise over style x packing x precision x recompute
    "gpt2-unpacked-fp32": ("gpt2", False, {}),
    "gpt2-packed-bf16-selective": ("gpt2", True, dict(bf16=True, **SELECTIVE)),
    "gpt2-unpacked-bf16-full": ("gpt2", False, dict(bf16=True, **FULL)),
    "llama-packed-fp32-full": ("llama", True, FULL),
    "llama-unpacked-fp32-selective": ("llama", False, SELECTIVE),
    "llama-packed-bf16": ("llama", True, dict(bf16=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_compiles_without_graph_breaks_at_tp1(case):
    """One graph per layer, no break, on the arguments a real training forward hands the layer
    (megatron-core's own linears break it into 14 graphs: see ``test_upstream_linears_break``); and one
    graph for the whole decoder where --torch-compile compiles it whole (not under full recompute)."""
    style, packed, overrides = CASES[case]
    out = run_ranks(_explain, 1, style, packed, overrides)[0]
    assert sorted(out) == (["layer"] if overrides.get("recompute_granularity") == "full" else ["block", "layer"])
    for name, (graphs, breaks, reasons) in out.items():
        assert (graphs, breaks) == (1, 0), (name, reasons)


def _explain_upstream(rank, world_size):
    import torch._dynamo

    import megatron_ext.run as run_module

    run_module.install_lean_linears = lambda chunks: 0  # megatron-core's own linears, as without issue 30
    run = build_tiny_run(_values("gpt2", False), _dataset(False))
    layer, args, kwargs = _record_layer_call(run, _dataset(False), False)
    return torch._dynamo.explain(layer)(*args, **kwargs).graph_break_count


def test_upstream_linears_break():
    """The reference: without our linears the same layer breaks (so the test above can fail)."""
    assert run_ranks(_explain_upstream, 1)[0] > 0


# ----------------------------------------------------------------------------- training and checkpoints

ITERS, SAVED_AT = 4, 2
TRAIN = dict(train_iters=ITERS, global_batch_size=4, save_interval=SAVED_AT, clip_grad=0.5)


def _train(values: dict, dataset, load: str | None = None):
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.training.checkpointing import load_checkpoint
    from megatron_ext.training.loop import train

    run = build_tiny_run(values, dataset)
    keys = sorted(run.model[0].state_dict().keys())
    if load is not None:
        assert load_checkpoint(run, load, step=SAVED_AT) == SAVED_AT
    train(run)
    destroy_parallel_context()
    return [r["loss"] for r in run.records], keys


def _train_across_the_flag(rank, world_size, root, style, packed, overrides):
    from torch._dynamo.backends.registry import lookup_backend

    import megatron_ext.model.compile as compile_module

    compiles = []
    compile_module.BACKEND = lambda gm, example_inputs: (
        compiles.append(1) or lookup_backend("aot_eager")(gm, example_inputs)
    )
    dataset = _dataset(packed)
    values = _values(style, packed, **TRAIN, **overrides)
    eager, compiled = os.path.join(root, "eager"), os.path.join(root, "compiled")
    out = {"eager": _train(dict(values, save=eager), dataset)}
    out["compiled"] = _train(dict(values, save=compiled, torch_compile=True), dataset)
    out["graphs"] = len(compiles)  # the layers did compile
    out["eager_from_compiled"] = _train(values, dataset, load=compiled)
    out["compiled_from_eager"] = _train(dict(values, torch_compile=True), dataset, load=eager)
    return out


@pytest.mark.parametrize("case,tol", [("llama-packed-fp32", 1e-5), ("gpt2-unpacked-bf16", 2e-2)])
def test_compiled_training_matches_eager_and_resumes_across_the_flag(case, tol, tmp_path):
    """Against eager (an independent reference: megatron-core's own linears, no compiler): the same
    losses, step by step, within 1e-5 relative (fp32) / 2e-2 (bf16); the same state-dict keys; and a
    checkpoint saved by either loads into the other and continues as the uninterrupted run does."""
    style, packing, precision = case.split("-")
    overrides = dict(bf16=True) if precision == "bf16" else {}
    out = run_ranks(_train_across_the_flag, 1, str(tmp_path), style, packing == "packed", overrides)[0]
    losses, keys = out["eager"]
    assert len(losses) == ITERS and out["graphs"] >= 1
    for name in ("compiled", "eager_from_compiled", "compiled_from_eager"):
        other, other_keys = out[name]
        assert other_keys == keys, name
        got = other if name == "compiled" else losses[:SAVED_AT] + other
        assert torch.allclose(torch.tensor(got), torch.tensor(losses), rtol=tol, atol=0), (name, got, losses)


# ----------------------------------------------------------------------------- shapes that stay put

MICROBATCHES, PER_STEP = 50, 1  # one micro-batch a step: each negotiates its own length


def _count_compiles(rank, world_size, packed):
    import megatron_ext.model.compile as compile_module
    from megatron_ext.model.attention import document_bound
    from megatron_ext.training.step import build_step_microbatches, train_step

    compiles = []

    def counting_backend(graph_module, example_inputs):  # dynamo calls it once per graph it compiles
        compiles.append(tuple(example_inputs[0].shape) if example_inputs else ())
        return graph_module.forward

    compile_module.BACKEND = counting_backend
    seq = 64
    values = _values(
        "llama",
        packed,
        seq_length=seq,
        micro_batch_size=1,
        global_batch_size=PER_STEP,
        torch_compile=True,
        sequence_padding="negotiated",
        pad_to_multiple_of=8,
        pad_length_bucket="power-of-two",
    )
    dataset = PackedMarkovDataset(seq, median=3.0) if packed else _VaryingLengths(seq)
    run = build_tiny_run(values, dataset)
    seen, late, documents = set(), [], set()
    for step in range(MICROBATCHES // PER_STEP):
        microbatches, length = build_step_microbatches(run, dataset, step * PER_STEP)
        # the CPU's masked kernel reads each token's document index [t]: the padded length is the bucket
        # (cu_seqlens, padded to the document bound, enters the graph with flash's varlen kernel: a GPU test)
        new = any(tuple(mb.tokens.shape) not in seen for mb in microbatches)
        seen |= {tuple(mb.tokens.shape) for mb in microbatches}
        documents |= {document_bound(len(mb.cu_seqlens_host) - 1) for mb in microbatches if mb.is_packed}
        before = len(compiles)
        train_step(run.model, run.optimizer, run.scheduler, microbatches, length, PER_STEP, run.ctx)
        if len(compiles) > before and not new:
            late.append((step, compiles[before:]))
    from megatron_ext.model.compile import compile_units

    return len(seen), len(compiles), late, len(documents), len(compile_units([run.model[0].module]))


class _VaryingLengths:
    """Unpacked samples of 5 to ``seq`` tokens (negotiated padding gives each step its own length)."""

    def __init__(self, seq: int):
        self.inner, self.seq = MarkovDataset(seq), seq

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        n = 5 + (i * 37) % (self.seq - 4)
        return {k: v[:n] for k, v in self.inner[i].items()}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_no_recompile_after_the_first_micro_batch_of_each_bucket(packed):
    """50 micro-batches of varying documents and lengths through compiled layers: one graph per compiled
    unit (the whole decoder here) per bucket (the padded length), compiled at the bucket's first micro-batch, none after; the
    documents' count and lengths never reach a guard (without ``prepare_static_shapes`` the host
    boundaries did: a recompile per distinct document layout)."""
    buckets, compiles, late, document_bounds, units = run_ranks(_count_compiles, 1, packed)[0]
    assert buckets >= 2 and (document_bounds >= 2 or not packed), (buckets, document_bounds)  # the data did vary
    assert not late, late  # a compile after a bucket's first micro-batch
    assert units == 1 and compiles == units * buckets


# ----------------------------------------------------------------------------- eager at TP 1


def _grads_with_and_without_lean_linears(rank, world_size, style):
    import megatron_ext.run as run_module
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import fetch_step_microbatches
    from megatron_ext.training.step import run_forward_backward

    out = {}
    for lean in (True, False):
        if not lean:
            run_module.install_lean_linears = lambda chunks: 0
        dataset = _dataset(False)
        run = build_tiny_run(_values(style, False, global_batch_size=4), dataset)
        reports = run_forward_backward(run.model, fetch_step_microbatches(dataset, [[0, 1], [2, 3]]), SEQ)
        linears = sum(
            type(m.forward).__name__ == "method" and m.forward.__func__.__name__.startswith("_lean")
            for m in run.model[0].modules()
        )
        out[lean] = (
            [r["lm loss"] for r in reports],
            {n: p.main_grad.clone() for n, p in run.model[0].module.named_parameters()},
            linears,
        )
        destroy_parallel_context()
    return out


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_lean_linears_keep_megatron_cores_numbers_bit_for_bit(style):
    """Eager at TP 1 takes our lean linears (fewer Python calls), the output layer's included (GPT-2's
    tied to the embedding: megatron-core's zeroed dummy gradient); against megatron-core's own linears
    the losses and every accumulated gradient are identical, bit for bit."""
    out = run_ranks(_grads_with_and_without_lean_linears, 1, style)[0]
    (lean_losses, lean_grads, lean_count), (ref_losses, ref_grads, ref_count) = out[True], out[False]
    assert lean_count == 9 and ref_count == 0  # 4 linears in each of the 2 layers, and the output layer
    assert all(torch.equal(a, b) for a, b in zip(lean_losses, ref_losses))
    assert lean_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert torch.equal(lean_grads[name], g), name


# ----------------------------------------------------------------------------- TP 2


def _tp2(rank, world_size):
    import megatron_ext.model.compile as compile_module

    compile_module.BACKEND = "aot_eager"
    from megatron_ext.parallel import destroy_parallel_context

    explained = _explain(rank, world_size, "llama", True, dict(tensor_model_parallel_size=2, sequence_parallel=True))
    destroy_parallel_context()
    dataset = _dataset(True)
    values = _values(
        "llama", True, train_iters=3, global_batch_size=4, tensor_model_parallel_size=2, sequence_parallel=True
    )
    return explained, _train(values, dataset)[0], _train(dict(values, torch_compile=True), dataset)[0]


def test_tp2_with_sequence_parallelism_compiles_whole_and_trains_as_eager():
    """At TP 2 with SP the collectives are traced in the graph (our reduce-scatter for the row-parallel
    linears: megatron-core's goes through _reduce_scatter_base, 8 breaks per layer): no break (the cap),
    and the compiled run's losses are eager's."""
    for explained, eager, compiled in run_ranks(_tp2, 2):
        assert sorted(explained) == ["layer"]  # sequence parallelism: each layer compiles alone
        graphs, breaks, reasons = explained["layer"]
        assert (graphs, breaks) == (1, 0), reasons
        assert torch.allclose(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0), (compiled, eager)


def _tp2_without_sp(rank, world_size):
    """One step's losses and full gradients at TP 2 without SP, eager (megatron-core's own linears) and
    compiled (``aot_eager``; the decoder compiles whole)."""
    import megatron_ext.model.compile as compile_module
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import fetch_step_microbatches, gather_full_grads
    from megatron_ext.training.step import run_forward_backward, unwrap_model

    compile_module.BACKEND = "aot_eager"
    dataset = _dataset(False)
    out = {}
    for compiled in (False, True):
        values = _values("llama", False, global_batch_size=4, tensor_model_parallel_size=2, torch_compile=compiled)
        run = build_tiny_run(values, dataset)
        ours = sum(getattr(m, "traceable_linear", False) for m in run.model[0].modules())
        block = unwrap_model(run.model[0]).decoder
        reports = run_forward_backward(run.model, fetch_step_microbatches(dataset, [[0, 1], [2, 3]]), SEQ)
        out[compiled] = {
            "losses": [float(r["lm loss"][0]) for r in reports],
            "grads": gather_full_grads(run),
            "ours": ours,
            "compiled_whole": getattr(block, "_compiled_call_impl", None) is not None,
        }
        destroy_parallel_context()
    return out


def test_tp2_without_sequence_parallelism_compiled_step_gives_eagers_losses_and_gradients():
    """At TP 2 without SP our compiled linears all-reduce the column-parallel input gradients themselves
    (``_linear_backward``; under SP it is a reduce-scatter, which the test above covers): one step's
    losses and every parameter's full gradient equal eager's (megatron-core's linears, no compiler)
    within 1e-5, on both TP ranks. A missing all-reduce leaves each rank half of the layers' input
    gradients: the embedding's and the first layers' gradients are off by O(1)."""
    for out in run_ranks(_tp2_without_sp, 2):
        eager, compiled = out[False], out[True]
        assert eager["ours"] == 0 and compiled["ours"] == 8 and compiled["compiled_whole"]  # 4 linears x 2 layers
        assert len(eager["losses"]) == 2 and compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert compiled["grads"].keys() == eager["grads"].keys()
        for name, g in eager["grads"].items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(
                compiled["grads"][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )


# ----------------------------------------------------------------------------- PP 2


def _pp2(rank, world_size):
    import megatron_ext.model.compile as compile_module

    compile_module.BACKEND = "aot_eager"
    dataset = _dataset(False)
    values = _values("llama", False, num_layers=4, train_iters=3, global_batch_size=4, pipeline_model_parallel_size=2)
    return _train(values, dataset)[0], _train(dict(values, torch_compile=True), dataset)[0]


def test_pp2_compiled_blocks_train_as_eager():
    """Under pipeline parallelism each stage's decoder compiles whole, the second stage's input arriving
    through ``set_input_tensor`` (an attribute the compiled block reads, not an argument): the losses of
    the last stage are eager's within 1e-5 relative (fp32)."""
    (first_eager, first_compiled), (eager, compiled) = run_ranks(_pp2, 2)
    assert first_eager == first_compiled == [] and len(eager) == len(compiled) == 3  # the loss is the last stage's
    assert torch.allclose(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0), (compiled, eager)


# ----------------------------------------------------------------------------- inductor's C++ wrapper


def _compile_calls(rank, world_size, extra):
    """The keyword arguments of every torch.compile call a --torch-compile build makes (torch.compile
    recorded, not run: inductor's C++ compile takes minutes on a CPU; bench/host_overhead.py runs it and
    compares its gradients with eager's)."""
    recorded = []

    def record(fn, **kwargs):
        recorded.append(kwargs)
        return fn

    torch.compile = record
    build_tiny_run(_values("llama", False, torch_compile=True, **extra), _dataset(False))
    return recorded


@pytest.mark.parametrize("wrapper", [True, False], ids=["cpp-wrapper", "python-wrapper"])
def test_cpp_wrapper_reaches_inductor(wrapper):
    """--torch-compile-cpp-wrapper: inductor's ``cpp_wrapper`` option on the one compiled block, and
    nothing without the flag."""
    recorded = run_ranks(_compile_calls, 1, dict(torch_compile_cpp_wrapper=wrapper))[0]
    options = {"size_asserts": False, "alignment_asserts": False, **({"cpp_wrapper": True} if wrapper else {})}
    assert recorded == [dict(fullgraph=True, dynamic=False, backend="inductor", options=options)]


def test_inductor_options_drop_the_wrappers_per_buffer_asserts():
    """``inductor_options()`` reaches inductor: a graph compiled with them has no ``assert_size_stride(...)``
    in its generated wrapper, and the same graph compiled with inductor's defaults has (so the check
    can fail); the results are equal. An extern matmul only: no C++ kernel to build, about a second."""
    from torch._inductor.utils import run_and_get_code

    from megatron_ext.model.compile import inductor_options

    def fn(x, w):
        return x @ w.t()

    x, w = torch.randn(8, 4), torch.randn(6, 4)
    torch._dynamo.reset()
    ours, (code,) = run_and_get_code(torch.compile(fn, dynamic=False, options=inductor_options()), x, w)
    torch._dynamo.reset()
    default, (default_code,) = run_and_get_code(torch.compile(fn, dynamic=False), x, w)
    torch._dynamo.reset()
    assert "assert_size_stride(" in default_code and "assert_size_stride(" not in code
    assert torch.equal(ours, default) and torch.equal(ours, fn(x, w))
