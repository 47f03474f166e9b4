"""Megatron-LM's theoretical memory (``megatron/training/theoretical_memory_usage.py``, core_v0.16.1),
re-derived here as a reference for the planner's own model (docs/planning.md compares them).

What it counts, as Megatron-LM does:
- weights and optimizer of the most loaded model shard: (transformer parameters / PP + one embedding)
  / TP (+ the output layer when untied and PP = 1), at 18 bytes a parameter, or 6 + 12 / DP with the
  distributed optimizer; the transformer's parameters from its closed form (no bias terms);
- activations of the first pipeline stage with sequence parallelism and selective recompute
  (Korthikanti et al. 2022, Table 2): s b h (18 + 4 ffn / h) bytes per layer, times all L layers (p
  micro-batches of L / p layers in flight), the embedding's input ids and dropout mask for p
  micro-batches, x (1 + (p - 1) / (p v)) when interleaved, x min(1, m / p) otherwise, the output layer
  and cross-entropy inputs only at PP 1, all / TP.
What it leaves out (why the planner differs): GQA (the formula has no key/value-head term), SwiGLU's
third matrix in the activations, full recompute, packing, the zero-bubble schedules, dtype (it is
bf16's), and everything outside autograd.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.config import JobConfig
from megatron_ext.derived import (
    get_data_parallel_size,
    get_ffn_hidden_size,
    get_kv_channels,
    get_num_query_groups,
    get_virtual_pipeline_size,
)


@dataclasses.dataclass(frozen=True)
class TheoreticalMemory:
    parameters: float  # the whole model's (the formula's count)
    shard_parameters: float  # the most loaded shard's
    weights_and_optimizer: float  # bytes
    activations: float  # bytes, first pipeline stage

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations


def theoretical_memory(
    cfg: JobConfig, world_size: int, padded_vocab: int, num_microbatches: int | None
) -> TheoreticalMemory:
    """Megatron-LM's figures for ``cfg`` on ``world_size`` GPUs (``padded_vocab``: the run's padded vocabulary)."""
    m, p = cfg.model, cfg.parallel
    h, layers, heads = m.hidden_size, m.num_layers, m.num_attention_heads
    ffn, groups = get_ffn_hidden_size(m), get_num_query_groups(m)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    vp = get_virtual_pipeline_size(cfg)
    vp = vp if vp and vp > 1 else None
    kv_channels = get_kv_channels(m)
    gated = 1.5 if m.swiglu else 1.0
    transformer = (
        2
        * layers
        * h
        * h
        * (
            (1 + groups / heads) * (kv_channels * heads / h)  # attention
            + (ffn / h) * gated  # MLP
            + 2 / h  # the layer's two norms
            + 1 / (layers * h)  # the final norm
        )
    )
    embedding = h * padded_vocab
    parameters = transformer + embedding * (2 if m.untie_embeddings_and_output_weights else 1)
    shard = (transformer / pp + embedding) / tp
    if m.untie_embeddings_and_output_weights and pp == 1:
        shard += embedding / tp
    dp = get_data_parallel_size(cfg, world_size)
    per_parameter = 6 + 12 / dp if p.use_distributed_optimizer else 18
    s, b = m.seq_length, cfg.training.micro_batch_size
    activations = s * b * h * (18 + 4 * ffn / h) * layers
    activations += 8 * s * b * pp + s * b * h * pp  # embedding input ids, embedding dropout
    if vp is not None:
        activations *= 1 + (pp - 1) / (pp * vp)
    elif pp > 1 and num_microbatches is not None:
        activations *= min(1, num_microbatches / pp)
    if pp == 1:
        activations += s * b * h * 4 * (1 + padded_vocab / h)
    return TheoreticalMemory(parameters, shard, shard * per_parameter, activations / tp)
