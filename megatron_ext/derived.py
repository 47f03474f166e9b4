"""What the flags imply: pure functions of the config, and the ``ResolvedConfig`` computed from them once.

A run reads its derived values (data-parallel size, virtual stages, global batch, steps, padded
vocabulary, MLP width, dtype, recompute fields, sequence padding, ...) from one frozen
``ResolvedConfig``, built by ``resolve_config`` after ``validation.validate`` accepted the flags
(``run.build_training_run`` builds it, right after the process groups and the tokenizer). The
functions below are what it is computed from; validation calls them too, on flags not yet known
to be valid, so each of them tolerates a config that breaks a rule (returning None or a value that
the rule's check then reports) and none of them raises.

Invariant: this module imports nothing of ours but ``config.py``, the schedule names of
``pipeline/names.py`` and the batch schedules of ``data/batch_schedule.py`` (pure, importing
nothing; ``get_batch_schedule`` alone raises, on flags validation refuses); it creates nothing and reads no file, process
group or environment variable. The one value written back into the config is
``train_iters`` (``resolve_train_iters``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from megatron_ext.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_ext.data.batch_schedule import BatchSchedule, parse_rampup, parse_step_schedule
from megatron_ext.data.batch_schedule import get_train_iters as get_schedule_train_iters
from megatron_ext.pipeline.names import (
    MEGATRON_CORE_SCHEDULES,
    V_PLACEMENT_SCHEDULES,
    canonical_schedule_name,
    get_schedule_placement,
)

# The dense model's selective-recompute modules (megatron-core also has MoE/MLA ones).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


# ----------------------------------------------------------------------------- layout and batch


def get_replica_size(cfg: JobConfig) -> int:
    """Ranks of one data-parallel replica, which read the same samples: TP x CP x PP."""
    p = cfg.parallel
    return p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size


def get_data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """DP = world / (TP x CP x PP): replicas reading distinct samples (CP ranks share theirs)."""
    return world_size // max(get_replica_size(cfg), 1)


CP_COMM_TYPES = {"all_gather": "all_gather", "allgather": "all_gather"}


def get_cp_comm_types(p: ParallelConfig) -> list[str | None]:
    """--cp-comm-type values in our spelling (None: a value we do not implement), one per value given."""
    return [CP_COMM_TYPES.get(v) for v in p.cp_comm_type]


def get_document_pad_multiple(d: DataConfig, cp_size: int) -> int:
    """--document-pad-multiple g, or its default: 2 x CP with context parallelism, 1 without (a
    run without CP reads exactly the packs it read before the flag existed)."""
    if d.document_pad_multiple is not None:
        return d.document_pad_multiple
    return 2 * cp_size if cp_size > 1 else 1


def get_cp_length_multiple(cfg: JobConfig) -> int:
    """What every sequence length (--seq-length, --pad-to-multiple-of, a padded step) must be a
    multiple of under CP: 2c (each rank takes two chunks of every row or document), c x lcm(2, TP)
    with sequence parallelism (each CP shard then splits over TP); 1 without CP."""
    p = cfg.parallel
    c = p.context_parallel_size
    if c <= 1:
        return 1
    if p.sequence_parallel:
        return c * math.lcm(2, max(p.tensor_model_parallel_size, 1))
    return 2 * c


def get_schedule_name(cfg: JobConfig) -> str | None:
    """The canonical name of ``--pipeline-schedule`` (None: not given, or not a schedule)."""
    name = cfg.parallel.pipeline_schedule
    return canonical_schedule_name(name) if name else None


def uses_our_runtime(cfg: JobConfig) -> bool:
    """The schedule runs on ``pipeline/runtime.py`` rather than megatron-core's schedules."""
    name = get_schedule_name(cfg)
    return name is not None and name not in MEGATRON_CORE_SCHEDULES


def get_schedule_chunks(cfg: JobConfig) -> int | None:
    """Chunks per rank the schedule implies when no virtual-stage flag is given: 2 for the V
    schedules, else None (the flags decide)."""
    p = cfg.parallel
    given = p.num_virtual_stages_per_pipeline_rank or p.num_layers_per_virtual_pipeline_stage
    return 2 if get_schedule_name(cfg) in V_PLACEMENT_SCHEDULES and not given else None


def get_stage_placement(cfg: JobConfig) -> str:
    """ "v" when --pipeline-schedule names a V-shaped schedule (ZBV, DualPipeV), else "loop"
    (``pipeline/placement.py``)."""
    name = cfg.parallel.pipeline_schedule
    return get_schedule_placement(name) if name else "loop"


def get_virtual_pipeline_size(cfg: JobConfig) -> int | None:
    """Virtual stages per pipeline rank, or None without interleaving (one virtual stage per rank,
    e.g. a config's --num-layers-per-virtual-pipeline-stage 1 with 4 layers at PP 4: megatron-core
    would otherwise be told VPP = 1 and assert that every layer names its virtual stage)."""
    p, m = cfg.parallel, cfg.model
    vpp = get_schedule_chunks(cfg)  # the V schedules imply 2 chunks per rank
    # 0 means "not set", so that a flag can switch off a config file's interleaving
    if p.num_virtual_stages_per_pipeline_rank:
        vpp = p.num_virtual_stages_per_pipeline_rank
    elif p.num_layers_per_virtual_pipeline_stage:
        vpp = m.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)
    return vpp if vpp is not None and vpp > 1 else None


def uses_uneven_split(p: ParallelConfig) -> bool:
    """The layers are split over pipeline stages by the first/last-stage or the accounting flags."""
    return (
        p.decoder_first_pipeline_num_layers is not None
        or p.decoder_last_pipeline_num_layers is not None
        or p.account_for_embedding_in_pipeline_split
        or p.account_for_loss_in_pipeline_split
        or bool(p.pipeline_model_parallel_layout)
    )


def get_chunk_layer_counts(cfg: JobConfig) -> list[int] | None:
    """Transformer layers of each model chunk, (pipeline rank, virtual stage) in order, as
    megatron-core's ``get_num_layers_to_build`` splits them (even, first/last or accounted
    splits); None when the layout flags do not split the layers (reported by validation)."""
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, v = p.pipeline_model_parallel_size, get_virtual_pipeline_size(cfg) or 1
    if pp <= 0 or layers <= 0:
        return None
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    emb, loss = bool(p.account_for_embedding_in_pipeline_split), bool(p.account_for_loss_in_pipeline_split)
    if first is not None or last is not None:
        middle_layers = layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if middle_layers < 0 or (middle_stages > 0 and middle_layers % middle_stages):
            return None
        per_stage = [middle_layers // middle_stages if middle_stages > 0 else 0] * pp
        if first is not None:
            per_stage[0] = first
        if last is not None:
            per_stage[-1] = last
    else:
        units = layers + emb + loss
        if units % pp:
            return None
        per_stage = [units // pp] * pp
    if any(n % v for n in per_stage):
        return None
    counts = [n // v for n in per_stage for _ in range(v)]
    counts[0] -= emb  # the embedding and the loss counted as layers take a layer's place
    counts[-1] -= loss
    return counts if min(counts) >= 0 else None


def get_global_batch_size(cfg: JobConfig, world_size: int) -> int:
    """The settled global batch: --global-batch-size, the last entry of --step-batch-size-schedule,
    or micro-batch x DP."""
    t = cfg.training
    if t.step_batch_size_schedule is not None and not t.global_batch_size:
        try:
            return parse_step_schedule(t.step_batch_size_schedule, max(cfg.model.seq_length, 1))[-1][1]
        except ValueError:  # reported by validation
            pass
    return t.global_batch_size or t.micro_batch_size * get_data_parallel_size(cfg, world_size)


def get_running_multiple(cfg: JobConfig, world_size: int) -> int:
    """What --decrease-batch-size-if-needed rounds each step's batch down to a multiple of:
    micro-batch x DP (1 without the flag: no rounding)."""
    if not cfg.training.decrease_batch_size_if_needed:
        return 1
    return max(cfg.training.micro_batch_size * get_data_parallel_size(cfg, world_size), 1)


def get_running_global_batch_size(cfg: JobConfig, world_size: int) -> int:
    """The settled global batch a step runs: ``get_global_batch_size``, rounded down to a multiple of
    micro-batch x DP under --decrease-batch-size-if-needed (megatron-core's running global batch)."""
    multiple = get_running_multiple(cfg, world_size)
    return get_global_batch_size(cfg, world_size) // multiple * multiple


def get_batch_schedule(cfg: JobConfig, world_size: int) -> BatchSchedule:
    """Each step's global batch (data/batch_schedule.py) of validated flags."""
    t, gbs = cfg.training, get_global_batch_size(cfg, world_size)
    multiple = get_running_multiple(cfg, world_size)
    if t.rampup_batch_size:
        return BatchSchedule(gbs, rampup=parse_rampup(t.rampup_batch_size, gbs), running_multiple=multiple)
    if t.step_batch_size_schedule is not None:
        return BatchSchedule(gbs, steps=parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length))
    return BatchSchedule(gbs, running_multiple=multiple)


def get_num_microbatches(cfg: JobConfig, world_size: int) -> int:
    """Micro-batches per step on each DP rank (of the running settled batch)."""
    dp = get_data_parallel_size(cfg, world_size)
    return get_running_global_batch_size(cfg, world_size) // (cfg.training.micro_batch_size * dp)


def describe_batch_decrease(cfg: JobConfig, world_size: int) -> str | None:
    """The start-up notice of --decrease-batch-size-if-needed when it rounds the settled batch down
    (as megatron-core's calculator logs it); None when it does not."""
    gbs, running = get_global_batch_size(cfg, world_size), get_running_global_batch_size(cfg, world_size)
    if running == gbs:
        return None
    b, dp = cfg.training.micro_batch_size, get_data_parallel_size(cfg, world_size)
    return (
        f"> decreasing batch size from {gbs} to {running} to keep divisibility by --micro-batch-size {b} x "
        f"data-parallel size {dp} = {b * dp} (--decrease-batch-size-if-needed): {running // (b * dp)} "
        f"micro-batches per step on each data-parallel rank; consumed samples count {running} per step"
    )


# ----------------------------------------------------------------------------- run length and schedule


def get_train_iters(cfg: JobConfig, world_size: int) -> int:
    """Training steps: --train-iters, or --train-samples // global batch (as Megatron-LM; counted
    over the steps of a ramp-up or a step schedule: batch_schedule.get_train_iters)."""
    t = cfg.training
    if t.train_samples is not None:
        return get_schedule_train_iters(get_batch_schedule(cfg, world_size), t.train_samples)
    return t.train_iters


def resolve_train_iters(cfg: JobConfig, world_size: int) -> None:
    """The one derived value written back into the config: with --train-samples, ``train_iters``
    becomes the step count it implies, so that the loop, the logs, the scheduler, the data builder
    and the checkpoint's recorded flags count steps alike (the loop reads ``cfg.training.train_iters``
    at every step, so a test may shorten a built run by setting it). Called once by
    ``run.build_training_run``, before ``resolve_config``."""
    cfg.training.train_iters = get_train_iters(cfg, world_size)


@dataclasses.dataclass(frozen=True)
class ScheduleSteps:
    """megatron-core's OptimizerParamScheduler lengths, in samples."""

    lr_warmup_steps: float  # not rounded with --lr-warmup-fraction, as in Megatron-LM
    lr_decay_steps: int
    wd_incr_steps: int
    wsd_decay_steps: int | None


def get_schedule_steps(cfg: JobConfig, global_batch_size: int, train_iters: int) -> ScheduleSteps:
    """The schedule in samples, as Megatron-LM's ``get_optimizer_param_scheduler`` computes it:
    from iteration flags times the global batch, or from the sample flags with --train-samples; a
    warm-up fraction is of the decay length, not rounded (Megatron-LM passes
    ``lr_warmup_fraction * lr_decay_steps`` to the scheduler as it is)."""
    t = cfg.training
    if t.train_samples is None:
        decay = (t.lr_decay_iters or train_iters) * global_batch_size
        wd_incr = train_iters * global_batch_size
        wsd = t.lr_wsd_decay_iters * global_batch_size if t.lr_wsd_decay_iters is not None else None
        warmup = t.lr_warmup_iters * global_batch_size
    else:
        decay = t.lr_decay_samples or t.train_samples
        wd_incr = t.train_samples
        wsd = t.lr_wsd_decay_samples
        warmup = t.lr_warmup_samples
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return ScheduleSteps(warmup, decay, wd_incr, wsd if t.lr_decay_style == "WSD" else None)


# ----------------------------------------------------------------------------- model shape and precision


def get_padded_vocab_size(vocab_size: int, cfg: JobConfig) -> int:
    """The vocabulary rounded up to --make-vocab-size-divisible-by, whatever the layout.

    Megatron-LM multiplies the multiple by TP, so a TP2 run would pad 513 ids to 768 and one process
    to 640: different models (the padded rows take part in the softmax). Ours does not; validation
    requires TP to divide the multiple, so the padded vocabulary always splits over TP."""
    multiple = cfg.model.make_vocab_size_divisible_by
    return int(math.ceil(vocab_size / multiple) * multiple)


def resolve_ffn_hidden_size(ffn_hidden_size: int | None, hidden_size: int, swiglu: bool) -> int:
    """--ffn-hidden-size, or Megatron-LM's default (``validate_args``): 4h, or with --swiglu 2/3 of
    4h rounded DOWN to a multiple of 64 (h 4096 -> 10880), so that a Megatron-LM script without
    --ffn-hidden-size builds the same model here. (Of raw values: checkpoints compare saved flags.)"""
    if ffn_hidden_size:
        return ffn_hidden_size
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def get_ffn_hidden_size(m: ModelConfig) -> int:
    return resolve_ffn_hidden_size(m.ffn_hidden_size, m.hidden_size, m.swiglu)


def get_num_query_groups(m: ModelConfig) -> int:
    """Key/value heads: --num-query-groups under --group-query-attention, else one per head."""
    return m.num_query_groups if m.group_query_attention and m.num_query_groups else m.num_attention_heads


def get_kv_channels(m: ModelConfig) -> int:
    """Each attention head's dimension: --kv-channels, else --hidden-size / --num-attention-heads
    (megatron-core's default). Queries are heads x this wide, keys and values groups x this."""
    return m.kv_channels or m.hidden_size // max(m.num_attention_heads, 1)


def precision_name(bf16: bool, fp16: bool) -> str:
    """The training precision of the --bf16/--fp16 flags: bf16, fp16 or fp32."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def get_params_dtype(t: TrainingConfig) -> torch.dtype:
    """The dtype of weights and activations: bf16, fp16 or fp32."""
    if t.bf16:
        return torch.bfloat16
    return torch.float16 if t.fp16 else torch.float32


def get_recompute(cfg: JobConfig) -> dict[str, Any]:
    """megatron-core's TransformerConfig recompute fields for this job (--recompute-activations is
    selective recompute of core attention, as in Megatron-LM)."""
    m = cfg.model
    granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
    if granularity is None:
        return {}
    out: dict[str, Any] = {"recompute_granularity": granularity}
    if granularity == "full":
        out.update(recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers)
    else:
        out["recompute_modules"] = list(m.recompute_modules) or ["core_attn"]
    return out


# ----------------------------------------------------------------------------- samples and padding


def uses_variable_lengths(d: DataConfig) -> bool:
    """Samples of their own lengths: packed documents or one document per row."""
    return d.packed_sequences or d.one_document_per_row


def uses_document_boundaries(d: DataConfig) -> bool:
    """Micro-batches carry THD document boundaries: packed documents, or GPTDataset windows split
    at their EOD tokens (--reset-attention-mask / --reset-position-ids)."""
    return d.packed_sequences or ((d.reset_attention_mask or d.reset_position_ids) and not d.one_document_per_row)


def get_max_microbatch_length(cfg: JobConfig) -> int:
    """A micro-batch's longest possible length: --seq-length, or, with THD boundaries, its b
    samples joined."""
    packs = cfg.training.micro_batch_size if uses_document_boundaries(cfg.data) else 1
    return cfg.model.seq_length * packs


def get_sequence_padding(d: DataConfig) -> str:
    """--sequence-padding, or its default: negotiated with variable-length samples, else static."""
    if d.sequence_padding:
        return d.sequence_padding
    return "negotiated" if uses_variable_lengths(d) else "static"


# ----------------------------------------------------------------------------- the resolved view


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """What a validated JobConfig means for a run of ``world_size`` ranks and a tokenizer of
    ``vocab_size`` ids, computed once by ``resolve_config``. Builders read these values; the flags
    they came from stay in the JobConfig (as the user gave them, but for ``train_iters``)."""

    world_size: int
    data_parallel_size: int
    virtual_pipeline_size: int | None  # None without interleaving
    pipeline_schedule: str | None  # --pipeline-schedule's canonical name (None: megatron-core's choice)
    uses_our_runtime: bool  # the schedule runs on pipeline/runtime.py, not megatron-core's
    stage_placement: str  # "loop" or "v" (pipeline/placement.py)
    global_batch_size: int  # the settled one a step runs (after a ramp-up, rounded down by
    # --decrease-batch-size-if-needed; evaluation's); the flags' is batch_schedule.global_batch_size
    num_microbatches: int  # per step on each DP rank, of the settled global batch
    batch_schedule: BatchSchedule  # each step's global batch, from the samples consumed before it
    train_iters: int
    padded_vocab_size: int
    ffn_hidden_size: int
    num_query_groups: int
    precision: str  # bf16, fp16 or fp32
    params_dtype: torch.dtype
    recompute: dict[str, Any]  # TransformerConfig's recompute fields (not to be changed: shared)
    sequence_padding: str  # static, negotiated or variable
    max_microbatch_length: int  # --seq-length, or b x --seq-length with document boundaries
    uses_document_boundaries: bool
    uses_variable_lengths: bool
    cuda_graph_max_documents: int | None  # packed boundaries' fixed count under CUDA graphs (else None)
    context_parallel_size: int = 1
    document_pad_multiple: int = 1  # every packed document's length is a multiple of it (g)


def get_cuda_graph_max_documents(cfg: JobConfig) -> int | None:
    """Documents every packed micro-batch's boundaries are padded to under --cuda-graph-impl local
    (captured layers replay one shape): --cuda-graph-max-documents, or a power of two >= the micro-
    batch's length / 128 (documents of 128 tokens on average), at least 16. None otherwise."""
    if cfg.training.cuda_graph_impl != "local" or not uses_document_boundaries(cfg.data):
        return None
    if cfg.training.cuda_graph_max_documents is not None:
        return cfg.training.cuda_graph_max_documents
    return max(16, 1 << max(0, get_max_microbatch_length(cfg) // 128 - 1).bit_length())


def resolve_config(cfg: JobConfig, world_size: int, vocab_size: int) -> ResolvedConfig:
    """The derived values of ``cfg`` (validated for ``world_size``) with a tokenizer of
    ``vocab_size`` ids. Pure; call it after ``resolve_train_iters``."""
    m, t, d = cfg.model, cfg.training, cfg.data
    return ResolvedConfig(
        world_size=world_size,
        data_parallel_size=get_data_parallel_size(cfg, world_size),
        virtual_pipeline_size=get_virtual_pipeline_size(cfg),
        pipeline_schedule=get_schedule_name(cfg),
        uses_our_runtime=uses_our_runtime(cfg),
        stage_placement=get_stage_placement(cfg),
        global_batch_size=get_running_global_batch_size(cfg, world_size),
        num_microbatches=get_num_microbatches(cfg, world_size),
        batch_schedule=get_batch_schedule(cfg, world_size),
        train_iters=get_train_iters(cfg, world_size),
        padded_vocab_size=get_padded_vocab_size(vocab_size, cfg),
        ffn_hidden_size=get_ffn_hidden_size(m),
        num_query_groups=get_num_query_groups(m),
        precision=precision_name(t.bf16, t.fp16),
        params_dtype=get_params_dtype(t),
        recompute=get_recompute(cfg),
        sequence_padding=get_sequence_padding(d),
        max_microbatch_length=get_max_microbatch_length(cfg),
        uses_document_boundaries=uses_document_boundaries(d),
        uses_variable_lengths=uses_variable_lengths(d),
        cuda_graph_max_documents=get_cuda_graph_max_documents(cfg),
        context_parallel_size=cfg.parallel.context_parallel_size,
        document_pad_multiple=get_document_pad_multiple(d, cfg.parallel.context_parallel_size),
    )
