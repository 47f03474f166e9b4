"""``--pipeline-schedule``: every impossible combination is one problem naming the flags and the fix,
found before anything is built (``validation.validate`` collects them with the others, through
``layout_rules.check_pipeline_schedule_layout``).

How a user asks for chunks per rank: ``--num-virtual-stages-per-pipeline-rank`` (or
``--num-layers-per-virtual-pipeline-stage``) as for megatron-core's interleaved schedule; the V
schedules imply 2 when neither is given (``derived.get_schedule_chunks``), and refuse any other number.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.derived import get_schedule_name, get_sequence_padding
from megatron_ext.pipeline.names import (
    MEGATRON_CORE_SCHEDULES,
    SCHEDULES,
    V_PLACEMENT_SCHEDULES,
    canonical_schedule_name,
)
from megatron_ext.pipeline.schedules import GENERATORS

FLAG = "--pipeline-schedule"
VPP_FLAG = "--num-virtual-stages-per-pipeline-rank"


def check_schedule_name(cfg: Any) -> list[str]:
    """``--pipeline-schedule`` names a schedule we have."""
    raw = cfg.parallel.pipeline_schedule
    name = canonical_schedule_name(raw) if raw else None
    if raw and name is None:
        return [f"{FLAG} {raw}: not a schedule; one of {', '.join(SCHEDULES)} (case-insensitive)"]
    if raw and name not in GENERATORS:
        return [
            f"{FLAG} {name}: not implemented yet; use ZBVZeroBubble (the same V placement) or InterleavedZeroBubble"
        ]
    return []


def check_pipeline_schedule(cfg: Any, vpp: int | None, num_microbatches: int | None) -> list[str]:
    """Problems of ``--pipeline-schedule`` with a valid layout; ``vpp``: virtual stages per rank
    (None: one), ``num_microbatches``: per step and DP rank (None: unknown, not checked)."""
    name = get_schedule_name(cfg)
    if name is None or check_schedule_name(cfg):
        return check_schedule_name(cfg)
    pp, v = cfg.parallel.pipeline_model_parallel_size, vpp or 1
    out = _check_chunks(name, pp, v)
    if out or name in MEGATRON_CORE_SCHEDULES:
        return out
    out += _check_layers(cfg, name, pp, v)
    if num_microbatches is not None and v > 1 and num_microbatches < pp:
        out.append(
            f"{FLAG} {name}: {num_microbatches} micro-batches per step (--global-batch-size / "
            f"(--micro-batch-size x data-parallel size)) is fewer than the {pp} pipeline stages it needs "
            f"to fill: raise --global-batch-size to a multiple with at least {pp}, or use 1F1B"
        )
    return out + _check_features(cfg, name)


def _check_chunks(name: str, pp: int, v: int) -> list[str]:
    if name == "1F1B" and v > 1:
        return [
            f"{FLAG} 1F1B runs one model chunk per rank, but {v} virtual stages per pipeline rank are set: "
            f"use {FLAG} Interleaved1F1B (or InterleavedZeroBubble), or drop {VPP_FLAG}"
        ]
    if name == "Interleaved1F1B" and v == 1:
        return [f"{FLAG} Interleaved1F1B needs virtual stages: set {VPP_FLAG} 2 (or more), or use {FLAG} 1F1B"]
    if name in MEGATRON_CORE_SCHEDULES:
        return []
    if pp == 1:
        return [
            f"{FLAG} {name} is a pipeline schedule: it needs --pipeline-model-parallel-size > 1 (got 1); "
            f"drop {FLAG} to train without pipelining"
        ]
    if name == "ZBH1" and v > 1:
        return [
            f"{FLAG} ZBH1 runs one model chunk per rank, but {v} virtual stages per pipeline rank are set: "
            f"use {FLAG} InterleavedZeroBubble, or drop {VPP_FLAG}"
        ]
    if name == "InterleavedZeroBubble" and v == 1:
        return [
            f"{FLAG} InterleavedZeroBubble needs virtual stages: set {VPP_FLAG} 2 (or more), or use "
            f"{FLAG} ZBH1 for one chunk per rank"
        ]
    if name in V_PLACEMENT_SCHEDULES and v != 2:
        return [
            f"{FLAG} {name} places exactly 2 model chunks per pipeline rank (a V), but "
            f"{v} {'is' if v == 1 else 'are'} set: set {VPP_FLAG} 2 or leave it out (the V schedules imply 2)"
        ]
    return []


def _check_layers(cfg: Any, name: str, pp: int, v: int) -> list[str]:
    layers = cfg.model.num_layers
    p = cfg.parallel
    # uneven splits are checked with the layout (layout_rules.check_uneven_split: the layers plus the embedding
    # and loss counted as layers split into the stages; layout_rules.check_v_split: which of them V takes)
    uneven = (
        p.decoder_first_pipeline_num_layers is not None
        or p.decoder_last_pipeline_num_layers is not None
        or p.account_for_embedding_in_pipeline_split
        or p.account_for_loss_in_pipeline_split
    )
    if name in V_PLACEMENT_SCHEDULES and not uneven and layers % (2 * pp):
        return [
            f"{FLAG} {name}: --num-layers {layers} does not split into 2 x --pipeline-model-parallel-size "
            f"{pp} = {2 * pp} equal model chunks (the V placement's stages): use a multiple of {2 * pp} layers"
        ]
    return []


def _check_features(cfg: Any, name: str) -> list[str]:
    """Features megatron-core's schedules have and ours refuse, by flag."""
    out = []
    if get_sequence_padding(cfg.data) == "variable":
        out.append(
            f"{FLAG} {name} with --sequence-padding variable: megatron-core's shape handshake is a blocking "
            f"exchange per message, which deadlocks when messages run out of 1F1B's order; use "
            f"--sequence-padding negotiated (one MAX over the pipeline per step, the same data)"
        )
    if cfg.parallel.microbatch_group_size_per_vp_stage is not None:
        out.append(
            f"--microbatch-group-size-per-vp-stage applies to megatron-core's Interleaved1F1B only, not to "
            f"{FLAG} {name}: drop it"
        )
    # megatron-core's --defer-embedding-wgrad-compute (the output layer's W buffered to the flush) would
    # be refused here too, but our CLI has no such flag: the model config never turns it on.
    return out
