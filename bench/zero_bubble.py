"""Zero-bubble schedules on the simulated device: ours against torch.distributed.pipelining's, side by side.

    python -m bench.schedule --zero-bubble [--layers 8 16] [--microbatches 8 16] [--wgrad 1 0.5]
                                           [--rounds 5] [--warmup 1] [--layer-ms 25]

PP = 4 (4 forked gloo ranks), micro-batches of [s=64, b=1, h=128] fp32. Every layer is
``bench/simdevice.py``'s SplitSimLayer: forward ``--layer-ms`` (t), input gradient t, weight gradient
``--wgrad`` x t, the input path and the weight path two autograd nodes, so torch's zero-bubble
schedules can run W later; under our runtime the weight path goes through the rank's W queue, as the
real linears' do. Stage 0 starts with a free "embedding" parameter so that its first layer's input
path runs as every other's. A configuration is (layers L, micro-batches m, t_W).

Variants, alternated A B C ... per round, ``--warmup`` rounds dropped, medians over ``--rounds``:
- ours: 1F1B and Interleaved1F1B (megatron-core's schedules, v = 2), ZBH1, InterleavedZeroBubble
  (v = 2) and ZBVZeroBubble (V) on ``megatron_ext/pipeline``'s runtime, as training runs them;
- torch: Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
  ScheduleDualPipeV on PipelineStages of the same layers.
Stage 0: torch does not split its backward (its I does nothing, its W runs the whole backward); ours
makes the same choice (``pipeline/runtime.py``), so both pay the same compute per rank.

Printed per variant: median step (last rank's end - first rank's start, one host clock, each step
from a barrier), overhead = step / ideal - 1 with ideal = m (L/p)(2t + t_W) (every rank's compute,
the same for all), the hop-0 model of the variant's own order (``megatron_ext.pipeline.simulate``;
torch's orders read from its schedule objects), runtime excess = measured overhead - model, and peak
saved-activation bytes on rank 0 (one extra step with zero-cost layers, ``SavedTensorMeter``; a
deferred W's input counted until it ran). Then each target of the zero-bubble issue beside its figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.simdevice import SavedTensorMeter, SimChunk, SimStage
from megatron_ext.pipeline.actions import BW, Action, B, F, PipelineOrder, W
from megatron_ext.pipeline.schedules import get_order
from megatron_ext.pipeline.simulate import StageCosts, simulate_order

P, SEQ, MICRO_BATCH, HIDDEN = 4, 64, 1, 128
OURS = ("1F1B", "Interleaved1F1B", "ZBH1", "InterleavedZeroBubble", "ZBVZeroBubble")
TORCH = (
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
ZB_OURS = ("ZBH1", "InterleavedZeroBubble", "ZBVZeroBubble")
CHUNKS = {"1F1B": 1, "ZBH1": 1, "Schedule1F1B": 1}  # every other variant: 2 chunks per rank
V_SHAPED = ("ZBVZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# targets (issue "Zero-bubble pipeline schedules")
TARGET_SPEED_MEDIAN, TARGET_SPEED_EACH = 1.00, 1.03
TARGET_EXCESS = 0.02
TARGET_ZBH1 = 0.03
ZBH1_MODEL = {1.0: 0.818, 0.5: 0.891}  # T(ZBH1)/T(1F1B) at p = 4, m = 8 (the ZB paper's bubbles)


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    microbatches: int
    wgrad: float  # t_W / t

    def __str__(self) -> str:
        return f"L={self.layers} m={self.microbatches} t_W={self.wgrad:g}t"


def get_stages(rank: int, name: str) -> list[int]:
    """The stages ``rank`` runs under variant ``name``, by local chunk."""
    from megatron_ext.pipeline.placement import get_rank_stages

    return get_rank_stages(rank, P, CHUNKS.get(name, 2), "v" if name in V_SHAPED else "loop")


# ---- ours ----


def _loss_func(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator) if model.pre_process else None
    return model(batch), _loss_func


def build_ours(rank: int, name: str, cfg: Config, layer_s: float):
    """A callable running one step of our variant ``name`` on this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.pipeline.runtime import ScheduleRuntime
    from megatron_ext.pipeline.wgrad_queue import WeightGradQueue

    v = CHUNKS.get(name, 2)
    config = TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=P,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        microbatch_group_size_per_vp_stage=P,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=False,
        overlap_p2p_comm=name == "Interleaved1F1B",
        batch_p2p_comm=name == "1F1B",
    )  # as model/gpt.py sets them
    rate = layer_s / (SEQ * MICRO_BATCH)
    layers = cfg.layers // (P * v)
    model = [
        SimChunk(config, layers, rate, pre_process=stage == 0, split=(rate, rate * cfg.wgrad), embed=True)
        for stage in get_stages(rank, name)
    ]
    runtime = None
    if name in ZB_OURS:
        queue = WeightGradQueue()
        for chunk in model:
            for layer in chunk.layers:
                layer.wgrad_queue = queue
        runtime = ScheduleRuntime(name, ps.get_pipeline_model_parallel_group(), rank, P, v, queue)

    def step() -> None:
        batches = [torch.randn(SEQ, MICRO_BATCH, HIDDEN) for _ in range(cfg.microbatches)]  # [s, b, h]
        iterators = [iter(batches) for _ in model]
        kwargs = dict(
            forward_step_func=_forward_step,
            model=model,
            num_microbatches=cfg.microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        if runtime is not None:
            runtime.run(data_iterator=iterators, **kwargs)
        else:
            ps.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
            get_forward_backward_func()(data_iterator=iterators if v > 1 else iterators[0], **kwargs)

    return step, runtime


# ---- torch.distributed.pipelining ----


def build_torch(rank: int, name: str, cfg: Config, layer_s: float):
    """A callable running one step of torch's ``name`` on this rank, and the schedule object."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    v = CHUNKS.get(name, 2)
    rate = layer_s / (SEQ * MICRO_BATCH)
    layers = cfg.layers // (P * v)
    stage_ids = get_stages(rank, name)
    stages = [
        PipelineStage(
            SimStage(layers, rate, split=(rate, rate * cfg.wgrad), embed=s == 0), s, P * v, torch.device("cpu")
        )
        for s in stage_ids
    ]
    loss_fn = lambda output, target: output.float().mean()  # noqa: E731  the same loss as ours
    cls = getattr(pipelining.schedules, name)
    schedule = cls(stages[0] if v == 1 else stages, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    first, last = 0 in stage_ids, P * v - 1 in stage_ids
    m = cfg.microbatches

    def step() -> None:
        args = (torch.randn(m * MICRO_BATCH, SEQ, HIDDEN),) if first else ()  # [b, s, h], split on dim 0
        kwargs = dict(target=torch.zeros(m * MICRO_BATCH), losses=[]) if last else {}
        schedule.step(*args, **kwargs)

    return step, schedule


def get_torch_order(schedule, name: str, m: int) -> PipelineOrder:
    """torch's per-rank order (its schedule object's own) as our action lists: F, I -> B, W, the
    whole backward -> BW, an overlapped F+B as its two actions."""
    v = CHUNKS.get(name, 2)
    if name == "Schedule1F1B":
        # Schedule1F1B's step runs the standard 1F1B loop; its _get_pipeline_order (an IR for
        # visualisation) starts the last rank at micro-batch 1 in 2.13: take the order the step runs
        return dataclasses.replace(get_order("1F1B", P, 1, m), name=name)
    raw = schedule.pipeline_order
    kinds = {"F": F, "I": B, "W": W, "B": BW}
    ranks = []
    for r in range(P):
        subs = [
            sub
            for a in raw[r]
            if a is not None
            for sub in (a.sub_actions or (a,))
            if sub.computation_type.value in kinds
        ]  # not REDUCE_GRAD and the like
        ranks.append(tuple(Action(kinds[a.computation_type.value], a.stage_index, a.microbatch_index) for a in subs))
    return PipelineOrder(name, P, v, m, "v" if name in V_SHAPED else "loop", tuple(ranks))


# ---- the rank worker ----


def _timed(fn) -> tuple[float, float]:
    dist.barrier()
    start = time.time()
    fn()
    return start, time.time()


def measure_config(rank: int, cfg: Config, args: argparse.Namespace) -> dict:
    """This rank's step spans per variant, and (rank 0) the variants' orders."""
    layer_s = args.layer_ms / 1e3
    variants = {}
    for name in OURS:
        variants["ours " + name] = build_ours(rank, name, cfg, layer_s)
    for name in TORCH:
        variants["torch " + name] = build_torch(rank, name, cfg, layer_s)
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for it in range(args.warmup + args.rounds):
        for label, (step, _) in variants.items():
            span = _timed(step)
            if it >= args.warmup:
                spans[label].append(span)
    orders = {}
    if rank == 0:
        for label, (_, obj) in variants.items():
            name = label.split()[1]
            orders[label] = (
                get_torch_order(obj, name, cfg.microbatches)
                if label.startswith("torch")
                else get_order(name, P, CHUNKS.get(name, 2), cfg.microbatches)
            )
    memory = {label: _peak_bytes(rank, label, cfg) for label in variants}
    return {"spans": spans, "orders": orders, "memory": memory}


def _peak_bytes(rank: int, label: str, cfg: Config) -> int:
    """Peak saved-activation bytes of one step of ``label`` on this rank, zero-cost layers."""
    build = build_ours if label.startswith("ours") else build_torch
    step, _ = build(rank, label.split()[1], cfg, 0.0)
    step()  # torch infers its stage shapes in the first step
    meter = SavedTensorMeter()
    dist.barrier()
    with meter.track():
        step()
    return meter.peak


def bench_worker(rank: int, world_size: int, args: argparse.Namespace, configs: list[Config]) -> dict:
    from megatron.core import parallel_state as ps

    from bench.schedule import measure_hop
    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    ps.initialize_model_parallel(pipeline_model_parallel_size=P, create_gloo_process_groups=False)
    torch.manual_seed(rank)
    out = {"hop": measure_hop(rank), "configs": {}}
    for cfg in configs:
        out["configs"][cfg] = measure_config(rank, cfg, args)
    ps.destroy_model_parallel()
    return out


# ---- report ----


def _step_times(per_rank: list[dict], cfg: Config, label: str) -> list[float]:
    rounds = zip(*(r["configs"][cfg]["spans"][label] for r in per_rank))  # per round: (start, end) per rank
    return [max(e for _, e in rnd) - min(b for b, _ in rnd) for rnd in rounds]


def summarize_config(per_rank: list[dict], cfg: Config, layer_s: float) -> dict:
    """{label: {step, overhead, model, excess, memory}} of one configuration."""
    ideal = cfg.microbatches * (cfg.layers / P) * (2 + cfg.wgrad) * layer_s
    out = {}
    for label, order in per_rank[0]["configs"][cfg]["orders"].items():
        t_chunk = cfg.layers // order.num_stages * layer_s
        costs = StageCosts.uniform(
            order.num_stages, t_chunk, t_chunk, cfg.wgrad * t_chunk, first_stage_backward_in_w=True
        )
        model = simulate_order(order, costs).makespan / ideal - 1
        step = statistics.median(_step_times(per_rank, cfg, label))
        out[label] = dict(
            step=step,
            overhead=step / ideal - 1,
            model=model,
            excess=step / ideal - 1 - model,
            memory=per_rank[0]["configs"][cfg]["memory"][label],
        )
    return out


def print_config(cfg: Config, rows: dict, layer_ms: float) -> None:
    print(
        f"\n{cfg} (t = {layer_ms:g} ms per layer forward), ideal step "
        f"{cfg.microbatches * (cfg.layers / P) * (2 + cfg.wgrad) * layer_ms:.0f} ms"
    )
    print(f"{'variant':<38} {'step ms':>9} {'overhead':>9} {'hop-0 model':>12} {'excess':>8} {'rank-0 act. B':>14}")
    for label, r in rows.items():
        print(
            f"{label:<38} {r['step'] * 1e3:>9.1f} {r['overhead']:>9.4f} {r['model']:>12.4f} {r['excess']:>8.4f} "
            f"{r['memory']:>14,}"
        )


def check_targets(results: dict[Config, dict]) -> list[tuple[str, str, str, bool]]:
    """(what, figure, target, met) per target and configuration."""
    ok, out = lambda c: bool(c), []  # noqa: E731
    ratios = []
    for cfg, rows in results.items():
        zb = {name: rows["ours " + name] for name in ZB_OURS}
        best = min(zb, key=lambda n: zb[n]["step"])
        best_model = min(r["model"] for r in zb.values())
        torch_zbv = rows["torch ScheduleZBVZeroBubble"]
        out.append(
            (
                f"{cfg}: best ZB hop-0 bubble (ours) vs torch ZBV's",
                f"{best_model:.4f} vs {torch_zbv['model']:.4f}",
                "<=",
                ok(best_model <= torch_zbv["model"] + 1e-9),
            )
        )
        ratio = zb[best]["step"] / torch_zbv["step"]
        ratios.append(ratio)
        mem_ok = zb[best]["memory"] <= rows["ours 1F1B"]["memory"]
        out.append(
            (
                f"{cfg}: T(ours {best}) / T(torch ZBV), rank-0 act. vs ours 1F1B",
                f"{ratio:.3f}, {zb[best]['memory']:,} vs {rows['ours 1F1B']['memory']:,} B",
                f"<= {TARGET_SPEED_EACH}, <=",
                ok(ratio <= TARGET_SPEED_EACH and mem_ok),
            )
        )
        bound = rows["ours 1F1B"]["excess"] + TARGET_EXCESS
        for name, r in zb.items():
            out.append(
                (
                    f"{cfg}: runtime excess of ours {name}",
                    f"{r['excess']:.4f}",
                    f"<= {bound:.4f}",
                    ok(r["excess"] <= bound),
                )
            )
        if cfg.microbatches == 8 and cfg.wgrad in ZBH1_MODEL:
            measured = rows["ours ZBH1"]["step"] / rows["ours 1F1B"]["step"]
            target = ZBH1_MODEL[cfg.wgrad]
            equal_mem = rows["ours ZBH1"]["memory"] == rows["ours 1F1B"]["memory"]
            out.append(
                (
                    f"{cfg}: T(ZBH1) / T(ours 1F1B), rank-0 act. equal",
                    f"{measured:.3f}, {equal_mem}",
                    f"{target} +- {TARGET_ZBH1}",
                    ok(abs(measured - target) <= TARGET_ZBH1 and equal_mem),
                )
            )
    median = statistics.median(ratios)
    out.append(
        (
            "median over the configurations of T(our best ZB) / T(torch ZBV)",
            f"{median:.3f}",
            f"<= {TARGET_SPEED_MEDIAN}",
            ok(median <= TARGET_SPEED_MEDIAN),
        )
    )
    return out


def main(argv: list[str] | None = None) -> None:
    from megatron_ext.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16], help="layers L (multiples of 8)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16], help="micro-batches per step m")
    parser.add_argument("--wgrad", type=float, nargs="+", default=[1.0, 0.5], help="t_W / t")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one step of each variant per round)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds dropped first")
    parser.add_argument("--layer-ms", type=float, default=25.0, help="forward ms of one layer (t)")
    args = parser.parse_args(argv)
    configs = [Config(*c) for c in itertools.product(args.layers, args.microbatches, args.wgrad)]
    bad = [c for c in configs if c.layers % (2 * P)]
    if bad:
        parser.error(f"--layers must be multiples of {2 * P} (2 chunks per rank): {[c.layers for c in bad]}")
    torch.set_num_threads(1)
    start, load_before = time.perf_counter(), os.getloadavg()
    per_rank = run_ranks(bench_worker, P, args, configs, timeout=600 * len(configs))
    load_after = os.getloadavg()
    hop = statistics.median(r["hop"] for r in per_rank)
    print(
        f"PP={P}, micro-batch [{SEQ}, {MICRO_BATCH}, {HIDDEN}] fp32, t = {args.layer_ms:g} ms per layer forward, "
        f"B = t, W = t_W; {args.rounds} rounds after {args.warmup} warm-up, variants alternated"
    )
    print(
        f"measured P2P hop (ping-pong, one way, median): {hop * 1e3:.3f} ms; load average (1, 5, 15 min) "
        f"before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, after {load_after[0]:.1f} "
        f"{load_after[1]:.1f} {load_after[2]:.1f} (2 cores)"
    )
    results = {}
    for cfg in configs:
        results[cfg] = summarize_config(per_rank, cfg, args.layer_ms / 1e3)
        print_config(cfg, results[cfg], args.layer_ms)
    print(f"\n{'target':<72} {'figure':>30} {'target':>14}  result")
    for what, figure, target, met in check_targets(results):
        print(f"{what:<72} {figure:>30} {target:>14}  {'PASS' if met else 'FAIL'}")
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
