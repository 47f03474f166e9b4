"""The time model: one training step's seconds for a layout, from FLOPs, the schedule's bubble on
the simulated device and communication volumes. Stated, not validated, except the pipeline part.

- Compute: Megatron-LM's model FLOPs (``training/metrics.num_floating_point_operations``; full
  recompute adds one forward, x 4/3) over ``peak_tflops x achievable`` per GPU (``achievable``
  stated, 0.5 by default: Megatron-Core's 41-48% MFU on H100, docs/benchmarks.md).
- Pipeline: the schedule's own action list run by ``pipeline/simulate.simulate_order`` with
  uniform chunk costs (forward 1, input gradient 1, weight gradient 1 per chunk-micro-batch) and
  the P2P hop in those units: step = makespan x one chunk-forward's seconds. This is the part a
  test checks against the simulated device (tests/unit/test_step_time.py).
- TP: per layer and micro-batch, 2 all-reduces forward and 2 backward of the [s, b, h] activation
  (sequence parallel: all-gathers and reduce-scatters of the same volume), ring cost 2 (t-1)/t x
  bytes at the intra-node bandwidth, not overlapped.
- DP: the gradient reduce (reduce-scatter + all-gather with the distributed optimizer: the same
  volume) 2 (d-1)/d x gradient bytes at the inter-node bandwidth; hidden behind the backward with
  --overlap-grad-reduce up to the backward's length, else exposed.
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
class StepTime:
    compute: float  # bubble-free compute per GPU (TP communication included)
    pipeline: float  # compute with the bubble: the schedule's makespan
    dp_exposed: float
    bubble: float  # pipeline / compute - 1
    comm_bytes: dict[str, float]  # per GPU per step: tp, dp, pp

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_exposed


@functools.lru_cache(maxsize=4096)
def _simulate_units(schedule: str, pp: int, vp: int, m: int, hop_units: float) -> float:
    order = get_cached_order(schedule, pp, vp, m)
    return simulate_order(order, StageCosts.uniform(pp * vp, 1.0, 1.0, 1.0), hop=hop_units).makespan


def get_pipeline_units(schedule: str, pp: int, vp: int, m: int, hop_units: float) -> tuple[float, float]:
    """(makespan, ideal) of the schedule in chunk-forward units (forward 1, B 1, W 1). Beyond
    ``simulated`` = max(4 p, 16) micro-batches (a multiple of p) the steady state adds the same
    time per micro-batch: the makespan is extrapolated from the simulations at that m and p more
    (the greedy zero-bubble orders at m = 1536 would take minutes to generate)."""
    ideal = 3.0 * vp * m
    simulated = -(-max(4 * pp, 16) // pp) * pp
    if m <= simulated + pp:
        return _simulate_units(schedule, pp, vp, m, hop_units), ideal
    low = _simulate_units(schedule, pp, vp, simulated, hop_units)
    high = _simulate_units(schedule, pp, vp, simulated + pp, hop_units)
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
) -> StepTime:
    """Seconds per step (module docstring); ``flops_per_step`` of the whole global batch."""
    gpus = tp * pp * dp
    flops_time = flops_per_step / gpus / (cluster.peak_tflops * 1e12 * cluster.achievable)
    act = tokens_per_microbatch * hidden * dtype_bytes  # [s, b, h]
    tp_bytes = 4 * num_layers / pp * m * 2 * (tp - 1) / tp * act if tp > 1 else 0.0
    tp_time = tp_bytes / (cluster.intra_node_gbps * 1e9)
    compute = flops_time + tp_time
    p2p_bytes = act / (tp if sequence_parallel else 1)
    if pp > 1:
        chunk_forward = compute / (m * vp * 3)  # one chunk-micro-batch's forward (backward twice that)
        hop = P2P_LATENCY_S + p2p_bytes / (cluster.inter_node_gbps * 1e9)
        makespan, ideal = get_pipeline_units(schedule or "1F1B", pp, vp, m, round(hop / chunk_forward, 4))
        pipeline = compute * makespan / ideal
    else:
        pipeline = compute
    dp_bytes = 2 * (dp - 1) / dp * grad_bytes_per_gpu if dp > 1 else 0.0
    dp_time = dp_bytes / (cluster.inter_node_gbps * 1e9)
    dp_exposed = max(0.0, dp_time - compute * 2 / 3) if overlap_grad_reduce else dp_time
    pp_bytes = 2 * m * vp * p2p_bytes if pp > 1 else 0.0
    return StepTime(
        compute, pipeline, dp_exposed, pipeline / compute - 1, {"tp": tp_bytes, "dp": dp_bytes, "pp": pp_bytes}
    )
