"""Zero-bubble orders by greedy list scheduling under a memory limit (the ZB paper's approach).

A discrete-event simulation builds the order: the rank that is free first picks its next action
among those whose input is there, by a ``GreedyPolicy``; when nothing is ready it fills the wait
with a pending W (the weight gradient nothing waits for), which is what removes the bubbles. A
forward is only started while the rank's activations in flight (forwarded, W not yet run; a chunk
weighs 1 / vp) stay within ``memory_limit``: the limit that keeps a schedule at 1F1B's memory.

``build_greedy_candidates`` runs a handful of policies; ``select_best_order`` keeps the order with
the shortest step in the execution model of ``simulate.py``, so an order is a pure function of
(p, v, m, placement, costs, limit): every rank computes the same one.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.pipeline.actions import Action, B, F, PipelineOrder, W
from megatron_ext.pipeline.placement import get_rank_stages
from megatron_ext.pipeline.simulate import StageCosts, check_order, simulate_order

EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class GreedyPolicy:
    """How a free rank picks among ready actions.

    ``first``: which kind wins when both a forward and an input gradient are ready ("B": the
    backward, which unblocks the previous stage; "F": the forward, which feeds the next one).
    ``later_stage_first``: among ready forwards (and backwards) of several local stages, the one
    nearer the end of the pipeline first (depth-first), else the earlier micro-batch first.
    ``fill``: "idle" runs a pending W whenever nothing else is ready; "fit" only when it ends before
    the next input already known to arrive (else the rank waits for that input).
    ``max_pending_w``: with more W's pending than this, the oldest W runs before any F or B (0: each
    W right after its B, as torch's ZBV order does; None: W's only fill waits or free memory)."""

    first: str = B
    later_stage_first: bool = True
    fill: str = "idle"
    max_pending_w: int | None = None


# Over p in 2..8, m in 2..16, the three schedules and 32 combinations of the knobs above, the greedy
# beat the closed-form orders of ``schedules/zero_bubble.py`` only at m close to p, and these three
# policies always among the winners (the others are kept as knobs for other cost models).
POLICIES = (GreedyPolicy(B), GreedyPolicy(F), GreedyPolicy(B, max_pending_w=2))


@dataclasses.dataclass
class _State:
    order: PipelineOrder  # the shell: sizes and placement (ranks filled at the end)
    costs: StageCosts
    hop: float
    limit: float
    free: list[float]
    live: list[float]
    actions: list[list[Action]]
    next_mb: dict[tuple[str, int], int]  # (kind, stage) -> next micro-batch
    done: dict[tuple[str, int, int], tuple[int, float]]  # (F | B | W, stage, mb) -> (rank, end)
    stages: list[list[int]]  # each rank's stages

    def arrival(self, kind: str, stage: int, mb: int, rank: int) -> float | None:
        """When the input of ``kind`` (stage, mb) is on ``rank``; None: its producer has not run."""
        last = self.order.num_stages - 1
        dep = {
            F: (F, stage - 1, mb) if stage > 0 else None,
            B: (B, stage + 1, mb) if stage < last else (F, stage, mb),
            W: (B, stage, mb),
        }[kind]
        if dep is None:
            return 0.0
        if dep not in self.done:
            return None
        dep_rank, end = self.done[dep]
        return end + (self.hop if dep_rank != rank else 0.0)


def _candidates(st: _State, rank: int) -> list[tuple[Action, float | None]]:
    """The next action of each kind of each local stage, with its input's arrival (None: unknown)."""
    m, out, nxt = st.order.num_microbatches, [], st.next_mb
    for s in st.stages[rank]:
        nf, nb, nw = nxt[(F, s)], nxt[(B, s)], nxt[(W, s)]
        for kind, mb, behind in ((F, nf, m), (B, nb, nf), (W, nw, nb)):
            if mb < behind:
                out.append((Action(kind, s, mb), st.arrival(kind, s, mb, rank)))
    return out


def _pick(st: _State, rank: int, policy: GreedyPolicy) -> tuple[Action | None, float]:
    """The action ``rank`` runs next at its free time, or (None, when to look again)."""
    now = st.free[rank]
    cands = _candidates(st, rank)
    fits = st.live[rank] + 1.0 / st.order.vp <= st.limit + EPS
    ready = [a for a, t in cands if t is not None and t <= now + EPS and (a.kind != F or fits)]
    stage_key = (lambda a: (-a.stage, a.mb)) if policy.later_stage_first else (lambda a: (a.mb, -a.stage))
    pending_w = sorted((a for a in ready if a.kind == W), key=lambda a: (a.mb, a.stage))
    backlog = sum(st.next_mb[(B, s)] - st.next_mb[(W, s)] for s in {a.stage for a, _ in cands})
    if pending_w and policy.max_pending_w is not None and backlog > policy.max_pending_w:
        return pending_w[0], now
    kinds = (B, F) if policy.first == B else (F, B)
    for kind in kinds:
        mine = sorted((a for a in ready if a.kind == kind), key=stage_key)
        if mine:
            return mine[0], now
    known = [t for a, t in cands if a.kind != W and t is not None and t > now + EPS and (a.kind != F or fits)]
    if pending_w:
        w = pending_w[0]
        if policy.fill == "idle" or not known or now + st.costs.cost(W, w.stage) <= min(known) + EPS:
            return w, now
    return None, min(known, default=float("inf"))


def build_greedy_order(
    name: str,
    pp: int,
    vp: int,
    num_microbatches: int,
    placement: str,
    costs: StageCosts,
    memory_limit: float,
    policy: GreedyPolicy,
    hop: float = 0.0,
) -> PipelineOrder:
    """One order by ``policy`` (module docstring)."""
    shell = PipelineOrder(name, pp, vp, num_microbatches, placement, ())
    st = _State(
        shell,
        costs,
        hop,
        memory_limit,
        [0.0] * pp,
        [0.0] * pp,
        [[] for _ in range(pp)],
        {(k, s): 0 for k in (F, B, W) for s in range(pp * vp)},
        {},
        [get_rank_stages(r, pp, vp, placement) for r in range(pp)],
    )
    total = 3 * pp * vp * num_microbatches
    scheduled = 0
    blocked = [False] * pp  # waits for another rank that is free at the same time
    while scheduled < total:
        busy = [r for r in range(pp) if len(st.actions[r]) < 3 * vp * num_microbatches]
        first = min(st.free[r] for r in busy)
        rank = min((r for r in busy if st.free[r] <= first + EPS), key=lambda r: (blocked[r], st.free[r], r))
        action, arrival = _pick(st, rank, policy)
        if action is None:
            _wait(st, rank, arrival, busy, blocked)
            continue
        blocked = [False] * pp
        start = max(st.free[rank], st.arrival(action.kind, action.stage, action.mb, rank))
        end = start + costs.cost(action.kind, action.stage)
        st.free[rank] = end
        st.done[(action.kind, action.stage, action.mb)] = (rank, end)
        st.next_mb[(action.kind, action.stage)] += 1
        st.live[rank] += {F: 1.0, B: 0.0, W: -1.0}[action.kind] / vp
        st.actions[rank].append(action)
        scheduled += 1
    return dataclasses.replace(shell, ranks=tuple(tuple(a) for a in st.actions))


def _wait(st: _State, rank: int, arrival: float, busy: list[int], blocked: list[bool]) -> None:
    """Nothing to run on ``rank`` now: wait for the next known input or the next rank to act."""
    now = st.free[rank]
    if any(r != rank and not blocked[r] and abs(st.free[r] - now) <= EPS for r in busy):
        blocked[rank] = True  # another rank acts at this same time first
        return
    later = [arrival] + [st.free[r] for r in busy if st.free[r] > now + EPS]
    if min(later) == float("inf"):
        raise RuntimeError(f"{st.order.name}: greedy schedule stuck on rank {rank} at {now}")
    st.free[rank] = min(later)
    blocked[rank] = False


def build_greedy_candidates(
    name: str,
    pp: int,
    vp: int,
    num_microbatches: int,
    placement: str,
    costs: StageCosts,
    memory_limit: float,
    policies: tuple[GreedyPolicy, ...] = POLICIES,
) -> list[PipelineOrder]:
    """One order per policy (duplicates dropped)."""
    out: dict[tuple, PipelineOrder] = {}
    for policy in policies:
        order = build_greedy_order(name, pp, vp, num_microbatches, placement, costs, memory_limit, policy)
        out.setdefault(order.ranks, order)
    return list(out.values())


def select_best_order(candidates: list[PipelineOrder], costs: StageCosts, memory_limit: float) -> PipelineOrder:
    """The candidate with the shortest step in the hop-0 model; ties: the shortest with a hop of 5%
    of the shortest forward (real P2P is not free), then the first given. The chosen order must be
    valid within ``memory_limit`` (our own invariant: asserted)."""
    hop = 0.05 * min(costs.forward)
    hop0 = [round(simulate_order(order, costs).makespan, 9) for order in candidates]
    tied = [i for i, t in enumerate(hop0) if t == min(hop0)]
    best = candidates[min(tied, key=lambda i: (round(simulate_order(candidates[i], costs, hop).makespan, 9), i))]
    problems = check_order(best, memory_limit)
    assert not problems, f"{best.name}: generated an invalid order: {problems[:3]}"
    return best
