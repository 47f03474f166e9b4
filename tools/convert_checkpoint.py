"""Convert Hugging Face Llama-architecture checkpoints (Llama 2/3/3.1/3.2/3.3, Qwen2/2.5) to ours and back.

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --save CKPT \\
        [--tensor-model-parallel-size 2] [--make-vocab-size-divisible-by 128]
    python tools/convert_checkpoint.py megatron-to-hf --load CKPT --hf-dir OUT

Our checkpoints (megatron-core ``torch_dist``) key every tensor by its global name and layer
number, so one converted checkpoint loads under any TP x PP x VPP x DP: the conversion runs in
one process. The padded vocabulary (a multiple of ``--make-vocab-size-divisible-by``, the same at
every TP size, unlike Megatron-LM's) is recorded in the checkpoint; a run loads it at any TP that
divides the multiple. The converted
checkpoint holds weights only (a run that loads it starts a fresh optimizer at iteration 0) and
prints the flags a run needs to match it.

Tensor layouts (megatron-core, checked against 0.16.1):
- ``linear_qkv.weight`` is grouped per key/value head: for each of the G query groups,
  [its H/G query heads; its key head; its value head], each head ``head_dim`` rows;
- ``linear_fc1.weight`` of the SwiGLU MLP is [gate; up] (megatron-core applies silu to the first
  half); ``linear_fc2`` is ``down_proj``;
- RoPE: megatron-core's default (``rotary_interleaved=False``) rotates halves, as Hugging Face's
  ``rotate_half`` does, so q/k rows are copied without permutation; theta is ``--rotary-base``.
  Llama-3.1-style scaling (``rope_type: llama3``) maps to ``--use-rope-scaling
  --rope-scaling-factor F``: megatron-core fixes the low/high frequency factors (1, 4) and the
  original context (8192), so other values are refused;
- Qwen2/2.5: q/k/v biases (implied by ``model_type``) map to ``--add-qkv-bias``, grouped like the
  weight rows; sliding-window attention is refused;
- ``--apply-layernorm-1p`` (zero-centred gamma): our norms scale by ``1 + weight``, Hugging Face's
  by ``weight``: the export adds 1 to every norm weight, and ``hf-to-megatron --apply-layernorm-1p``
  subtracts it (the checkpoint then records the flag, which its runs must give).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# megatron-core 0.16.1's RotaryEmbedding._apply_scaling constants (Llama 3.1)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Training settings of the converter's one-process model, not the HF model's: recorded, every run
# that loads the converted checkpoint warned that it was "trained with --seq-length 16" (state.py's
# WARNED_SETTINGS); the model settings a run must match stay recorded
PLACEHOLDER_SETTINGS = ("seq_length", "seed", "hidden_dropout", "attention_dropout", "packed_sequences")


# ----------------------------------------------------------------------------- config


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
            f"architectures {not_causal}: only causal language models (LlamaForCausalLM, Qwen2ForCausalLM) convert"
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
    if hf.get("model_type") == "qwen2" and (
        hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or [])
    ):
        problems.append("use_sliding_window=true: sliding-window attention is not supported")
    for key in REQUIRED_KEYS:
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf.get(key) <= 0:
            problems.append(f"config.json: {key} must be a positive integer, got {hf.get(key)!r}")
    heads, hidden = hf.get("num_attention_heads", 0), hf.get("hidden_size", 0)
    head_dim = hf.get("head_dim") or (hidden // heads if heads else 0)
    if heads and head_dim * heads != hidden:
        problems.append(f"head_dim {head_dim} x heads {heads} != hidden_size {hidden}: not supported")
    if problems:
        raise ValueError("cannot convert this checkpoint:\n" + "\n".join(f"  - {p}" for p in problems))


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
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        disable_bias_linear=True,
        position_embedding_type="rope",
        rotary_base=int(get_rope_theta(hf)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings"),
        make_vocab_size_divisible_by=divisible_by,
        add_qkv_bias=hf.get("model_type") == "qwen2",
        use_rope_scaling=factor is not None,
        **({"rope_scaling_factor": factor} if factor is not None else {}),
    )


# ----------------------------------------------------------------------------- tensors

# the norm weights, in our names and HF's: (1 + gamma) under --apply-layernorm-1p, gamma in HF
OUR_NORMS = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight")
HF_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


def shift_norm_weights(state: dict[str, torch.Tensor], names: tuple[str, ...], by: float) -> dict[str, torch.Tensor]:
    """``state`` with ``by`` added to every norm weight (a key ending in one of ``names``), in fp32
    (a zero-centred gamma near 0 keeps its precision until the 1 is added)."""
    return {k: (v.float() + by).to(v.dtype) if k.endswith(names) else v for k, v in state.items()}


def _dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    return heads, groups, hf["hidden_size"] // heads


def hf_to_megatron_tensors(
    hf_state: dict[str, torch.Tensor], hf: dict[str, Any], padded_vocab: int, zero_centered_gamma: bool = False
) -> dict[str, torch.Tensor]:
    """{our single-process parameter name: tensor} from HF Llama tensors (pure); with
    ``zero_centered_gamma`` (--apply-layernorm-1p) each norm weight is HF's minus 1."""
    heads, groups, d = _dims(hf)
    hidden = hf["hidden_size"]
    out = {}
    embed = hf_state["model.embed_tokens.weight"]
    out["embedding.word_embeddings.weight"] = _pad_rows(embed, padded_vocab)
    for i in range(hf["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf_state[src + "self_attn.q_proj.weight"].view(groups, heads // groups * d, hidden)
        k = hf_state[src + "self_attn.k_proj.weight"].view(groups, d, hidden)
        v = hf_state[src + "self_attn.v_proj.weight"].view(groups, d, hidden)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        if src + "self_attn.q_proj.bias" in hf_state:  # Qwen2: grouped like the weight rows
            qb = hf_state[src + "self_attn.q_proj.bias"].view(groups, heads // groups * d)
            kb = hf_state[src + "self_attn.k_proj.bias"].view(groups, d)
            vb = hf_state[src + "self_attn.v_proj.bias"].view(groups, d)
            out[dst + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        out[dst + "self_attention.linear_proj.weight"] = hf_state[src + "self_attn.o_proj.weight"]
        out[dst + "input_layernorm.weight"] = hf_state[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf_state[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[src + "mlp.gate_proj.weight"], hf_state[src + "mlp.up_proj.weight"]], dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = hf_state[src + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
    if not hf.get("tie_word_embeddings", False):
        out["output_layer.weight"] = _pad_rows(hf_state["lm_head.weight"], padded_vocab)
    return shift_norm_weights(out, OUR_NORMS, -1.0) if zero_centered_gamma else out


def megatron_to_hf_tensors(
    ours: dict[str, torch.Tensor], hf: dict[str, Any], zero_centered_gamma: bool = False
) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_megatron_tensors`` (drops the vocabulary padding; adds 1 to each norm
    weight with ``zero_centered_gamma``)."""
    heads, groups, d = _dims(hf)
    hidden, vocab = hf["hidden_size"], hf["vocab_size"]
    out = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"][:vocab]}
    for i in range(hf["num_hidden_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = ours[src + "self_attention.linear_qkv.weight"].view(groups, (heads // groups + 2) * d, hidden)
        q, k, v = qkv.split([heads // groups * d, d, d], dim=1)
        out[dst + "self_attn.q_proj.weight"] = q.reshape(-1, hidden)
        out[dst + "self_attn.k_proj.weight"] = k.reshape(-1, hidden)
        out[dst + "self_attn.v_proj.weight"] = v.reshape(-1, hidden)
        if src + "self_attention.linear_qkv.bias" in ours:
            qkv_b = ours[src + "self_attention.linear_qkv.bias"].view(groups, (heads // groups + 2) * d)
            qb, kb, vb = qkv_b.split([heads // groups * d, d, d], dim=1)
            for name, b in (("q", qb), ("k", kb), ("v", vb)):
                out[dst + f"self_attn.{name}_proj.bias"] = b.reshape(-1)
        out[dst + "self_attn.o_proj.weight"] = ours[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = ours[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = ours[src + "pre_mlp_layernorm.weight"]
        gate, up = ours[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = ours[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = ours["decoder.final_layernorm.weight"]
    if not hf.get("tie_word_embeddings", False):
        out["lm_head.weight"] = ours["output_layer.weight"][:vocab]
    if zero_centered_gamma:
        out = shift_norm_weights(out, HF_NORMS, 1.0)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < t.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the checkpoint's {t.shape[0]}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


# ----------------------------------------------------------------------------- process world


def _with_single_process_model(values: dict[str, Any], padded_vocab: int, fn: Callable) -> Any:
    """Build our model in a 1-rank world (TP = PP = 1) and call ``fn(model_chunk, cfg)``.
    Uses the current process group when there is one of size 1 (tests fork one)."""
    import torch.distributed as dist

    from megatron_ext.config import build_job_config
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context

    own_group = not dist.is_initialized()
    if own_group:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
        )
    if dist.get_world_size() != 1:
        raise ValueError("the converter runs in one process: launch it with python, not torchrun")
    cfg = build_job_config(
        {
            **values,
            "mock_data": True,
            "tokenizer_type": "NullTokenizer",
            "vocab_size": padded_vocab - 1,
            "seq_length": 16,
        }
    )
    device = torch.device("cpu")
    ctx = build_parallel_context(cfg, device)
    try:
        (chunk,) = build_model_chunks(cfg, resolve_config(cfg, 1, padded_vocab), ctx.placement, device)
        return fn(chunk, cfg)
    finally:
        destroy_parallel_context()
        if own_group:
            dist.destroy_process_group()


def _read_hf(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--hf-dir {hf_dir}: no config.json")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except ValueError as err:
        raise ValueError(f"--hf-dir {hf_dir}: config.json is not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"--hf-dir {hf_dir}: config.json holds {type(hf).__name__}, not an object")
    check_supported(hf)
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"--hf-dir {hf_dir}: no *.safetensors files (PyTorch .bin is not supported)")
    state = {}
    for name in files:
        state.update(_read_safetensors(os.path.join(hf_dir, name)))
    return hf, {k: v.float() for k, v in state.items()}


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors; ValueError naming the file when it is not one (garbage,
    truncated: safetensors raises its own SafetensorError, which says neither which file nor what
    to do) or cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"--hf-dir: {path} is not a readable safetensors file ({err}); it may be truncated "
            f"or damaged: download or export it again"
        ) from None


def convert_hf_to_megatron(
    hf_dir: str,
    save: str,
    tp: int = 1,
    divisible_by: int = 128,
    log: Callable[[str], None] = print,
    apply_layernorm_1p: bool = False,
) -> str:
    """HF Llama directory -> ``save/iter_0000000`` (weights, args, the HF config); with
    ``apply_layernorm_1p`` a checkpoint of zero-centred norm weights (HF's minus 1)."""
    from megatron_ext.checkpoint.directory import FORMAT_VERSION, write_checkpoint
    from megatron_ext.checkpoint.state import build_model_sharded_state_dict

    check_empty_save_dir(save)
    hf, hf_state = _read_hf(hf_dir)
    log(f"read {len(hf_state)} tensors from {hf_dir} ({hf['num_hidden_layers']} layers)")
    values = {**hf_config_to_values(hf, divisible_by), "apply_layernorm_1p": apply_layernorm_1p}
    padded = get_padded_vocab(hf["vocab_size"], divisible_by, tp)
    ours = hf_to_megatron_tensors(hf_state, hf, padded, zero_centered_gamma=apply_layernorm_1p)

    def save_chunk(chunk, cfg) -> str:
        params = dict(chunk.named_parameters())
        missing = sorted(set(params) - set(ours))
        if missing:
            raise ValueError(f"no HF tensor for our parameters {missing}")
        with torch.no_grad():
            for name, param in sorted(params.items()):
                if tuple(param.shape) != tuple(ours[name].shape):
                    raise ValueError(f"{name}: HF gives {tuple(ours[name].shape)}, ours is {tuple(param.shape)}")
                param.copy_(ours[name])
        log(f"copied {len(params)} parameters; writing {save}")

        class _Wrapped:  # build_model_sharded_state_dict expects DDP-wrapped chunks
            module = chunk

        state = build_model_sharded_state_dict([_Wrapped])
        args = {k: v for k, v in cfg.to_flat_dict().items() if k not in PLACEHOLDER_SETTINGS}
        state.update(
            args=args, tokenizer=None, padded_vocab_size=padded, hf_config=hf, checkpoint_version=FORMAT_VERSION
        )
        return write_checkpoint(state, save, 0)

    out = _with_single_process_model(values, padded, save_chunk)
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in values.items()
        if v not in (None, False)
    )
    log(f"wrote {out}\nload it with: --load {save} {flags}")
    return out


def check_empty_save_dir(save: str) -> None:
    """The converted checkpoint is iteration 0: written beside a run's checkpoints, ``--load`` would
    still take the run's newest one. Refuse a ``--save`` that holds checkpoints."""
    from megatron_ext.checkpoint.directory import TRACKER_FILE

    if os.path.exists(save) and not os.path.isdir(save):
        raise ValueError(f"--save {save} is a file, not a directory")
    held = (
        sorted(n for n in os.listdir(save) if n.startswith("iter_") or n == TRACKER_FILE) if os.path.isdir(save) else []
    )
    if held:
        raise ValueError(
            f"--save {save} already holds checkpoints ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
            f"give a new or empty directory"
        )


def check_hf_output_dir(hf_dir: str) -> None:
    """Never overwrite a model: ``--hf-dir`` must be new, or a directory without config.json and
    safetensors files."""
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir} is a file, not a directory")
    if os.path.isdir(hf_dir):
        held = sorted(n for n in os.listdir(hf_dir) if n == "config.json" or n.endswith(".safetensors"))
        if held:
            raise ValueError(
                f"--hf-dir {hf_dir} already holds a model ({', '.join(held)}): give a new or empty directory"
            )


def convert_megatron_to_hf(load: str, hf_dir: str, log: Callable[[str], None] = print) -> str:
    """Our newest complete checkpoint under ``load`` (or ``load`` itself, one ``iter_XXXXXXX``
    directory) -> HF safetensors + config.json in a new or empty ``hf_dir``. Every file and item read
    is checked against the checksums its save recorded (as ``--ckpt-verify`` checks a load); a
    damaged file, or one holding what a checkpoint never holds, is a ValueError naming it, and
    nothing is written."""
    from safetensors.torch import save_file

    from megatron_ext.checkpoint.directory import resolve_load_path
    from megatron_ext.checkpoint.reader import NAMED_ERRORS, open_checkpoint
    from megatron_ext.checkpoint.state import load_full_tensors

    check_hf_output_dir(hf_dir)
    found, warning = resolve_load_path(load)  # a save directory or one iter_XXXXXXX, as --load takes
    if warning:
        log(f"WARNING: {warning}")
    if found is None:
        raise ValueError(f"--load {load}: no complete checkpoint")
    iteration, ckpt_dir = found
    try:  # every file and item read is checked against the checksums the save recorded
        common = open_checkpoint(ckpt_dir, warn=lambda message: log(f"WARNING: {message}"))[1]
        args = common["args"]
        hf = common.get("hf_config") or build_hf_config(args, common)
        check_supported(hf)
        log(f"reading {ckpt_dir} (iteration {iteration})")
        # the weights only: a run's optimizer state (fp32 main parameters and two Adam moments, 6x the
        # bytes of a bf16 model) would be read into memory and dropped
        full = load_full_tensors(ckpt_dir, exclude=("optimizer.",))
    except NAMED_ERRORS as err:
        raise ValueError(f"--load {load}: {err}; nothing was written to {hf_dir}") from None
    ours = unstack_layers(full, args["num_layers"])
    tensors = megatron_to_hf_tensors(ours, hf, zero_centered_gamma=bool(args.get("apply_layernorm_1p")))
    os.makedirs(hf_dir, exist_ok=True)
    weights = os.path.join(hf_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # safetensors creates it 0600: readable as config.json is
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    log(f"wrote {len(tensors)} tensors to {hf_dir}")
    return hf_dir


# Checkpoint keys of layer-stacked tensors -> our per-layer parameter names (megatron-core stores
# the norms fused into the following linear's key, as Transformer Engine names them).
_STACKED = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "decoder.layers.self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "decoder.layers.mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
}


_STACKED_OPTIONAL = {"decoder.layers.self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias"}


def unstack_layers(full: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (layers stacked on dim 0) -> our single-process parameter names."""
    out = {k: v for k, v in full.items() if not k.startswith(("decoder.layers.", "optimizer."))}
    for key, name in _STACKED_OPTIONAL.items():
        if key in full:
            for i in range(num_layers):
                out[f"decoder.layers.{i}.{name}"] = full[key][i]
    for key, name in _STACKED.items():
        if key not in full:
            raise ValueError(f"checkpoint has no {key}: not a Llama-style (RMSNorm, SwiGLU, no bias) model")
        stacked = full[key]
        if key.endswith("linear_fc1.weight") and stacked.dim() == 4:  # [L, 2, ffn, h] (swiglu split)
            stacked = stacked.flatten(1, 2)
        for i in range(num_layers):
            out[f"decoder.layers.{i}.{name}"] = stacked[i]
    return out


def build_hf_config(args: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """An HF LlamaConfig dict for a checkpoint trained here (no HF config recorded)."""
    if not (
        args.get("swiglu")
        and args.get("normalization") == "RMSNorm"
        and args.get("disable_bias_linear")
        and args.get("position_embedding_type") == "rope"
    ):
        raise ValueError(
            "only Llama-style checkpoints convert to HF: need --swiglu --normalization RMSNorm "
            "--disable-bias-linear --position-embedding-type rope"
        )
    if float(args.get("rotary_percent", 1.0)) != 1.0:
        # HF's Llama rotates every dimension of a head: the export would be another model
        raise ValueError(
            f"--rotary-percent {args['rotary_percent']}: HF Llama/Qwen2 rotate the whole head, "
            f"only checkpoints trained with --rotary-percent 1.0 convert"
        )
    vocab = (common.get("tokenizer") or {}).get("vocab_size") or common["padded_vocab_size"]
    heads = args["num_attention_heads"]
    theta = float(args["rotary_base"])
    rope = {"rope_type": "default", "rope_theta": theta}
    if args.get("use_rope_scaling"):
        rope = {"rope_type": "llama3", "factor": float(args["rope_scaling_factor"]), **LLAMA3_ROPE, "rope_theta": theta}
    qwen = bool(args.get("add_qkv_bias"))
    from megatron_ext.checkpoint.compatibility import saved_ffn_hidden_size

    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        **({"use_sliding_window": False} if qwen else {}),
        "vocab_size": vocab,
        "hidden_size": args["hidden_size"],
        # the width the model had: --ffn-hidden-size, or its default (None in args) when it was saved
        "intermediate_size": saved_ffn_hidden_size({**common, "args": args}),
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": heads,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF Llama / Qwen2 (safetensors + config.json) -> our checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--save", required=True)
    a.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="TP size of the runs that will load it (only checked: it must divide the multiple)",
    )
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="write zero-centred norm weights (HF's minus 1), for runs with --apply-layernorm-1p",
    )
    b = sub.add_parser(
        "megatron-to-hf",
        help="our checkpoint -> HF Llama / Qwen2 (safetensors + config.json); "
        "every file read is checked against the checksums its save recorded, a damaged one refused",
    )
    b.add_argument("--load", required=True)
    b.add_argument("--hf-dir", required=True)
    args = parser.parse_args(argv)
    from megatron_ext.cpu_platform import quiet_known_warnings

    quiet_known_warnings()
    # torch DCP's note when it reads without a process group, which is what this tool means to do
    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    if importlib.util.find_spec("safetensors") is None:  # checked before any work, not after the read
        print(
            "error: tools/convert_checkpoint.py reads and writes Hugging Face safetensors, which is not "
            "installed: pip install -e '.[convert]' (or pip install safetensors)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.direction == "hf-to-megatron":
            convert_hf_to_megatron(
                args.hf_dir,
                args.save,
                args.tensor_model_parallel_size,
                args.make_vocab_size_divisible_by,
                apply_layernorm_1p=args.apply_layernorm_1p,
            )
        else:
            convert_megatron_to_hf(args.load, args.hf_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
