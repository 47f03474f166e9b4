"""Framework tax: CPU time per step of our training step vs a plain torch loop on the same model.

    python -m bench.framework_tax [--steps 12] [--seq-length 512] [--hidden-size 256]

A = ours: ``megatron_ext.training.loop.train_step`` at TP=PP=DP=1, exactly what ``pretrain_gpt.py``
runs (megatron-core ``get_forward_backward_func`` schedule over megatron-core DDP,
``finalize_model_grads``, megatron-core optimizer with clipping, LR scheduler, our token-sum loss).
B = plain: the same megatron-core GPTModel class built by ``build_model_chunks`` from the same
config (so the same initial weights), no DDP, on the same micro-batch tensors:
``loss = sum CE over valid / count; backward; clip_grad_norm_; torch.optim.AdamW.step; zero_grad``
(AdamW with megatron-core's parameter groups: no weight decay on biases and 1-D parameters).

Both run in one process (a 1-rank gloo world), alternated A B A B, CPU time
(``time.process_time``) per step, the first ``--warmup`` steps of each dropped, medians
compared. The CPU platform layer (``megatron_ext.cpu_platform``) is process-wide, so it is active
for both; its own cost is measured separately on the plain loop only (megatron-core's schedule,
DDP and optimizer need it): platform active vs removed, alternated likewise. While removed,
megatron-core's RNG tracker object stays the CPU one (its attention forks the tracker on every
forward, and the CUDA tracker cannot run here), and both sides pass an explicit causal mask
(megatron-core builds its default one with device="cuda" on every forward); the TorchFunctionMode
and the torch.cuda stand-ins are what is removed.

The per-step losses of A and B for the first steps must agree (same weights, same data, same
maths): a large difference means the bench compares different work.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import init_single_rank_world  # noqa: E402

TARGET = 1.05
NUM_LAYERS = 4
NUM_HEADS = 4
MICRO_BATCH = 4
VOCAB = 8192
LR = 1e-4
WEIGHT_DECAY = 0.01
CLIP = 1.0
SEED = 1234
POOL = 4  # distinct micro-batches, cycled


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per side (first --warmup dropped)")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each side")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument(
        "--platform-steps",
        type=int,
        default=None,
        help="steps per side of the platform-cost comparison (default: --steps; 0 skips it)",
    )
    args = p.parse_args(argv)
    if args.steps - args.warmup < 5:
        p.error("need at least 5 measured steps per side (--steps - --warmup >= 5)")
    if args.platform_steps is None:
        args.platform_steps = args.steps
    return args


def job_values(args: argparse.Namespace) -> dict:
    return dict(
        num_layers=NUM_LAYERS,
        hidden_size=args.hidden_size,
        num_attention_heads=NUM_HEADS,
        seq_length=args.seq_length,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=MICRO_BATCH,
        train_iters=10_000,
        lr=LR,
        min_lr=LR,
        lr_decay_style="constant",
        lr_warmup_iters=0,
        weight_decay=WEIGHT_DECAY,
        clip_grad=CLIP,
        optimizer="adam",
        seed=SEED,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mock_data=True,
        tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=128,
        log_interval=1,
    )


def make_microbatches(seq_length: int, n: int = POOL) -> list:
    """Random tokens (NullTokenizer-like); a few labels ignored so that 'valid' is exercised."""
    from megatron_ext.data.microbatch import IGNORE_INDEX, Microbatch

    g = torch.Generator().manual_seed(SEED)
    out = []
    for i in range(n):
        seq = torch.randint(0, VOCAB - 1, (MICRO_BATCH, seq_length + 1), generator=g)
        labels = seq[:, 1:].clone()
        loss_mask = torch.ones(MICRO_BATCH, seq_length)
        loss_mask[0, : 7 * (i + 1)] = 0.0  # uneven valid counts
        labels[loss_mask == 0] = IGNORE_INDEX
        out.append(
            Microbatch(
                tokens=seq[:, :-1].contiguous(),
                labels=labels,
                position_ids=torch.arange(seq_length).expand(MICRO_BATCH, seq_length).contiguous(),
                num_real_tokens=MICRO_BATCH * seq_length,
                attention_pairs=MICRO_BATCH * seq_length**2,
            )
        )
    return out


class Ours:
    """What pretrain_gpt.py builds at TP=PP=DP=1 (``build_training_run``), stepped by
    megatron_ext.training.step.train_step."""

    def __init__(self, cfg):
        from megatron_ext.run import build_training_run

        run = build_training_run(cfg, device=torch.device("cpu"), data=(None, None), log=lambda s: None, metrics=False)
        self.cfg, self.ctx = cfg, run.ctx
        self.model, self.optimizer, self.scheduler = run.model, run.optimizer, run.scheduler

    def step(self, mb) -> float:
        from megatron_ext.training.loss import get_mean_loss
        from megatron_ext.training.step import train_step

        result = train_step(
            self.model, self.optimizer, self.scheduler, [mb], self.cfg.model.seq_length, MICRO_BATCH, self.ctx
        )
        return get_mean_loss(result.loss_sum_count)


class Plain:
    """The same GPTModel (same builder, config and weights), a hand-written torch loop."""

    def __init__(self, cfg, ctx):
        from megatron_ext.derived import resolve_config
        from megatron_ext.model.gpt import build_model_chunks

        (self.model,) = build_model_chunks(cfg, resolve_config(cfg, ctx.world_size, VOCAB), ctx.placement, ctx.device)
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():  # megatron-core's default wd rule
            (no_decay if (p.ndim == 1 or name.endswith(".bias")) else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=(cfg.training.adam_beta1, cfg.training.adam_beta2),
            eps=cfg.training.adam_eps,
        )
        self.params = [p for p in self.model.parameters()]

    def step(self, mb, attention_mask: torch.Tensor | None = None) -> float:
        labels = mb.labels
        per_token = self.model(
            input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=attention_mask, labels=labels.clamp(min=0)
        )  # [b, s] CE
        valid = mb.valid
        loss = torch.where(valid, per_token, torch.zeros_like(per_token)).sum() / valid.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def timed(fn, *args) -> tuple[float, float]:
    gc.collect()
    t0 = time.process_time()
    out = fn(*args)
    return time.process_time() - t0, out


def alternate(a, b, microbatches, steps: int, before_a=None, before_b=None):
    """A B A B ...: per-step CPU seconds and losses of each side."""
    ta, tb, la, lb = [], [], [], []
    for i in range(steps):
        mb = microbatches[i % len(microbatches)]
        if before_a:
            before_a()
        dt, loss = timed(a, mb)
        ta.append(dt)
        la.append(loss)
        if before_b:
            before_b()
        dt, loss = timed(b, mb)
        tb.append(dt)
        lb.append(loss)
    return ta, tb, la, lb


def max_weight_diff(ours: Ours, plain: Plain) -> float:
    a = dict(ours.model[0].module.named_parameters())
    b = dict(plain.model.named_parameters())
    assert a.keys() == b.keys(), "models differ in parameter names"
    return max(float((a[k].detach() - b[k].detach()).abs().max()) for k in a)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_ext.config import build_job_config
    from megatron_ext.cpu_platform import apply_cpu_platform, remove_cpu_platform

    init_single_rank_world(timeout_minutes=5)
    cfg = build_job_config(job_values(args))
    ours = Ours(cfg)  # builds the process groups and applies the CPU platform layer
    plain = Plain(cfg, ours.ctx)
    w0 = max_weight_diff(ours, plain)
    mbs = make_microbatches(args.seq_length)
    nparams = sum(p.numel() for p in plain.params)

    print(
        f"framework tax | hidden {args.hidden_size}, {NUM_LAYERS} layers, {NUM_HEADS} heads, "
        f"seq {args.seq_length}, micro-batch {MICRO_BATCH} x 1 per step, vocab {VOCAB}, fp32, "
        f"{torch.get_num_threads()} thread | {nparams:,} parameters | TP=PP=DP=1 (1-rank gloo)"
    )
    print(
        f"steps {args.steps} per side, first {args.warmup} dropped, A B A B, CPU time "
        f"(time.process_time) | initial weights max |ours - plain| = {w0:.1e}"
    )

    ta, tb, la, lb = alternate(ours.step, plain.step, mbs, args.steps)
    ma, mb_ = statistics.median(ta[args.warmup :]), statistics.median(tb[args.warmup :])
    ratio = ma / mb_
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"ours  (train_step: schedule+DDP+finalize+mcore optimizer+scheduler): median {ma * 1e3:8.1f} ms/step")
    print(f"plain (loss.backward, clip_grad_norm_, torch AdamW, zero_grad):      median {mb_ * 1e3:8.1f} ms/step")
    print(f"ratio ours/plain = {ratio:.3f}   target <= {TARGET:.2f} (limit 1.00)   -> {verdict}")
    n = min(3, args.steps)
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la[:n], lb[:n])]
    print("loss first steps  ours: " + "  ".join(f"{x:.6f}" for x in la[:n]))
    print("                 plain: " + "  ".join(f"{y:.6f}" for y in lb[:n]))
    print(
        f"max relative loss difference over the first {n} steps: {max(rel):.2e} "
        f"({'same work' if max(rel) < 1e-4 else 'CHECK: the two sides may not do the same work'})"
    )

    if args.platform_steps:
        # Keep megatron-core's (CPU) RNG tracker across remove/apply: its attention forks it.
        saved = (mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)

        def keep_tracker():
            mcore_random._CUDA_RNG_STATE_TRACKER, mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved

        def platform_on():
            apply_cpu_platform(ours.ctx.device)
            keep_tracker()

        def platform_off():
            remove_cpu_platform()
            keep_tracker()

        # megatron-core builds its default causal mask with device="cuda" on every forward
        # (transformer/utils.py get_default_causal_mask), so without the platform the model only
        # runs when given the mask: both sides get the same explicit causal mask (True = masked).
        s = args.seq_length
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)

        def plain_masked(mb):
            return plain.step(mb, causal)

        ton, toff, _, _ = alternate(
            plain_masked, plain_masked, mbs, args.platform_steps, before_a=platform_on, before_b=platform_off
        )
        platform_on()
        mon, moff = statistics.median(ton[args.warmup :]), statistics.median(toff[args.warmup :])
        print(
            f"platform layer cost (plain loop, active vs removed): {mon * 1e3:.1f} vs {moff * 1e3:.1f} "
            f"ms/step = {mon / moff:.3f}x ({(mon - moff) * 1e3:+.1f} ms/step)"
        )

    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
