"""Offline analysis of pipeline timelines recorded by ``megatron_ext/training/timeline.py``
(``--pp-timeline DIR``) or simulated: schedule order and dependency checks, bubble statistics,
in-flight bounds, P2P waits. Pure functions, no process group; used by ``tools/pp_timeline.py``,
``bench/schedule.py`` and the tests, never by a training run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics


def read_timeline(trace_dir: str) -> dict[int, dict[int, list[dict]]]:
    """{step: {rank: [records]}} from every ``rank<N>.jsonl`` under ``trace_dir``."""
    out: dict[int, dict[int, list[dict]]] = {}
    names = sorted(n for n in os.listdir(trace_dir) if re.fullmatch(r"rank\d+\.jsonl", n))
    if not names:
        raise ValueError(f"{trace_dir}: no rank<N>.jsonl files (was the run started with --pp-timeline {trace_dir}?)")
    for name in names:
        rank = int(name[len("rank") : -len(".jsonl")])
        with open(os.path.join(trace_dir, name), encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    rec = _parse_record(line, os.path.join(trace_dir, name), number)
                    out.setdefault(rec["step"], {}).setdefault(rank, []).append(rec)
    return out


def _parse_record(line: str, path: str, number: int) -> dict:
    """One JSON record with its step; ValueError naming the file and line for anything else."""
    try:
        rec = json.loads(line)
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            return rec
        problem = "no integer 'step'"
    except ValueError as err:
        problem = str(err)
    raise ValueError(
        f"{path} line {number} is not a --pp-timeline record ({problem}): the file is damaged or not a trace; "
        f"record the run again, or delete the file"
    )


# ---- analysis of recorded (or simulated) timelines: pure functions, no process group ----


@dataclasses.dataclass(frozen=True)
class Op:
    """One forward ("F"), backward ("B": whole under megatron-core's schedules, the input gradient
    under ours) or weight gradient ("W") of micro-batch ``mb`` on model chunk ``chunk``."""

    kind: str
    chunk: int
    mb: int
    start: float = 0.0
    end: float = 0.0


@dataclasses.dataclass(frozen=True)
class RankStep:
    """One rank's records of one step."""

    rank: int
    pp_rank: int
    pp_size: int
    vp_size: int
    pipeline: int
    num_microbatches: int
    start: float
    end: float
    ops: list[Op]  # by start time
    optimizer: tuple[float, float] | None
    schedule: str | None = None  # --pipeline-schedule (None: megatron-core's default choice)
    placement: str = "loop"

    @property
    def ours(self) -> bool:
        """Run by our runtime (``megatron_ext/pipeline``), not by megatron-core's schedules."""
        return self.schedule not in (None, "1F1B", "Interleaved1F1B")

    def stage_of(self, chunk: int) -> int:
        from megatron_ext.pipeline.placement import get_stage_index

        return get_stage_index(self.pp_rank, chunk, self.pp_size, self.vp_size, self.placement)


def parse_rank_step(records: list[dict]) -> RankStep:
    (meta,) = [r for r in records if r["kind"] == "step"]
    ops = sorted(
        (Op(r["kind"], r["chunk"], r["mb"], r["start"], r["end"]) for r in records if r["kind"] in ("F", "B", "W")),
        key=lambda op: op.start,
    )
    opt = [(r["start"], r["end"]) for r in records if r["kind"] == "optimizer"]
    return RankStep(
        meta["rank"],
        meta["pp_rank"],
        meta["pp_size"],
        meta["vp_size"],
        meta.get("pipeline", 0),
        meta["num_microbatches"],
        meta["start"],
        meta["end"],
        ops,
        opt[0] if opt else None,
        meta.get("schedule"),
        meta.get("placement", "loop"),
    )


def get_order(rs: RankStep):
    """The ``PipelineOrder`` the rank's step ran (megatron-core's own for its schedules)."""
    from megatron_ext.pipeline.schedules import get_order as get_schedule_order_of

    name = rs.schedule if rs.ours else ("Interleaved1F1B" if rs.vp_size > 1 else "1F1B")
    return get_schedule_order_of(name, rs.pp_size, rs.vp_size, rs.num_microbatches)


def get_recorded_order(order, pp_rank: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, mb) in the order the timeline records ``order``'s actions on ``pp_rank``: a
    whole backward (BW) as "B"; stage 0's B nothing and its W a B then a W (the runtime runs that
    stage's whole backward in its W slot)."""
    out = []
    for a in order.ranks[pp_rank]:
        c = order.chunk_of(a.stage)
        if a.kind == "BW":
            out.append(("B", c, a.mb))
        elif a.stage == 0 and a.kind == "B":
            continue
        elif a.stage == 0 and a.kind == "W":
            out += [("B", c, a.mb), ("W", c, a.mb)]
        else:
            out.append((a.kind, c, a.mb))
    return out


def get_bubble_theory(pp_size: int, num_microbatches: int, vp_size: int = 1) -> float:
    """Pipeline bubble relative to the ideal (bubble-free) compute time: (p-1)/(m v)."""
    return (pp_size - 1) / (num_microbatches * vp_size)


def get_schedule_order(
    pp_rank: int, pp_size: int, vp_size: int, num_microbatches: int, group_size: int | None = None
) -> list[tuple[str, int, int]]:
    """The (kind, chunk, mb) sequence megatron-core's schedule runs on one pipeline rank (the whole
    backward as "B"): ``megatron_ext.pipeline.schedules.one_f_one_b``, which says how."""
    from megatron_ext.pipeline.schedules.one_f_one_b import get_megatron_core_rank_order

    return get_megatron_core_rank_order(pp_rank, pp_size, vp_size, num_microbatches, group_size)


def get_max_in_flight(ops: list[Op]) -> int:
    """Most (micro-batch, chunk) pairs forwarded but not yet backwarded (split backward: whose W has
    not run) at once: the number of activation sets a rank holds, which bounds its activation memory."""
    release = "W" if any(op.kind == "W" for op in ops) else "B"
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1 if op.kind == release else 0
        peak = max(peak, live)
    return peak


def get_in_flight_peak(order, pp_rank: int) -> float:
    from megatron_ext.pipeline.simulate import get_in_flight_peak as peak

    return peak(order, pp_rank)


def get_in_flight_bound(
    pp_rank: int, pp_size: int, vp_size: int, num_microbatches: int, group_size: int | None = None
) -> int:
    """1F1B: stage r holds at most p - r micro-batches. Interleaved: warm-up + 1 chunk-micro-batches
    (each 1/v of the stage's layers), 2 (p - r - 1) + (v - 1) g + 1, at most m v."""
    p, r, v, m = pp_size, pp_rank, vp_size, num_microbatches
    if v == 1:
        return min(p - r, m)
    return min(2 * (p - r - 1) + (v - 1) * (group_size or p) + 1, m * v)


def check_rank_step(rs: RankStep, group_size: int | None = None) -> list[str]:
    """Problems with one rank's recorded step: counts, per-chunk order, dependencies, overlap,
    the exact order of its schedule (megatron-core's, or ours: ``get_recorded_order``), and the
    in-flight (activation memory) bound."""
    where = f"rank {rs.rank} (pp {rs.pp_rank})"
    m, v = rs.num_microbatches, rs.vp_size
    problems = []
    for kind in "FBW" if rs.ours else "FB":
        for c in range(v):
            mbs = [op.mb for op in rs.ops if op.kind == kind and op.chunk == c]
            if sorted(mbs) != list(range(m)):
                problems.append(f"{where}: chunk {c} {kind} micro-batches {sorted(mbs)}, expected 0..{m - 1}")
            elif mbs != list(range(m)):
                problems.append(f"{where}: chunk {c} {kind} out of micro-batch order: {mbs}")
    ends = {(op.kind, op.chunk, op.mb): op.end for op in rs.ops}
    for op in rs.ops:
        before = {"B": "F", "W": "B"}.get(op.kind)
        if before and op.start < ends.get((before, op.chunk, op.mb), float("inf")):
            what = "forward" if before == "F" else "input gradient (B)"
            problems.append(f"{where}: {op.kind} chunk {op.chunk} mb {op.mb} starts before its {what} ended")
    for a, b in zip(rs.ops, rs.ops[1:]):
        if b.start < a.end:
            problems.append(f"{where}: {b.kind}{b.chunk}.{b.mb} starts before {a.kind}{a.chunk}.{a.mb} ended")
    order = [(op.kind, op.chunk, op.mb) for op in rs.ops]
    if rs.ours:
        scheduled = get_order(rs)
        expected, who = get_recorded_order(scheduled, rs.pp_rank), f"{rs.schedule}'s order"
        bound = round(get_in_flight_peak(scheduled, rs.pp_rank) * v)
    else:
        expected, who = get_schedule_order(rs.pp_rank, rs.pp_size, v, m, group_size), "megatron-core's schedule"
        bound = get_in_flight_bound(rs.pp_rank, rs.pp_size, v, m, group_size)
    if order != expected:
        i = next((i for i, (a, b) in enumerate(zip(order, expected)) if a != b), min(len(order), len(expected)))
        problems.append(f"{where}: op {i} is {order[i : i + 3]}, {who} runs {expected[i : i + 3]}")
    if get_max_in_flight(rs.ops) > bound:
        problems.append(f"{where}: {get_max_in_flight(rs.ops)} micro-batch chunks in flight, bound {bound}")
    return problems


def check_pipeline_dependencies(steps: list[RankStep], tolerance: float = 0.0) -> list[str]:
    """Across the ranks of one pipeline (one clock): F of micro-batch i on stage s starts after F of i
    ended on s-1; B on s starts after B ended on s+1 (stage s of a chunk by the step's placement:
    loop s = c p + r, or V). A W follows its own B on its rank (``check_rank_step``)."""
    num_stages = steps[0].pp_size * steps[0].vp_size
    ends = {(op.kind, rs.stage_of(op.chunk), op.mb): op.end for rs in steps for op in rs.ops}
    problems = []
    for rs in steps:
        for op in rs.ops:
            if op.kind == "W":
                continue
            s = rs.stage_of(op.chunk)
            dep = ("F", s - 1, op.mb) if op.kind == "F" else ("B", s + 1, op.mb)
            if not 0 <= dep[1] < num_stages:
                continue
            if dep not in ends:
                problems.append(f"rank {rs.rank}: {op.kind} stage {s} mb {op.mb}: no record of {dep}")
            elif op.start + tolerance < ends[dep]:
                problems.append(
                    f"rank {rs.rank}: {op.kind} stage {s} mb {op.mb} starts "
                    f"{(ends[dep] - op.start) * 1e3:.3f} ms before {dep} ended"
                )
    return problems


def check_schedule(step_records: dict[int, list[dict]], group_size: int | None = None) -> list[str]:
    """All problems of one recorded step ({rank: records}); empty when it is a valid schedule.
    Cross-rank checks apply to each pipeline whose every stage was traced."""
    steps = [parse_rank_step(recs) for _, recs in sorted(step_records.items())]
    problems = [msg for rs in steps for msg in check_rank_step(rs, group_size)]
    for pipeline in get_pipelines(steps).values():
        if sorted(rs.pp_rank for rs in pipeline) == list(range(pipeline[0].pp_size)):
            problems += check_pipeline_dependencies(pipeline)
    return problems


def get_pipelines(steps: list[RankStep]) -> dict[int, list[RankStep]]:
    out: dict[int, list[RankStep]] = {}
    for rs in steps:
        out.setdefault(rs.pipeline, []).append(rs)
    return out


@dataclasses.dataclass(frozen=True)
class BubbleStats:
    rank: int
    pp_rank: int
    span: float  # seconds, first forward -> last backward of the rank's pipeline (all its ranks)
    busy: float  # seconds of forward + backward on this rank
    theory: float  # (p-1)/(m v)

    @property
    def idle_over_span(self) -> float:
        return (self.span - self.busy) / self.span

    @property
    def idle_over_busy(self) -> float:
        """The bubble relative to ideal compute, comparable to (p-1)/(m v)."""
        return (self.span - self.busy) / self.busy


def get_bubble_stats(step_records: dict[int, list[dict]]) -> list[BubbleStats]:
    """Per rank: idle time inside its pipeline's compute span. With uniform stages and free P2P,
    idle/busy = (p-1)/(m v) on every rank and idle/span = (p-1)/(m v + p - 1)."""
    steps = [parse_rank_step(recs) for _, recs in sorted(step_records.items())]
    out = []
    for pipeline in get_pipelines(steps).values():
        t0 = min(op.start for rs in pipeline for op in rs.ops)
        t1 = max(op.end for rs in pipeline for op in rs.ops)
        for rs in pipeline:
            out.append(
                BubbleStats(
                    rs.rank,
                    rs.pp_rank,
                    t1 - t0,
                    sum(op.end - op.start for op in rs.ops),
                    get_bubble_theory(rs.pp_size, rs.num_microbatches, rs.vp_size),
                )
            )
    return sorted(out, key=lambda b: b.rank)


def simulate_schedule(
    pp_size: int,
    vp_size: int,
    num_microbatches: int,
    t_forward: float,
    t_backward: float,
    hop: float = 0.0,
    group_size: int | None = None,
) -> dict[int, list[Op]]:
    """Discrete-event model of megatron-core's schedule (``get_schedule_order`` on every rank) in
    the one execution model our own orders use (``megatron_ext.pipeline.simulate``): an op starts
    when its rank is free and its input is there, an input made on another rank arriving ``hop``
    seconds after its producer ended. ``t_forward`` / ``t_backward`` (the whole backward) are per
    chunk. Returns {pp_rank: ops}."""
    from megatron_ext.pipeline.schedules.one_f_one_b import build_megatron_core_order
    from megatron_ext.pipeline.simulate import StageCosts

    order = build_megatron_core_order("megatron-core", pp_size, vp_size, num_microbatches, group_size)
    costs = StageCosts.uniform(pp_size * vp_size, t_forward, t_backward, 0.0)
    return simulate_order_ops(order, costs, hop)


def simulate_order_ops(order, costs, hop: float = 0.0) -> dict[int, list[Op]]:
    """Any ``PipelineOrder`` (ours or megatron-core's) through ``megatron_ext.pipeline.simulate``, as
    {pp_rank: ops} with chunks (a whole backward "BW" reported as "B", as the timeline records it)."""
    from megatron_ext.pipeline.simulate import simulate_order

    sim = simulate_order(order, costs, hop)
    return {
        r: [
            Op(
                "B" if t.action.kind == "BW" else t.action.kind,
                order.chunk_of(t.action.stage),
                t.action.mb,
                t.start,
                t.end,
            )
            for t in ops
        ]
        for r, ops in enumerate(sim.ranks)
    }


def to_records(
    ops_by_rank: dict[int, list[Op]], pp_size: int, vp_size: int, num_microbatches: int, step: int = 1
) -> dict[int, list[dict]]:
    """Simulated ops in the trace's record format ({rank: records}), e.g. to check or plot them."""
    out = {}
    for r, ops in ops_by_rank.items():
        end = max(op.end for op in ops)
        meta = {
            "kind": "step",
            "step": step,
            "rank": r,
            "pp_rank": r,
            "pp_size": pp_size,
            "vp_size": vp_size,
            "pipeline": 0,
            "num_microbatches": num_microbatches,
            "start": 0.0,
            "end": end,
        }
        out[r] = [meta] + [
            {"kind": op.kind, "step": step, "chunk": op.chunk, "mb": op.mb, "start": op.start, "end": op.end}
            for op in ops
        ]
    return out


def get_p2p_waits(step_records: dict[int, list[dict]]) -> list[float]:
    """Seconds from a producer's end to its consumer's start on another rank, for every op whose
    rank was idle waiting for that input (the P2P latency as the pipeline saw it)."""
    steps = [parse_rank_step(recs) for _, recs in sorted(step_records.items())]
    waits = []
    for pipeline in get_pipelines(steps).values():
        ends = {(op.kind, rs.stage_of(op.chunk), op.mb): (op.end, rs.pp_rank) for rs in pipeline for op in rs.ops}
        for rs in pipeline:
            for prev, op in zip(rs.ops, rs.ops[1:]):
                if op.kind == "W":
                    continue
                s = rs.stage_of(op.chunk)
                dep = ("F", s - 1, op.mb) if op.kind == "F" else ("B", s + 1, op.mb)
                if dep in ends and ends[dep][1] != rs.pp_rank and ends[dep][0] > prev.end:
                    waits.append(op.start - ends[dep][0])
    return waits


def get_model_bubbles(step_records: dict[int, list[dict]]) -> dict[int, float]:
    """{rank: idle / busy} in the hop-0 model of the step's own order, with each stage's F, B and W
    costs the medians of the recorded spans (stage 0's B + W as recorded in its W slot): the bubble
    the order itself implies, to print beside the measured one (``BubbleStats.idle_over_busy``)."""
    from megatron_ext.pipeline.simulate import StageCosts, simulate_order

    steps = [parse_rank_step(recs) for _, recs in sorted(step_records.items())]
    out = {}
    for pipeline in get_pipelines(steps).values():
        first = pipeline[0]
        order = get_order(first)
        num_stages = first.pp_size * first.vp_size
        spans: dict[tuple[str, int], list[float]] = {}
        for rs in pipeline:
            for op in rs.ops:
                spans.setdefault((op.kind, rs.stage_of(op.chunk)), []).append(op.end - op.start)
        cost = {k: statistics.median(v) for k, v in spans.items()}
        split = order.splits_backward
        costs = StageCosts(
            tuple(cost.get(("F", s), 0.0) for s in range(num_stages)),
            tuple(cost.get(("B", s), 0.0) for s in range(num_stages)),
            tuple(cost.get(("W", s), 0.0) if split else 0.0 for s in range(num_stages)),
            first_stage_backward_in_w=split,
        )
        sim = simulate_order(order, costs)
        for rs in pipeline:
            busy = sum(t.end - t.start for t in sim.ranks[rs.pp_rank])
            out[rs.rank] = (sim.makespan - busy) / busy
    return out
