"""The time model: one training step's seconds for a layout, from FLOPs, the schedule's bubble on
the simulated device and communication volumes. Stated, not validated, except the pipeline part.

- Compute: Megatron-LM's model FLOPs (``training/metrics.num_floating_point_operations``; full
  recompute adds one forward, x 4/3) over ``peak_tflops x achievable`` per GPU (``achievable``
  stated, 0.5 by default: Megatron-Core's 41-48% MFU on H100, docs/benchmarks.md).
- Pipeline: the schedule's own action list run by ``pipeline/simulate.simulate_order`` with each
  stage's cost in units of the mean chunk-forward (``get_stage_costs``: its layers' FLOPs, plus the
  output layer's on the last stage; forward, input gradient and weight gradient alike) and the P2P
  hop in those units: step = makespan x one mean chunk-forward's seconds. The stage costs are what
  makes an uneven split (--decoder-first/last-pipeline-num-layers) faster when the last stage gives
  the output layer's share back in layers. This is the part a test checks against the simulated
  device (tests/unit/test_step_time.py).
- TP: per layer and micro-batch, 2 all-reduces forward and 2 backward of the [s, b, h] activation
  (sequence parallel: all-gathers and reduce-scatters of the same volume), ring cost 2 (t-1)/t x
  bytes at the intra-node bandwidth, not overlapped.
- DP: the gradient reduce (reduce-scatter + all-gather with the distributed optimizer: the same
  volume) 2 (d-1)/d x gradient bytes at the inter-node bandwidth; hidden behind the backward with
  --overlap-grad-reduce up to the backward's length, else exposed.
- CP (context parallelism, c ranks splitting each micro-batch of T tokens): compute, TP and PP
  traffic per rank are those of T / c tokens (the per-document head-tail layout balances attention
  work exactly); per layer and micro-batch, one all-gather of the local [K; V] forward and one
  reduce-scatter of their gradients backward, each (c-1)/c x T x 2 ng/TP x hn x bytes per rank, and
  one more all-gather per layer whose core attention is recomputed (selective or full recompute);
  intra-node while TP x CP fits a node (the CP ranks are TP apart), else inter-node; not overlapped.
  The DP gradient reduce runs over DP x CP (CP ranks hold the same parameters).
- PP: one [s/SP, b, h] message per micro-batch and stage boundary each way, inter-node.
Bandwidths are per GPU, stated defaults (H100 HGX: NVLink ~360 GB/s achieved of 450; 400 Gb/s
InfiniBand per GPU ~40 GB/s achieved).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_ext.pipeline.schedules import get_order
from megatron_ext.pipeline.simulate import StageCosts, simulate_order

# ----------------------------------------------------------------------------- orders


@functools.lru_cache(maxsize=2048)
def get_cached_order(schedule: str, pp: int, vp: int, m: int):
    """``pipeline.schedules.get_order``, once per (schedule, p, v, m) for the whole plan: the time model
    and the memory model (``predict.py``) read the same orders, and a greedy zero-bubble order takes
    0.1-0.5 s to generate."""
    return get_order(schedule, pp, vp, m)


DEFAULT_ACHIEVABLE = 0.5
DEFAULT_INTRA_NODE_GBPS = 360.0  # GB/s per GPU
DEFAULT_INTER_NODE_GBPS = 40.0
P2P_LATENCY_S = 20e-6


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu_memory_gib: float
    peak_tflops: float = 989.0  # dense bf16, H100 SXM
    achievable: float = DEFAULT_ACHIEVABLE
    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS


@dataclasses.dataclass(frozen=True)
class CPTraffic:
    """What context parallelism moves per layer and micro-batch (module docstring)."""

    size: int  # c
    kv_bytes_per_token: float  # 2 x query groups / TP x head dim x dtype bytes: one token's K and V
    recomputed: bool  # core attention recomputed (selective or full): one more all-gather per layer
    inter_node: bool  # the CP group spans nodes

    def get_bytes(self, tokens: int) -> float:
        """Bytes each rank moves per layer for a micro-batch of ``tokens`` (all CP ranks'): the
        forward all-gather, the backward reduce-scatter and the recompute's all-gather, each
        (c-1)/c x T x K/V bytes."""
        collectives = 3 if self.recomputed else 2
        return collectives * (self.size - 1) / self.size * tokens * self.kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float  # bubble-free compute per GPU (TP communication included)
    pipeline: float  # compute with the bubble: the schedule's makespan
    dp_exposed: float
    bubble: float  # pipeline / compute - 1
    comm_bytes: dict[str, float]  # per GPU per step: tp, cp (with CP), dp, pp

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_exposed


def get_stage_costs(stage_layers: list[int], head_layers: float) -> tuple[float, ...]:
    """Each stage's compute in units of the mean stage's: its layers, plus ``head_layers`` (the output
    layer's FLOPs in layers: 6 h V per token against a layer's) on the last stage; rounded so that
    equal layouts share one simulation. The embedding's lookup is left out (no FLOPs)."""
    loads = [float(n) for n in stage_layers]
    loads[-1] += head_layers
    mean = sum(loads) / len(loads)
    return tuple(round(x / mean, 4) for x in loads)


@functools.lru_cache(maxsize=4096)
def _simulate_units(
    schedule: str, pp: int, vp: int, m: int, hop_units: float, stage_costs: tuple[float, ...] | None
) -> float:
    order = get_cached_order(schedule, pp, vp, m)
    costs = StageCosts(stage_costs, stage_costs, stage_costs) if stage_costs else StageCosts.uniform(pp * vp, 1, 1, 1)
    return simulate_order(order, costs, hop=hop_units).makespan


def get_pipeline_units(
    schedule: str, pp: int, vp: int, m: int, hop_units: float, stage_costs: tuple[float, ...] | None = None
) -> tuple[float, float]:
    """(makespan, ideal) of the schedule in mean chunk-forward units (forward, B and W each 1 per
    chunk-micro-batch, or ``stage_costs[s]`` on stage s: ``get_stage_costs``). Beyond
    ``simulated`` = max(4 p, 16) micro-batches (a multiple of p) the steady state adds the same
    time per micro-batch: the makespan is extrapolated from the simulations at that m and p more
    (the greedy zero-bubble orders at m = 1536 would take minutes to generate)."""
    ideal = 3.0 * vp * m
    simulated = -(-max(4 * pp, 16) // pp) * pp
    if m <= simulated + pp:
        return _simulate_units(schedule, pp, vp, m, hop_units, stage_costs), ideal
    low = _simulate_units(schedule, pp, vp, simulated, hop_units, stage_costs)
    high = _simulate_units(schedule, pp, vp, simulated + pp, hop_units, stage_costs)
    return high + (high - low) / pp * (m - simulated - pp), ideal


def predict_step_time(
    cluster: Cluster,
    flops_per_step: float,
    tokens_per_microbatch: int,
    hidden: int,
    num_layers: int,
    tp: int,
    pp: int,
    vp: int,
    dp: int,
    m: int,
    schedule: str | None,
    sequence_parallel: bool,
    dtype_bytes: int,
    grad_bytes_per_gpu: float,
    overlap_grad_reduce: bool,
    stage_costs: tuple[float, ...] | None = None,
    cp: CPTraffic | None = None,
) -> StepTime:
    """Seconds per step (module docstring); ``flops_per_step`` of the whole global batch;
    ``tokens_per_microbatch`` all of a micro-batch's (T, over its CP ranks); ``stage_costs``
    relative per stage (``get_stage_costs``; None: uniform); ``cp`` None without CP."""
    c = cp.size if cp is not None else 1
    gpus = tp * pp * dp * c
    flops_time = flops_per_step / gpus / (cluster.peak_tflops * 1e12 * cluster.achievable)
    act = tokens_per_microbatch // c * hidden * dtype_bytes  # [s / c, b, h]
    tp_bytes = 4 * num_layers / pp * m * 2 * (tp - 1) / tp * act if tp > 1 else 0.0
    tp_time = tp_bytes / (cluster.intra_node_gbps * 1e9)
    cp_bytes = cp.get_bytes(tokens_per_microbatch) * num_layers / pp * m if cp is not None else 0.0
    cp_time = cp_bytes / (
        (cluster.inter_node_gbps if cp is not None and cp.inter_node else cluster.intra_node_gbps) * 1e9
    )
    compute = flops_time + tp_time + cp_time
    p2p_bytes = act / (tp if sequence_parallel else 1)
    if pp > 1:
        chunk_forward = compute / (m * vp * 3)  # one chunk-micro-batch's forward (backward twice that)
        hop = P2P_LATENCY_S + p2p_bytes / (cluster.inter_node_gbps * 1e9)
        hop_units = round(hop / chunk_forward, 4)
        makespan, ideal = get_pipeline_units(schedule or "1F1B", pp, vp, m, hop_units, stage_costs)
        pipeline = compute * makespan / ideal
    else:
        pipeline = compute
    reducers = dp * c  # the gradient reduce runs over DP x CP
    dp_bytes = 2 * (reducers - 1) / reducers * grad_bytes_per_gpu if reducers > 1 else 0.0
    dp_time = dp_bytes / (cluster.inter_node_gbps * 1e9)
    dp_exposed = max(0.0, dp_time - compute * 2 / 3) if overlap_grad_reduce else dp_time
    pp_bytes = 2 * m * vp * p2p_bytes if pp > 1 else 0.0
    comm = {"tp": tp_bytes} | ({"cp": cp_bytes} if cp is not None else {}) | {"dp": dp_bytes, "pp": pp_bytes}
    return StepTime(compute, pipeline, dp_exposed, pipeline / compute - 1, comm)
