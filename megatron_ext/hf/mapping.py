"""Tensors of a Llama-architecture model between Hugging Face's names and layouts and ours (pure).

Layouts (megatron-core, checked against 0.16.1):
- ``linear_qkv.weight`` is grouped per key/value head: for each of the G query groups,
  [its H/G query heads; its key head; its value head], each head ``head_dim`` rows (``--kv-channels``,
  HF's ``head_dim``: hidden / heads unless given);
- Qwen3's ``q_norm``/``k_norm`` (one [head_dim] weight each, shared by the heads) are our
  ``self_attention.q_layernorm``/``k_layernorm`` (``--qk-layernorm``);
- ``linear_fc1.weight`` of the SwiGLU MLP is [gate; up] (megatron-core applies silu to the first
  half); ``linear_fc2`` is ``down_proj``;
- RoPE: megatron-core's default (``rotary_interleaved=False``) rotates halves, as Hugging Face's
  ``rotate_half`` does, so q/k rows are copied without permutation;
- Qwen2's q/k/v biases are grouped like the weight rows;
- ``--apply-layernorm-1p`` (zero-centred gamma): our norms scale by ``1 + weight``, Hugging Face's
  by ``weight``: the export adds 1 to every norm weight, the import subtracts it.

Names are our single-process parameter names (``decoder.layers.<global i>.…``); the export maps
whichever layers a dict holds, so a pipeline stage maps its own.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_ext.hf.config import get_head_dim

# the norm weights, in our names and HF's: (1 + gamma) under --apply-layernorm-1p, gamma in HF
OUR_NORMS = (
    "input_layernorm.weight",
    "pre_mlp_layernorm.weight",
    "final_layernorm.weight",
    "q_layernorm.weight",
    "k_layernorm.weight",
)
HF_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "model.norm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
# Qwen3's per-head q/k norms: (HF name in a layer, ours), present in both or neither
QK_NORMS = (
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
)


def shift_norm_weights(state: dict[str, torch.Tensor], names: tuple[str, ...], by: float) -> dict[str, torch.Tensor]:
    """``state`` with ``by`` added to every norm weight (a key ending in one of ``names``), in fp32
    (a zero-centred gamma near 0 keeps its precision until the 1 is added)."""
    return {k: (v.float() + by).to(v.dtype) if k.endswith(names) else v for k, v in state.items()}


def _dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    return heads, groups, get_head_dim(hf)


def get_hf_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of every tensor ``hf_to_megatron_tensors`` reads for the config ``hf``
    (Qwen2's q/k/v biases and Qwen3's q/k norms as its ``model_type`` implies)."""
    heads, groups, d = _dims(hf)
    hidden, ffn, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not hf.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, hidden)
    for i in range(hf["num_hidden_layers"]):
        src = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (heads * d, hidden),
            "self_attn.k_proj.weight": (groups * d, hidden),
            "self_attn.v_proj.weight": (groups * d, hidden),
            "self_attn.o_proj.weight": (hidden, heads * d),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
        }
        if hf.get("model_type") == "qwen2":
            shapes.update(
                {f"self_attn.{x}_proj.bias": (n * d,) for x, n in (("q", heads), ("k", groups), ("v", groups))}
            )
        if hf.get("model_type") == "qwen3":
            shapes.update({theirs: (d,) for theirs, _ in QK_NORMS})
        out.update({src + name: shape for name, shape in shapes.items()})
    return out


def check_hf_tensors(hf_state: dict[str, torch.Tensor], hf: dict[str, Any], where: str) -> None:
    """ValueError unless ``hf_state`` holds every tensor of the model ``hf`` describes, each of its
    shape: the missing ones (up to 5 named, then a count) and those of another shape, named with
    ``where`` (the flag and directory)."""
    expected = get_hf_shapes(hf)
    missing = [name for name in expected if name not in hf_state]
    problems = []
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(f"no tensor {', '.join(missing[:5])}{more}")
    problems += [
        f"{name} is {tuple(hf_state[name].shape)}, config.json implies {shape}"
        for name, shape in expected.items()
        if name in hf_state and tuple(hf_state[name].shape) != shape
    ][:5]
    if problems:
        raise ValueError(
            f"{where}: its safetensors files are not the model its config.json describes: {'; '.join(problems)}: "
            f"download or export it again"
        )


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
        out.update({dst + ours: hf_state[src + theirs] for theirs, ours in QK_NORMS if src + theirs in hf_state})
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


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def get_layer_ids(ours: dict[str, torch.Tensor]) -> list[int]:
    """The global indices of the transformer layers ``ours`` holds, in order."""
    return sorted({int(m.group(1)) for m in map(_LAYER.match, ours) if m})


def megatron_to_hf_tensors(
    ours: dict[str, torch.Tensor], hf: dict[str, Any], zero_centered_gamma: bool = False
) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_megatron_tensors`` (drops the vocabulary padding; adds 1 to each norm
    weight with ``zero_centered_gamma``). ``ours`` may hold part of a model (one pipeline stage's
    layers, embedding, final norm or output layer): what it holds is mapped."""
    vocab = hf["vocab_size"]
    out = {}
    if "embedding.word_embeddings.weight" in ours:
        out["model.embed_tokens.weight"] = ours["embedding.word_embeddings.weight"][:vocab]
    for i in get_layer_ids(ours):
        out.update(_layer_to_hf(ours, i, hf))
    if "decoder.final_layernorm.weight" in ours:
        out["model.norm.weight"] = ours["decoder.final_layernorm.weight"]
    if not hf.get("tie_word_embeddings", False) and "output_layer.weight" in ours:
        out["lm_head.weight"] = ours["output_layer.weight"][:vocab]
    if zero_centered_gamma:
        out = shift_norm_weights(out, HF_NORMS, 1.0)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _layer_to_hf(ours: dict[str, torch.Tensor], i: int, hf: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF tensors of our transformer layer ``i``."""
    heads, groups, d = _dims(hf)
    hidden = hf["hidden_size"]
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {}
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
    out.update({dst + theirs: ours[src + name] for theirs, name in QK_NORMS if src + name in ours})
    out[dst + "input_layernorm.weight"] = ours[src + "input_layernorm.weight"]
    out[dst + "post_attention_layernorm.weight"] = ours[src + "pre_mlp_layernorm.weight"]
    gate, up = ours[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
    out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    out[dst + "mlp.down_proj.weight"] = ours[src + "mlp.linear_fc2.weight"]
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < t.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the checkpoint's {t.shape[0]}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


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


_STACKED_OPTIONAL = {
    "decoder.layers.self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",
    **{f"decoder.layers.{ours}": ours for _, ours in QK_NORMS},
}


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
