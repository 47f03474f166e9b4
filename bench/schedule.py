"""Pipeline schedule efficiency on a simulated device: 1F1B vs interleaved (VPP=2), ours
(megatron-core's schedules) vs torch.distributed.pipelining, bubble vs theory, activation memory.

    python -m bench.schedule [--steps 8] [--warmup 1] [--chunk-ms 100] [--trace-dir DIR]
    python -m bench.schedule --zero-bubble [...]   (ours vs torch's zero-bubble schedules: bench/zero_bubble.py)

Pinned: PP=4 (4 forked gloo ranks), m=8 micro-batches of [s=64, b=1, h=128] fp32, 8 simulated
layers (``bench/simdevice.py``: forward sleeps t per token, backward 2t); a VPP chunk (1 layer)
forwards in ``--chunk-ms`` (100 ms by default; keep >= 50), a 1F1B stage (2 layers) in twice that. Ideal (bubble-free) step:
m x 3 x (2 x chunk-ms) = 4.8 s at the default, on every rank, for every schedule.

- ours: the simulated chunks (``SimChunk``: megatron-core ``config``, ``model_type``,
  ``set_input_tensor``) through ``megatron.core.pipeline_parallel.get_forward_backward_func()``
  with our CPU platform layer and megatron-core's parallel_state groups, with the config our
  ``model.py`` uses (interleaved: overlap_p2p_comm, no batched P2P; 1F1B: batched P2P; no
  output deallocation on CPU); traced by ``megatron_ext.training.timeline`` (as ``--pp-timeline``),
  whose traces also give the P2P wait the pipeline actually saw (printed beside the ping-pong
  hop: on a loaded machine its tail, not its median, is what costs).
- torch: the same layers and costs as ``PipelineStage``s under ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B`` (stages r and r+4 on rank r, as ours).
The four variants alternate A B C D per round, ``--warmup`` rounds dropped, medians over
``--steps`` rounds. Step time = last rank's end - first rank's start (one host clock), every step
starting from a barrier.

Hop-adjusted predictions: the P2P hop is measured first (ping-pong of one [64, 1, 128] fp32
activation between neighbouring ranks, one way = round trip / 2); ``simulate_schedule`` (a
discrete-event model of megatron-core's per-rank order, each activation / gradient arriving one
hop after its producer ended) gives the step time each schedule should take with that hop.

Memory: saved-tensor bytes (``saved_tensors_hooks``, exact) on rank 0, peak over one step at
m = 4, 8, 16, zero-cost layers. 1F1B holds p micro-batches of L/p layers at most, whatever m;
interleaved holds 2(p-1) + (v-1)p + 1 chunk-micro-batches of L/(pv) layers (1.375x at p=4, v=2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.simdevice import SavedTensorMeter, SimChunk, SimStage  # noqa: E402
from megatron_ext.testing import run_ranks  # noqa: E402
from megatron_ext.training.timeline import PipelineTimeline  # noqa: E402
from tools.timeline_analysis import (  # noqa: E402
    get_bubble_theory,
    get_in_flight_bound,
    get_p2p_waits,
    read_timeline,
    simulate_schedule,
)

P, M, V = 4, 8, 2
NUM_LAYERS = 8
SEQ, MICRO_BATCH, HIDDEN = 64, 1, 128
MEMORY_MS = (4, 8, 16)
VARIANTS = ("ours 1F1B", "ours VPP2", "torch 1F1B", "torch VPP2")
TARGET_VPP = 0.97  # x the hop-adjusted ideal
TARGET_BUBBLE = 0.03  # over the hop-adjusted prediction
TARGET_PEER = 1.00
TARGET_MEM_FLAT, TARGET_MEM_VPP = 0.01, 1.5


# ---- ours: megatron-core's schedules ----


def _loss_func(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator) if model.pre_process else None
    return model(batch), _loss_func


def build_megatron_variant(rank: int, vp: int | None, seconds_per_token: float) -> list[SimChunk]:
    """This rank's chunks: one of L/p layers (1F1B) or v of L/(p v) layers (interleaved)."""
    from megatron.core.transformer import TransformerConfig

    interleaved = vp is not None
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=P,
        virtual_pipeline_model_parallel_size=vp,
        microbatch_group_size_per_vp_stage=P,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=False,
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
    )
    num_chunks = vp or 1
    layers = NUM_LAYERS // (P * num_chunks)
    return [SimChunk(config, layers, seconds_per_token, pre_process=(rank == 0 and c == 0)) for c in range(num_chunks)]


def run_megatron_step(model: list[SimChunk], vp: int | None, num_microbatches: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.set_virtual_pipeline_model_parallel_world_size(vp)
    batches = [torch.randn(SEQ, MICRO_BATCH, HIDDEN) for _ in range(num_microbatches)]  # [s, b, h]
    iterators = [iter(batches) for _ in model]
    get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )


# ---- torch.distributed.pipelining ----


def build_torch_variant(rank: int, vp: int | None, seconds_per_token: float):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    num_chunks = vp or 1
    layers = NUM_LAYERS // (P * num_chunks)
    stages = [
        PipelineStage(SimStage(layers, seconds_per_token), c * P + rank, P * num_chunks, torch.device("cpu"))
        for c in range(num_chunks)
    ]
    loss_fn = lambda output, target: output.float().mean()  # noqa: E731  same loss as ours
    if vp is None:
        return Schedule1F1B(stages[0], n_microbatches=M, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=loss_fn)


def run_torch_step(schedule, rank: int) -> None:
    if rank == 0:
        schedule.step(torch.randn(M * MICRO_BATCH, SEQ, HIDDEN))  # [b, s, h], split on dim 0
    elif rank == P - 1:
        schedule.step(target=torch.zeros(M * MICRO_BATCH), losses=[])
    else:
        schedule.step()


# ---- the rank worker ----


def measure_hop(rank: int, iters: int = 200) -> float:
    """One-way P2P time of one activation between neighbours (0<->1 and 2<->3 at once)."""
    peer = rank ^ 1
    buf = torch.randn(SEQ, MICRO_BATCH, HIDDEN)
    times = []
    for i in range(iters + 20):
        start = time.perf_counter()
        if rank % 2 == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def _timed(fn) -> tuple[float, float]:
    dist.barrier()
    start = time.time()
    fn()
    return start, time.time()


def bench_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_ext.cpu_platform import apply_cpu_platform

    apply_cpu_platform(torch.device("cpu"))
    ps.initialize_model_parallel(pipeline_model_parallel_size=P, create_gloo_process_groups=False)
    torch.manual_seed(rank)
    hop = measure_hop(rank)
    spt = args.chunk_ms / 1e3 / (SEQ * MICRO_BATCH)  # one layer = one VPP chunk = chunk_ms per micro-batch
    ours = {
        "ours 1F1B": (None, build_megatron_variant(rank, None, spt)),
        "ours VPP2": (V, build_megatron_variant(rank, V, spt)),
    }
    tracers = {
        name: PipelineTimeline(os.path.join(args.trace_dir, name.split()[1]), rank, rank, P, vp)
        for name, (vp, _) in ours.items()
    }
    torch_scheds = {"torch 1F1B": build_torch_variant(rank, None, spt), "torch VPP2": build_torch_variant(rank, V, spt)}
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for it in range(args.warmup + args.steps):
        for name in VARIANTS:
            if name in ours:
                vp, model = ours[name]
                with tracers[name].trace_step(it + 1):
                    span = _timed(lambda: run_megatron_step(model, vp, M))
            else:
                span = _timed(lambda: run_torch_step(torch_scheds[name], rank))
            if it >= args.warmup:
                spans[name].append(span)
    memory = measure_memory(rank)
    ps.destroy_model_parallel()
    return {"hop": hop, "spans": spans, "memory": memory}


def measure_memory(rank: int) -> dict[tuple[str, int], int]:
    """Peak saved-tensor bytes of one step per (schedule, m), zero-cost layers."""
    meter = SavedTensorMeter()
    out = {}
    for label, vp in (("1F1B", None), ("VPP2", V)):
        model = build_megatron_variant(rank, vp, 0.0)
        for m in MEMORY_MS:
            meter.reset()
            dist.barrier()
            with meter.track():
                run_megatron_step(model, vp, m)
            out[(label, m)] = meter.peak
    return out


# ---- report ----


def _median_step(per_rank: list[dict], name: str) -> float:
    steps = zip(*(r["spans"][name] for r in per_rank))  # per step: one (start, end) per rank
    return statistics.median(max(e for _, e in step) - min(s for s, _ in step) for step in steps)


def report(per_rank: list[dict], args: argparse.Namespace) -> None:
    t_chunk = args.chunk_ms / 1e3
    ideal = M * 3 * t_chunk * V  # per rank: m micro-batches x (F + 2F) x the stage's layers
    hop = statistics.median(r["hop"] for r in per_rank)
    T = {name: _median_step(per_rank, name) for name in VARIANTS}
    pred = predict_step_times(t_chunk, hop)
    waits = read_p2p_waits(args.trace_dir, args.warmup)
    _print_setup(args, hop, ideal, waits)
    print(f"{'variant':<12} {'median step ms':>15} {'hop-adjusted pred ms':>21} {'all steps ms':>s}")
    for name in VARIANTS:
        steps = [max(e for _, e in st) - min(s for s, _ in st) for st in zip(*(r["spans"][name] for r in per_rank))]
        p = pred[name.split()[1]]
        print(f"{name:<12} {T[name] * 1e3:>15.1f} {p * 1e3:>21.1f}   {' '.join(f'{s * 1e3:.0f}' for s in steps)}")
    _print_step_targets(T, pred, ideal)
    _print_memory(per_rank[0]["memory"])


def predict_step_times(t_chunk: float, hop: float) -> dict[str, float]:
    """{"1F1B", "VPP2": seconds} a step takes in ``simulate_schedule`` with P2P hop ``hop``."""
    pred = {}
    for name, v in (("1F1B", 1), ("VPP2", V)):
        ops = simulate_schedule(P, v, M, t_chunk * V / v, 2 * t_chunk * V / v, hop=hop)
        pred[name] = max(op.end for rank_ops in ops.values() for op in rank_ops)
    return pred


def read_p2p_waits(trace_dir: str, warmup: int) -> dict[str, list[float]]:
    """{"1F1B", "VPP2": the P2P waits our traces in ``trace_dir`` saw after the warm-up rounds}."""
    return {
        name: [
            w
            for step, by_rank in read_timeline(os.path.join(trace_dir, name)).items()
            if step > warmup
            for w in get_p2p_waits(by_rank)
        ]
        for name in ("1F1B", "VPP2")
    }


def _verdict(cond: bool) -> str:
    return "PASS" if cond else "FAIL"


def _print_setup(args: argparse.Namespace, hop: float, ideal: float, waits: dict[str, list[float]]) -> None:
    """The pinned shapes and costs, the measured hop and P2P waits, the load."""
    print(
        f"\nPP={P}, m={M}, {NUM_LAYERS} simulated layers, micro-batch [{SEQ}, {MICRO_BATCH}, {HIDDEN}] fp32; "
        f"VPP chunk forward {args.chunk_ms:.0f} ms, backward {2 * args.chunk_ms:.0f} ms; "
        f"{args.steps} steps per variant after {args.warmup} warm-up round(s), A B C D order"
    )
    print(
        f"measured P2P hop (ping-pong, one way, median): {hop * 1e3:.3f} ms;  ideal step m*3*t_stage = {ideal * 1e3:.0f} ms"
    )
    for name, w in waits.items():
        w = sorted(w)
        print(
            f"P2P wait seen in our {name} traces (producer end -> waiting consumer start): median "
            f"{statistics.median(w) * 1e3:.2f} ms, p90 {w[int(0.9 * len(w))] * 1e3:.2f} ms over {len(w)} waits"
        )
    print(f"load average while running: {os.getloadavg()[0]:.1f} (2 cores)\n")


def _print_step_targets(T: dict[str, float], pred: dict[str, float], ideal: float) -> None:
    """The step-time targets: VPP's gain, each schedule's overhead, ours against torch's."""
    ratio = T["ours 1F1B"] / T["ours VPP2"]
    ideal_ratio = (1 + get_bubble_theory(P, M)) / (1 + get_bubble_theory(P, M, V))
    hop_ratio = pred["1F1B"] / pred["VPP2"]
    print(f"\n{'quantity':<34} {'measured':>9} {'ideal':>7} {'hop-adj':>8} {'target':>16}  result")
    print(
        f"{'T(1F1B)/T(VPP2), ours':<34} {ratio:>9.3f} {ideal_ratio:>7.3f} {hop_ratio:>8.3f} "
        f"{'>= ' + format(TARGET_VPP * hop_ratio, '.3f'):>16}  {_verdict(ratio >= TARGET_VPP * hop_ratio)}"
    )
    for name, v in (("1F1B", 1), ("VPP2", V)):
        over = T[f"ours {name}"] / ideal - 1
        theory = get_bubble_theory(P, M, v)
        p = pred[name] / ideal - 1
        print(
            f"{'overhead step/ideal-1, ours ' + name:<34} {over:>9.4f} {theory:>7.4f} {p:>8.4f} "
            f"{'<= ' + format(p + TARGET_BUBBLE, '.4f'):>16}  {_verdict(over <= p + TARGET_BUBBLE)}"
        )
    for name in ("1F1B", "VPP2"):
        peer = T[f"ours {name}"] / T[f"torch {name}"]
        print(
            f"{'T_ours/T_torch ' + name:<34} {peer:>9.3f} {'':>7} {'':>8} {'<= 1.00':>16}  {_verdict(peer <= TARGET_PEER)}"
        )
    torch_over = {name: T[f"torch {name}"] / ideal - 1 for name in ("1F1B", "VPP2")}
    print(
        f"(torch.distributed.pipelining overheads: 1F1B {torch_over['1F1B']:.4f}, VPP2 {torch_over['VPP2']:.4f}; "
        f"its T(1F1B)/T(VPP2) = {T['torch 1F1B'] / T['torch VPP2']:.3f})"
    )


def _print_memory(mem: dict[tuple[str, int], int]) -> None:
    """Rank 0's peak saved-tensor bytes per (schedule, m) beside their bounds, and the memory targets."""
    act = SEQ * MICRO_BATCH * HIDDEN * 4  # bytes one layer saves per micro-batch
    print(f"\nactivation memory, rank 0, peak saved-tensor bytes of one step (one layer saves {act} B per micro-batch)")
    print(f"{'m':>4} {'1F1B':>10} {'bound':>10} {'VPP2':>10} {'bound':>10} {'VPP2/1F1B':>10}")
    for m in MEMORY_MS:
        b1 = get_in_flight_bound(0, P, 1, m) * (NUM_LAYERS // P) * act
        b2 = get_in_flight_bound(0, P, V, m) * (NUM_LAYERS // (P * V)) * act
        print(
            f"{m:>4} {mem[('1F1B', m)]:>10} {b1:>10} {mem[('VPP2', m)]:>10} {b2:>10} "
            f"{mem[('VPP2', m)] / mem[('1F1B', m)]:>10.3f}"
        )
    flat = [mem[("1F1B", m)] for m in MEMORY_MS]
    spread = max(flat) / min(flat) - 1
    worst = max(mem[("VPP2", m)] / mem[("1F1B", m)] for m in MEMORY_MS)
    print(
        f"1F1B flat in m: max/min - 1 = {spread:.4f} (target <= {TARGET_MEM_FLAT})  {_verdict(spread <= TARGET_MEM_FLAT)}"
    )
    print(f"VPP2 / 1F1B worst over m: {worst:.3f} (target <= {TARGET_MEM_VPP})  {_verdict(worst <= TARGET_MEM_VPP)}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--zero-bubble" in argv:
        from bench import zero_bubble

        zero_bubble.main([a for a in argv if a != "--zero-bubble"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="measured rounds (one step of each variant per round)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds dropped first")
    parser.add_argument("--chunk-ms", type=float, default=100.0, help="forward ms of one VPP chunk (keep >= 50)")
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="write our runs' timelines here (DIR/1F1B, DIR/VPP2; default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    args.trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="pp_timeline_")
    torch.set_num_threads(1)
    start = time.perf_counter()
    per_rank = run_ranks(bench_worker, P, args, timeout=1200)
    report(per_rank, args)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
