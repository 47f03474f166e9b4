"""Megatron-LM's run settings (the ``args`` Namespace its checkpoints record) read as our flags.

Invariant: every model setting of Megatron-LM core_v0.16.1 (its argument groups "transformer
configuration", "network size", "moe", "mla", "experimental_attention_variant", "heterogeneous
architecture", and the few model switches outside them) is in exactly one table here:
``MEGATRON_LM_ARGS`` (its value becomes one of our flat config values, then compared as our own
checkpoints' are), ``UNSUPPORTED_ARGS`` (a model we do not build unless it has the neutral value:
refused by name), or ``NOT_MODEL_ARGS`` / ``NOT_MODEL_PREFIXES`` (layout, kernels, memory, or the
details of a switch refused above). ``tests/unit/test_megatron_lm.py`` checks the tables against
core_v0.16.1's parser (``tests/data/megatron_lm/arguments_core_v0.16.1.json``, dumped from its
``arguments.py``): every name exists there, every model setting is classified, every neutral value is
its default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _same(name: str) -> Callable[[Any], Any]:
    return lambda a: getattr(a, name, None)


# Megatron-LM's name -> (our flat config field, its value as ours, from the whole Namespace)
MEGATRON_LM_ARGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    **{
        name: (name, _same(name))
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "group_query_attention",
            "num_query_groups",
            "seq_length",
            "max_position_embeddings",
            "position_embedding_type",
            "rotary_base",
            "rotary_percent",
            "use_rope_scaling",
            "rope_scaling_factor",
            "normalization",
            "swiglu",
            "untie_embeddings_and_output_weights",
            "init_method_std",
            "hidden_dropout",
            "attention_dropout",
            "seed",
            "bf16",
            "fp16",
            "use_distributed_optimizer",
            "decoupled_lr",
            "decoupled_min_lr",
            "tokenizer_type",
            "tokenizer_model",
            "vocab_file",
            "merge_file",
            "vocab_size",
            "split",
            "global_batch_size",
            "train_iters",
            "train_samples",
        )
    },
    # TransformerConfig fields under Megatron-LM flag names: --norm-epsilon, --apply-layernorm-1p,
    # --disable-bias-linear (megatron-core 0.16.1 generates those flags from the config dataclass)
    "layernorm_epsilon": ("norm_epsilon", _same("layernorm_epsilon")),
    "layernorm_zero_centered_gamma": ("apply_layernorm_1p", _same("layernorm_zero_centered_gamma")),
    "add_bias_linear": ("disable_bias_linear", lambda a: not a.add_bias_linear),
    # megatron-core biases the QKV projection when either is set: ours has --add-qkv-bias only
    # with --disable-bias-linear (with biases everywhere the QKV one is among them)
    "add_qkv_bias": ("add_qkv_bias", lambda a: bool(a.add_qkv_bias) and not a.add_bias_linear),
    "data_path": ("data_path", lambda a: list(a.data_path or [])),
}


def _is(value: Any) -> Callable[[Any, Any], bool]:
    return lambda v, a: v == value


def _kv_channels_neutral(v: Any, a: Any) -> bool:
    return v is None or v * a.num_attention_heads == a.hidden_size


# Model settings we do not implement: Megatron-LM's name -> (is its value one we build, what it is).
UNSUPPORTED_ARGS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "num_experts": (_is(None), "mixture of experts"),
    "multi_latent_attention": (_is(False), "multi-latent attention"),
    "experimental_attention_variant": (_is(None), "an experimental attention variant"),
    "linear_attention_freq": (_is(None), "linear attention layers"),
    "window_size": (_is(None), "sliding-window attention"),
    "window_attn_skip_freq": (_is(None), "sliding-window attention layers"),
    "mtp_num_layers": (_is(None), "multi-token prediction"),
    "squared_relu": (_is(False), "the squared-ReLU MLP"),
    "quick_geglu": (_is(False), "the quick-GeGLU MLP"),
    "openai_gelu": (_is(False), "OpenAI's tanh GeLU"),
    "onnx_safe": (lambda v, a: not v, "the ONNX-safe GeLU"),
    "glu_linear_offset": (_is(0.0), "an offset on the GLU's linear half"),
    "activation_func_clamp_value": (_is(None), "a clamped activation"),
    "softmax_type": (_is("vanilla"), "an attention softmax other than the vanilla one"),
    "rotary_interleaved": (_is(False), "interleaved RoPE"),
    "rotary_seq_len_interpolation_factor": (_is(None), "RoPE sequence-length interpolation"),
    "no_rope_freq": (_is(None), "layers without RoPE"),
    "position_embedding_type": (lambda v, a: v in ("learned_absolute", "rope"), "this position embedding"),
    "mrope_section": (_is(None), "multimodal RoPE"),
    "kv_channels": (_kv_channels_neutral, "a head dimension other than hidden size / heads"),
    "qk_layernorm": (_is(False), "query/key layer norms"),
    "qk_l2_norm": (_is(False), "query/key L2 norms"),
    "attention_output_gate": (_is(False), "a gated attention output"),
    "apply_query_key_layer_scaling": (_is(False), "query-key layer scaling"),
    "apply_residual_connection_post_layernorm": (_is(False), "post-norm residual connections"),
    "fp32_residual_connection": (_is(False), "fp32 residual connections"),
    "is_hybrid_model": (_is(False), "a hybrid (Mamba) model"),
    "hybrid_override_pattern": (_is(None), "a hybrid (Mamba) layer pattern"),
    "heterogeneous_layers_config_path": (_is(None), "heterogeneous layers"),
    "heterogeneous_layers_config_encoded_json": (_is(None), "heterogeneous layers"),
    "spec": (_is(None), "a custom layer spec"),
    "use_legacy_models": (_is(False), "Megatron-LM's legacy model (other parameter names)"),
    "use_kitchen_attention": (_is(False), "the kitchen attention"),
    "fp8": (_is(None), "FP8 layers (Transformer Engine state not covered)"),
    "fp4": (_is(None), "FP4 layers (Transformer Engine state not covered)"),
    # Transformer Engine layers keep their own state in _extra_state items (FP8 scales and
    # histories), which the local layers here do not read: not covered
    "transformer_impl": (_is("local"), "Transformer Engine layers (their _extra_state is not covered)"),
}

# Settings of Megatron-LM's model argument groups that change neither the weights' meaning nor what
# the model computes: parallel layout (the checkpoint reshards), kernels and fusions, memory and
# recompute, initialisation, or details of a switch UNSUPPORTED_ARGS refuses.
NOT_MODEL_ARGS = frozenset(
    {
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "add_position_embedding",  # deprecated: validate_args refuses it off unless --position-embedding-type rope
        "async_tensor_model_parallel_allreduce",
        "attention_backend",
        "batch_invariant_mode",
        "bert_binary_head",
        "calculate_per_token_loss",
        "clone_scatter_output_in_embedding",
        "config_logger_dir",
        "context_parallel_size",
        "cpu_offloading_num_layers",
        "cross_entropy_fusion_impl",
        "cross_entropy_loss_fusion",
        "decoder_num_layers",
        "defer_embedding_wgrad_compute",
        "delay_wgrad_compute",
        "deterministic_mode",
        "disable_bf16_reduced_precision_matmul",
        "distribute_saved_activations",
        "embedding_init_method_std",
        "enable_cuda_graph",
        "encoder_num_layers",
        "ep_overlap_early_attn_memory_release",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "external_cuda_graph",
        "fine_grained_activation_offloading",
        "first_last_layers_bf16",
        "flash_decode",
        "hierarchical_context_parallel_sizes",
        "hybrid_context_parallel",
        "inference_fuse_tp_communication",
        "init_model_with_meta_device",
        "kitchen_attention_backend",
        "make_vocab_size_divisible_by",  # the checkpoint's padded_vocab_size is what the model has
        "max_seqlen_per_dp_cp_rank",
        "microbatch_group_size_per_vp_stage",
        "min_offloaded_tensor_size",
        "mlp_chunks_for_prefill",
        "num_layers_at_end_in_bf16",
        "num_layers_at_start_in_bf16",
        "offload_modules",
        "overlap_moe_expert_parallel_comm",
        "overlap_p2p_comm_warmup_flush",
        "perform_initialization",
        "pipeline_model_parallel_comm_backend",
        "pipeline_model_parallel_size",
        "relative_attention_max_distance",
        "relative_attention_num_buckets",
        "sequence_parallel",
        "symmetric_ar_type",
        "tensor_model_parallel_size",
        "use_cpu_initialization",
        "use_fused_weighted_squared_relu",
        "use_mamba_mem_eff_path",
        "use_ring_exchange_p2p",
        "use_rotary_position_embeddings",  # deprecated: validate_args folds it into position_embedding_type
        "use_te_activation_func",
        "wgrad_deferral_limit",
    }
)
# details of a refused switch (MoE, MLA, MTP, Mamba, linear/sparse attention, FP8/FP4) or kernels,
# communication overlap, recompute, CUDA graphs, QK clipping (an optimizer step)
NOT_MODEL_PREFIXES = (
    "moe_",
    "mamba_",
    "mtp_",
    "linear_",
    "dsa_",
    "fp8_",
    "fp4_",
    "tp_comm_",
    "cuda_graph_",
    "recompute_",
    "qk_clip",
    "cache_mla_",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "mscale",
    "rotary_scaling_factor",
)


def map_megatron_lm_args(args: Any) -> tuple[dict[str, Any], list[str]]:
    """(our flat config values of ``MEGATRON_LM_ARGS``, one problem per ``UNSUPPORTED_ARGS`` setting
    the checkpoint has at a value we do not build) of a Megatron-LM checkpoint's ``args``. Names it
    lacks (another Megatron-LM version) are left out of the values, and not refused."""
    values = {}
    for name, (ours, read) in MEGATRON_LM_ARGS.items():
        if hasattr(args, name):
            values[ours] = read(args)
    if not values.get("group_query_attention"):
        values["num_query_groups"] = None  # megatron-core's config ignores it without GQA
    problems = []
    for name, (neutral, what) in UNSUPPORTED_ARGS.items():
        value = getattr(args, name, None)
        if hasattr(args, name) and not neutral(value, args):
            problems.append(
                f"the checkpoint was trained with {what} (Megatron-LM's {name} = {value!r}), which this framework "
                f"does not build: it cannot be loaded here"
            )
    return values, problems


def get_megatron_lm_tokenizer_identity(args: Any) -> dict[str, Any] | None:
    """Our tokenizer identity (``tokenizer.identity()``) of the checkpoint's tokenizer where its args
    determine it (NullTokenizer: its vocabulary), else None: Megatron-LM records a tokenizer's path,
    not a digest of its files."""
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        return {"type": "NullTokenizer", "model_sha256": None, "vocab_size": int(args.vocab_size) + 1}
    return None


def describe_tokenizer_difference(args: Any, current: dict[str, Any]) -> tuple[str | None, str | None]:
    """(a problem, a warning) comparing the checkpoint's tokenizer with this run's identity
    ``current``: a different type, or a NullTokenizer of another vocabulary, is a problem; a file-backed
    tokenizer of the same type is a warning (its files cannot be compared)."""
    saved_type = getattr(args, "tokenizer_type", None)
    known = get_megatron_lm_tokenizer_identity(args)
    if known is not None:
        if known == current:
            return None, None
        return (
            f"--tokenizer-type/--vocab-size: the checkpoint was trained with NullTokenizer over "
            f"{known['vocab_size']} ids (--vocab-size {known['vocab_size'] - 1}), this run uses {current}"
        ), None
    if saved_type != current.get("type"):
        return (
            f"--tokenizer-type: the checkpoint was trained with {saved_type} "
            f"({getattr(args, 'tokenizer_model', None) or getattr(args, 'vocab_file', None)}), this run uses "
            f"{current.get('type')}: use the checkpoint's tokenizer"
        ), None
    path = getattr(args, "tokenizer_model", None) or getattr(args, "vocab_file", None)
    return None, (
        f"Megatron-LM records its {saved_type}'s path ({path}), not its contents: the ids are checked only "
        f"against the vocabulary size; give the same tokenizer files"
    )
