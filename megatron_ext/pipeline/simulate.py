"""The pure model of a pipeline order: a checker and a discrete-event simulation, no process group.

Execution model (what ``runtime.py`` does): each rank runs its action list strictly in order; an
action starts when its rank is free and its input is there. A forward needs stage s-1's forward of
the same micro-batch, a B / BW needs its own forward and stage s+1's B / BW (the last stage: its own
forward only), a W its own B. An input made on another rank arrives ``hop`` seconds after its
producer ended (hop 0: the "hop-0 model"); a local hand-over (same rank) costs nothing. Sends never
block (the runtime's sends are non-blocking, their handles kept to the step's end) and receives
block until the message is there, so an order deadlocks exactly when this simulation cannot
progress: the checker reports that, as ``ScheduleDeadlock`` does.

Memory model: a (stage, micro-batch) holds its activations from its forward's start until its W
(split backward) or BW ended; each stage weighs ``1 / vp`` (one chunk of a rank's layers), so a 1F1B
stage-micro-batch weighs 1 and 1F1B's rank r peaks at p - r.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from megatron_ext.pipeline.actions import BW, Action, B, F, PipelineOrder, W


class ScheduleDeadlock(RuntimeError):
    """The per-rank orders wait on each other in a cycle."""


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Seconds per action of each stage: ``forward[s]``, ``backward_input[s]`` (B),
    ``backward_weight[s]`` (W); a BW costs B + W. ``first_stage_backward_in_w``: stage 0's B does
    nothing and its W runs the whole backward (torch.distributed.pipelining's choice: nothing waits
    for stage 0's input gradient)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    first_stage_backward_in_w: bool = False

    @classmethod
    def uniform(
        cls, num_stages: int, t_forward: float, t_input: float, t_weight: float, first_stage_backward_in_w: bool = False
    ) -> StageCosts:
        return cls(
            (t_forward,) * num_stages, (t_input,) * num_stages, (t_weight,) * num_stages, first_stage_backward_in_w
        )

    def cost(self, kind: str, stage: int) -> float:
        if kind == F:
            return self.forward[stage]
        if kind == BW:
            return self.backward_input[stage] + self.backward_weight[stage]
        if self.first_stage_backward_in_w and stage == 0:
            return 0.0 if kind == B else self.backward_input[0] + self.backward_weight[0]
        return self.backward_input[stage] if kind == B else self.backward_weight[stage]

    def ideal(self, order: PipelineOrder) -> float:
        """The bubble-free step: the busiest rank's compute."""
        return max(sum(self.cost(a.kind, a.stage) for a in actions) for actions in order.ranks)


@dataclasses.dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The timed actions per rank, in order; ``peak_memory[r]`` in stage-micro-batch units."""

    ranks: tuple[tuple[TimedAction, ...], ...]
    peak_memory: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(t.end for ops in self.ranks for t in ops) - min(t.start for ops in self.ranks for t in ops)

    def bubble(self, ideal: float) -> float:
        """Step time over the bubble-free ideal, minus 1."""
        return self.makespan / ideal - 1


def get_dependency(order: PipelineOrder, action: Action) -> tuple[str, int, int] | None:
    """(kind, stage, mb) whose end ``action`` waits for; for a B / BW of a stage that is not the last,
    stage s+1's backward (B or BW, whichever that stage runs): reported as kind "B*"."""
    kind, s, mb = action
    if kind == F:
        return (F, s - 1, mb) if s > 0 else None
    if kind == W:
        return ("B*", s, mb)
    return ("B*", s + 1, mb) if s < order.num_stages - 1 else (F, s, mb)


def _key(kind: str, stage: int, mb: int) -> tuple[str, int, int]:
    return ("B*" if kind in (B, BW) else kind, stage, mb)


def simulate_order(order: PipelineOrder, costs: StageCosts, hop: float = 0.0) -> Simulation:
    """Run the discrete-event model (module docstring); raises ``ScheduleDeadlock``."""
    p = order.pp
    pos, free = [0] * p, [0.0] * p
    done: dict[tuple[str, int, int], tuple[int, float]] = {}  # key -> (rank, end)
    timed: list[list[TimedAction]] = [[] for _ in range(p)]
    remaining = sum(len(a) for a in order.ranks)
    while remaining:
        progressed = False
        for r in range(p):
            actions = order.ranks[r]
            while pos[r] < len(actions):
                action = actions[pos[r]]
                dep = get_dependency(order, action)
                if dep is not None and dep not in done:
                    break
                ready = 0.0
                if dep is not None:
                    dep_rank, dep_end = done[dep]
                    ready = dep_end + (hop if dep_rank != r else 0.0)
                start = max(free[r], ready)
                end = start + costs.cost(action.kind, action.stage)
                free[r] = end
                done[_key(*action)] = (r, end)
                timed[r].append(TimedAction(action, start, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [f"rank {r} at {order.ranks[r][pos[r]]}" for r in range(p) if pos[r] < len(order.ranks[r])]
            raise ScheduleDeadlock(f"{order.name}: every rank waits: {', '.join(waiting)}")
    ranks = tuple(tuple(t) for t in timed)
    return Simulation(ranks, tuple(get_peak_memory(order, ops) for ops in ranks))


def get_peak_memory(order: PipelineOrder, ops: Iterable[TimedAction]) -> float:
    """Peak activation units a rank holds (module docstring), from its timed actions."""
    events = []
    for t in ops:
        if t.action.kind == F:
            events.append((t.start, 1, 1.0 / order.vp))
        elif t.action.kind in (W, BW):
            events.append((t.end, 0, -1.0 / order.vp))  # a free at time x comes before an F at x
    live = peak = 0.0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def get_in_flight_peak(order: PipelineOrder, pp_rank: int) -> float:
    """Peak activation units by position in the order alone (no times): F adds, W / BW frees."""
    live = peak = 0.0
    for a in order.ranks[pp_rank]:
        if a.kind == F:
            live += 1.0 / order.vp
            peak = max(peak, live)
        elif a.kind in (W, BW):
            live -= 1.0 / order.vp
    return peak


def check_order(order: PipelineOrder, memory_limit: float | None = None) -> list[str]:
    """Every problem of ``order`` (module docstrings of this file and ``actions.py``); empty when it
    is valid. ``memory_limit``: the in-flight activation units no rank may exceed."""
    problems = _check_coverage(order)
    if problems:
        return problems
    problems += _check_per_stage_order(order)
    try:
        simulate_order(order, StageCosts.uniform(order.num_stages, 1.0, 1.0, 1.0))
    except ScheduleDeadlock as e:
        problems.append(f"deadlock under blocking receives: {e}")
    if memory_limit is not None:
        for r in range(order.pp):
            peak = get_in_flight_peak(order, r)
            if peak > memory_limit + 1e-9:
                problems.append(
                    f"rank {r}: {peak:g} stage-micro-batches of activations in flight, limit {memory_limit:g}"
                )
    return problems


def _check_coverage(order: PipelineOrder) -> list[str]:
    problems = []
    seen: dict[Action, int] = {}
    for r, actions in enumerate(order.ranks):
        for a in actions:
            if a.kind not in (F, B, W, BW) or not (
                0 <= a.stage < order.num_stages and 0 <= a.mb < order.num_microbatches
            ):
                problems.append(f"rank {r}: {a} is not an action of this pipeline")
            elif order.rank_of(a.stage) != r:
                problems.append(f"rank {r}: {a} belongs to rank {order.rank_of(a.stage)}")
            elif a in seen:
                problems.append(f"rank {r}: {a} appears twice")
            else:
                seen[a] = r
    for s in range(order.num_stages):
        for mb in range(order.num_microbatches):
            has = {k for k in (F, B, W, BW) if Action(k, s, mb) in seen}
            if has not in ({F, BW}, {F, B, W}):
                problems.append(f"stage {s} micro-batch {mb} has {sorted(has)}: needs F and BW, or F, B and W")
    return problems


def _check_per_stage_order(order: PipelineOrder) -> list[str]:
    """Per stage, each kind in micro-batch order; per (stage, mb), F before B / BW before W."""
    problems = []
    for r, actions in enumerate(order.ranks):
        position = {a: i for i, a in enumerate(actions)}
        for kind in (F, B, W, BW):
            for s in {a.stage for a in actions}:
                mbs = [a.mb for a in actions if a.kind == kind and a.stage == s]
                if mbs != sorted(mbs):
                    problems.append(f"rank {r}: stage {s} runs {kind} out of micro-batch order: {mbs}")
        for a in actions:
            before = {B: (F,), BW: (F,), W: (B,)}.get(a.kind, ())
            for k in before:
                if position.get(Action(k, a.stage, a.mb), -1) > position[a]:
                    problems.append(f"rank {r}: {a} comes before {Action(k, a.stage, a.mb)}")
    return problems
