"""Predicted memory of a job's layout per pipeline rank (``planning/memory.py``'s model applied to
a ``JobConfig``), and the parameter counts it needs, exact and cheap enough to rank hundreds of
layouts.

``count_parts(cfg, vocab, tp)``: the parameters one TP rank holds of a layer, of the embedding and
of the head (final norm and output layer; alone on the last stage it carries a copy of tied word
embeddings), from three tiny builds on the ``meta`` device of the same model
(``model/param_count.count_parameters``: 2 layers at PP 2, 4 layers at PP 2, 1 layer at PP 1);
any even layout's per-rank count follows by addition, equal to ``count_parameters`` of that layout.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.config import JobConfig
from megatron_ext.derived import (
    get_chunk_layer_counts,
    get_data_parallel_size,
    get_num_microbatches,
    get_padded_vocab_size,
    get_schedule_name,
    get_virtual_pipeline_size,
)
from megatron_ext.model.param_count import count_parameters
from megatron_ext.pipeline.actions import PipelineOrder
from megatron_ext.planning.memory import (
    PerToken,
    RankMemory,
    RecomputePlan,
    Shape,
    StageBytes,
    get_activation_peak,
    get_cp_index_per_token,
    get_cp_layer_delta_per_token,
    get_family,
    get_qk_norm_per_token,
    get_recompute_kind,
    get_saved_per_token,
    get_shape,
    get_stage_bytes,
    get_state_bytes,
    get_temporaries,
    get_wgrad_held_per_token,
)
from megatron_ext.planning.step_time import get_cached_order


@dataclasses.dataclass(frozen=True)
class PartCounts:
    """Parameters one TP rank holds, by part (module docstring)."""

    layer: int
    embedding: int
    head: int  # on a last stage that also holds the embedding (PP 1)
    head_alone: int  # on a last stage without the embedding (a tied output layer's copy included)


def _with(cfg: JobConfig, **parallel) -> JobConfig:
    layers = parallel.pop("num_layers")
    p = dataclasses.replace(
        cfg.parallel,
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None,
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        pipeline_schedule=None,
        **parallel,
    )
    return dataclasses.replace(cfg, parallel=p, model=dataclasses.replace(cfg.model, num_layers=layers))


_PARTS_CACHE: dict[tuple[str, int, int], PartCounts] = {}


def _count_parts(cfg: JobConfig, vocab_size: int, tp: int) -> PartCounts:
    def held(layers: int, pp: int) -> list[int]:
        return count_parameters(
            _with(cfg, num_layers=layers, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), vocab_size
        ).per_pp_rank()

    two, four, one = held(2, 2), held(4, 2), held(1, 1)
    layer = four[0] - two[0]
    embedding = two[0] - layer
    return PartCounts(layer, embedding, one[0] - embedding - layer, two[1] - layer)


def count_parts(cfg: JobConfig, vocab_size: int, tp: int) -> PartCounts:
    """Parameters per part on one of ``tp`` ranks (cached per model, vocabulary and TP)."""
    key = (repr(cfg.model), vocab_size, tp)
    if key not in _PARTS_CACHE:
        _PARTS_CACHE[key] = _count_parts(cfg, vocab_size, tp)
    return _PARTS_CACHE[key]


def get_stage_layers(cfg: JobConfig) -> list[int]:
    """Transformer layers of each stage, in the order a micro-batch's forward runs them (a stage
    holds the layers the loop placement gives it, whichever rank runs it: model/v_placement.py)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    v = get_virtual_pipeline_size(cfg) or 1
    counts = get_chunk_layer_counts(cfg)
    assert counts is not None, "an invalid layout (validation.validate first)"
    return [counts[(s % pp) * v + s // pp] for s in range(pp * v)]


def get_rank_parameters(parts: PartCounts, stage_layers: list[int], order: PipelineOrder | None) -> list[int]:
    """Parameters one rank of each pipeline rank holds."""
    pp = order.pp if order is not None else 1
    last = len(stage_layers) - 1
    out = [0] * pp
    for s, n in enumerate(stage_layers):
        r = order.rank_of(s) if order is not None else 0
        out[r] += n * parts.layer + (parts.embedding if s == 0 else 0)
        if s == last:
            out[r] += parts.head if last == 0 else parts.head_alone
    return out


def get_schedule(cfg: JobConfig) -> str:
    """The schedule a run of ``cfg`` uses (megatron-core's default without --pipeline-schedule)."""
    return get_schedule_name(cfg) or ("Interleaved1F1B" if get_virtual_pipeline_size(cfg) else "1F1B")


def get_memory_microbatches(pp: int, m: int) -> int:
    """Micro-batches of the order whose peak in flight the memory model reads: ``m``, at most max(4 p, 16)
    (a multiple of p). Past the warm-up the peak is flat in m (1F1B's p - r, interleaving's
    2(p - r - 1) + (v - 1) p + 1, the zero-bubble orders' 1F1B count; ``test_memory_model`` checks it
    against full orders), and the greedy zero-bubble orders at m = 1536 take minutes to generate."""
    return min(m, -(-max(4 * pp, 16) // pp) * pp)


def get_pipeline_order(cfg: JobConfig, world_size: int) -> PipelineOrder | None:
    pp = cfg.parallel.pipeline_model_parallel_size
    if pp == 1:
        return None
    vp = get_virtual_pipeline_size(cfg) or 1
    m = get_memory_microbatches(pp, get_num_microbatches(cfg, world_size))
    return get_cached_order(get_schedule(cfg), pp, vp, m)


def get_stage_memory(
    stage_layers: list[int],
    shape: Shape,
    saved: PerToken,
    plain: PerToken,
    plan: RecomputePlan,
    dtype_bytes: int,
    shared: float = 0.0,
) -> StageBytes:
    """A micro-batch's bytes per stage (``memory.StageBytes``): ``saved`` the calibrated figure of the
    job's recompute kind, ``plain`` that without recompute. Under full recompute a checkpointed group
    keeps its input (``saved.layer`` per layer), and its backward rebuilds ``k`` plain layers whose
    first input is that kept input (counted once), after freeing the head's saves on the last stage.
    ``shared``: per-token bytes the plain layers of a stage keep once (CP's gather index)."""
    per_token = dataclasses.replace(saved, layer=plain.layer)
    tokens, last = shape.tokens, len(stage_layers) - 1
    held = get_wgrad_held_per_token(shape, dtype_bytes)
    extra = []
    for s, n in enumerate(stage_layers):
        rebuilt = plan.split(n)[2]
        e = (rebuilt * plain.layer + shared - saved.layer) * tokens if rebuilt else 0.0
        extra.append(e - (saved.head * tokens if rebuilt and s == last else 0.0))
    return StageBytes(
        saved=get_stage_bytes(stage_layers, tokens, per_token, saved.layer, plan, shared),
        held_for_w=[(n * held.layer + (held.head if s == last else 0.0)) * tokens for s, n in enumerate(stage_layers)],
        backward_extra=extra,
    )


def get_layer_per_token(cfg: JobConfig, recompute: str, shape: Shape) -> PerToken:
    """The calibrated bytes per token of ``cfg``'s family and precision under ``recompute``, plus what
    --qk-layernorm's norms keep (``memory.get_qk_norm_per_token``: the calibration has no q/k norms)."""
    m, t = cfg.model, cfg.training
    precision = "bf16" if (t.bf16 or t.fp16) else "fp32"
    family = get_family(cfg)
    per_token = get_saved_per_token(family, precision, recompute, shape)
    if not m.qk_layernorm:
        return per_token
    rms, rotary = m.normalization == "RMSNorm", m.position_embedding_type == "rope"
    norms = get_qk_norm_per_token(shape, family, 2 if precision == "bf16" else 4, recompute, rms, rotary)
    return dataclasses.replace(per_token, layer=per_token.layer + norms)


def predict_stage_bytes(cfg: JobConfig, vocab_size: int, cuda: bool = True) -> StageBytes:
    """What one micro-batch costs each stage of ``cfg`` (``memory.StageBytes``): ``saved`` is what a
    ``SavedBytesMeter`` reads once its forward and loss ran. ``cuda``: the kernel the CP attention runs
    (CUDA's repacked keys, what the planner prices; else the CPU kernel's gathered buffer)."""
    m, t = cfg.model, cfg.training
    shape = get_shape(cfg, get_padded_vocab_size(vocab_size, cfg))
    kind = get_recompute_kind(cfg)
    dtype_bytes = 2 if (t.bf16 or t.fp16) else 4
    rotary = m.position_embedding_type == "rope"
    # under CP a layer whose core attention is not recomputed keeps the gathered K and V instead of
    # the local ones; a checkpointed one gathers them again in its recompute (full: the rebuilt
    # layers keep them)
    delta = get_cp_layer_delta_per_token(shape, dtype_bytes, rotary, cuda)
    none = get_layer_per_token(cfg, "none", shape)
    none = dataclasses.replace(none, layer=none.layer + delta)
    saved = none if kind == "none" else get_layer_per_token(cfg, kind, shape)
    plain = none if kind == "full" else saved
    plan = RecomputePlan(kind, m.recompute_method, m.recompute_num_layers or 1)
    # (selective recompute checkpoints the gather's reordering with the core attention)
    shared = get_cp_index_per_token(shape, cuda) if kind != "selective" else 0.0
    return get_stage_memory(get_stage_layers(cfg), shape, saved, plain, plan, dtype_bytes, shared)


def predict_memory(
    cfg: JobConfig, world_size: int, vocab_size: int, parts: PartCounts | None = None
) -> list[RankMemory]:
    """Each pipeline rank's predicted memory per GPU (``memory.py``); ``cfg`` must be valid."""
    p, t = cfg.parallel, cfg.training
    shape = get_shape(cfg, get_padded_vocab_size(vocab_size, cfg))
    dtype_bytes = 2 if (t.bf16 or t.fp16) else 4
    stages = predict_stage_bytes(cfg, vocab_size)
    stage_layers = get_stage_layers(cfg)
    order = get_pipeline_order(cfg, world_size)
    params = get_rank_parameters(
        parts or count_parts(cfg, vocab_size, p.tensor_model_parallel_size), stage_layers, order
    )
    shards = get_data_parallel_size(cfg, world_size) * p.context_parallel_size  # the distributed optimizer's
    transient = max([0.0, *stages.backward_extra])
    last_rank = order.rank_of(len(stage_layers) - 1) if order is not None else 0
    selective = get_recompute_kind(cfg) == "selective"
    out = []
    for r, n in enumerate(params):
        out.append(
            RankMemory(
                state=get_state_bytes(cfg, n, shards),
                activations=get_activation_peak(order, r, stages),
                recompute_transient=transient,
                temporaries=get_temporaries(
                    shape, dtype_bytes, r == last_rank, order is not None, kv_transient=selective
                ),
            )
        )
    return out
