"""Activation recomputation: saved-activation bytes per micro-batch and step time, side by side.

    python -m bench.recompute [--steps 8] [--warmup 2] [--hidden-size 256] [--seq-length 512]

One process (1-rank gloo world), our training step (``build_training_run`` + ``train_step``:
megatron-core schedule, DDP, optimizer) on a GPT-2 style model (4 layers, 4 heads, micro-batch 4,
fp32, dropout 0.1), for each setting: none, selective core_attn, selective layernorm, full uniform
(1 layer per group) and full block (2 of 4 layers). Saved bytes: every activation autograd keeps
after one micro-batch's forward (the model called with gradients on, no backward), counted once per
storage by ``saved_tensors_hooks``, parameters excluded (exact, independent of load). Step time: CPU time per step, settings alternated step by step, the first
``--warmup`` dropped, medians. Expected shape: full recompute keeps each layer's input and one
layer's activations while recomputing, for about one extra forward (~+33% step FLOPs); selective
core attention saves the attention internals for little time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402

SETTINGS = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full block 2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


def saved_bytes(model: torch.nn.Module, mb) -> int:
    """Activation bytes one micro-batch's forward leaves for the backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(
            input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, labels=mb.labels.clamp(min=0)
        )
    del out
    return sum(seen.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=512)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from bench.common import init_single_rank_world
    from megatron_ext.config import build_job_config
    from megatron_ext.cpu_platform import quiet_known_warnings
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.run import build_training_run
    from megatron_ext.testing import MarkovDataset
    from megatron_ext.training.step import build_step_microbatches, train_step

    quiet_known_warnings()
    init_single_rank_world()
    runs, ctx = {}, None
    for name, flags in SETTINGS.items():
        cfg = build_job_config(
            dict(
                num_layers=4,
                hidden_size=args.hidden_size,
                num_attention_heads=4,
                seq_length=args.seq_length,
                micro_batch_size=4,
                global_batch_size=4,
                train_iters=1000,
                hidden_dropout=0.1,
                attention_dropout=0.1,
                mock_data=True,
                tokenizer_type="NullTokenizer",
                vocab_size=127,
                make_vocab_size_divisible_by=128,
                **flags,
            )
        )
        runs[name] = build_training_run(
            cfg,
            device=torch.device("cpu"),
            data=(MarkovDataset(args.seq_length), None),
            log=lambda s: None,
            metrics=False,
            ctx=ctx,
        )
        ctx = ctx or runs[name].ctx
    mbs, length = build_step_microbatches(runs["none"], runs["none"].train_ds, 0)
    nbytes = {name: saved_bytes(run.model[0], mbs[0]) for name, run in runs.items()}
    times = {name: [] for name in runs}
    for step in range(args.steps):
        for name, run in runs.items():
            t0 = time.process_time()
            train_step(run.model, run.optimizer, run.scheduler, mbs, length, 4, run.ctx)
            if step >= args.warmup:
                times[name].append(time.process_time() - t0)
    print(
        f"recompute | hidden {args.hidden_size}, 4 layers, seq {args.seq_length}, micro-batch 4, fp32, dropout 0.1, "
        f"1 thread | medians of {args.steps - args.warmup} steps, settings alternated"
    )
    base_b, base_t = nbytes["none"], statistics.median(times["none"])
    for name in runs:
        t = statistics.median(times[name])
        print(
            f"  {name:<22} saved {nbytes[name] / 2**20:8.1f} MiB per micro-batch ({nbytes[name] / base_b:5.2f}x) | "
            f"step {1000 * t:7.1f} ms CPU ({t / base_t:5.2f}x)"
        )
    destroy_parallel_context()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
