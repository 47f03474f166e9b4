"""Zero-bubble orders (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward split
into B (input gradient, which the previous stage waits for) and W (weight gradient, which nothing
waits for), with the W's moved into what would be bubbles.

- ``ZBH1``: one chunk per rank (loop placement) at 1F1B's memory: the greedy list scheduler of
  ``greedy.py`` with at most p stage-micro-batches in flight per rank (1F1B's rank 0). With equal
  F, B and W it reaches the paper's ZB-H1 bubble (p-1)(t_F + t_B - t_W), against 1F1B's
  (p-1)(t_F + t_B + t_W).
- ``InterleavedZeroBubble``: v chunks per rank in the loop placement, same scheduler and limit.
- ``ZBVZeroBubble``: two chunks per rank in the V placement (stages r and 2p-1-r on rank r), the
  best of the paper's hand-made V order (section 6, ``build_v_order``) and the greedy orders, at
  p stage-micro-batches (2p chunk-micro-batches) in flight: 1F1B's peak.

Every order is chosen for a cost model (``StageCosts``; default F = B = W per chunk, and stage 0
runs its whole backward in its W slot, as torch.distributed.pipelining does: nothing waits for stage
0's input gradient) by the execution model of ``simulate.py`` at hop 0, ties broken at a small hop.
"""

from __future__ import annotations

from megatron_ext.pipeline.actions import Action, B, F, PipelineOrder, W
from megatron_ext.pipeline.greedy import build_greedy_candidates, select_best_order
from megatron_ext.pipeline.schedules.one_f_one_b import get_megatron_core_rank_order
from megatron_ext.pipeline.simulate import StageCosts


def get_memory_limit(pp: int) -> float:
    """1F1B's peak activation units (rank 0 holds p micro-batches of its stage)."""
    return float(pp)


def get_default_costs(pp: int, vp: int) -> StageCosts:
    """F = B = W per chunk (a chunk is 1/vp of a rank's layers); stage 0's backward in W."""
    return StageCosts.uniform(pp * vp, 1.0 / vp, 1.0 / vp, 1.0 / vp, first_stage_backward_in_w=True)


def build_zbh1(pp: int, vp: int, num_microbatches: int, costs: StageCosts | None = None, **_) -> PipelineOrder:
    return _build_loop_zero_bubble("ZBH1", pp, 1, num_microbatches, costs)


def build_interleaved_zero_bubble(
    pp: int, vp: int, num_microbatches: int, costs: StageCosts | None = None, **_
) -> PipelineOrder:
    return _build_loop_zero_bubble("InterleavedZeroBubble", pp, vp, num_microbatches, costs)


def _build_loop_zero_bubble(
    name: str, pp: int, vp: int, num_microbatches: int, costs: StageCosts | None
) -> PipelineOrder:
    costs = costs or get_default_costs(pp, vp)
    limit = get_memory_limit(pp)
    candidates = [build_lagged_w_order(name, pp, vp, num_microbatches)]
    candidates += build_greedy_candidates(name, pp, vp, num_microbatches, "loop", costs, limit)
    return select_best_order(candidates, costs, limit)


def build_lagged_w_order(name: str, pp: int, vp: int, num_microbatches: int) -> PipelineOrder:
    """1F1B's order (interleaved: megatron-core's table, micro-batches in groups of p) with each
    backward split and rank r's W's lagging its B's by r: ZB-H1 of the paper at v = 1, its
    interleaved form (ZB1P) at v > 1. Rank r: w = (v-1) p + p-1-r warm-up forwards (one per hop
    fewer than interleaved 1F1B's two), then (F, B) pairs, each followed from the r-th on by the W
    of the backward r places earlier, then the remaining B's and W's. In flight: w + r + 1 chunk-
    micro-batches = p stage-micro-batches on every rank (1F1B's rank 0)."""
    ranks = []
    for r in range(pp):
        table = [(c, mb) for kind, c, mb in get_megatron_core_rank_order(r, pp, vp, num_microbatches) if kind == "F"]
        fwd = [Action(F, c * pp + r, mb) for c, mb in table]
        bwd = [Action(B, (vp - 1 - c) * pp + r, mb) for c, mb in table]
        warmup = min((vp - 1) * pp + pp - 1 - r, len(table))
        out, waiting = fwd[:warmup], []
        for k, b in enumerate(bwd):
            out += ([fwd[warmup + k]] if warmup + k < len(fwd) else []) + [b]
            waiting.append(Action(W, b.stage, b.mb))
            if len(waiting) > r:
                out.append(waiting.pop(0))
        ranks.append(tuple(out + waiting))
    return PipelineOrder(name, pp, vp, num_microbatches, "loop", tuple(ranks))


def build_zbv(pp: int, vp: int, num_microbatches: int, costs: StageCosts | None = None, **_) -> PipelineOrder:
    costs = costs or get_default_costs(pp, 2)
    limit = get_memory_limit(pp)
    candidates = [build_v_order(pp, num_microbatches)]
    candidates += build_greedy_candidates("ZBVZeroBubble", pp, 2, num_microbatches, "v", costs, limit)
    return select_best_order(candidates, costs, limit)


def build_v_order(pp: int, num_microbatches: int) -> PipelineOrder:
    """The ZB paper's V order (its figure for ZB-V), rank r holding stages r (chunk 0) and 2p-1-r
    (chunk 1). Per rank: 2(p-r)-1 chunk-0 forwards; r pairs (F1, F0); p-r triples (F1, B1, W1);
    then (F0, B0, W0, F1, B1, W1) while forwards remain; cool-down r pairs (B0, B1), p-r pairs
    (B0, W0), the remaining W1 and W0. Written for m >= 2p-1 micro-batches; with fewer, the actions
    of the micro-batches that do not exist are dropped (still a valid order: the checker says so)."""
    ranks = tuple(
        tuple(a for a in _v_rank_order(pp, max(num_microbatches, 2 * pp - 1), r) if a.mb < num_microbatches)
        for r in range(pp)
    )
    return PipelineOrder("ZBVZeroBubble", pp, 2, num_microbatches, "v", ranks)


def _v_rank_order(p: int, m: int, r: int) -> list[Action]:
    stages = (r, 2 * p - 1 - r)
    count = {(k, c): 0 for k in (F, B, W) for c in (0, 1)}
    out: list[Action] = []

    def run(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            out.append(Action(kind, stages[chunk], count[(kind, chunk)]))
            count[(kind, chunk)] += 1

    for _ in range(2 * (p - r) - 1):
        run((F, 0))
    for _ in range(r):
        run((F, 1), (F, 0))
    for _ in range(p - r):
        run((F, 1), (B, 1), (W, 1))
    while count[(F, 1)] < count[(F, 0)] or count[(F, 0)] < m:
        if count[(F, 0)] < m:
            run((F, 0))
        run((B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    for _ in range(r):
        run((B, 0), (B, 1))
    for _ in range(p - r):
        run((B, 0), (W, 0))
    while count[(W, 1)] < count[(B, 1)]:
        run((W, 1))
    while count[(W, 0)] < count[(B, 0)]:
        run((W, 0))
    return out
