"""The rules a parallel layout, a batch and a model shape must satisfy, with our flag names.

megatron-core checks most of these itself, late (in ``TransformerConfig``, mid-schedule, or in a
layer's constructor) and with messages that name no flag; here each rule is one problem string
naming the flags, the values and the fix. Each check is pure, returns every problem it finds and
tolerates the flags breaking other rules (``validation.validate`` runs them all and reports
everything at once).
"""

from __future__ import annotations

import math

from megatron_ext.config import JobConfig, ModelConfig, TrainingConfig
from megatron_ext.data.batch_schedule import BatchSchedule
from megatron_ext.data.batch_schedule import get_train_iters as get_schedule_train_iters
from megatron_ext.derived import (
    RECOMPUTE_MODULES,
    get_batch_schedule,
    get_chunk_layer_counts,
    get_data_parallel_size,
    get_global_batch_size,
    get_kv_channels,
    get_num_microbatches,
    get_running_global_batch_size,
    get_stage_placement,
    get_virtual_pipeline_size,
    resolve_ffn_hidden_size,
    uses_our_runtime,
    uses_uneven_split,
)
from megatron_ext.pipeline.validate import check_pipeline_schedule, check_schedule_name


def check_layout(cfg: JobConfig, world_size: int) -> list[str]:
    p, m = cfg.parallel, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if tp <= 0 or pp <= 0 or m.num_layers <= 0 or p.context_parallel_size <= 0:
        return []
    out = []
    cp = p.context_parallel_size
    if cp > 1 and world_size % (tp * cp * pp):
        out.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp} = {tp * cp * pp}: launch a "
            f"multiple of {tp * cp * pp} processes or change TP/CP/PP"
        )
    elif world_size % (tp * pp):
        out.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}: launch a multiple of {tp * pp} "
            f"processes or change TP/PP"
        )
    lps = p.num_layers_per_virtual_pipeline_stage or None  # 0: not set
    vps = p.num_virtual_stages_per_pipeline_rank or None
    if uses_uneven_split(cfg.parallel):
        out += check_uneven_split(cfg, pp, lps, vps)
    elif lps is not None and vps is not None and lps * vps * pp != m.num_layers:
        out.append(
            f"--num-layers-per-virtual-pipeline-stage {lps} and --num-virtual-stages-per-pipeline-rank "
            f"{vps} disagree: with --pipeline-model-parallel-size {pp} they give {lps * vps * pp} layers, "
            f"--num-layers is {m.num_layers}; give only one of the two"
        )
    elif lps is not None and (lps <= 0 or m.num_layers % (pp * lps)):
        out.append(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-layers-per-virtual-pipeline-stage {lps} = {pp * lps}: choose a layers-per-stage "
            f"that divides {m.num_layers // pp if m.num_layers % pp == 0 else m.num_layers} "
        )
    elif vps is not None and (vps <= 0 or m.num_layers % (pp * vps)):
        out.append(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-virtual-stages-per-pipeline-rank {vps} = {pp * vps}: choose a number of virtual stages "
            f"that divides {m.num_layers // pp if m.num_layers % pp == 0 else m.num_layers}"
        )
    elif m.num_layers % pp:
        out.append(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}: "
            f"use a multiple of {pp} layers"
        )
    vpp = get_virtual_pipeline_size(cfg) if not out else None
    if vpp is not None and vpp > 1 and pp == 1:
        out.append(
            f"interleaved schedule ({vpp} virtual stages per pipeline rank) needs "
            f"--pipeline-model-parallel-size > 1, got 1: drop --num-layers-per-virtual-pipeline-stage / "
            f"--num-virtual-stages-per-pipeline-rank"
        )
    return out


def check_v_split(cfg: JobConfig) -> list[str]:
    """Uneven splits under the V placement, where stage s holds the layers the loop placement gives
    it (model/v_placement.py). --account-for-embedding/loss-in-pipeline-split take one layer from
    stage 0 and from stage 2p-1: under V both are on rank 0, which holds the embedding and the loss,
    as intended. --decoder-first/last-pipeline-num-layers are megatron-core's layers of the first and
    the last pipeline *rank*, shared by its chunks: under V those are stages 0 and p (ranks 0 and p-1)
    and stages p-1 and 2p-1 (ranks p-1 and 0), not what the flags promise; refused."""
    p = cfg.parallel
    if get_stage_placement(cfg) != "v" or (
        p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None
    ):
        return []
    return [
        f"--pipeline-schedule {p.pipeline_schedule} places the first and the last pipeline stage on rank 0; "
        f"--decoder-first/last-pipeline-num-layers give layers to the first and the last pipeline rank of "
        f"megatron-core's loop placement and are not supported with it: use "
        f"--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split (which lighten "
        f"rank 0's two stages under V), an even split, or ZBH1 / InterleavedZeroBubble"
    ]


def check_uneven_split(cfg: JobConfig, pp: int, lps: int | None, vps: int | None) -> list[str]:
    """megatron-core's rules for uneven pipeline splits (it checks them in TransformerConfig, with
    messages that name no flag), with Megatron-LM's: VPP only through the number of virtual stages."""
    p, layers = cfg.parallel, cfg.model.num_layers
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    accounts = p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split
    out = []
    if p.pipeline_model_parallel_layout:
        out.append(
            "--pipeline-model-parallel-layout is not supported: use --decoder-first/last-pipeline-num-layers "
            "or --account-for-embedding/loss-in-pipeline-split"
        )
    if pp < 2:
        return out + ["uneven pipeline splits need --pipeline-model-parallel-size > 1"]
    if lps is not None:
        return out + [
            "uneven pipeline splits take virtual stages as --num-virtual-stages-per-pipeline-rank, not "
            "--num-layers-per-virtual-pipeline-stage (as in Megatron-LM)"
        ]
    v = vps or get_virtual_pipeline_size(cfg) or 1  # (the V schedules imply 2 chunks per rank)
    if (first is not None or last is not None) and accounts:
        return out + [
            "--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split "
            "are exclusive: give one way of splitting"
        ]
    if accounts:
        units = layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
        if units % (pp * v):
            out.append(
                f"--num-layers {layers} plus the embedding/loss counted as layers = {units} is not divisible "
                f"by --pipeline-model-parallel-size {pp} x virtual stages {v} = {pp * v}"
            )
        return out
    middle_layers, middle_stages = layers, pp
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is None:
            continue
        if n <= 0 or n % v:
            out.append(f"{flag} {n} must be a positive multiple of the {v} virtual stages per pipeline rank")
        middle_layers, middle_stages = middle_layers - n, middle_stages - 1
    if v > 1 and middle_stages == 0:
        out.append(
            "with virtual stages, --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers "
            "need a middle pipeline stage (megatron-core 0.16.1 divides by the middle stages): raise "
            "--pipeline-model-parallel-size or give one of the two"
        )
    elif (
        middle_layers < 0
        or bool(middle_layers) != bool(middle_stages)
        or (middle_stages and middle_layers % (middle_stages * v))
    ):
        out.append(
            f"--num-layers {layers} minus the first/last stages' layers leaves {middle_layers} for "
            f"{middle_stages} middle stages x {v} virtual stages: they must split evenly (and exist "
            f"together)"
        )
    return out


def check_batch(cfg: JobConfig, world_size: int) -> list[str]:
    p, t = cfg.parallel, cfg.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if (
        tp <= 0
        or pp <= 0
        or cp <= 0
        or world_size % (tp * cp * pp)
        or t.micro_batch_size <= 0
        or (t.global_batch_size is not None and t.global_batch_size <= 0)
    ):
        return []  # reported by _check_positive / check_layout
    dp = get_data_parallel_size(cfg, world_size)
    found = check_batch_divisibility(t, get_global_batch_size(cfg, world_size), dp)
    if found:
        return found
    gbs = get_running_global_batch_size(cfg, world_size)
    out = []
    scheduled = t.rampup_batch_size or t.step_batch_size_schedule is not None  # check_batch_schedule's
    if t.train_samples is not None and 0 < t.train_samples < gbs and not scheduled:
        out.append(f"--train-samples {t.train_samples} is less than one global batch ({gbs} samples)")
    vpp = get_virtual_pipeline_size(cfg)
    if vpp is not None and vpp > 1 and pp > 1 and not uses_our_runtime(cfg):  # megatron-core's own rule
        out += check_interleaved_microbatches(
            get_num_microbatches(cfg, world_size),
            pp,
            p.microbatch_group_size_per_vp_stage or pp,
            gbs,
            t.micro_batch_size,
            dp,
        )
    return out


DECREASE_FLAG = "--decrease-batch-size-if-needed"


def check_batch_divisibility(t: TrainingConfig, gbs: int, dp: int) -> list[str]:
    """megatron-core's rule: the global batch ``gbs`` divides by micro-batch x ``dp``; with
    --decrease-batch-size-if-needed (rounded down to a multiple of it) at least one micro-batch per
    rank; not with --step-batch-size-schedule (Megatron-LM main refuses the two together)."""
    b = t.micro_batch_size
    if t.decrease_batch_size_if_needed and t.step_batch_size_schedule is not None:
        return [
            f"{DECREASE_FLAG} and --step-batch-size-schedule are exclusive (as in Megatron-LM main, whose step "
            f"schedules do not round batches down): drop {DECREASE_FLAG} and give batches that divide by "
            f"--micro-batch-size {b} x data-parallel size {dp} = {b * dp}"
        ]
    if t.decrease_batch_size_if_needed and gbs < b * dp:
        return [
            f"--global-batch-size {gbs} is less than --micro-batch-size {b} x data-parallel size {dp} = {b * dp}: "
            f"{DECREASE_FLAG} cannot round it down to a whole micro-batch per data-parallel rank; use at least "
            f"{b * dp}, a smaller --micro-batch-size or fewer data-parallel ranks"
        ]
    if gbs % (b * dp) and not t.decrease_batch_size_if_needed:
        fix = f" or add {DECREASE_FLAG} to run {gbs // (b * dp) * b * dp} per step" if gbs > b * dp else ""
        return [
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {b} x data-parallel size {dp} = "
            f"{b * dp}: use a multiple of {b * dp}{fix}"
        ]
    return []


def check_batch_schedule(
    cfg: JobConfig, world_size: int, resuming: bool = False, resumed_at: tuple[int, int] | None = None
) -> list[str]:
    """--rampup-batch-size and --step-batch-size-schedule (``data/batch_schedule.py``): their grammar,
    Megatron-LM's exclusions, and every global batch the run's steps take from step 0 against the
    batch rules (megatron-core checks each only when its step comes). ``resuming`` (--load holds a
    checkpoint to resume): only the steps left are checked, from ``resumed_at`` (the checkpoint's
    iteration and consumed samples, read by ``validation``; None: unreadable, left to the loop), since
    the ramp batches the checkpoint trained past do not matter on this layout; the loop checks them
    again from the loaded state before its first step (``check_steps_left``)."""
    t = cfg.training
    ramp, steps = t.rampup_batch_size, t.step_batch_size_schedule
    if not ramp and steps is None:
        return []
    rflag, sflag = _schedule_flags(t)
    if ramp and steps is not None:
        return [f"{rflag} and {sflag} are exclusive (Megatron-LM main replaced the first by the second): give one"]
    flag, out = (rflag, []) if ramp else (sflag, [])
    if steps is not None and t.global_batch_size:
        out.append(
            f"{sflag} and --global-batch-size {t.global_batch_size} are exclusive (as in Megatron-LM main): the "
            f"schedule's last entry is the global batch; drop --global-batch-size"
        )
    if t.train_samples is None:
        out.append(
            f"{flag} needs sample-based training (as Megatron-LM: the run and its LR schedule counted in "
            f"samples): replace --train-iters {t.train_iters} with --train-samples N (and -iters schedule flags with -samples ones)"
        )
    gbs = get_global_batch_size(cfg, world_size)
    try:  # (a --seq-length or batch that is not positive is _check_positive's)
        schedule = get_batch_schedule(cfg, world_size) if gbs > 0 and cfg.model.seq_length > 0 else None
    except ValueError as exc:
        return out + [f"{flag}: {exc}"]
    if out or schedule is None or t.micro_batch_size <= 0 or check_layout(cfg, world_size) or not t.train_samples:
        return out
    if not resuming:
        return check_steps_left(cfg, world_size, schedule, 0, get_schedule_train_iters(schedule, t.train_samples))
    if resumed_at is None:  # the batches of the steps it trained past may not divide on this layout: they do not matter
        return out
    iteration, consumed = resumed_at
    left = (
        get_schedule_train_iters(schedule, t.train_samples, consumed)  # as training/loop.maybe_recount_train_iters
        if schedule.decreases
        else get_schedule_train_iters(schedule, t.train_samples) - iteration
    )
    return check_steps_left(cfg, world_size, schedule, consumed, left)


def check_steps_left(
    cfg: JobConfig, world_size: int, schedule: BatchSchedule, first_sample: int, iterations: int
) -> list[str]:
    """The batch rules (``check_step_batches``) broken by the global batches of the ``iterations``
    steps from the one at ``first_sample`` (0: a new run's; a resumed run's consumed samples), as one
    problem naming the schedule's flag; the settled batch is ``check_batch``'s. Pure: the loop calls
    it on a resume, once the checkpoint's consumed samples are known."""
    if schedule.decreases and schedule.get_global_batch_size(first_sample) == 0:
        iterations = max(iterations, 1)  # rounded to no micro-batch: counted as no step left, yet refused
    if schedule.is_constant or iterations <= 0:
        return []
    sizes = schedule.get_batch_sizes(iterations, first_sample)
    found = check_step_batches(cfg, world_size, [g for g in sizes if g != schedule.global_batch_size])
    if not found:
        return []
    rflag, sflag = _schedule_flags(cfg.training)
    flag = rflag if cfg.training.rampup_batch_size else sflag
    if first_sample:
        return [
            f"{flag}, resumed after {first_sample} consumed samples: {found[0]}, or resume on a data-parallel "
            f"size that divides the batches of the steps left"
        ]
    return [f"{flag}: {found[0]}"]


def _schedule_flags(t: TrainingConfig) -> tuple[str, str]:
    """--rampup-batch-size and --step-batch-size-schedule as given, for messages."""
    return (
        f"--rampup-batch-size {' '.join(t.rampup_batch_size)}",
        f'--step-batch-size-schedule "{t.step_batch_size_schedule}"',
    )


def check_step_batches(cfg: JobConfig, world_size: int, batches: list[int]) -> list[str]:
    """The rules the steps' global ``batches`` (of a batch schedule) break: megatron-core's
    divisibility, then the interleaved schedules' micro-batch count."""
    p, b = cfg.parallel, cfg.training.micro_batch_size
    pp = p.pipeline_model_parallel_size
    dp = world_size // (p.tensor_model_parallel_size * pp)
    if cfg.training.decrease_batch_size_if_needed:  # each rounded down to a multiple of b x dp
        small = [g for g in batches if g < b * dp]
        if small:
            return [
                f"the steps' global batch {small[0]} is less than --micro-batch-size {b} x data-parallel size "
                f"{dp} = {b * dp}, which {DECREASE_FLAG} cannot round down to: start the schedule at {b * dp} "
                f"or more"
            ]
        batches = [g // (b * dp) * b * dp for g in batches]
    bad = [g for g in batches if g % (b * dp)]
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        return [
            f"the steps' global batch{'es' if len(bad) > 1 else ''} {shown} not divisible by --micro-batch-size {b} "
            f"x data-parallel size {dp} = {b * dp} (megatron-core's rule for every step): make every batch of "
            f"the schedule a multiple of {b * dp}"
        ]
    vpp, out = get_virtual_pipeline_size(cfg) or 1, []
    for g in batches:
        m = g // (b * dp)
        if vpp > 1 and pp > 1 and not uses_our_runtime(cfg):
            out += check_interleaved_microbatches(m, pp, p.microbatch_group_size_per_vp_stage or pp, g, b, dp)
        elif vpp > 1 and m < pp:  # our runtime's interleaved schedules (pipeline/validate.py)
            out.append(
                f"a step's global batch {g} gives {m} micro-batches per step, fewer than the {pp} pipeline "
                f"stages the interleaved schedule needs to fill: start the schedule at {pp * b * dp} or more"
            )
    return out


def check_pipeline_schedule_layout(cfg: JobConfig, world_size: int) -> list[str]:
    """--pipeline-schedule with the layout (``pipeline/validate.py``), once the layout itself is valid."""
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if tp <= 0 or pp <= 0 or cp <= 0 or world_size % (tp * cp * pp) or check_layout(cfg, world_size):
        return check_schedule_name(cfg)  # the rest once the layout is valid
    m = get_num_microbatches(cfg, world_size) if cfg.training.micro_batch_size > 0 else None
    return check_pipeline_schedule(cfg, get_virtual_pipeline_size(cfg), m)


def check_interleaved_microbatches(m: int, pp: int, n: int, gbs: int, mbs: int, dp: int) -> list[str]:
    """megatron-core's interleaved-schedule rule, which it checks only mid-schedule."""
    what = (
        f"{m} micro-batch{'' if m == 1 else 'es'} per step (--global-batch-size {gbs} / (--micro-batch-size {mbs} x "
        f"data-parallel {dp}))"
    )
    if not pp <= n <= m:
        return [
            f"interleaved schedule: {what} must be at least --pipeline-model-parallel-size {pp} "
            f"(and at least --microbatch-group-size-per-vp-stage {n}): raise --global-batch-size to "
            f"{max(pp, n) * mbs * dp} or more"
        ]
    if 0 < m % n < pp:
        return [
            f"interleaved schedule: {what} leaves a last group of {m % n} < PP {pp} when grouped by "
            f"{n}: use a multiple of {n} micro-batches (--global-batch-size a multiple of {n * mbs * dp})"
        ]
    return []


def check_model(cfg: JobConfig, world_size: int) -> list[str]:
    """The model's shape flags against TP, then its biases, recompute and dropout."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    out = check_head_split(m, tp) + check_ffn_split(m, tp) + check_position_embeddings(m)
    if m.add_qkv_bias and not m.disable_bias_linear:
        out.append(
            "--add-qkv-bias adds biases to the query/key/value projection only: it needs "
            "--disable-bias-linear (without it every linear layer has biases already)"
        )
    out += check_recompute(cfg)
    for name in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, name)
        if not 0.0 <= v < 1.0:
            out.append(f"--{name.replace('_', '-')} must be in [0, 1), got {v}")
    return out


def check_head_split(m: ModelConfig, tp: int) -> list[str]:
    """The hidden size over the heads, and the vocabulary, heads and query groups over TP."""
    out = []
    if m.kv_channels is not None and m.kv_channels <= 0:
        out.append(f"--kv-channels must be > 0 (each attention head's dimension), got {m.kv_channels}")
    if m.kv_channels is None and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        out.append(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}: "
            f"give each head's dimension with --kv-channels"
        )
    if tp > 0 and m.make_vocab_size_divisible_by > 0 and m.make_vocab_size_divisible_by % tp:
        out.append(
            f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} is not divisible by "
            f"--tensor-model-parallel-size {tp}: the padded vocabulary is split over TP; use a multiple "
            f"of {tp} (ours pads the same at every TP size, unlike Megatron-LM's divisible-by x TP)"
        )
    if tp > 0 and m.num_attention_heads % tp:
        out.append(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}: use a TP size that divides the heads"
        )
    if m.group_query_attention:
        g = m.num_query_groups
        if not g or g <= 0:
            out.append("--group-query-attention needs --num-query-groups N (N > 0)")
        else:
            if m.num_attention_heads % g:
                out.append(
                    f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {g}: "
                    f"use a number of key/value groups that divides the heads"
                )
            if tp > 0 and g % tp:
                out.append(
                    f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size {tp}: each TP rank "
                    f"holds whole key/value groups; use a TP size that divides {g}"
                )
    return out


def check_ffn_split(m: ModelConfig, tp: int) -> list[str]:
    """--ffn-hidden-size (given, or the --swiglu default) over TP."""
    out = []
    ffn = m.ffn_hidden_size
    if ffn is not None and tp > 0 and ffn % tp:
        out.append(
            f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}: use a multiple of {tp}"
        )
    if ffn is None and m.swiglu and m.hidden_size > 0:
        default = resolve_ffn_hidden_size(None, m.hidden_size, True)
        what = (
            f"--swiglu with --hidden-size {m.hidden_size}: the default --ffn-hidden-size (2/3 of 4 x hidden, "
            f"rounded down to a multiple of 64, as Megatron-LM) is {default}"
        )
        if default == 0:
            out.append(f"{what}; give --ffn-hidden-size")
        elif tp > 0 and default % tp:
            # megatron-core: an AssertionError traceback from ColumnParallelLinear while building the MLP
            out.append(
                f"{what}, not divisible by --tensor-model-parallel-size {tp}: give --ffn-hidden-size, a "
                f"multiple of {tp}"
            )
    return out


def check_position_embeddings(m: ModelConfig) -> list[str]:
    """--max-position-embeddings against --seq-length, RoPE's rotated fraction and scaling."""
    out = []
    if m.position_embedding_type == "learned_absolute":
        max_pos = m.max_position_embeddings or m.seq_length
        if max_pos < m.seq_length:
            out.append(
                f"--seq-length {m.seq_length} exceeds --max-position-embeddings {max_pos}: raise "
                f"--max-position-embeddings or use --position-embedding-type rope"
            )
    if m.position_embedding_type == "rope":
        if not 0.0 < m.rotary_percent <= 1.0:
            # megatron-core rotates the whole head above 1 (silently 1.0) and nothing at 0
            out.append(
                f"--rotary-percent must be in (0, 1] (the fraction of each head's dimensions RoPE rotates), "
                f"got {m.rotary_percent}"
            )
        elif (
            m.num_attention_heads > 0
            and (m.kv_channels or 0) >= 0
            and (m.kv_channels or m.hidden_size % m.num_attention_heads == 0)
        ):
            head = get_kv_channels(m)
            if head % 2 and int(head * m.rotary_percent) == head:
                # megatron-core builds ceil(d / 2) frequency pairs: d + 1 rotated dimensions, a shape error
                # mid-forward
                given = (
                    "--kv-channels"
                    if m.kv_channels
                    else f"--hidden-size {m.hidden_size} / --num-attention-heads {m.num_attention_heads}"
                )
                out.append(
                    f"--position-embedding-type rope rotates dimension pairs, but the head dimension "
                    f"({given}) is {head}, odd: choose an even head dimension (or --rotary-percent below 1)"
                )
    if m.use_rope_scaling and m.position_embedding_type != "rope":
        out.append("--use-rope-scaling scales rotary embeddings: add --position-embedding-type rope")
    if m.use_rope_scaling and not m.rope_scaling_factor > 0:
        out.append(f"--rope-scaling-factor must be > 0, got {m.rope_scaling_factor}")
    return out


def check_recompute(cfg: JobConfig) -> list[str]:
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    out = []
    if m.recompute_activations and m.recompute_granularity == "full":
        out.append("--recompute-activations is selective recompute: drop it or --recompute-granularity full")
    granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
    full_flags = m.recompute_method is not None or m.recompute_num_layers is not None
    if granularity == "full":
        reported = len(out)
        if m.recompute_method is None or m.recompute_num_layers is None:
            out.append(
                "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N"
            )
        elif pp > 0 and m.num_layers % pp == 0 and not uses_uneven_split(cfg.parallel):
            per_stage = m.num_layers // pp
            if not 1 <= m.recompute_num_layers <= per_stage:
                out.append(
                    f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and the {per_stage} "
                    f"layers of a pipeline stage (--num-layers {m.num_layers} / "
                    f"--pipeline-model-parallel-size {pp})"
                )
        if (
            m.recompute_method == "uniform"
            and m.recompute_num_layers is not None
            and m.recompute_num_layers > 0
            and len(out) == reported
        ):
            # megatron-core checkpoints layers [i, i + N) of each model chunk and indexes past its last
            # layer (IndexError mid-forward) when N does not divide the chunk's layers
            counts = get_chunk_layer_counts(cfg)
            bad = sorted({c for c in counts or [] if c % m.recompute_num_layers})
            if bad:
                sizes = sorted(set(counts))
                out.append(
                    f"--recompute-method uniform: --recompute-num-layers {m.recompute_num_layers} must "
                    f"divide the "
                    f"layers of every model chunk (a pipeline stage, or a virtual stage with interleaving), "
                    f"which hold {', '.join(map(str, sizes))} layers here (megatron-core would index past a "
                    f"chunk's last layer): use a divisor of {math.gcd(*counts)}, or --recompute-method block"
                )
        if m.recompute_modules:
            out.append("--recompute-modules applies to --recompute-granularity selective, not full")
    elif full_flags:
        out.append("--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if m.recompute_modules and granularity != "full":
        if granularity is None:
            out.append("--recompute-modules needs --recompute-granularity selective")
        if "mlp" in m.recompute_modules and not m.disable_bias_linear:
            out.append(
                "--recompute-modules mlp needs --disable-bias-linear: megatron-core 0.16.1 recomputes "
                "the MLP through a checkpoint that returns linear_fc2's bias parameter, and its backward "
                "then recurses forever; recompute core_attn/layernorm, or use --recompute-granularity full"
            )
        unknown = [x for x in m.recompute_modules if x not in RECOMPUTE_MODULES]
        if unknown:
            out.append(
                f"--recompute-modules {' '.join(unknown)}: a dense model recomputes "
                f"{', '.join(RECOMPUTE_MODULES)} (megatron-core's MoE/MLA modules do not apply)"
            )
    return out
