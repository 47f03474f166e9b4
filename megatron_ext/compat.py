"""Every workaround for megatron-core and torch internals, in one table.

Each workaround lives with its concern (the platform layer, the checkpoint reader, ...); this
table is where whoever upgrades megatron-core or torch starts. An entry names what upstream does
wrong or lacks for us, the code of ours that corrects it (``where``: ``module:qualified.name``),
the upstream names it reaches into or replaces (``upstream``: dotted paths that must exist), and
the versions it was checked against.

Invariant: ``tests/unit/test_compat.py`` resolves every ``where`` and ``upstream`` name and fails
on a megatron-core other than ``CHECKED_MEGATRON_CORE_VERSION``; a new workaround is added here
or that test's scan of the package fails. At run time ``check_versions()`` warns once when the
installed megatron-core or torch lies outside what was checked (it never fails a run).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Any

CHECKED_MEGATRON_CORE_VERSION = "0.16.1"
# torch releases the workarounds were run against: the GPU machines run 2.11, CI 2.13.
CHECKED_TORCH_RANGE = ((2, 11), (2, 13))


@dataclasses.dataclass(frozen=True)
class Workaround:
    name: str
    corrects: str  # the upstream behaviour, as measured
    where: str  # our code: "megatron_ext.module:qualified.name"
    upstream: tuple[str, ...]  # upstream names reached into or replaced
    checked: str = f"megatron-core {CHECKED_MEGATRON_CORE_VERSION}, torch 2.11-2.13"


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "pickle-free-index-caches",
        "GPTDataset and BlendedDataset load their index caches with numpy.load(allow_pickle=True): a file "
        "there that is a pickle, not a .npy array, runs its code",
        "megatron_ext.data.gpt_datasets:apply_pickle_free_index_loads",
        ("megatron.core.datasets.gpt_dataset.numpy", "megatron.core.datasets.blended_dataset.numpy"),
    ),
    Workaround(
        "cuda-devices-on-cpu",
        "megatron-core hard-codes device='cuda' / torch.cuda.current_device() in its schedules "
        "(total_num_tokens), P2P buffers, optimizer buffers, grad-norm buffers and DDP buffers, and "
        "accepts only 'torch.cuda.*Tensor' parameters",
        "megatron_ext.cpu_platform:CudaToCpuMode",
        (
            "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
            "megatron.core.pipeline_parallel.p2p_communication",
            "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params",
            "megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
        ),
    ),
    Workaround(
        "torch-cuda-stand-ins",
        "megatron-core calls torch.cuda.current_device/synchronize/Stream/Event/default_stream/"
        "set_device, which fail without CUDA",
        "megatron_ext.cpu_platform:_cuda_stand_ins",
        ("torch.cuda.current_device", "torch.cuda.Stream", "torch.cuda.default_stream"),
    ),
    Workaround(
        "cpu-rng-tracker",
        "megatron-core's model-parallel RNG tracker keeps CUDA generator states (forked in every "
        "core attention call, even with dropout 0)",
        "megatron_ext.cpu_platform:build_cpu_rng_tracker_class",
        (
            "megatron.core.tensor_parallel.random._get_cuda_rng_state",
            "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            "megatron.core.tensor_parallel.random.CudaRNGStatesTracker",
            "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
        ),
    ),
    Workaround(
        "in-process-checkpoint-writer",
        "the torch_dist save strategy always writes through FileSystemWriterAsync, which starts a "
        "spawn-context multiprocessing.Manager and forks writers even for a synchronous save: it "
        "hung on CPU/gloo",
        "megatron_ext.checkpoint.writer:InProcessFileSystemWriter",
        (
            "megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue",
            "megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync",
            "torch.distributed.checkpoint.filesystem._write_item",
            "torch.distributed.checkpoint.api._wrap_exception",
            "megatron.core.dist_checkpointing.strategies.torch._replace_state_dict_keys_with_sharded_keys",
        ),
    ),
    Workaround(
        "checkpoint-reader-hook",
        "megatron-core's torch_dist load strategy builds torch's FileSystemReader through a module function "
        "and offers no way to check what it reads: a truncated shard fails inside torch's zip reader naming no "
        "file, a damaged item loads silently, and torch DCP's DefaultLoadPlanner.load_bytes unpickles byte items "
        "(the RNG state) with weights_only=False. During our load that function returns our subclass, which "
        "checks shard sizes, hashes every item against the marker (--ckpt-verify) and lets a byte item reach "
        "load_bytes only after torch's weights-only unpickler accepted it. (Our own faster reader, 'direct', "
        "was removed: 2.4-3.0x megatron-core's from the page cache, 0.6-0.9x from disk; bench/checkpoint.py "
        "--readers)",
        "megatron_ext.checkpoint.reader:_verifying_reader",
        (
            "megatron.core.dist_checkpointing.strategies.torch._get_filesystem_reader",
            "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader.CachedMetadataFileSystemReader",
            "torch.distributed.checkpoint.FileSystemReader.read_data",
            "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes",
        ),
    ),
    Workaround(
        "checkpoint-allowlisted-unpickling",
        "torch's FileSystemReader.read_metadata reads a checkpoint's .metadata with plain pickle.load, and "
        "megatron-core's TorchCommonLoadStrategy.load_common reads common.pt with torch.load's default (the "
        "full unpickler under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1): a forged .metadata, its digest rewritten in "
        "complete.json, ran its code in every load and tool (issue 45). Process-wide, on importing "
        "megatron_ext.checkpoint.reader, read_metadata reads through unpickler.MetadataUnpickler (torch DCP's "
        "metadata classes, dtypes, torch.Size: what our saves write, pinned by "
        "tests/distributed/test_checkpoint_globals.py) and load_common through reader.read_common, so every "
        "reader built on them is covered: ours, megatron-core's cached one (whose read_metadata calls torch's), "
        "load_tensors_metadata, load_sharded_metadata, load_common_state_dict, load_content_metadata. "
        "read_metadata is torch 2.13's own, line for line, but for the unpickler (it sets load_id and names "
        "rank-local metadata __<rank>.metadata as torch does); our load_common reads local files only (no "
        "multi-storage client)",
        "megatron_ext.checkpoint.reader:install_allowlisted_unpickling",
        (
            "torch.distributed.checkpoint.FileSystemReader.read_metadata",
            "megatron.core.dist_checkpointing.strategies.common.TorchCommonLoadStrategy.load_common",
            "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader.CachedMetadataFileSystemReader.read_metadata",
        ),
    ),
    Workaround(
        "megatron-core-safe-globals",
        "importing megatron-core 0.16.1 adds 16 classes to torch's weights-only allowlist, process-wide "
        "(megatron/core/safe_globals.py: Namespace, SimpleNamespace, PosixPath, BytesIO, numpy arrays and "
        "dtypes, Signals, OptimizerConfig, a few enums), and torch adds its own DTensor/DeviceMesh/NestedTensor "
        "classes: 30 in all, none of which our checkpoints hold. Each of our reads of a torch.save file "
        "(common.pt, tensor and byte items) sets them aside (torch.serialization.clear_safe_globals) and "
        "restores them after, so torch's built-in set (tensors, storages, dtypes, plain containers) is all a "
        "checkpoint of ours may hold",
        "megatron_ext.checkpoint.unpickler:torch_allowlist_only",
        (
            "megatron.core.safe_globals.SAFE_GLOBALS",
            "megatron.core.safe_globals.register_safe_globals",
            "torch.serialization.get_safe_globals",
            "torch.serialization.clear_safe_globals",
        ),
    ),
    Workaround(
        "distrib-optimizer-bucket-padding",
        "the distributed optimizer gathers optimizer state without bucket-end padding but locates "
        "parameters with it: state after a padded bucket is saved shifted (resume not exact)",
        "megatron_ext.checkpoint.optimizer_state:apply_optimizer_state_offset_fix",
        ("megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucket",),
    ),
    Workaround(
        "distrib-optimizer-load-step",
        "a fully_reshardable load with torch's Adam raises KeyError: 'step', then shares one step "
        "tensor between all parameters (bias correction N times too fast after a resume)",
        "megatron_ext.checkpoint.optimizer_state:load_optimizer_state",
        ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",),
    ),
    Workaround(
        "empty-optimizer-state",
        "building the distributed optimizer's sharded state dict (also for a load) reads each "
        "parameter's Adam step, which does not exist before the first step",
        "megatron_ext.checkpoint.optimizer_state:init_empty_optimizer_state",
        ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict",),
    ),
    Workaround(
        "optimizer-step-zero",
        "the non-distributed optimizers (mixed precision and fp32) save their common Adam step only 'if step:', "
        "so a save before the first optimizer step (step 0) loses it and the load fails with KeyError 'step'",
        "megatron_ext.checkpoint.optimizer_state:restore_step_zero",
        (
            "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.sharded_state_dict",
            "megatron.core.optimizer.optimizer.FP32Optimizer.sharded_state_dict",
        ),
    ),
    Workaround(
        "incomplete-optimizer-state-warning",
        "a save that writes part of a parameter's optimizer state as zeros only logs a warning on "
        "megatron-core's logger; we repeat it as a clear per-rank warning",
        "megatron_ext.checkpoint.optimizer_state:catch_megatron_state_corruption",
        ("megatron.core.optimizer.distrib_optimizer",),
    ),
    Workaround(
        "fp32-optimizer-nan-guard",
        "FP32Optimizer.prepare_grads reports no found-inf, so ChainedOptimizer.step applies an update "
        "whose gradients are NaN; and each step reads found-inf (.item(), optimizer.py:519) and the grad "
        "norm (.item(), clip_grads.py:133) on the host. Our step is ChainedOptimizer.step with the update "
        "skipped on a non-finite global grad norm, the norm computed and all-reduced on the device as "
        "get_grad_norm_fp32 does and read with the step's loss reports and exit agreement in one copy; "
        "where the grad scaler is a constant 1.0 (--bf16 with the guard) prepare_grads' unscale and "
        "found-inf read are left out (a non-finite gradient is a non-finite norm); with --fp16's scaler "
        "found-inf is unscaled, checked and MAX-reduced on the device as _unscale_main_grads_and_check_for_nan "
        "does and read in the same copy, each scaler updated after it; with the guard off (no scaler "
        "with --bf16) the update is applied whatever the norm, as upstream's step applies it",
        "megatron_ext.training.optimizer:step_optimizer_fetching",
        (
            "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan",
            "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._collect_main_grad_data_for_unscaling",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._collect_main_grad_data_for_unscaling",
            "megatron.core.optimizer.grad_scaler.DynamicGradScaler.update",
            "megatron.core.optimizer.optimizer.ChainedOptimizer.step",
            "megatron.core.optimizer.optimizer.FP32Optimizer.prepare_grads",
            "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.prepare_grads",
            "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._copy_model_grads_to_main_grads",
            "megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
            "megatron.core.optimizer.clip_grads.l2_norm_impl",
            "megatron.core.optimizer.clip_grads.multi_tensor_applier",
            "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
        ),
    ),
    Workaround(
        "token-count-scaling-on-device",
        "finalize_model_grads ends with 'if num_tokens > 0: scale_gradients(1.0 / num_tokens)' "
        "(finalize_model_grads.py:495), a host read of the count every step; ours runs upstream's "
        "steps without the count (less reset_model_temporary_tensors's walk over every module where it "
        "resets nothing: no MoE expert bias, no global aux loss), then its broadcast and DP all-reduce of "
        "the count and the scaling by 1 / max(count, 1) on the device (with no valid token every gradient "
        "is zero: the same step)",
        "megatron_ext.training.finalize:finalize_model_grads",
        (
            "megatron.core.distributed.finalize_model_grads.finalize_model_grads",
            "megatron.core.distributed.finalize_model_grads.get_pp_last_rank",
            "megatron.core.distributed.finalize_model_grads._allreduce_conditional_embedding_grads",
            "megatron.core.distributed.finalize_model_grads._allreduce_non_tensor_model_parallel_grads",
            "megatron.core.distributed.finalize_model_grads._allreduce_word_embedding_grads",
            "megatron.core.distributed.finalize_model_grads._allreduce_position_embedding_grads",
            "megatron.core.distributed.finalize_model_grads._update_router_expert_bias",
            "megatron.core.distributed.finalize_model_grads.reset_model_temporary_tensors",
        ),
    ),
    Workaround(
        "compilable-linear",
        "torch.compile breaks a transformer layer into 14 graphs at megatron-core's linears: their "
        "backward assigns weight.main_grad and weight.grad_added_to_main_grad (layers.py:506, 610), and "
        "RowParallelLinear passes tp_group=None, resolved per call by a function that warns "
        "(utils.py:501); with --torch-compile each linear of a compiled layer gets our _forward_impl "
        "(main_grad accumulated by a torch.library op whose schema marks it mutated, the flag set "
        "in the forward, the layer's own TP group; collectives through the torch.distributed calls dynamo "
        "traces; under sequence parallelism the row-parallel linear's reduce-scatter too: megatron-core's "
        "goes through _reduce_scatter_base, 8 breaks per layer at TP 2): zero breaks at TP 1 and TP 2",
        "megatron_ext.model.compile:_compilable_forward_impl",
        (
            "megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl",
            "megatron.core.tensor_parallel.mappings.reduce_scatter_to_sequence_parallel_region",
            "megatron.core.tensor_parallel.layers.RowParallelLinear._forward_impl",
            "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication",
            "megatron.core.utils.get_tensor_model_parallel_group_if_none",
        ),
    ),
    Workaround(
        "compile-block-viewless-input",
        "nn.Module.compile compiles the module's _call_impl and stores it in the private "
        "_compiled_call_impl, which nn.Module's __call__ runs; megatron-core's TransformerBlock calls "
        "make_viewless_tensor on its input, an autograd.Function that makes a requires_grad tensor dynamo "
        "will not trace (the input is a view at micro-batch 1: the embedding's transpose). Ours compiles "
        "the same _call_impl and stores in _compiled_call_impl a call that makes the input viewless in "
        "eager first (the block's own call then does nothing): the block compiles whole, in place, so "
        "state-dict keys keep their names",
        "megatron_ext.model.compile:compile_block",
        (
            "torch.nn.Module._compiled_call_impl",
            "torch.nn.Module._call_impl",
            "torch.nn.Module.compile",
            "megatron.core.utils.make_viewless_tensor",
            "megatron.core.transformer.transformer_block.TransformerBlock.forward",
        ),
    ),
    Workaround(
        "foreach-main-to-model-copy",
        "the distributed optimizer copies each updated fp32 main shard into the model's parameter buffer "
        "with its own copy_ (one kernel and launch per parameter per step: 148 at GPT-2 124M); ours "
        "collects the same pairs and makes one torch._foreach_copy_ (stub, Megatron-FSDP, precision-aware "
        "and FP8 cases keep upstream's method); Float16OptimizerWithFloat16Params: see "
        "foreach-float16-param-copy",
        "megatron_ext.training.optimizer:foreach_copy_main_params_to_model_params",
        (
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._copy_main_params_to_model_params",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._get_model_param_range_map",
        ),
    ),
    Workaround(
        "foreach-float16-param-copy",
        "Float16OptimizerWithFloat16Params copies main to model parameters (and back on a reload) with "
        "_multi_tensor_copy_this_to_that, which goes through multi_tensor_scale_impl only when given an "
        "overflow buffer; MixedPrecisionOptimizer sets _dummy_overflow_buf = None with --bf16, so there "
        "it loops one copy_ per parameter every step (148 at GPT-2 124M; the GPU benches' configuration). "
        "Ours replaces the module's function: without a buffer one torch._foreach_copy_ over the same "
        "pairs, with one (--fp16) upstream's route (our foreach_scale at 1.0)",
        "megatron_ext.training.optimizer:foreach_copy_this_to_that",
        (
            "megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that",
            "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
            "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._copy_model_params_to_main_params",
            "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer",
        ),
    ),
    Workaround(
        "lean-tp1-linears",
        "at TP 1 each megatron-core linear still runs its autocast-decorated Function, resolves its TP "
        "group per call (RowParallelLinear passes tp_group=None) and applies the identity copy-to/reduce-from "
        "TP-region Functions, forward and backward: measured 5,073 -> 3,785 Python calls per micro-batch "
        "(Llama style, 4 layers, bench/host_overhead.py's shapes; GPT-2 style likewise to 3,724); ours "
        "runs the same GEMMs and accumulation (bit for bit: tests/distributed/test_torch_compile.py) in "
        "the transformer layers' linears and the output layer at TP 1 (a tied weight's dummy gradient "
        "zeroed as upstream's zero_out_wgrad does: -~100 calls per micro-batch, eager and compiled). NVTX ranges are left alone: megatron-core's "
        "nvtx_range_push/pop already return at once when profiling is off (one call each, 96 per "
        "micro-batch); removing the calls means rewriting its layers",
        "megatron_ext.model.compile:install_lean_linears",
        (
            "megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward",
            "megatron.core.tensor_parallel.layers.RowParallelLinear.forward",
            "megatron.core.tensor_parallel.mappings.copy_to_tensor_model_parallel_region",
            "megatron.core.tensor_parallel.mappings.reduce_from_tensor_model_parallel_region",
            "megatron.core.models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
            "megatron.core.utils.nvtx_range_push",
        ),
    ),
    Workaround(
        "lean-set-current-microbatch",
        "megatron-core's forward_step calls set_current_microbatch for every micro-batch, which sets "
        "each decoder layer's current_microbatch through nn.Module.__setattr__: ~13 Python calls per "
        "layer per micro-batch (52 of ~2,010 at 4 Llama-style layers compiled, bench/host_overhead.py; "
        "~300 at 24 layers); ours writes the same int into each layer's __dict__, as __setattr__ "
        "ends up doing for a value that is no parameter, module or buffer",
        "megatron_ext.training.step:set_current_microbatch",
        ("megatron.core.pipeline_parallel.schedules.set_current_microbatch",),
    ),
    Workaround(
        "lean-grad-ready-hooks",
        "megatron-core's DDP registers a grad-ready hook per parameter (distributed_data_parallel.py:420) "
        "that runs every micro-batch and, per call, asks is_graph_capturing(), looks the parameter up in "
        "param_to_bucket_group (Tensor.__hash__ is Python) and getattr's zero_out_wgrad; under "
        "--overlap-grad-reduce it calls register_grad_ready also inside no_sync, where it does nothing. Our "
        "DDP subclass builds each hook with the bucket group, overlap setting and zero_out_wgrad read at wrap "
        "time (megatron-core marks the tied weight while building the model) and the capture flag read as "
        "the module global; the same main_grad, param.grad = None and megatron-core's register_grad_ready in "
        "the last micro-batch (bit for bit: tests/distributed/test_grad_hooks.py). Measured (python calls "
        "per micro-batch as bench/host_overhead.py counts them, 4 layers, 4 micro-batches): Llama eager "
        "3,140 -> 3,042, compiled 1,944 -> 1,846 (hooks 135 -> 27); GPT-2 eager 3,158 -> 2,985, compiled "
        "2,196 -> 2,023; Llama eager with --overlap-grad-reduce 3,285 -> 3,112; a fused weight's hook ~250 ns "
        "per call less (735 -> 480 ns, CPU, timeit)",
        "megatron_ext.model.grad_hooks:build_grad_ready_hook",
        (
            "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel._make_backward_post_hook",
            "megatron.core.transformer.cuda_graphs.is_graph_capturing",
            "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.register_grad_ready",
            "megatron.core.transformer.cuda_graphs._IS_GRAPH_CAPTURING",
        ),
    ),
    Workaround(
        "compilable-selective-recompute",
        "selective recompute of core attention runs megatron-core's reentrant CheckpointFunction, which "
        "saves RNG states with get_rng_state (a graph break); with --torch-compile the attention's "
        "_checkpointed_attention_forward is torch.utils.checkpoint (non-reentrant), one traced region",
        "megatron_ext.model.compile:_checkpointed_core_attention",
        (
            "megatron.core.transformer.attention.Attention._checkpointed_attention_forward",
            "megatron.core.tensor_parallel.random.CheckpointFunction",
        ),
    ),
    Workaround(
        "reshardable-optimizer-format",
        "the distributed optimizer's default sharded format (fully_sharded_model_space) raises "
        "'ShardedTensor.flattened_range is not supported'; fully_reshardable changes TP/PP on load",
        "megatron_ext.checkpoint.state:SHARDED_STATE_DICT_METADATA",
        ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict",),
    ),
    Workaround(
        "blended-dataset-rank",
        "BlendedDataset._build_indices calls torch.distributed.get_rank() unguarded on a cache "
        "miss, which raises without a process group",
        "megatron_ext.data.gpt_datasets:maybe_single_process_rank",
        ("megatron.core.datasets.blended_dataset.BlendedDataset._build_indices", "torch.distributed.get_rank"),
    ),
    Workaround(
        "schedule-step-timing",
        "the schedules expose no per-micro-batch hooks; --pp-timeline wraps their module-level "
        "forward_step/backward_step for the duration of a traced step",
        "megatron_ext.training.timeline:PipelineTimeline.trace_step",
        (
            "megatron.core.pipeline_parallel.schedules.forward_step",
            "megatron.core.pipeline_parallel.schedules.backward_step",
        ),
    ),
    Workaround(
        "cpu-pipeline-settings",
        "freeing sent activations early (deallocate_pipeline_outputs) corrupted interleaved "
        "gradients with gloo's asynchronous sends; batched P2P with PP=2 interleaving swaps "
        "forward/backward messages to the one neighbour; variable_seq_lengths is refused with the "
        "default MoE dispatcher even without experts",
        "megatron_ext.model.gpt:build_transformer_config",
        ("megatron.core.transformer.TransformerConfig",),
    ),
    Workaround(
        "packed-local-attention",
        "the local spec's DotProductAttention refuses packed (THD) inputs",
        "megatron_ext.model.attention:VarlenDotProductAttention",
        ("megatron.core.transformer.dot_product_attention.DotProductAttention",),
    ),
    Workaround(
        "rope-in-core-attention",
        "the unfused THD rotary path (rope_utils._apply_rotary_pos_emb_thd) calls cu_seqlens.tolist() "
        "and loops over documents in every layer: a host sync per layer on GPUs (0.74x unpacked "
        "throughput measured on an H100); the unfused rotation (_apply_rotary_pos_emb_bshd) recomputes "
        "cos/sin of the table for q and for k in every layer and copies its result once more (12 "
        "kernels per tensor). The rotary module yields nothing and our core attention rotates with "
        "cos/sin made once per sequence length or packed micro-batch (4 kernels, the same values)",
        "megatron_ext.model.attention:CoreAttentionRotaryEmbedding",
        (
            "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd",
            "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",
            "megatron.core.models.common.embeddings.rope_utils._rotate_half",
            "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb",
            "megatron.core.models.gpt.gpt_model.GPTModel._preprocess",
            "megatron.core.transformer.attention.Attention.forward",
        ),
    ),
    Workaround(
        "varlen-attn-custom-op-overhead",
        "torch's varlen_attn runs aten's flash varlen kernel through a Python custom op "
        "(torch.library.custom_op, autograd registered in Python): ~0.5 ms of host time per call and "
        "again per backward (H100, torch 2.11); our packed attention calls the aten op, whose C++ "
        "autograd node (FlashAttentionBackward0) runs the backward",
        "megatron_ext.model.attention:varlen_causal_attention",
        ("torch.ops.aten._flash_attention_forward", "torch.nn.attention.varlen.varlen_attn"),
    ),
    Workaround(
        "local-attention-cp-assert",
        "DotProductAttention.__init__ asserts context_parallel_size == 1: our core attention is built on a "
        "shallow config copy with CP 1 and keeps the shared config (never changed)",
        "megatron_ext.context_parallel.attention:get_config_without_cp",
        ("megatron.core.transformer.dot_product_attention.DotProductAttention.__init__",),
    ),
    Workaround(
        "cp-comm-type-per-layer-index",
        "TransformerLayer.__init__ indexes a per-layer cp_comm_type list with the 1-based layer number (each "
        "layer reads the next one's, the last raises IndexError): normalised to one string, all_gather",
        "megatron_ext.model.gpt:get_transformer_cp_comm_type",
        ("megatron.core.transformer.transformer_layer.TransformerLayer.__init__",),
    ),
    Workaround(
        "cp-local-attention-fallback",
        "under CP, DotProductAttention.forward (our fallback for masks, windows, other softmaxes, layer "
        "scaling) would silently attend to the local keys only: the CP attention raises at run time instead",
        "megatron_ext.context_parallel.attention:check_attention_under_cp",
        ("megatron.core.transformer.dot_product_attention.DotProductAttention.forward",),
    ),
    Workaround(
        "cp-rotary-positions",
        "RotaryEmbedding.forward under CP slices positions 0..s-1 head-tail per row (wrong for packed "
        "documents): our core attention rotates by the sliced position ids; other rotary modules are refused",
        "megatron_ext.model.gpt:check_rotary_under_cp",
        ("megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank",),
    ),
    Workaround(
        "cp-collective-names",
        "torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for all_gather_single / "
        "reduce_scatter_single, which torch 2.11 lacks: the CP gather takes the _single name where it exists",
        "megatron_ext.context_parallel.collectives:get_collective",
        ("torch.distributed.all_gather_into_tensor", "torch.distributed.reduce_scatter_tensor"),
    ),
    Workaround(
        "cp-attention-kernels",
        "CPU SDPA keeps a float32 copy of a bool mask for backward and aligns is_causal top-left: CP pieces call "
        "the CPU flash kernel and its backward directly (prefix + square causal block, logsumexp merge); on CUDA "
        "aten's flash varlen kernel (bottom-right causal), as varlen_causal_attention does",
        "megatron_ext.context_parallel.attention:PiecewiseCausalAttention",
        (
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
            "torch.ops.aten._flash_attention_forward",
        ),
    ),
    Workaround(
        "multi-tensor-fallback-host-syncs",
        "without Apex or Transformer Engine, megatron-core's local_multi_tensor_l2_norm (grad norm) "
        "calls .item() on every parameter's norm: one host sync per parameter per step (149 per "
        "step for GPT-2 124M on an H100); local_multi_tensor_scale launches two kernels per tensor",
        "megatron_ext.training.optimizer:apply_multi_tensor_fallback_fix",
        (
            "megatron.core.utils.local_multi_tensor_l2_norm",
            "megatron.core.utils.local_multi_tensor_scale",
            "megatron.core.optimizer.clip_grads.l2_norm_impl",
            "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
            "megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
        ),
    ),
    Workaround(
        "gradient-accumulation-fusion-without-apex",
        "megatron-core fuses a weight gradient's GEMM with its accumulation into main_grad only through "
        "Apex's fused_weight_gradient_mlp_cuda extension; without it each weight gradient is a new "
        "bf16 tensor that DDP's hook adds into the fp32 buffer (~5 ms per micro-batch at 1.3B on an "
        "H100); torch's addmm with out_dtype is the same GEMM, standing in for Apex's module",
        "megatron_ext.model.wgrad:apply_gradient_accumulation_fusion",
        (
            "megatron.core.tensor_parallel.layers._grad_accum_fusion_available",
            "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward",
        ),
    ),
    Workaround(
        "weight-gradient-deferral",
        "megatron-core's local linears compute the weight gradient inside the backward (their backward_dw() "
        "does nothing) and return a dummy gradient so DDP's grad-ready hook fires at B. With a zero-bubble "
        "schedule's deferral installed, each linear's _forward_impl (per instance) runs our copy of "
        "LinearWithGradAccumulationAndAsyncCommunication whose weight GEMM (megatron-core's own fused "
        "wgrad_gemm_accum_* or plain GEMM, the SP all-gather into the 'mpu' buffer) is deferred, and DDP's "
        "delay_wgrad_compute / skip_backward_post_hook / register_wgrad_accumulation_and_reduce_hooks seam "
        "hands the weight's hook to the layer, which runs it in W",
        "megatron_ext.model.wgrad_deferral:apply_weight_grad_deferral",
        (
            "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward",
            "megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl",
            "megatron.core.tensor_parallel.layers.RowParallelLinear._forward_impl",
            "megatron.core.tensor_parallel.layers.dist_all_gather_func",
            "megatron.core.tensor_parallel.layers.dist_reduce_scatter_func",
            "megatron.core.utils.prepare_input_tensors_for_wgrad_compute",
            "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel._make_backward_post_hook",
            "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig",
        ),
    ),
    Workaround(
        "v-placement-layer-numbers",
        "megatron-core names a chunk's layers (count and global offset: layer numbers, checkpoint keys) from "
        "(vp_stage, pp rank) of its loop placement; under the V placement (ZBV) chunk 1 of rank r is stage "
        "2p-1-r, which the loop placement puts on rank p-1-r: the three functions are wrapped to ask for that "
        "chunk when the TransformerConfig is marked 'v' (unchanged otherwise)",
        "megatron_ext.model.v_placement:apply_v_placement_layer_numbers",
        (
            "megatron.core.transformer.transformer_layer.get_transformer_layer_offset",
            "megatron.core.transformer.transformer_block.get_transformer_layer_offset",
            "megatron.core.transformer.transformer_block.get_num_layers_to_build",
        ),
    ),
    Workaround(
        "v-placement-last-stage",
        "megatron-core puts the last stage on the last pipeline rank: Float16Module upcasts the outputs of "
        "(last vp stage, last pp rank), finalize_model_grads broadcasts the token count from the last pp rank, "
        "and the embedding group (tied output weight) is the first and last pp rank, whose build then fails "
        "under V. Under V: Float16Module.forward decides by the chunk's pre/post_process, our finalize "
        "broadcasts from rank 0 and ties the embedding locally, the embedding group is rank 0 alone",
        "megatron_ext.model.v_placement:finalize_model_grads_v",
        (
            "megatron.core.transformer.module.Float16Module.forward",
            "megatron.core.distributed.finalize_model_grads.finalize_model_grads",
            "megatron.core.parallel_state.default_embedding_ranks",
            "megatron.core.models.common.language_module.language_module.LanguageModule"
            ".setup_embeddings_and_output_layer",
        ),
    ),
    Workaround(
        "checkpoint-without-output-fp8-flag",
        "CheckpointWithoutOutput(fp8=False), its default, sets self.fp8 = (fp8 is not None) = True and "
        "calls Transformer Engine's FP8GlobalStateManager: --recompute-modules layernorm raises "
        "NameError without TE",
        "megatron_ext.model.gpt:apply_checkpoint_without_output_fix",
        ("megatron.core.tensor_parallel.random.CheckpointWithoutOutput",),
    ),
    Workaround(
        "process-group-store",
        "torch has no public accessor for the default process group's key-value store (the one torchrun's "
        "agent or rank 0 hosts); the stall watchdog's heartbeats clone it for connections of their own, with "
        "short timeouts, and fall back to a TCPStore client to MASTER_ADDR:MASTER_PORT",
        "megatron_ext.heartbeat:open_store_connection",
        (
            "torch.distributed.distributed_c10d._get_default_store",
            "torch.distributed.Store.clone",
            "torch.distributed.Store.set_timeout",
        ),
    ),
    Workaround(
        "destroy-process-groups",
        "destroy_model_parallel() drops its group references while every gloo subgroup keeps its "
        "threads and connections (over 1,000 threads per process after a few hundred groups)",
        "megatron_ext.parallel:destroy_parallel_context",
        ("torch.distributed.distributed_c10d._world", "torch.distributed.distributed_c10d._get_default_group"),
    ),
)


def resolve(path: str) -> Any:
    """The object a dotted path (``a.b.C.d``) or ``module:qualified.name`` names; raises
    ImportError/AttributeError when it does not exist."""
    if ":" in path:
        module, qualname = path.split(":", 1)
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def get_megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def get_torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def describe_version_drift() -> list[str]:
    """What lies outside the checked versions (empty when everything matches)."""
    out = []
    mcore = get_megatron_core_version()
    if mcore != CHECKED_MEGATRON_CORE_VERSION:
        out.append(
            f"megatron-core {mcore} is installed; megatron_ext's workarounds (megatron_ext/compat.py) "
            f"were checked against {CHECKED_MEGATRON_CORE_VERSION}"
        )
    torch_version = get_torch_version()
    low, high = CHECKED_TORCH_RANGE
    if not low <= torch_version <= high:
        out.append(
            f"torch {'.'.join(map(str, torch_version))} is installed; megatron_ext's workarounds were "
            f"checked with torch {low[0]}.{low[1]}-{high[0]}.{high[1]}"
        )
    return out


_WARNED = False


def check_versions() -> None:
    """Warn once per process when megatron-core or torch lies outside what was checked."""
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    for message in describe_version_drift():
        warnings.warn(message, stacklevel=2)
