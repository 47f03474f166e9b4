"""RoPE: kernels and CPU time of our core attention's rotation vs megatron-core's unfused one.

    python -m bench.rope [--steps 12] [--warmup 2] [--seq-length 512] [--micro-batch 2] [--num-layers 24]

megatron-core 0.16.1's unfused rotation (``rope_utils._apply_rotary_pos_emb_bshd``), called by its
attention for q and for k in every layer, computes cos and sin of the frequency table, scales and
casts them, rotates, and copies the result once more (a ``cat`` with the empty unrotated part). Our
core attention (``model/attention.py``) rotates with cos/sin made once per sequence length (or
packed micro-batch) in the activations' dtype: the same values, bitwise (tests/unit/test_rope.py,
tests/distributed/test_attention.py).

Two sections, both in one process on the CPU (a 1-rank gloo world), settings alternated step by
step, the first ``--warmup`` dropped, medians of CPU time (``time.process_time``):

- ``rotation``: the rotation of one layer's q [s, b, 32, 64] and k [s, b, 8, 64] (Llama GQA 4
  groups), bf16, forward and backward: aten operators that launch kernels (views excluded), CPU time.
- ``model``: a Llama-style chunk (``--num-layers`` 24, hidden 256, 4 heads, 2 KV groups, RMSNorm, SwiGLU),
  bf16 through megatron-core's Float16Module, one forward and backward: aten operators per step
  and CPU time; our rotation vs megatron-core's (the rotary module's class switched back, same
  weights, same input, same logits).

On a GPU every launched kernel also costs host time; the Llama steps measured on an H100 at
micro-batch 1 are host-bound (bench/README.md), which is why launches are counted here.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VIEWS = {
    "view",
    "_unsafe_view",
    "t",
    "permute",
    "transpose",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "expand",
    "split",
    "split_with_sizes",
    "chunk",
    "detach",
    "alias",
    "as_strided",
    "reshape",
    "lift_fresh",
    "unbind",
    "narrow",
}


class LaunchCounter(TorchDispatchMode):
    """aten operators that run a kernel (views and metadata operators excluded), by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def alternate(fns: dict, steps: int, warmup: int) -> dict[str, float]:
    """Median CPU seconds of each function, called in turn step by step."""
    times = {name: [] for name in fns}
    for i in range(steps):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            if i >= warmup:
                times[name].append(time.process_time() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def counted(fn) -> LaunchCounter:
    counter = LaunchCounter()
    with counter:
        fn()
    return counter


def section_rotation(args) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_ext.model.attention import RotaryTable, rotate

    class Table:  # megatron-core's table layout, [s, 1, 1, 64]
        def get_emb(self, n):
            inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
            f = torch.outer(torch.arange(n, dtype=torch.float32), inv)
            return torch.cat((f, f), dim=-1)[:, None, None, :]

    s, b = args.seq_length, args.micro_batch
    freqs = Table().get_emb(s)
    table = RotaryTable(Table())
    q = torch.randn(s, b, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, 8, 64, dtype=torch.bfloat16, requires_grad=True)

    def ours():
        cos, sin = table.coefficients(s, torch.bfloat16, q.device, False)
        (rotate(q, cos, sin, False).sum() + rotate(k, cos, sin, False).sum()).backward()

    def theirs():
        (_apply_rotary_pos_emb_bshd(q, freqs).sum() + _apply_rotary_pos_emb_bshd(k, freqs).sum()).backward()

    ours()  # the table's first use
    launches = {"ours": counted(ours), "megatron-core": counted(theirs)}
    seconds = alternate({"ours": ours, "megatron-core": theirs}, args.steps, args.warmup)
    print(
        f"rotation | one layer's q [{s}, {b}, 32, 64] and k [{s}, {b}, 8, 64], bf16, forward + backward "
        f"(each side includes a .sum() and its backward per tensor)"
    )
    for name in launches:
        print(f"  {name:<14} {launches[name].total:4d} kernels | {1000 * seconds[name]:8.2f} ms CPU")
    print(
        f"  ours/megatron-core: kernels {launches['ours'].total / launches['megatron-core'].total:.2f}x, "
        f"CPU time {seconds['ours'] / seconds['megatron-core']:.2f}x"
    )


def section_model(args) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_ext.config import build_job_config
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.attention import CoreAttentionRotaryEmbedding
    from megatron_ext.model.gpt import apply_mixed_precision, build_model_chunks
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
    from megatron_ext.training.step import unwrap_model

    s, b = args.seq_length, args.micro_batch
    cfg = build_job_config(
        dict(
            num_layers=args.num_layers,
            hidden_size=256,
            num_attention_heads=4,
            group_query_attention=True,
            num_query_groups=2,
            seq_length=s,
            max_position_embeddings=s,
            micro_batch_size=b,
            global_batch_size=b,
            bf16=True,
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
            disable_bias_linear=True,
            mock_data=True,
            tokenizer_type="NullTokenizer",
            vocab_size=1000,
            train_iters=1,
            lr=1e-4,
        )
    )
    ctx = build_parallel_context(cfg, torch.device("cpu"))
    resolved = resolve_config(cfg, ctx.world_size, 1024)
    (model,) = apply_mixed_precision(
        cfg.training, build_model_chunks(cfg, resolved, ctx.placement, torch.device("cpu"))
    )
    rotary = unwrap_model(model).rotary_pos_emb
    tokens = torch.randint(0, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(s).expand(b, s)
    logits = {}

    def step(cls):
        def run():
            rotary.__class__ = cls
            model.zero_grad(set_to_none=True)
            out = model(input_ids=tokens, position_ids=positions, attention_mask=None)
            out.float().square().mean().backward()
            logits[cls] = out.detach()

        return run

    sides = {"ours": step(CoreAttentionRotaryEmbedding), "megatron-core": step(RotaryEmbedding)}
    for run in sides.values():
        run()
    same = torch.equal(logits[CoreAttentionRotaryEmbedding], logits[RotaryEmbedding])
    launches = {name: counted(run) for name, run in sides.items()}
    seconds = alternate(sides, args.steps, args.warmup)
    rotary.__class__ = CoreAttentionRotaryEmbedding
    destroy_parallel_context()
    print(
        f"model | Llama-style {args.num_layers} x 256, GQA 2, seq {s}, micro-batch {b}, bf16, forward + backward "
        f"(logits equal: {same})"
    )
    for name in sides:
        cos = launches[name].counts["cos"]
        print(f"  {name:<14} {launches[name].total:5d} kernels ({cos} cos) | {1000 * seconds[name]:8.1f} ms CPU")
    print(
        f"  ours/megatron-core: kernels {launches['ours'].total / launches['megatron-core'].total:.3f}x, "
        f"CPU time {seconds['ours'] / seconds['megatron-core']:.3f}x"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=24, help="layers of the model section's chunk")
    p.add_argument("--only", nargs="+", choices=["rotation", "model"], default=["rotation", "model"])
    args = p.parse_args(argv)
    from bench.common import init_single_rank_world
    from megatron_ext.cpu_platform import quiet_known_warnings

    quiet_known_warnings()
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():  # (a test's forked rank already has its world)
        init_single_rank_world()
    print(
        f"rope | torch {torch.__version__} | CPU, one thread | steps {args.steps}, first {args.warmup} "
        f"dropped, medians",
        flush=True,
    )
    if "rotation" in args.only:
        section_rotation(args)
    if "model" in args.only:
        section_model(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
