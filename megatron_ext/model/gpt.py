"""megatron-core GPTModel chunks (one per virtual pipeline stage), GPT-2 or Llama style.

Invariant: every chunk starts from the layout-independent initial weights of
``init_weights.py``; with ``--bf16``/``--fp16`` it is then wrapped in megatron-core's
``Float16Module`` (parameters and activations in half precision, inputs cast on the first stage,
outputs upcast to fp32 on the last), as Megatron-LM does; last comes megatron-core's
DistributedDataParallel (fp32 gradient buffers unless --grad-reduce-in-bf16; chunk 0 alone owns bucketing, as Megatron-LM does
for the interleaved schedule). The optimizer keeps fp32 main parameters (``training/optimizer.py``).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from megatron_ext.config import JobConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_ext.derived import ResolvedConfig, get_cp_comm_types

# attention and wgrad are called through their modules: bench/gpu_ablation.py patches them there
from megatron_ext.model import attention, wgrad
from megatron_ext.model.cross_entropy import vocab_parallel_cross_entropy
from megatron_ext.model.grad_hooks import LeanGradHookDDP
from megatron_ext.model.init_weights import apply_layout_independent_init
from megatron_ext.model.norm import HeadNorm, TorchNorm
from megatron_ext.model.v_placement import (
    build_placed_float16_module,
    get_config_placement,
    mark_config_placement,
)
from megatron_ext.model.wgrad_deferral import uses_weight_grad_deferral
from megatron_ext.parallel import StagePlacement


def build_transformer_config(cfg: JobConfig, resolved: ResolvedConfig, device: torch.device):
    """megatron-core TransformerConfig for this job: the flags of ``cfg`` and the values
    ``resolved`` derived from them (virtual stages, MLP width, key/value heads, dtype, recompute).
    megatron-core's advice against recomputing Transformer Engine's fused core_attn (printed for
    --recompute-activations) is silenced on the local spec, which has no fused attention."""
    with warnings.catch_warnings():
        if not use_transformer_engine(cfg.model, device, cfg.parallel.context_parallel_size):
            warnings.filterwarnings("ignore", message=".*the core_attn is from transformer_engine.*")
        return _build_transformer_config(cfg, resolved, device)


def _build_transformer_config(cfg: JobConfig, resolved: ResolvedConfig, device: torch.device):
    from megatron.core.transformer import TransformerConfig

    m, p = cfg.model, cfg.parallel
    interleaved = (resolved.virtual_pipeline_size or 1) > 1
    dtype = resolved.params_dtype
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=resolved.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=resolved.num_query_groups,
        kv_channels=m.kv_channels,  # None: hidden / heads
        qk_layernorm=m.qk_layernorm,  # also what sums the q/k norms' gradients over TP (model/norm.py)
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,  # our (1 + gamma) norms: model/norm.py
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=not m.disable_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        cp_comm_type=get_transformer_cp_comm_type(p),
        virtual_pipeline_model_parallel_size=resolved.virtual_pipeline_size,
        microbatch_group_size_per_vp_stage=p.microbatch_group_size_per_vp_stage,
        num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        sequence_parallel=p.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=cfg.training.bf16,
        fp16=cfg.training.fp16,
        calculate_per_token_loss=cfg.training.calculate_per_token_loss,
        **resolved.recompute,
        # megatron-core's shape handshake before every P2P message (--sequence-padding variable)
        variable_seq_lengths=resolved.sequence_padding == "variable",
        # (megatron-core rejects variable_seq_lengths with its default MoE dispatcher even
        # without experts; the dispatcher is unused in a dense model)
        moe_token_dispatcher_type="alltoall",
        # --cuda-graph-impl local: megatron-core builds a CudaGraphManager per layer (CUDA only: validated)
        cuda_graph_impl=cfg.training.cuda_graph_impl,
        cuda_graph_scope=cfg.training.cuda_graph_scope,
        cuda_graph_warmup_steps=cfg.training.cuda_graph_warmup_steps,
        # megatron-core draws its own (layout-dependent) init, which ours then overwrites; its
        # draw cannot be skipped: perform_initialization=False also skips setting the TP
        # attributes (tensor_model_parallel, partition_dim) that grad norms and checkpoints need.
        use_cpu_initialization=False,
        perform_initialization=True,
        # Off while building; wrap_with_ddp turns gradient-accumulation fusion on where DDP's
        # buffers exist (model/wgrad.py). megatron-core's other fusions stay off: they need
        # TE/Apex kernels or torch.compile.
        gradient_accumulation_fusion=False,
        # Freeing a sent activation's storage early is safe with NCCL's stream ordering; with
        # gloo's asynchronous sends it corrupted gradients under the interleaved schedule
        # (measured: 40% relative error at PP2 x VPP2), so the CPU keeps the storage.
        deallocate_pipeline_outputs=device.type == "cuda",
        # Megatron-LM's defaults for the interleaved schedule. The batched path must not be
        # used there with PP=2: both neighbours are the same rank, and a batch holding a
        # forward and a backward message to it is matched in posting order, which swaps them.
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
    )


def apply_checkpoint_without_output_fix() -> None:
    """megatron-core 0.16.1's ``CheckpointWithoutOutput(fp8=False)`` (its default, used by the
    "layernorm" selective recompute) sets ``self.fp8 = fp8 is not None``, i.e. True, and then calls
    Transformer Engine's FP8GlobalStateManager: a NameError wherever TE is not installed. Read
    ``fp8`` as a recipe-or-nothing flag, as intended (registered in compat.py). Idempotent."""
    from megatron.core.tensor_parallel import random as mcore_random

    cls = mcore_random.CheckpointWithoutOutput
    if getattr(cls, "_megatron_ext_fp8_fix", False):
        return
    original = cls.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = fp8 is not None and fp8 is not False

    cls.__init__ = __init__
    cls._megatron_ext_fp8_fix = True


def get_transformer_cp_comm_type(p: ParallelConfig) -> str | None:
    """TransformerConfig's ``cp_comm_type``: one string, never megatron-core's per-layer list, which
    0.16.1's TransformerLayer indexes with the 1-based global layer number (each layer reads the next
    layer's value, the last raises IndexError; compat.py: cp-comm-type-per-layer-index). Every value
    we accept is all_gather (``context_parallel/rules.py``), so one string says the same. None
    without CP."""
    if p.context_parallel_size <= 1:
        return None
    ours = set(get_cp_comm_types(p))
    if ours != {"all_gather"}:
        raise ValueError(f"--cp-comm-type {' '.join(p.cp_comm_type)}: only all_gather is supported")
    return "all_gather"


def use_transformer_engine(m: ModelConfig, device: torch.device, context_parallel_size: int = 1) -> bool:
    """Transformer Engine's layer spec: --transformer-impl transformer_engine, or auto where TE is
    importable and CUDA is used, without context parallelism (CP runs on our attention of the local
    spec: auto takes it; transformer_engine is refused under CP at start-up)."""
    impl = m.transformer_impl
    if impl == "local" or device.type != "cuda" or (impl == "auto" and context_parallel_size > 1):
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if impl == "transformer_engine":
            raise ValueError("--transformer-impl transformer_engine: transformer_engine is not installed") from None
        return False
    return True


def build_layer_spec(m: ModelConfig, device: torch.device, context_parallel_size: int = 1):
    """One transformer layer's spec: Transformer Engine's, or megatron-core's local one with our
    core attention and norms."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if use_transformer_engine(m, device, context_parallel_size):
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=m.qk_layernorm)
    # (our core attention below also applies RoPE: see model/attention.py)
    spec = get_gpt_layer_local_spec(normalization=m.normalization, qk_layernorm=m.qk_layernorm)
    # megatron-core's local DotProductAttention rejects packed (THD) inputs; ours honours them.
    spec.submodules.self_attention.submodules.core_attention = attention.VarlenDotProductAttention
    # its torch norms refuse --sequence-parallel; ours support it (model/norm.py)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is WrappedTorchNorm:
            setattr(spec.submodules, name, TorchNorm)
    if m.qk_layernorm:  # upstream's torch q/k norm refuses --sequence-parallel and --apply-layernorm-1p
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = HeadNorm
    return spec


def build_block_spec(layer_spec, tf_config, vp_stage: int | None, pp_rank: int):
    """The chunk's decoder spec: as megatron-core builds it from a layer spec (that many layers on
    this stage), with our ``TorchNorm`` as the final norm where upstream would take its torch norm."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if transformer_block.LayerNormImpl is not WrappedTorchNorm:  # TE's or Apex's norm: upstream's path
        return layer_spec
    layers = transformer_block.get_num_layers_to_build(tf_config, vp_stage, pp_rank)
    return transformer_block.TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=TorchNorm)


def check_rotary_under_cp(chunk: torch.nn.Module, context_parallel_size: int) -> None:
    """Under CP a rotary module other than megatron-core's plain one (which our core attention applies
    from each token's sliced position) would rotate by upstream's rule for CP (a row head-tail slice
    of positions 0..s-1), wrong for packed documents: refused."""
    rotary = getattr(chunk, "rotary_pos_emb", None)
    if context_parallel_size > 1 and rotary is not None:
        raise ValueError(
            f"context parallelism: the rotary embedding {type(rotary).__name__} is not applied by our core "
            f"attention (megatron-core's plain RotaryEmbedding is: --position-embedding-type rope)"
        )


def check_packed_sequence_support(chunks: list[torch.nn.Module]) -> None:
    """Packed sequences need a core attention that consumes cu_seqlens (ours or TE's)."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name.endswith("core_attention"):
                kind = type(module).__name__
                if not (getattr(module, "supports_packed_sequences", False) or kind.startswith("TE")):
                    raise ValueError(
                        f"--packed-sequences: {name} is {kind}, which does not honour cu_seqlens; "
                        f"use the local spec (--transformer-impl local) or Transformer Engine"
                    )


@functools.cache
def gpt_model_class():
    """megatron-core's GPTModel with our cross-entropy (``model/cross_entropy.py``: the same fp32
    loss in half the memory passes); everything else is upstream's."""
    from megatron.core.models.gpt import GPTModel

    class GPTModelWithLeanCrossEntropy(GPTModel):
        def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            # as upstream: labels [b, s] -> [s, b] like the logits; the loss back to [b, s]
            loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
            return loss.transpose(0, 1).contiguous()

    return GPTModelWithLeanCrossEntropy


def build_model_chunks(
    cfg: JobConfig, resolved: ResolvedConfig, placement: StagePlacement, device: torch.device
) -> list[torch.nn.Module]:
    """Unwrapped GPTModel chunks of this rank (over ``resolved.padded_vocab_size`` ids),
    initialised layout-independently."""
    tf_config = build_transformer_config(cfg, resolved, device)
    if placement.placement != resolved.stage_placement:
        raise AssertionError(
            f"stage placement {placement.placement!r} is not the schedule's {resolved.stage_placement!r}"
        )
    # under V, megatron-core's layer numbering is asked for the same stage's loop-placement chunk
    mark_config_placement(tf_config, placement.placement)
    if tf_config.recompute_granularity == "selective":
        apply_checkpoint_without_output_fix()
    cp = cfg.parallel.context_parallel_size
    spec = build_layer_spec(cfg.model, device, cp)
    m = cfg.model
    num_chunks = placement.vp_size or 1
    chunks = []
    for vp_stage in range(num_chunks):
        chunk = gpt_model_class()(
            config=tf_config,
            transformer_layer_spec=build_block_spec(
                spec, tf_config, vp_stage if placement.vp_size else None, placement.pp_rank
            ),
            vocab_size=resolved.padded_vocab_size,
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            pre_process=placement.is_first(vp_stage),
            post_process=placement.is_last(vp_stage),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_base=m.rotary_base,
            rotary_percent=m.rotary_percent,
            rope_scaling=m.use_rope_scaling,
            rope_scaling_factor=m.rope_scaling_factor,
            vp_stage=vp_stage if placement.vp_size else None,
        )
        if not use_transformer_engine(m, device, cp) and not attention.apply_core_attention_rotary(chunk):
            check_rotary_under_cp(chunk, cp)
        chunks.append(chunk.to(device))
    if resolved.uses_document_boundaries:
        check_packed_sequence_support(chunks)
    apply_layout_independent_init(
        chunks,
        seed=cfg.training.seed,
        std=m.init_method_std,
        num_layers=m.num_layers,
        tp_rank=placement.tp_rank,
        tp_size=placement.tp_size,
        gated_mlp=m.swiglu,
        zero_centered_norms=m.apply_layernorm_1p,
    )
    return chunks


def apply_mixed_precision(t: TrainingConfig, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """With --bf16 or --fp16, megatron-core's Float16Module around each chunk (as Megatron-LM
    wraps its model before DDP); unchanged in fp32. Under the V placement its first and last stage
    are the chunk's own pre/post_process (``model/v_placement.py``)."""
    if not (t.bf16 or t.fp16):
        return chunks
    from megatron.core.transformer.module import Float16Module

    if any(get_config_placement(chunk.config) == "v" for chunk in chunks):
        return [build_placed_float16_module(chunk.config, chunk) for chunk in chunks]
    return [Float16Module(chunk.config, chunk) for chunk in chunks]


def wrap_with_ddp(
    p: ParallelConfig, chunks: list[torch.nn.Module], gradient_accumulation_fusion: bool
) -> list[torch.nn.Module]:
    """megatron-core DDP around each chunk (fp32 grad buffers, bf16 with --grad-reduce-in-bf16; DP reduce in
    finalize), with weight
    gradients accumulated into those buffers inside their GEMMs (``model/wgrad.py``) when
    ``gradient_accumulation_fusion`` (--gradient-accumulation-fusion). Where the chunks defer their
    weight gradients (``model/wgrad_deferral.py``), DDP's ``delay_wgrad_compute`` hands each deferred
    weight's grad-ready hook to its layer, which runs it in W. DDP's grad-ready hooks are the lean
    ones of ``model/grad_hooks.py`` (megatron-core's effects, fewer Python calls)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if gradient_accumulation_fusion:
        wgrad.enable_gradient_accumulation_fusion(chunks)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not p.grad_reduce_in_bf16,  # bf16 buffers: the parameters' dtype under --bf16
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        align_param_gather=p.overlap_param_gather and p.align_param_gather,
        bucket_size=p.ddp_bucket_size,
        use_distributed_optimizer=p.use_distributed_optimizer,
        delay_wgrad_compute=uses_weight_grad_deferral(chunks),
    )
    return [
        LeanGradHookDDP(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
