"""The Hugging Face config of a Llama-architecture model (Llama 2/3/3.x, Qwen2/2.5, Qwen3) and ours (pure).

``check_supported`` judges an HF ``config.json`` (what the converter can read), ``hf_config_to_values``
turns it into our flags, ``get_exportable_problems`` judges our flags (what ``--save-hf`` and the
converter can write: RMSNorm, SwiGLU, RoPE over the whole head, no linear biases but Qwen2's q/k/v,
no learned positions; q/k norms as Qwen3's) and ``build_hf_config`` writes the HF ``config.json`` of
a model trained here. Qwen3 is Llama with RMSNorm q/k norms over each head (``--qk-layernorm``) and,
in some sizes, a ``head_dim`` that is not hidden / heads (``--kv-channels``).
Used by ``tools/convert_checkpoint.py``, the training-time export (``hf/export.py``) and validation.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# transformers' head_dim where config.json has none: Qwen3Config's 128, else hidden / heads
DEFAULT_HEAD_DIM = {"qwen3": 128}
# megatron-core 0.16.1's RotaryEmbedding._apply_scaling constants (Llama 3.1)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_supported(hf: dict[str, Any]) -> None:
    """Raise ValueError naming each unsupported property of an HF config."""
    problems = []
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        problems.append(
            f"model_type {hf.get('model_type')!r} (architectures {hf.get('architectures')}) is not "
            f"supported: only Llama-architecture checkpoints ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    not_causal = [a for a in hf.get("architectures") or [] if not str(a).endswith("ForCausalLM")]
    if hf.get("model_type") in SUPPORTED_MODEL_TYPES and not_causal:
        # e.g. a reward model (LlamaForSequenceClassification): its head would be dropped and the
        # tied embedding taken as the LM head, a causal LM that checkpoint never was
        problems.append(
            f"architectures {not_causal}: only causal language models (LlamaForCausalLM, Qwen2/3ForCausalLM) convert"
        )
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4.x / 5.x names
        rope = hf.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            off = {k: rope.get(k) for k, v in LLAMA3_ROPE.items() if float(rope.get(k, -1)) != v}
            if off or not float(rope.get("factor", 0)) > 0:
                problems.append(
                    f"{key} {rope}: Llama-3 RoPE scaling converts only with low_freq_factor 1, "
                    f"high_freq_factor 4, original_max_position_embeddings 8192 and a factor > 0 "
                    f"(megatron-core's fixed values); this config has {off or rope.get('factor')}"
                )
        elif kind != "default":
            problems.append(f"{key} {rope}: RoPE scaling {kind!r} is not supported (only llama3)")
    theta = get_rope_theta(hf)
    if not theta.is_integer():  # --rotary-base is an integer (as Megatron-LM's): int() would silently change it
        problems.append(
            f"rope_theta {theta}: not supported, --rotary-base takes an integer (RoPE theta without a fraction)"
        )
    partial = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        problems.append(f"partial_rotary_factor {partial}: only full-dimension RoPE converts")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true: biases in linear layers are not supported (Qwen2's q/k/v biases are)")
    if hf.get("quantization_config"):
        # the tensors keep their HF names (q_proj.weight holds fp8 or int values, the scales sit
        # beside it): converted as plain weights, they would be a silently wrong model
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        problems.append(
            f"quantization_config (quant_method {method!r}): quantized checkpoints are not supported; "
            f"convert the unquantized (bf16/fp16/fp32) checkpoint"
        )
    if hf.get("model_type") in ("qwen2", "qwen3") and (
        hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or [])
    ):
        problems.append("use_sliding_window=true: sliding-window attention is not supported")
    for key in REQUIRED_KEYS:
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf.get(key) <= 0:
            problems.append(f"config.json: {key} must be a positive integer, got {hf.get(key)!r}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0):
        problems.append(f"config.json: head_dim must be a positive integer, got {head_dim!r}")
    if problems:
        raise ValueError("cannot convert this checkpoint:\n" + "\n".join(f"  - {p}" for p in problems))


def get_head_dim(hf: dict[str, Any]) -> int:
    """Each attention head's dimension, as transformers reads the config (``head_dim``, else its default)."""
    default = DEFAULT_HEAD_DIM.get(hf.get("model_type"), hf["hidden_size"] // hf["num_attention_heads"])
    return hf.get("head_dim") or default


def get_rope_theta(hf: dict[str, Any]) -> float:
    """RoPE theta: top-level ``rope_theta`` (transformers 4.x) or ``rope_parameters`` (5.x)."""
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    return float((hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get("rope_theta", 10000.0))


def get_rope_scaling_factor(hf: dict[str, Any]) -> float | None:
    """The llama3 RoPE scaling factor, or None without scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        if rope.get("rope_type", rope.get("type")) == "llama3":
            return float(rope["factor"])
    return None


def get_padded_vocab(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Rounded up to ``divisible_by`` whatever the TP size (megatron_ext.derived.get_padded_vocab_size);
    ``tp`` only has to divide it."""
    if divisible_by % tp:
        raise ValueError(
            f"--make-vocab-size-divisible-by {divisible_by} is not divisible by --tensor-model-parallel-size {tp}"
        )
    multiple = divisible_by
    return -(-vocab_size // multiple) * multiple


def hf_config_to_values(hf: dict[str, Any], divisible_by: int = 128) -> dict[str, Any]:
    """Our flat config values (flag names with underscores) for an HF Llama config."""
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    factor = get_rope_scaling_factor(hf)
    head_dim = get_head_dim(hf)
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=head_dim if head_dim * heads != hf["hidden_size"] else None,
        qk_layernorm=hf.get("model_type") == "qwen3",
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        disable_bias_linear=True,
        position_embedding_type="rope",
        rotary_base=int(get_rope_theta(hf)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings"),
        make_vocab_size_divisible_by=divisible_by,
        add_qkv_bias=hf.get("model_type") == "qwen2",  # Qwen3 has none (attention_bias, refused above)
        use_rope_scaling=factor is not None,
        **({"rope_scaling_factor": factor} if factor is not None else {}),
    )


def get_exportable_problems(args: dict[str, Any]) -> list[str]:
    """What keeps a model of our flags (flat, flag names with underscores) from being an HF
    Llama/Qwen2/Qwen3 model, one line per problem naming the flag; empty when it exports. A model
    with --qk-layernorm exports as Qwen3 only."""
    problems = []
    need = {
        "normalization": ("RMSNorm", "--normalization RMSNorm"),
        "swiglu": (True, "--swiglu"),
        "disable_bias_linear": (True, "--disable-bias-linear"),
        "position_embedding_type": ("rope", "--position-embedding-type rope"),
    }
    for key, (want, flag) in need.items():
        if args.get(key) != want:
            problems.append(f"{flag} (this model has {key.replace('_', '-')} {args.get(key)!r})")
    if float(args.get("rotary_percent", 1.0)) != 1.0:
        # HF's Llama rotates every dimension of a head: the export would be another model
        problems.append(
            f"--rotary-percent {args['rotary_percent']}: HF Llama/Qwen2 rotate the whole head, give --rotary-percent 1.0"
        )
    if args.get("qk_layernorm") and (problems or args.get("add_qkv_bias")):
        bias = " (it has --add-qkv-bias)" if args.get("add_qkv_bias") else ""
        problems.append(
            f"--qk-layernorm: q/k norms export as Qwen3 only (RMSNorm, SwiGLU, RoPE, no linear or q/k/v "
            f"biases), which this model is not{bias}: drop --qk-layernorm or what Qwen3 lacks"
        )
    return problems


def build_hf_config(args: dict[str, Any], vocab_size: int, ffn_hidden_size: int) -> dict[str, Any]:
    """An HF LlamaConfig (Qwen2Config with --add-qkv-bias, Qwen3Config with --qk-layernorm) dict for
    a model of our flags ``args``; ``vocab_size`` is the tokenizer's (the padding rows are dropped),
    ``ffn_hidden_size`` the MLP width the model has."""
    problems = get_exportable_problems(args)
    if problems:
        raise ValueError("only Llama-style models convert to HF: need " + "; ".join(problems))
    heads = args["num_attention_heads"]
    theta = float(args["rotary_base"])
    rope = {"rope_type": "default", "rope_theta": theta}
    if args.get("use_rope_scaling"):
        rope = {"rope_type": "llama3", "factor": float(args["rope_scaling_factor"]), **LLAMA3_ROPE, "rope_theta": theta}
    model_type = "qwen3" if args.get("qk_layernorm") else "qwen2" if args.get("add_qkv_bias") else "llama"
    qwen = model_type != "llama"
    return {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
        ],
        "model_type": model_type,
        **({"use_sliding_window": False} if qwen else {}),
        **({"attention_bias": False} if model_type == "qwen3" else {}),
        "vocab_size": vocab_size,
        "hidden_size": args["hidden_size"],
        "intermediate_size": ffn_hidden_size,
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": heads,
        "head_dim": args.get("kv_channels") or args["hidden_size"] // heads,
        "num_key_value_heads": args["num_query_groups"] if args.get("group_query_attention") else heads,
        "rms_norm_eps": args["norm_epsilon"],
        "rope_theta": theta,
        "rope_parameters": rope,
        "rope_scaling": rope if args.get("use_rope_scaling") else None,
        "max_position_embeddings": args.get("max_position_embeddings") or args["seq_length"],
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "hidden_act": "silu",
        # the weights keep the dtype they were trained in (bf16 with --bf16)
        "torch_dtype": "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32",
    }
