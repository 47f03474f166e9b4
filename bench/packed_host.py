"""Host cost of the packed GPU path, measured on a CPU: packed (THD, the flash varlen branch) vs
unpacked steps of a deep, narrow Llama-style model, side by side in one run.

    python -m bench.packed_host [--layers 24] [--hidden 64] [--seq 2048] [--steps 10]

On a GPU a small step is host-bound: what it costs is the Python and dispatch work of launching it.
The CPU cannot run the flash varlen kernel (CUDA only), so here the packed side takes the branch the
GPU takes (``select_packed_kernel`` -> VARLEN, ``aten._flash_attention_forward``'s signature) with
the kernel stood in for by the same cheap elementwise op that replaces SDPA on the unpacked side:
both sides then differ only in what our code and megatron-core do around attention (THD params,
packed RoPE, squeezes and reshapes). The model is narrow and the vocabulary small, so the rest of
the step is cheap too. Printed: median wall ms per step, Python calls per step (cProfile), and the
packed/unpacked ratios; alternated step by step, medians (this machine is noisy).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

from bench import gpu_throughput as throughput

VOCAB = 1024
VARLEN_CALLS = [0]  # forwards through the stand-in flash kernel (the packed side's branch was taken)


def _cheap(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q * 1.0 + (k.mean() + v.mean())  # touches q, k, v: gradients flow to all three


def stand_in_kernels() -> None:
    """The packed side takes the GPU's varlen branch; both sides' attention is ``_cheap``."""
    from megatron_ext.model import attention

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug_mask, scale=None):
        assert cu_q.dtype == torch.int32 and isinstance(max_q, int), (cu_q.dtype, type(max_q))
        VARLEN_CALLS[0] += 1
        return (_cheap(q, k, v),)

    def causal(q, k, v, scale, dropout_p=0.0):
        s, b, heads, hn = q.shape
        return _cheap(q, k, v).reshape(s, b, heads * hn)

    attention.flash_attention_forward = flash
    attention.causal_attention = causal
    attention.flash_varlen_supported = lambda *args: True
    attention.select_packed_kernel = lambda *args: attention.VARLEN


class _Rows(throughput.RandomRows):
    def __init__(self, seq: int):
        super().__init__(seq, VOCAB)


class _Packs(throughput.RandomPacks):
    def __init__(self, seq: int):
        super().__init__(seq, VOCAB)


def python_calls(side, steps: int) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        side.step()
    profiler.disable()
    return sum(row[1] for row in pstats.Stats(profiler).stats.values()) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side (after 2 warm-up steps)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if throughput.start_on_one_device("cpu", "packed_host") is None:
        return 2
    stand_in_kernels()
    throughput.VOCAB, throughput.RandomRows, throughput.RandomPacks = VOCAB, _Rows, _Packs
    throughput.PREFETCH = False  # the step's own thread only
    shape = dict(
        throughput.LLAMA_24x2048,
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=None,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=args.seq,
    )
    unpacked = throughput.Ours(shape, 1)
    sides = {"unpacked": unpacked, "packed": throughput.Ours(shape, 1, packed=True, beside=unpacked)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.steps + 2):
        for name, side in sides.items():
            t0 = time.perf_counter()
            side.step()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    calls = {name: python_calls(side, 2) for name, side in sides.items()}
    for side in reversed(sides.values()):
        side.close()
    print(
        f"packed_host | CPU, 1 thread | Llama style {args.layers} x {args.hidden}, seq {args.seq}, micro-batch 1, "
        f"vocab {VOCAB}; attention stood in for on both sides (the packed side through the varlen branch)"
    )
    for name in sides:
        print(f"  {name:<9} {ms[name]:8.1f} ms/step (median of {args.steps})   {calls[name]:9.0f} Python calls/step")
    print(
        f"  packed/unpacked: wall {ms['packed'] / ms['unpacked']:.3f}x, Python calls "
        f"{calls['packed'] / calls['unpacked']:.3f}x | varlen-branch forwards: {VARLEN_CALLS[0]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
