"""The V placement (ZBV, DualPipeV) in megatron-core: rank r holds stage r as chunk 0 and stage
2p-1-r as chunk 1, so the first and the last stage both sit on pipeline rank 0.

megatron-core 0.16.1 assumes the loop placement (stage = chunk x p + rank; the last stage on rank
p-1) wherever it needs to know a stage. Each such place, and what replaces it under V:

- the layers a chunk builds and their global numbers (``get_num_layers_to_build``,
  ``get_transformer_layer_offset``, called with the chunk's (vp_stage, pp_rank) by the block, the
  layer and the block's ``sharded_state_dict``): under V they are asked for the (chunk, rank) that
  holds the *same stage* under the loop placement (``get_loop_equivalent``), so stage s carries the
  same layers, the same checkpoint keys and, through our init by global name, the same initial
  weights under every schedule. So ``--account-for-embedding/loss-in-pipeline-split`` lighten stages 0
  and 2p-1, both on rank 0 under V; ``--decoder-first/last-pipeline-num-layers`` (layers of the
  loop placement's first/last *rank*) are refused under V (``layout_rules.check_v_split``).
- where the embedding and the output layer with the loss are built: ``StagePlacement.is_first`` /
  ``is_last`` from the placement (``parallel.py``), passed to GPTModel as pre/post_process.
- the embedding group (first and last pipeline rank; the tied output weight's initial copy and
  gradient all-reduce): under V both chunks are on rank 0, so the group is rank 0 alone
  (``get_v_embedding_ranks``; megatron-core skips a one-rank group). The initial copy is our
  layout-independent init, which gives the duplicate the embedding's values by name; the gradient
  tie is local (``tie_word_embedding_grads``): both copies get e + o, the sum the two-rank
  all-reduce gives (one fp32 addition of two values: bitwise the same).
- the token count for per-token loss: ``finalize_model_grads`` broadcasts it from the last pipeline
  rank; under V the loss is on rank 0 (``finalize_model_grads_v``).
- Float16Module casts the inputs of (first vp stage, first pp rank) and upcasts the outputs of
  (last vp stage, last pp rank): under V the last stage is chunk 1 of rank 0
  (``PlacedFloat16Module`` decides by the chunk's pre/post_process).
- who holds and reports the loss: ``ParallelContext.is_last_stage`` / ``is_logging_rank``.
P2P directions are the schedule runtime's (``pipeline/``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_ext.model.wrapping import unwrap_model
from megatron_ext.pipeline.placement import get_stage_index, get_stage_location
from megatron_ext.training.finalize import finalize_without_count, scale_by_global_token_count

PLACEMENT_ATTR = "pipeline_stage_placement"  # set on the TransformerConfig: "loop" (absent) or "v"


def get_config_placement(config: Any) -> str:
    return getattr(config, PLACEMENT_ATTR, "loop")


def get_loop_equivalent(config: Any, vp_stage: int | None, pp_rank: int) -> tuple[int | None, int]:
    """(vp_stage, pp_rank) of the chunk that holds the same stage as ``(vp_stage, pp_rank)`` does
    under ``config``'s placement, in megatron-core's loop placement (unchanged under loop)."""
    if get_config_placement(config) != "v" or vp_stage is None:
        return vp_stage, pp_rank
    p, v = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    rank, chunk = get_stage_location(get_stage_index(pp_rank, vp_stage, p, v, "v"), p, v, "loop")
    return chunk, rank


def _stage_aware(original):
    """megatron-core's (config, vp_stage, pp_rank) function, asked for the loop-equivalent chunk."""

    @functools.wraps(original)
    def wrapper(config, vp_stage=None, pp_rank=None):
        if get_config_placement(config) == "v":
            if pp_rank is None:
                from megatron.core import parallel_state

                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            vp_stage, pp_rank = get_loop_equivalent(config, vp_stage, pp_rank)
        return original(config, vp_stage, pp_rank)

    wrapper._megatron_ext_stage_aware = True
    return wrapper


def apply_v_placement_layer_numbers() -> None:
    """Make megatron-core's layer counts and offsets placement-aware (a no-op for configs without
    the V marker, i.e. every loop-placement build). Idempotent."""
    from megatron.core.transformer import transformer_block, transformer_layer

    for module, name in (
        (transformer_layer, "get_transformer_layer_offset"),
        (transformer_block, "get_transformer_layer_offset"),
        (transformer_block, "get_num_layers_to_build"),
    ):
        current = getattr(module, name)
        if not getattr(current, "_megatron_ext_stage_aware", False):
            setattr(module, name, _stage_aware(current))


def mark_config_placement(config: Any, placement: str) -> None:
    """Record the stage placement on megatron-core's TransformerConfig (read by the wrappers above
    and by ``apply_mixed_precision`` / ``configure_model_hooks``)."""
    if placement == "v":
        apply_v_placement_layer_numbers()
        setattr(config, PLACEMENT_ATTR, "v")


def get_v_embedding_ranks(pp_ranks: list[int], *_: Any) -> list[int]:
    """megatron-core's ``get_embedding_ranks`` under V: the embedding and the output layer are both
    on the first pipeline rank, so the tie needs no collective."""
    return [pp_ranks[0]]


def tie_word_embedding_grads(model: list[torch.nn.Module]) -> None:
    """The tied word embedding's gradient under V, on rank 0: chunk 0's embedding weight and chunk
    1's duplicate output weight both become ``e + o`` (fp32 main_grad [vocab/tp, h]), as the
    first/last-rank all-reduce makes them under the loop placement. Nothing to do elsewhere or
    untied."""
    weights = []
    for chunk in model:
        module = unwrap_model(chunk)
        if getattr(module, "share_embeddings_and_output_weights", False):
            weight = module.shared_embedding_or_output_weight()
            if weight is not None:
                weights.append(weight)
    if len(weights) < 2:
        return
    if len(weights) != 2:
        raise AssertionError(f"{len(weights)} copies of the tied word embedding on one rank")
    first, last = (w.main_grad for w in weights)
    total = first + last
    first.copy_(total)
    last.copy_(total)


def finalize_model_grads_v(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """megatron-core's ``finalize_model_grads`` for the V placement: its DP reduce, SP norm
    all-reduce and (one-rank, skipped) embedding all-reduce, then the local tie, then the per-token
    scaling with the token count broadcast from pipeline rank 0 (where the loss is), summed over
    DP: the same steps in the same order as under the loop placement."""
    finalize_without_count(model, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    tie_word_embedding_grads(model)
    if num_tokens is not None:
        scale_by_global_token_count(model, num_tokens, pg_collection, _first_rank)


def _first_rank(group: Any) -> int:
    return torch.distributed.get_process_group_ranks(group)[0]


def build_placed_float16_module(config: Any, chunk: torch.nn.Module) -> torch.nn.Module:
    """megatron-core's Float16Module whose first/last stage is the chunk's own pre/post_process."""
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    class PlacedFloat16Module(Float16Module):
        """Float16Module.forward with the stage taken from the wrapped GPTModel, not from the
        (vp_stage, pp rank) of the loop placement."""

        def forward(self, *inputs, fp32_output=True, **kwargs):
            model = unwrap_model(self)
            if model.pre_process:
                inputs = fp32_to_float16(inputs, self.float16_convertor)
            outputs = self.module(*inputs, **kwargs)
            if model.post_process and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs

    return PlacedFloat16Module(config, chunk)
