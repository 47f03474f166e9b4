"""megatron-core's own orders, 1F1B and interleaved 1F1B, as action lists (whole backward: BW).

Training runs these two through megatron-core's schedules, not through our runtime; the lists are
the reference that the model (``simulate.py``), the timeline analysis and the tests compare with.

1F1B (v = 1): rank r runs w = min(p - r - 1, m) warm-up forwards, m - w (F, BW) pairs, w cool-down
backwards; no pipelining (p = 1) is the same with w = 0. Interleaved (Narayanan et al. 2021, as
megatron-core's schedule table has it): forward k runs table entry k, where micro-batches go in
groups of g (``microbatch_group_size_per_vp_stage``, default p) through every chunk in order before
the next group; backward k runs table entry k on the mirrored chunk v-1-c;
w = min(2 (p - r - 1) + (v - 1) g, m v).
"""

from __future__ import annotations

from megatron_ext.pipeline.actions import BW, Action, F, PipelineOrder


def get_megatron_core_rank_order(
    pp_rank: int, pp: int, vp: int, num_microbatches: int, group_size: int | None = None
) -> list[tuple[str, int, int]]:
    """(kind "F" | "B", local chunk, micro-batch) in the order megatron-core runs them on one rank."""
    p, r, v, m = pp, pp_rank, vp, num_microbatches
    if v == 1:
        table = [(mb, 0) for mb in range(m)]
        warmup = min(p - r - 1, m)
    else:
        g = group_size or p
        table = [(mb, c) for lo in range(0, m, g) for c in range(v) for mb in range(lo, m if lo + g >= m else lo + g)]
        warmup = min(2 * (p - r - 1) + (v - 1) * g, m * v)
    fwd = [("F", c, mb) for mb, c in table]
    bwd = [("B", v - 1 - c, mb) for mb, c in table]
    order = fwd[:warmup]
    for k in range(len(table) - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[len(table) - warmup :]


def build_megatron_core_order(
    name: str, pp: int, vp: int, num_microbatches: int, group_size: int | None = None
) -> PipelineOrder:
    """megatron-core's order for every rank (loop placement: stage = chunk x p + rank)."""
    ranks = tuple(
        tuple(
            Action(F if kind == "F" else BW, c * pp + r, mb)
            for kind, c, mb in get_megatron_core_rank_order(r, pp, vp, num_microbatches, group_size)
        )
        for r in range(pp)
    )
    return PipelineOrder(name, pp, vp, num_microbatches, "loop", ranks)


def build_1f1b(pp: int, vp: int, num_microbatches: int, **_) -> PipelineOrder:
    return build_megatron_core_order("1F1B", pp, 1, num_microbatches)


def build_interleaved_1f1b(
    pp: int, vp: int, num_microbatches: int, group_size: int | None = None, **_
) -> PipelineOrder:
    return build_megatron_core_order("Interleaved1F1B", pp, vp, num_microbatches, group_size)
