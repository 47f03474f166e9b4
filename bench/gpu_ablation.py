"""What each of our GPU-step changes is worth: our training step with everything on, against the
same step with one change undone, and our cross-entropy against megatron-core's alone.

    python -m bench.gpu_ablation [--shape 1.3b|gpt2|llama] [--micro-batch 4]
                                 [--only fused-adam wgrad-fusion cross-entropy rope ce-kernel gqa-kernel]
    python -m bench.gpu_ablation --device cpu --tiny --steps 1 --warmup 0   # smoke run, no figures

Sides run one after the other (two 1.3B models do not fit beside each other), as
``on, off, on`` so that drift of the machine shows as a difference between the two ``on`` runs;
the ratio is off / mean(on) of the median step times (> 1: the change helps). One optimizer
step per micro-batch (``bench.gpu_throughput.Ours``, data built in the step).

- ``fused-adam``: torch's fused AdamW (``optim.use_fused_adam``, called by ``training/optimizer``) vs the ``foreach``
  kernels megatron-core gets from torch without Apex/TE.
- ``wgrad-fusion``: weight gradients accumulated into the fp32 buffer in the GEMM
  (``model/wgrad.py``) vs a bf16 gradient added by DDP's hook.
- ``cross-entropy``: ``model/cross_entropy.py`` vs megatron-core's ``vocab_parallel_cross_entropy``.
- ``rope`` (RoPE shapes: ``--shape llama``): RoPE applied by our core attention with cos/sin made
  once (``model/attention.py``) vs megatron-core's own unfused rotation in every layer.
- ``ce-kernel``: the two cross-entropies alone, forward and backward over [seq x micro-batch,
  50304] bf16 logits, alternated, medians.
- ``gqa-kernel`` (grouped-query shapes: ``--shape llama``): unpacked causal SDPA alone, forward and
  backward, with k/v repeated to every head (what our core attention does) vs SDPA's own
  ``enable_gqa=True``, which may change the kernel SDPA picks: the figure that decides whether our
  attention should switch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench import gpu_throughput as throughput

SHAPES = throughput.SHAPES
ABLATIONS = ("fused-adam", "wgrad-fusion", "cross-entropy", "rope")
KERNELS = ("ce-kernel", "gqa-kernel")


def undo(name: str):
    """Patch one change away (in this process); returns the function that restores it."""
    import megatron_ext.model.gpt as gpt
    import megatron_ext.training.optimizer as optimizer

    if name == "fused-adam":
        original = optimizer.use_fused_adam
        optimizer.use_fused_adam = lambda opt: None

        def restore():
            optimizer.use_fused_adam = original
    elif name == "wgrad-fusion":
        from megatron_ext.model import wgrad

        original = wgrad.enable_gradient_accumulation_fusion
        wgrad.enable_gradient_accumulation_fusion = lambda chunks: None

        def restore():
            wgrad.enable_gradient_accumulation_fusion = original
    elif name == "rope":
        from megatron_ext.model import attention

        original = attention.apply_core_attention_rotary
        attention.apply_core_attention_rotary = lambda chunk: False  # megatron-core rotates

        def restore():
            attention.apply_core_attention_rotary = original
    else:
        from megatron.core.models.gpt import GPTModel

        original = gpt.gpt_model_class
        gpt.gpt_model_class = lambda: GPTModel

        def restore():
            gpt.gpt_model_class = original

    return restore


def step_ms(shape: dict, micro_batch: int, steps: int, warmup: int) -> float:
    side = throughput.Ours(shape, micro_batch)
    try:
        for _ in range(warmup):
            side.step()
        return 1000 * statistics.median(throughput.timed_step(side)[0] for _ in range(steps))
    finally:
        side.close()
        del side
        throughput.free_memory()


def ablate(name: str, shape: dict, micro_batch: int, steps: int, warmup: int) -> None:
    first = step_ms(shape, micro_batch, steps, warmup)
    restore = undo(name)
    try:
        off = step_ms(shape, micro_batch, steps, warmup)
    finally:
        restore()
    second = step_ms(shape, micro_batch, steps, warmup)
    on = (first + second) / 2
    print(
        f"  {name:<14} on {first:7.1f} / {second:7.1f} ms/step | off {off:7.1f} ms/step | off/on = {off / on:.3f}",
        flush=True,
    )


def forward_backward_ms(fns: dict, steps: int, warmup: int = 2) -> list[float]:
    """Median ms of ``fn().sum().backward()`` for each function, alternated, the first ``warmup``
    rounds dropped (a kernel-alone comparison)."""
    times = {name: [] for name in fns}
    for i in range(steps + warmup):
        for name, fn in fns.items():
            throughput.synchronize()
            t0 = time.perf_counter()
            fn().sum().backward()
            throughput.synchronize()
            if i >= warmup:
                times[name].append(1000 * (time.perf_counter() - t0))
    return [statistics.median(t) for t in times.values()]


def ce_kernel(tokens: int, vocab: int, steps: int) -> None:
    """Both cross-entropies alone (megatron-core's needs its TP group: a side is built first)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as theirs

    from megatron_ext.model.cross_entropy import vocab_parallel_cross_entropy as ours

    side = throughput.Ours(throughput.TINY, 1)  # initialises megatron-core's parallel state
    try:
        device = throughput.DEVICE
        logits = torch.randn(tokens, 1, vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (tokens, 1), device=device)
        fns = {"ours": lambda: ours(logits, target), "megatron-core": lambda: theirs(logits.float(), target)}
        a, b = forward_backward_ms(fns, steps)
        print(
            f"  ce-kernel      [{tokens} x {vocab}] bf16, forward + backward: ours {a:.2f} ms | "
            f"megatron-core {b:.2f} ms | megatron-core/ours = {b / a:.2f}",
            flush=True,
        )
    finally:
        side.close()


def gqa_kernel(shape: dict, micro_batch: int, steps: int) -> None:
    """Causal SDPA forward + backward with repeated k/v vs ``enable_gqa=True``, alternated, medians."""
    import torch.nn.functional as F

    heads = shape["num_attention_heads"]
    groups = shape.get("num_query_groups") if shape.get("group_query_attention") else None
    if not groups or groups == heads:
        print("  gqa-kernel     n/a: this shape has no grouped-query attention (--shape llama has)", flush=True)
        return
    device, s, hn = throughput.DEVICE, shape["seq_length"], shape["hidden_size"] // heads
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(micro_batch, n, s, hn, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
        for n in (heads, groups, groups)
    )
    repeat = heads // groups
    fns = {
        "repeated k/v": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), is_causal=True
        ),
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    a, b = forward_backward_ms(fns, steps)
    print(
        f"  gqa-kernel     [{micro_batch} x {heads} heads / {groups} groups x {s} x {hn}] bf16 causal SDPA, "
        f"forward + backward: repeated k/v {a:.2f} ms | enable_gqa {b:.2f} ms | repeated/enable_gqa = {a / b:.2f}",
        flush=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.3b")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--only", nargs="+", choices=[*ABLATIONS, *KERNELS], default=[*ABLATIONS, *KERNELS])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a smoke run")
    args = p.parse_args(argv)
    name = throughput.start_on_one_device(args.device, "gpu_ablation")
    if name is None:
        return 2
    throughput.PREFETCH = False
    shape = throughput.shape_for(args.shape, args.tiny)
    print(
        f"gpu_ablation | {name} | torch {torch.__version__} | {args.shape}{' (--tiny)' if args.tiny else ''}, "
        f"micro-batch {args.micro_batch}, {args.steps} steps after {args.warmup}, medians",
        flush=True,
    )
    for section in args.only:
        if section == "ce-kernel":
            tokens = 256 if args.tiny else shape["seq_length"] * args.micro_batch
            ce_kernel(tokens, 1024 if args.tiny else throughput.VOCAB + 47, args.steps)
        elif section == "gqa-kernel":
            gqa_kernel(shape, args.micro_batch, args.steps)
        elif section == "rope" and shape.get("position_embedding_type") != "rope":
            print("  rope           n/a: this shape has no RoPE (--shape llama has)", flush=True)
        else:
            ablate(section, shape, args.micro_batch, args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
