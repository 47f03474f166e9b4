"""The memory model (``megatron_ext/planning``) against one GPU: per variant, ``predict_memory``'s terms
beside what the step measurably holds (issue 32).

    python -m bench.gpu_memory [--only none selective full] [--micro-batches 4]
    python -m bench.gpu_memory --device cpu --tiny     # the same code path on a CPU (tiny Llama)

One process, TP = PP = DP = 1 (one GPU is one rank), ``bench.gpu_throughput.Ours`` (what pretrain_gpt.py
builds) on a Llama-style model of 0.93B parameters (16 x 2048, 16 heads in 4 KV groups, SwiGLU 5632,
RoPE, untied, GPT-2's vocabulary), seq 4096, micro-batch 1, bf16, ``--micro-batches`` per step. Variants:
no recompute, ``--recompute-granularity selective``, ``full`` (uniform, 1 layer a group). Per variant,
three steps: a warm-up (the optimizer's state is allocated in its first step), one under
``SavedBytesMeter`` (peak bytes autograd saved, one count per storage), one after
``torch.cuda.reset_peak_memory_stats()``. Printed per variant:

- ``predicted``: the rank's ``RankMemory``: state (weights, gradient buffers, optimizer), activations
  at the schedule's peak, temporaries, margin and the total, in bytes;
- ``state``: measured weights + DDP gradient buffers + optimizer state (``measure_state_bytes``)
  against the predicted state (exact but for bucket padding);
- ``saved``: the meter's peak against the predicted activations (the CPU tests hold it within 5%);
- ``allocated`` (CUDA only): ``torch.cuda.max_memory_allocated`` of the measured step (and the reserved
  peak) against the predicted total, and against the total without the margin (the margin covers what
  the allocator does not count: CUDA context, NCCL, fragmentation).

On the CPU (``--device cpu --tiny``: 2 x 64 at seq 128, vocabulary 1024) the allocator's figures do not
exist; the rest runs and is checked by tests/distributed/test_gpu_bench_smoke.py.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import gpu_throughput as throughput
from megatron_ext.config import JobConfig
from megatron_ext.data.tokenizers import build_tokenizer, get_tokenizer_args
from megatron_ext.planning.memory import GIB, RankMemory
from megatron_ext.planning.meter import SavedBytesMeter, measure_state_bytes
from megatron_ext.planning.predict import predict_memory

# ~1B Llama style at seq 4096: state ~16 GiB, activations 1-8 GiB by variant: every variant fits 80 GB
LLAMA_1B = {**throughput.LLAMA_24x2048, "num_layers": 16, "seq_length": 4096, "ffn_hidden_size": 5632}
VARIANTS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def predict(cfg: JobConfig) -> RankMemory:
    """``predict_memory`` of the one rank, for the tokenizer's vocabulary as the run builds it."""
    return predict_memory(cfg, 1, build_tokenizer(**get_tokenizer_args(cfg.data)).vocab_size)[0]


def measure(shape: dict, variant: str) -> tuple[JobConfig, dict]:
    """Three steps of the variant (module docstring): its config, and its state, peak saved bytes and
    CUDA peaks."""
    side = throughput.Ours(shape, 1, **VARIANTS[variant])
    try:
        side.step()
        out = {"state": measure_state_bytes(side.run.model, side.run.optimizer)}
        meter = SavedBytesMeter(p for chunk in side.run.model for p in chunk.parameters())
        with meter.track():
            side.step()
        out["saved"] = meter.peak
        if throughput.DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out["before"] = torch.cuda.memory_allocated()
            side.step()
            torch.cuda.synchronize()
            out["allocated"] = torch.cuda.max_memory_allocated()
            out["reserved"] = torch.cuda.max_memory_reserved()
        else:
            side.step()
        return side.cfg, out
    finally:
        side.close()
        del side
        throughput.free_memory()


def report(variant: str, want: RankMemory, got: dict) -> None:
    s = want.state
    print(f"== {variant}", flush=True)
    print(
        f"  predicted   state {s.total:,} (weights {s.parameters:,}, grads {s.gradients:,}, optimizer "
        f"{s.optimizer:,}) | activations {want.activations:,.0f} | temporaries {want.temporaries:,.0f} | "
        f"margin {want.margin:,.0f} | total {want.total:,.0f} bytes ({want.total / GIB:.2f} GiB)"
    )
    weights, grads, optimizer = got["state"]
    state = weights + grads + optimizer
    print(
        f"  state       measured {state:,} (weights {weights:,}, grads {grads:,}, optimizer {optimizer:,}) "
        f"| predicted/measured {s.total / state:.4f}"
    )
    print(
        f"  saved       measured peak {got['saved']:,} (SavedBytesMeter) | predicted activations/measured "
        f"{want.activations / got['saved']:.4f}"
    )
    if "allocated" not in got:
        print("  allocated   n/a: torch.cuda.max_memory_allocated is CUDA only", flush=True)
        return
    bare = want.total - want.margin
    print(
        f"  allocated   max {got['allocated']:,} ({got['allocated'] / GIB:.2f} GiB; {got['before'] / GIB:.2f} "
        f"at the step's start; reserved {got['reserved'] / GIB:.2f}) | predicted total/measured "
        f"{want.total / got['allocated']:.3f}, without the margin {bare / got['allocated']:.3f}",
        flush=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (micro-batch 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny Llama (2 x 64, seq 128) for a smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        throughput.use_tiny_shapes()
    name = throughput.start_on_one_device(args.device, "gpu_memory")
    if name is None:
        return 2
    throughput.PREFETCH = False  # nothing built beside the step
    throughput.ACCUMULATE = args.micro_batches
    shape = throughput.shape_for("llama", tiny=True) if args.tiny else LLAMA_1B
    print(
        f"gpu_memory | {name} | torch {torch.__version__} | Llama {shape['num_layers']} x {shape['hidden_size']}"
        f" (ffn {shape['ffn_hidden_size'] or 'default'}), seq {shape['seq_length']}, micro-batch 1, {args.micro_batches} "
        f"micro-batches per step, bf16, vocabulary {throughput.VOCAB} | TP = PP = DP = 1",
        flush=True,
    )
    for variant in args.only:
        t0 = time.perf_counter()
        cfg, measured = measure(shape, variant)
        report(variant, predict(cfg), measured)
        print(f"  ({variant}: {time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
