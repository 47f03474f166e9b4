"""--torch-compile (ours, off by default): each chunk's transformer block (or each layer) compiled whole, in place.

``apply_torch_compile(chunks)`` runs after mixed precision and before DDP (as torchtitan's
``apply_compile``): each chunk's ``decoder`` (megatron-core's TransformerBlock: its layers and final
norm) is compiled whole with ``fullgraph=True`` (``compile_block``: one dynamo entry and one AOT
autograd wrapper per micro-batch, not one per layer: at 4 Llama-style layers 4,028 -> ~3,020 Python
calls per micro-batch, ``bench/host_overhead.py``); where the block cannot trace (full recompute,
sequence parallelism, fp8/fp4, offloading: ``block_compiles``) every ``TransformerLayer`` gets
``layer.compile(fullgraph=True)`` instead. Both compile the module's call in place, so parameter names
and state-dict keys are unchanged (``torch.compile(layer)`` would rename every key to ``_orig_mod.*``
and break checkpoints between compiled and eager runs). Before that, each layer's column/row-parallel
linears gets our
``_forward_impl`` (the seam ``model/wgrad_deferral.py`` uses too), because megatron-core 0.16.1's
cannot be traced whole:

- its backward assigns ``weight.main_grad`` and ``weight.grad_added_to_main_grad`` (attribute side
  effects dynamo refuses inside an autograd.Function's backward): ours hands ``main_grad`` to the
  Function as an input kept on ``ctx`` (not ``save_for_backward``: DDP's buffer is bumped by every
  other weight's accumulation before this backward runs, so a saved version would never match) and
  accumulates into it through the ``megatron_ext::accumulate_wgrad`` custom op, whose schema marks
  it mutated (``Tensor(a!)``); ``grad_added_to_main_grad`` is set in the forward (dynamo replays that side
  effect), before the backward whose DDP hook reads it;
- ``RowParallelLinear`` passes ``tp_group=None`` and megatron-core resolves it per call through a
  function that warns (a break, and a process-group look-up per linear per micro-batch): ours uses
  the group the layer resolved when it was built.

Invariants: numbers are megatron-core's (the same GEMMs; the fused accumulation is
``model/wgrad.accumulate_wgrad``); eager runs at TP 1 run the same linears, less their TP-region
Functions (``install_lean_linears``: fewer Python calls); the zero-bubble schedules' W deferral
(``model/wgrad_deferral.py``) and these linears never meet: validation refuses --torch-compile with a
zero-bubble --pipeline-schedule (``compile_checks``), ``run.prepare_layers`` leaves the lean linears out
under one, each of these linears is marked ``traceable_linear``, which ``apply_weight_grad_deferral``
refuses, and ``install_compilable_linears`` refuses a linear that already defers.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_ext.model.attention import (
    MASKED,
    VARLEN,
    VarlenDotProductAttention,
    flash_varlen_supported,
    prepare_static_packed_params,
    select_packed_kernel,
)
from megatron_ext.model.wgrad import accumulate_wgrad
from megatron_ext.model.wrapping import unwrap_model

# graphs per layer: grad on/off (full recompute's no-grad forward) x a few length/document buckets
# (dynamo counts every layer's graphs against one code object, TransformerLayer's call)
GRAPHS_PER_LAYER = 32
BACKEND = "inductor"  # torch.compile's backend (tests use aot_eager: the same graphs, no code generation)


def _accumulate_wgrad_kernel(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_output [n, out]^T @ total_input [n, in]`` (fp32 accumulation of
    bf16 inputs on CUDA); opaque to the compiler, which sees only that ``main_grad`` is written."""
    accumulate_wgrad(total_input, grad_output, main_grad)


# ``megatron_ext::accumulate_wgrad``, defined through the low-level ``torch.library.Library``: the schema
# marks ``main_grad`` mutated (``Tensor(a!)``: inductor functionalizes the call and keeps it, in order, in
# the compiled backward), one kernel for every backend, a fake for tracing, and no Python autograd or
# ADInplaceOrView kernel (nothing differentiates through it; ``main_grad`` is saved by no autograd node).
# ``torch.library.custom_op`` registered those in Python: ~20 Python calls per call (4 linears a layer,
# every backward) against ~4 here.
_LIBRARY = torch.library.Library("megatron_ext", "FRAGMENT")
_LIBRARY.define("accumulate_wgrad(Tensor total_input, Tensor grad_output, Tensor(a!) main_grad) -> ()")
_LIBRARY.impl("accumulate_wgrad", _accumulate_wgrad_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("megatron_ext::accumulate_wgrad", lambda total_input, grad_output, main_grad: None)
accumulate_wgrad_op = torch.ops.megatron_ext.accumulate_wgrad.default


def _collective_input(input_: torch.Tensor, tp_group: Any, sequence_parallel: bool) -> torch.Tensor:
    """[s/tp, b, h] shards -> [s, b, h] under sequence parallelism (a synchronous all-gather, which
    dynamo turns into a functional collective or breaks at); the input itself otherwise."""
    if not sequence_parallel:
        return input_
    size = list(input_.shape)
    size[0] *= tp_group.size()
    out = input_.new_empty(size)
    torch.distributed.all_gather_into_tensor(out, input_.contiguous(), group=tp_group)
    return out


class CompilableLinear(torch.autograd.Function):
    """megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``, traceable:
    ``output [s, b, out] = gather_sp(input) @ weight^T + bias``; backward gives the input gradient
    (all-reduced over TP, or reduce-scattered under SP), the bias gradient, and the weight gradient
    either accumulated into ``main_grad`` (returning the dummy gradient DDP's hook then ignores,
    as upstream) or, without DDP's buffers, returned."""

    @staticmethod
    def forward(ctx, input_, weight, bias, main_grad, allreduce_dgrad, sequence_parallel, tp_group):
        ctx.save_for_backward(input_, weight)
        ctx.main_grad = main_grad  # on ctx, not saved: see the module docstring
        ctx.use_bias, ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = (
            bias is not None,
            allreduce_dgrad,
            sequence_parallel,
            tp_group,
        )
        output = torch.matmul(_collective_input(input_, tp_group, sequence_parallel), weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        return _linear_backward(ctx, grad_output, zero_dummy=False)


class CompilableLinearZeroedDummy(CompilableLinear):
    """``CompilableLinear`` on a weight megatron-core marks ``zero_out_wgrad`` (the embedding weight an
    output layer on the same stage shares): the dummy weight gradient is zeros, as upstream's, because
    DDP's hook then adds the summed ``.grad`` (the embedding's gradient plus this dummy) into
    ``main_grad``."""

    @staticmethod
    def backward(ctx, grad_output):
        return _linear_backward(ctx, grad_output, zero_dummy=True)


def _linear_backward(ctx, grad_output, zero_dummy: bool):
    """``CompilableLinear``'s backward; ``zero_dummy``: the dummy weight gradient zeroed."""
    input_, weight = ctx.saved_tensors
    total_input = _collective_input(input_, ctx.tp_group, ctx.sequence_parallel)
    grad_input = grad_output.matmul(weight)
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    if ctx.sequence_parallel:
        shard = grad_input.new_empty(input_.shape)
        torch.distributed.reduce_scatter_tensor(shard, grad_input.contiguous(), group=ctx.tp_group)
        grad_input = shard
    g2 = grad_output.reshape(-1, grad_output.shape[-1])
    x2 = total_input.reshape(-1, total_input.shape[-1])
    if ctx.main_grad is not None:
        # compiled: the custom op (the compiler sees main_grad written); eager: the same function
        # without the op's Python dispatch (~20 calls)
        accumulate = accumulate_wgrad_op if torch.compiler.is_compiling() else accumulate_wgrad
        accumulate(x2, g2, ctx.main_grad)
        # DDP's hook drops it (grad_added_to_main_grad), or adds it where zero_out_wgrad
        grad_weight = torch.zeros_like(weight) if zero_dummy else torch.empty_like(weight)
    else:
        grad_weight = g2.t().matmul(x2)
    grad_bias = g2.sum(dim=0) if ctx.use_bias else None
    return grad_input, grad_weight, grad_bias, None, None, None, None


def _compilable_forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (upstream's name)
    """``_forward_impl`` of a linear in a compiled layer (bound to the instance): upstream's keyword
    arguments, our Function, the layer's own TP group. A frozen weight keeps upstream's path."""
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight

    if not weight.requires_grad:
        return linear_with_frozen_weight(input, weight, *args, **{**kwargs, "tp_group": self.tp_group})
    main_grad = None
    if kwargs["gradient_accumulation_fusion"] and hasattr(weight, "main_grad"):
        main_grad = weight.main_grad
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True  # read by DDP's hook in this micro-batch's backward
    return self.linear_function.apply(  # CompilableLinear, or its zeroed-dummy variant (install_lean_output_layers)
        input, weight, kwargs["bias"], main_grad, kwargs["allreduce_dgrad"], kwargs["sequence_parallel"], self.tp_group
    )


def install_compilable_linears(module: torch.nn.Module) -> int:
    """Our ``_forward_impl`` on every column/row-parallel linear under ``module`` (and, at TP 1, the
    lean ``forward``: ``install_lean_forward``); returns how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for linear in module.modules():
        if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            if getattr(linear, "wgrad_queue", None) is not None:
                raise ValueError(
                    "--torch-compile: this linear defers its weight gradient into a zero-bubble W queue, "
                    "which a compiled backward cannot feed; drop --torch-compile or pick a 1F1B schedule"
                )
            linear._forward_impl = types.MethodType(_compilable_forward_impl, linear)
            linear.linear_function = CompilableLinear  # an instance attribute: no Python call to find it
            linear.traceable_linear = True  # apply_weight_grad_deferral refuses it (model/wgrad_deferral.py)
            if (
                not install_lean_forward(linear)
                and isinstance(linear, RowParallelLinear)
                and linear.sequence_parallel
                and not linear.explicit_expert_comm
            ):
                linear.forward = types.MethodType(_sequence_parallel_row_forward, linear)
            count += 1
    return count


def _lean_column_forward(self, input_, weight=None, runtime_gather_output=None):
    """``ColumnParallelLinear.forward`` at TP 1 (bound to the instance): upstream's steps less the
    identity copy-to/gather-from-TP-region autograd Functions (each an apply of ~15 Python calls,
    forward and backward, with nothing to do for one rank). Returns (output, bias or None)."""
    if weight is None:
        weight = self.weight
    elif weight.shape != (self.output_size_per_partition, self.input_size):
        raise RuntimeError(
            f"supplied weight's shape is {tuple(weight.shape)}, not "
            f"{(self.output_size_per_partition, self.input_size)} as expected"
        )
    output = self._forward_impl(
        input=input_,
        weight=weight,
        bias=None if self.skip_bias_add else self.bias,
        gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        allreduce_dgrad=False,
        sequence_parallel=False,
        grad_output_buffer=None,
        wgrad_deferral_limit=None,
        tp_group=self.tp_group,
    )
    return output, self.bias if self.skip_bias_add else None


def _row_matmul_and_bias(self, input_, reduce=None):
    """The steps of ``RowParallelLinear.forward`` both row forwards below share: the local GEMM
    (no TP-region Functions), then ``reduce`` of the partial sums if given, then the bias."""
    output = self._forward_impl(
        input=input_,
        weight=self.weight,
        bias=None,
        gradient_accumulation_fusion=self.gradient_accumulation_fusion,
        allreduce_dgrad=False,
        sequence_parallel=False,
        grad_output_buffer=None,
        tp_group=self.tp_group,
    )
    if reduce is not None:
        output = reduce(output)
    if self.skip_bias_add:
        return output, self.bias
    return (output + self.bias if self.bias is not None else output), None


def _lean_row_forward(self, input_):
    """``RowParallelLinear.forward`` at TP 1 (bound to the instance): upstream's steps less the
    identity scatter-to/reduce-from-TP-region autograd Functions. Returns (output, bias or None)."""
    return _row_matmul_and_bias(self, input_)


class _ReduceScatterToSequenceShards(torch.autograd.Function):
    """megatron-core's reduce-scatter to the sequence-parallel region ([s, b, h] partial sums -> the
    summed [s/tp, b, h] shard; backward: all-gather), through the ``torch.distributed`` calls dynamo
    traces as collectives (megatron-core's goes through ``_reduce_scatter_base``, a graph break)."""

    @staticmethod
    def forward(ctx, input_, tp_group):
        ctx.tp_group = tp_group
        out = input_.new_empty((input_.shape[0] // tp_group.size(), *input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, input_.contiguous(), group=tp_group)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return _collective_input(grad_output, ctx.tp_group, True), None


def _sequence_parallel_row_forward(self, input_):
    """``RowParallelLinear.forward`` under sequence parallelism (bound to the instance, compiled layers
    only): upstream's steps with a reduce-scatter dynamo traces. Returns (output, bias or None)."""
    return _row_matmul_and_bias(self, input_, lambda out: _ReduceScatterToSequenceShards.apply(out, self.tp_group))


def install_lean_forward(linear: torch.nn.Module) -> bool:
    """The TP-1 ``forward`` of ``_lean_column_forward`` / ``_lean_row_forward`` on one linear where
    upstream's would do nothing more (one TP rank, no sequence parallelism, no expert communication,
    no deferred embedding wgrad, no activation offloading); returns whether installed."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if not lean_forward_applies(linear):
        return False
    lean = _lean_column_forward if isinstance(linear, ColumnParallelLinear) else _lean_row_forward
    linear.forward = types.MethodType(lean, linear)
    return True


def lean_forward_applies(linear: torch.nn.Module) -> bool:
    config = linear.config
    return not (
        linear.tp_group is None
        or linear.tp_group.size() != 1
        or linear.sequence_parallel
        or linear.explicit_expert_comm
        or config.defer_embedding_wgrad_compute
        or config._cpu_offloading_context is not None
        or getattr(config, "cpu_offloading", False)
    )


def install_lean_linears(chunks: list[torch.nn.Module]) -> int:
    """Eager runs at TP 1: our ``_forward_impl`` and lean ``forward`` on the linears of every
    transformer layer and on the output layer (``install_lean_output_layers``): the same GEMMs and
    accumulation (bitwise megatron-core's numbers), ~40% fewer Python calls per linear (megatron-core's
    autocast decorators, its per-call TP-group look-up and the identity TP-region Functions). Returns
    how many linears got it."""
    count = 0
    for layer in transformer_layers(chunks):
        if all(lean_forward_applies(m) for m in _linears(layer)):
            count += install_compilable_linears(layer)
    return count + install_lean_output_layers(chunks)


def install_lean_output_layers(chunks: list[torch.nn.Module]) -> int:
    """The lean TP-1 linear on each chunk's output layer (eager, also under --torch-compile, which
    compiles the transformer block only): ~100 fewer Python calls per micro-batch. A weight the
    embedding shares on this stage (megatron-core's ``zero_out_wgrad``) gets upstream's zeroed dummy
    gradient (``CompilableLinearZeroedDummy``). Returns how many."""
    count = 0
    for model in map(unwrap_model, chunks):
        head = getattr(model, "output_layer", None)
        if head is None or not lean_forward_applies(head):
            continue
        count += install_compilable_linears(head)
        weight = head.weight if head.weight is not None else model.shared_embedding_or_output_weight()
        if getattr(weight, "zero_out_wgrad", False):  # set by megatron-core when the model is built
            head.linear_function = CompilableLinearZeroedDummy
    return count


def _linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in layer.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def transformer_layers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every megatron-core TransformerLayer of the chunks (inside Float16Module or not)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


def apply_torch_compile(chunks: list[torch.nn.Module], backend: Any = None, cpp_wrapper: bool = False) -> int:
    """Compile every transformer layer of ``chunks`` in place (before DDP), within its whole block where
    it can (``compile_units``); returns how many layers. ``backend``: torch.compile's (default
    ``BACKEND``); ``cpp_wrapper`` (--torch-compile-cpp-wrapper): inductor's C++ wrapper, an option of the
    inductor backend only. Static shapes (``dynamic=False``): each bucket of ``data/padding.py`` gets its
    own graph, as CUDA graphs and fixed kernels want."""
    from megatron.core.distributed import DistributedDataParallel

    if any(isinstance(c, DistributedDataParallel) for c in chunks):
        raise RuntimeError("apply_torch_compile runs before wrap_with_ddp (DDP registers its hooks on the weights)")
    mark_static_shapes(chunks)
    layers = transformer_layers(chunks)
    configure_dynamo(len(layers))
    for layer in layers:
        install_compilable_linears(layer)
        install_compilable_recompute(layer)
    backend = backend or BACKEND
    kwargs = dict(fullgraph=True, dynamic=False, backend=backend)
    if backend == "inductor":  # torch.compile takes options with inductor alone
        kwargs["options"] = inductor_options(cpp_wrapper)
    for unit in compile_units(chunks):
        if isinstance(unit, TransformerBlock):
            compile_block(unit, kwargs)
        else:
            unit.compile(**kwargs)
    install_lean_output_layers(chunks)  # eager, outside the compiled blocks
    return len(layers)


def inductor_options(cpp_wrapper: bool = False) -> dict[str, bool]:
    """Inductor's options for our compiled blocks: its generated wrapper's per-buffer checks off
    (``size_asserts``: an ``assert_size_stride`` per graph input and per extern kernel's output;
    ``alignment_asserts``), which re-check what dynamo's guards already pin under ``dynamic=False``
    (every input's sizes and strides) and cost one Python call each on every call: ~150 of ~2,240
    Python calls per micro-batch at 4 Llama-style layers (bench/host_overhead.py), host time on a GPU
    too (as vLLM's CPU backend turns them off). ``cpp_wrapper``: --torch-compile-cpp-wrapper."""
    options = {"size_asserts": False, "alignment_asserts": False}
    if cpp_wrapper:
        options["cpp_wrapper"] = True
    return options


def compile_block(block: torch.nn.Module, compile_kwargs: dict) -> None:
    """``block.compile(**compile_kwargs)`` with the input made viewless first, in eager:
    megatron-core's block calls ``make_viewless_tensor`` on it, whose autograd.Function creates a
    ``requires_grad`` tensor dynamo will not trace (the input is a view at micro-batch 1: the
    embedding's transpose). The block's own call then finds a viewless input and does nothing."""
    compiled = torch.compile(block._call_impl, **compile_kwargs)

    def call(*args, **kwargs):
        args, kwargs = viewless_block_input(args, kwargs)
        return compiled(*args, **kwargs)

    block._compiled_call_impl = call  # what Module.compile sets; nn.Module's call runs it


def viewless_block_input(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A TransformerBlock call's arguments with ``hidden_states`` (first positional or keyword) made
    viewless by megatron-core's ``make_viewless_tensor`` (a no-op on a tensor that is no view)."""
    from megatron.core.utils import make_viewless_tensor

    if args and isinstance(args[0], torch.Tensor):
        return (make_viewless_tensor(args[0], requires_grad=True, keep_graph=True), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        hidden = make_viewless_tensor(kwargs["hidden_states"], requires_grad=True, keep_graph=True)
        return args, {**kwargs, "hidden_states": hidden}
    return args, kwargs


def compile_units(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """What ``apply_torch_compile`` compiles: each chunk's whole ``decoder`` (megatron-core's
    TransformerBlock: its layers and final norm, one dynamo entry and one AOT autograd wrapper per
    micro-batch instead of one per layer: ~970 fewer Python calls per micro-batch at 4 layers) where
    ``block_compiles``; each of its layers otherwise."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    units = []
    for chunk in chunks:
        for block in (m for m in chunk.modules() if isinstance(m, TransformerBlock)):
            if block_compiles(block.config):
                units.append(block)
            else:
                units += [m for m in block.modules() if isinstance(m, TransformerLayer)]
    return units


def block_compiles(config: Any) -> bool:
    """Whether a TransformerBlock traces whole: not under full recompute (megatron-core's
    ``_checkpointed_forward`` saves RNG states, which dynamo will not trace), sequence parallelism (the
    block forks the CUDA RNG tracker), fp8/fp4 contexts or activation offloading (host-side state per
    layer); each layer compiles alone there, as before."""
    return not (
        config.recompute_granularity == "full"
        or config.sequence_parallel
        or config.fp8
        or config.fp4
        or getattr(config, "cpu_offloading", False)
        or config._cpu_offloading_context is not None
    )


def configure_dynamo(num_layers: int) -> None:
    """Room for every layer's graph of every bucketed shape without falling back to eager."""
    import torch._dynamo

    limit = max(1, num_layers) * GRAPHS_PER_LAYER
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, limit)


def _checkpointed_core_attention(
    self,
    query,
    key,
    value,
    attention_mask,
    rotary_pos_emb=None,
    attn_mask_type=None,
    attention_bias=None,
    packed_seq_params=None,
):
    """megatron-core's selective recompute of core attention (``Attention._checkpointed_attention_forward``,
    bound to the instance) through ``torch.utils.checkpoint`` (non-reentrant), which dynamo traces as one
    region: upstream's reentrant ``CheckpointFunction`` saves RNG states with ``get_rng_state``, which
    dynamo will not trace. Same recomputation: core attention's output is not kept, its inputs are."""
    import torch.utils.checkpoint

    def core_attention(q, k, v, mask):
        return self.core_attention(
            q,
            k,
            v,
            mask,
            attn_mask_type=attn_mask_type or self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )

    return torch.utils.checkpoint.checkpoint(core_attention, query, key, value, attention_mask, use_reentrant=False)


def install_compilable_recompute(layer: torch.nn.Module) -> None:
    """Selective recompute of core attention through ``_checkpointed_core_attention`` where the
    layer's attention recomputes it (``--recompute-modules core_attn``, the default)."""
    attention = getattr(layer, "self_attention", None)
    if attention is not None and getattr(attention, "checkpoint_core_attention", False):
        attention._checkpointed_attention_forward = types.MethodType(_checkpointed_core_attention, attention)


# ----------------------------------------------------------------------------- static shapes


def mark_static_shapes(chunks: list[torch.nn.Module], fixed_documents: int | None = None) -> None:
    """Tell ``training/step.py`` to hand these chunks' layers bounded shapes and nothing host-side
    (``prepare_static_shapes``): compiled layers and CUDA graphs need both. ``fixed_documents`` (CUDA
    graphs): packed boundaries padded to exactly this many documents, ``max_seqlen`` the micro-batch's
    length: one shape for the whole run (``attention.prepare_static_packed_params``)."""
    for chunk in chunks:
        chunk.static_shapes = True
        chunk.fixed_documents = fixed_documents


def fixed_packed_documents(model: torch.nn.Module) -> int | None:
    return _wrapped_mark(model, "fixed_documents", None)


def uses_static_shapes(model: torch.nn.Module) -> bool:
    return bool(_wrapped_mark(model, "static_shapes", False))


def _wrapped_mark(model: torch.nn.Module, name: str, default: Any) -> Any:
    """``mark_static_shapes``'s ``name`` on ``model`` or the chunk it wraps (DDP's ``.module``), read
    from the instances' ``__dict__``: once per micro-batch, and ``hasattr`` on a module that lacks
    the name runs nn.Module's Python ``__getattr__`` and raises inside it."""
    while name not in model.__dict__:
        modules = model.__dict__["_modules"]
        if "module" not in modules:
            return default
        model = modules["module"]
    return model.__dict__[name]


def prepare_static_shapes(params, num_tokens: int, config, fixed_documents: int | None = None):
    """Once per packed micro-batch, before the first layer: ``StaticPackedParams`` with the kernel
    chosen (flash varlen where it runs, else one masked SDPA), boundaries checked and padded,
    ``max_seqlen`` bucketed, rotary coefficients built in the layers' dtype
    (``model/attention.prepare_static_packed_params``)."""
    device = params.cu_seqlens_q.device
    dtype = config.params_dtype
    available = device.type == "cuda" and flash_varlen_supported(device.index or 0, config.kv_channels)
    kernel = select_packed_kernel(device.type, config.attention_dropout, available, dtype)
    return prepare_static_packed_params(
        params, num_tokens, dtype, config.rotary_interleaved, VARLEN if kernel == VARLEN else MASKED, fixed_documents
    )


def warm_rotary_table(model: torch.nn.Module, seq_len: int, device: torch.device) -> None:
    """Fill the chunk's RoPE table for ``seq_len`` before the layers read it (a miss inside a
    compiled layer would break its graph)."""
    found = getattr(model, "rope_attention", None)  # looked up once per chunk (a tuple: not a submodule)
    if found is None:
        found = model.rope_attention = tuple(
            m for m in model.modules() if isinstance(m, VarlenDotProductAttention) and m._rotates()
        )[:1]
    for module in found:
        config = module.config
        module.rotary_table.coefficients(seq_len, config.params_dtype, device, config.rotary_interleaved)
