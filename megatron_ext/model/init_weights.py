"""Initial weights that do not depend on the parallel layout.

Invariant: the initial value of every parameter is a function of (seed, global parameter name,
full unsharded shape) only. A TP rank holds the slice of that full tensor that megatron-core's
sharding gives it; a PP or virtual stage holds the layers whose global numbers it owns. So a run
under any TP x PP x VPP x DP layout starts from exactly the model one process would build.

Global names are megatron-core's own module paths with layer indices made global
(``decoder.layers.<global index>.``); the duplicate output weight that a tied last pipeline stage
holds is named after the word embedding it copies.

Values (GPT-2 / Megatron conventions): linear and embedding weights ~ N(0, std); the residual
output projections (``linear_proj``, ``linear_fc2``) ~ N(0, std / sqrt(2 L)); biases 0; norm
weights 1 (0 with --apply-layernorm-1p: those norms scale by 1 + weight), the per-head q/k norms of
--qk-layernorm too (a [kv-channels] weight each). Cost: each rank draws the full tensor of each of its
parameters once (TP x the draws of a sharded init); negligible next to training.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable

import torch

_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")

_NORM_WEIGHT = re.compile(r"(layernorm\.weight|layer_norm_weight|layer_norm\.weight|norm\.weight)$")
_NORM_BIAS = re.compile(r"(layernorm\.bias|layer_norm_bias|layer_norm\.bias|norm\.bias)$")
_SCALED = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_PLAIN = re.compile(
    r"(linear_qkv|linear_q|linear_kv|linear_fc1|word_embeddings|position_embeddings|output_layer)\.weight$"
)


def get_param_seed(seed: int, global_name: str) -> int:
    """A 63-bit seed from the run seed and a parameter's global name (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).hexdigest()
    return int(digest[:15], 16)


def build_full_tensor(
    seed: int,
    global_name: str,
    full_shape: Iterable[int],
    std: float,
    num_layers: int,
    zero_centered_norms: bool = False,
) -> torch.Tensor:
    """The full (unsharded) initial value of one parameter, fp32 on the CPU."""
    shape = tuple(full_shape)
    if _NORM_WEIGHT.search(global_name):
        return torch.zeros(shape) if zero_centered_norms else torch.ones(shape)
    if global_name.endswith("bias") or _NORM_BIAS.search(global_name):
        return torch.zeros(shape)
    if _SCALED.search(global_name):
        std = std / math.sqrt(2.0 * num_layers)
    elif not _PLAIN.search(global_name):
        raise ValueError(
            f"no initialisation rule for parameter '{global_name}': add one to megatron_ext/model/init_weights.py"
        )
    generator = torch.Generator().manual_seed(get_param_seed(seed, global_name))
    return torch.normal(0.0, std, size=shape, generator=generator)


def get_global_name(local_name: str, layer_offset: int) -> str:
    """Make the layer index in ``decoder.layers.<i>.`` global by adding the chunk's offset."""

    def shift(match: re.Match) -> str:
        return f"{match.group(1)}decoder.layers.{int(match.group(2)) + layer_offset}."

    return _LAYER.sub(shift, local_name, count=1)


def get_full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def slice_for_tp(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int, gated: bool) -> torch.Tensor:
    """The TP rank's shard of ``full``, laid out as megatron-core lays out ``param``.

    A gated MLP's ``linear_fc1`` holds [gate; up] both on one process and on each TP rank, so a
    rank's shard is [gate shard; up shard], not one contiguous block.
    """
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if gated:
        halves = full.chunk(2, dim=dim)
        return torch.cat([h.chunk(tp_size, dim=dim)[tp_rank] for h in halves], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def get_layer_offset(chunk: torch.nn.Module) -> int:
    """Global index of a model chunk's first transformer layer (0 when it has none)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return layers[0].layer_number - 1


def apply_layout_independent_init(
    chunks: list[torch.nn.Module],
    seed: int,
    std: float,
    num_layers: int,
    tp_rank: int,
    tp_size: int,
    gated_mlp: bool,
    zero_centered_norms: bool = False,
) -> dict[str, str]:
    """Overwrite every parameter of ``chunks`` (unwrapped GPTModels) in place (norm weights 0 where
    ``zero_centered_norms``, i.e. --apply-layernorm-1p).

    Returns {local name in chunk i ("<i>/<name>"): global name} for inspection and tests.
    """
    names = {}
    for i, chunk in enumerate(chunks):
        offset = get_layer_offset(chunk)
        tied_output = getattr(chunk, "share_embeddings_and_output_weights", False)
        for local_name, param in chunk.named_parameters():
            global_name = get_global_name(local_name, offset)
            if tied_output and global_name == "output_layer.weight":
                global_name = "embedding.word_embeddings.weight"
            full = build_full_tensor(
                seed, global_name, get_full_shape(param, tp_size), std, num_layers, zero_centered_norms
            )
            gated = gated_mlp and "linear_fc1" in global_name
            with torch.no_grad():
                param.copy_(slice_for_tp(full, param, tp_rank, tp_size, gated))
            names[f"{i}/{local_name}"] = global_name
    return names
