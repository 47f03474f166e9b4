"""Host overhead per micro-batch: our layers (eager and --torch-compile) beside transformers' GPT-2 and Llama.

    python -m bench.host_overhead [--hidden-size 64] [--seq-length 128] [--steps 8] [--skip-compiled]
    python -m bench.host_overhead --device cuda     # the same on one CUDA GPU (no TP-2 part)

Same shapes on every side (GPT-2 style: LayerNorm, GELU, biases, learned positions, tied embedding;
Llama style: RMSNorm, SwiGLU, RoPE, no biases, GQA 4/2, untied), a tiny hidden size so that kernels are
negligible and what is measured is the host: 1 thread, fp32, CPU time. Ours is what ``pretrain_gpt.py``
builds at TP = PP = DP = 1 (``build_training_run``: megatron-core schedule, DDP, our loss); a micro-batch
is measured as ``run_forward_backward`` over a step of ``--microbatches`` micro-batches divided by their
number (the schedule's per-step work, DDP's finalize included, is shared out). transformers' side is
``model(input_ids, labels=...).loss.backward()`` with ``attn_implementation="sdpa"``, per micro-batch.

Figures, each beside the issue-30 target where there is one:
- Python calls per micro-batch (cProfile's total calls, C builtins included); frames of our CPU
  platform layer (``megatron_ext/cpu_platform.py``, absent on GPUs) are counted apart and excluded.
  Compiled code is counted as cProfile sees it: dynamo's guarded entry, AOT autograd's runtime
  wrappers, and inductor's generated Python module (one call per fused kernel); where the backend is
  inductor, a row of ours with ``--torch-compile-cpp-wrapper`` (inductor's C++ wrapper: kernels run from C++);
- aten ops per layer, forward + backward (a TorchDispatchMode count; the difference between the model
  at L and 2L layers over L); compiled layers dispatch only their extern kernels (GEMMs) through aten;
- syncs per step on the training thread (``SyncCounter``; ours through ``train_one`` with the flags
  printed, transformers' loop as people write it: ``loss.item()`` for the log);
- host milliseconds per micro-batch (median CPU time, A B A B over the sides, warm-up dropped);
- graphs and breaks per layer (``torch._dynamo.explain`` on one layer with the arguments it receives),
  at TP 1 and at TP 2 with sequence parallelism (two forked ranks; ours compiled and megatron-core's linears);
- recompiles over a packed run (ours: 40 packed micro-batches, negotiated power-of-two buckets).

``--device cuda`` runs the single-process parts on one CUDA GPU (issue 30 asks for the host overhead on
CPUs and GPUs): the same sides and figures, the host milliseconds as synchronized wall time (with a tiny
hidden size the GPU waits on the host, so the wall is the host's), inductor generating Triton kernels,
and the C++ wrapper launching them from C++. The TP-2 part is skipped there and says so: its forked ranks
cannot run dynamo once the parent has initialised CUDA (run it with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import init_single_rank_world  # noqa: E402

HEADS, GROUPS, VOCAB = 4, 2, 1024
STYLES = ("gpt2", "llama")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (ours)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per side (first 2 dropped)")
    p.add_argument("--skip-compiled", action="store_true", help="eager sides only (inductor on a CPU is slow)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled sides")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the single-process parts on one CUDA GPU (wall ms; the forked TP-2 part is skipped)",
    )
    return p.parse_args(argv)


def get_device(args) -> torch.device:
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


# ----------------------------------------------------------------------------- the sides


def our_values(args, style: str, num_layers: int, **extra) -> dict:
    values = dict(
        num_layers=num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=HEADS,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * args.microbatches,
        train_iters=10_000,
        lr=1e-4,
        min_lr=1e-4,
        lr_decay_style="constant",
        weight_decay=0.01,
        clip_grad=1.0,
        seed=1234,
        mock_data=True,
        tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=128,
        log_interval=10_000,
    )
    if style == "llama":
        values.update(
            normalization="RMSNorm",
            swiglu=True,
            position_embedding_type="rope",
            disable_bias_linear=True,
            untie_embeddings_and_output_weights=True,
            group_query_attention=True,
            num_query_groups=GROUPS,
        )
    values.update(extra)
    return values


def build_ours(args, style: str, num_layers: int, ctx=None, **extra):
    from megatron_ext.config import build_job_config
    from megatron_ext.run import build_training_run

    cfg = build_job_config(our_values(args, style, num_layers, **extra))
    return build_training_run(
        cfg, device=get_device(args), data=(None, None), log=lambda s: None, metrics=False, ctx=ctx
    )


def build_hf(args, style: str, num_layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from megatron_ext.derived import resolve_ffn_hidden_size

    torch.manual_seed(0)
    h = args.hidden_size
    if style == "gpt2":
        config = GPT2Config(
            n_embd=h,
            n_layer=num_layers,
            n_head=HEADS,
            n_positions=args.seq_length,
            vocab_size=VOCAB,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
        )
        return GPT2LMHeadModel(config).to(get_device(args))
    config = LlamaConfig(
        hidden_size=h,
        intermediate_size=resolve_ffn_hidden_size(None, h, True),
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        vocab_size=VOCAB,
        max_position_embeddings=args.seq_length,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(get_device(args))


def make_microbatches(args, n: int) -> list:
    from megatron_ext.data.microbatch import IGNORE_INDEX, Microbatch

    g = torch.Generator().manual_seed(0)
    b, s = args.micro_batch_size, args.seq_length
    out = []
    for _ in range(n):
        seq = torch.randint(0, VOCAB - 1, (b, s + 1), generator=g)
        labels = seq[:, 1:].clone()
        labels[0, :5] = IGNORE_INDEX
        out.append(
            Microbatch(
                tokens=seq[:, :-1].contiguous(),
                labels=labels,
                position_ids=torch.arange(s).expand(b, s).contiguous(),
                num_real_tokens=b * s,
                attention_pairs=b * s * s,
            ).to(get_device(args))
        )
    return out


def ours_step(run, microbatches):
    """One forward-backward over the step's micro-batches (what a micro-batch costs, times m)."""
    from megatron_ext.training.step import run_forward_backward

    return run_forward_backward(run.model, microbatches, microbatches[0].tokens.shape[1])


def hf_step(model, microbatches):
    for mb in microbatches:
        model(input_ids=mb.tokens, labels=mb.labels).loss.backward()


# ----------------------------------------------------------------------------- the measures


def python_calls(fn, *args) -> tuple[int, int]:
    """(calls outside our CPU platform layer, calls inside it) of one ``fn(*args)``."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn(*args)
    profiler.disable()
    stats = pstats.Stats(profiler)
    platform = sum(v[1] for k, v in stats.stats.items() if k[0].endswith("megatron_ext/cpu_platform.py"))
    return stats.total_calls - platform, platform


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn, *args) -> int:
    with OpCounter() as counter:
        fn(*args)
    return counter.count


def cpu_ms(fn, *args) -> float:
    gc.collect()
    t0 = time.process_time()
    fn(*args)
    return (time.process_time() - t0) * 1e3


def cuda_wall_ms(fn, *args) -> float:
    """Wall time of ``fn(*args)`` between two synchronizations (process time would count the driver's
    threads and a spinning wait)."""
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def alternate(sides: dict, steps: int, timer=cpu_ms) -> dict:
    """{name: median ms per call} over ``steps`` rounds A B C ..., the first 2 dropped."""
    times = {name: [] for name in sides}
    for _ in range(steps):
        for name, (fn, args) in sides.items():
            times[name].append(timer(fn, *args))
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def explain_layer(layer, call) -> tuple[int, int, list[str]]:
    """(graphs, breaks, first reasons) of ``torch._dynamo.explain`` on ``layer`` with the arguments
    it receives while ``call()`` runs the model once."""
    import torch._dynamo

    seen = {}
    handle = layer.register_forward_pre_hook(lambda m, a, k: seen.setdefault("x", (a, k)), with_kwargs=True)
    call()
    handle.remove()
    args, kwargs = seen["x"]
    target = getattr(layer, "_orig_mod", layer)
    result = torch._dynamo.explain(target)(*args, **kwargs)
    return result.graph_count, result.graph_break_count, [r.reason.splitlines()[0][:90] for r in result.break_reasons]


def count_syncs(fn, *args) -> int:
    from megatron_ext.training.sync_counter import SyncCounter

    with SyncCounter() as counter:
        fn(*args)
    return counter.total


def ours_train_step(run, microbatches):
    from megatron_ext.training.step import train_step

    return train_step(
        run.model,
        run.optimizer,
        run.scheduler,
        microbatches,
        microbatches[0].tokens.shape[1],
        run.global_batch_size,
        run.ctx,
    )


def hf_train_step(model, optimizer, microbatches):
    """The loop people write: backward per micro-batch, clip, step, and the loss read for the log."""
    total = 0.0
    for mb in microbatches:
        loss = model(input_ids=mb.tokens, labels=mb.labels).loss
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def count_packed_recompiles(args, style: str, ctx) -> tuple[int, int, int]:
    """(compiles after each bucket's first micro-batch, buckets, micro-batches) over a packed run of
    ours compiled (dynamo with a counting eager backend: recompiles are dynamo's, whatever the backend)."""
    import megatron_ext.model.compile as compile_module
    from megatron_ext.testing import PackedMarkovDataset
    from megatron_ext.training.step import build_step_microbatches

    compiles = []
    saved, compile_module.BACKEND = compile_module.BACKEND, lambda gm, ex: compiles.append(1) or gm.forward
    try:
        run = build_ours(
            args,
            style,
            2,
            ctx=ctx,
            torch_compile=True,
            packed_sequences=True,
            micro_batch_size=1,
            global_batch_size=1,
            sequence_padding="negotiated",
            pad_to_multiple_of=16,
            pad_length_bucket="power-of-two",
        )
    finally:
        compile_module.BACKEND = saved
    dataset, seen, late, n = PackedMarkovDataset(args.seq_length, median=6.0), set(), 0, 40
    for i in range(n):
        (mb,), length = build_step_microbatches(run, dataset, i)
        before, new = len(compiles), tuple(mb.tokens.shape) not in seen
        seen.add(tuple(mb.tokens.shape))
        ours_step(run, [mb])
        late += 0 if new else len(compiles) - before
    return late, len(seen), n


def compare_compiled(args, style: str, ctx, microbatches) -> tuple[float, tuple[float, str]]:
    """Fresh eager and compiled runs (the same initial weights), one forward-backward each on the same
    micro-batches: (relative loss difference, (worst relative parameter-gradient difference, its name))."""
    eager = build_ours(args, style, args.num_layers, ctx=ctx)
    compiled = build_ours(args, style, args.num_layers, ctx=ctx, torch_compile=True)
    a = ours_step(eager, microbatches)[0]["lm loss"]
    b = ours_step(compiled, microbatches)[0]["lm loss"]
    worst = (0.0, "-")
    for (name, pa), (_, pb) in zip(eager.model[0].named_parameters(), compiled.model[0].named_parameters()):
        rel = float((pb.main_grad - pa.main_grad).norm() / pa.main_grad.norm().clamp_min(1e-30))
        worst = max(worst, (rel, name))
    return float((a[0] - b[0]).abs() / a[0].abs()), worst


def explain_tp2(rank: int, world_size: int, args, styles) -> dict:
    """{style: {"compiled": (graphs, breaks, reasons), "upstream": ...}} of one layer at TP 2 with sequence
    parallelism (a 2-rank gloo world of its own): with what --torch-compile installs, and with megatron-core's
    own linears (what an eager run at TP 2 has)."""
    from megatron_ext.model.compile import install_compilable_linears, install_compilable_recompute, mark_static_shapes
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.training.step import unwrap_model

    torch.set_num_threads(1)
    out, ctx = {}, None
    mbs = make_microbatches(args, 1)
    for style in styles:
        out[style] = {}
        for side in ("upstream", "compiled"):
            run = build_ours(
                args, style, args.num_layers, ctx=ctx, tensor_model_parallel_size=2, sequence_parallel=True
            )
            ctx = run.ctx
            layer = unwrap_model(run.model[0]).decoder.layers[0]
            if side == "compiled":
                mark_static_shapes([run.model[0].module])
                install_compilable_linears(layer)
                install_compilable_recompute(layer)
            out[style][side] = explain_layer(layer, lambda: ours_step(run, mbs))
    destroy_parallel_context()
    return out


# ----------------------------------------------------------------------------- the report


def measure_style(args, style: str, ctx) -> tuple[dict, object]:
    """{side: {figure: value}} for one style; returns the context for the next builds."""
    import megatron_ext.model.compile as compile_module
    from megatron_ext.model.compile import install_compilable_linears, install_compilable_recompute, mark_static_shapes
    from megatron_ext.training.step import unwrap_model

    m, L = args.microbatches, args.num_layers
    mbs = make_microbatches(args, m)
    eager = build_ours(args, style, L, ctx=ctx)
    ctx = eager.ctx
    hf = build_hf(args, style, L)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    sides = {f"ours {style} eager": (ours_step, (eager, mbs)), f"transformers {style} eager": (hf_step, (hf, mbs))}
    compiled = None
    if not args.skip_compiled:
        compile_module.BACKEND = args.backend
        compiled = build_ours(args, style, L, ctx=ctx, torch_compile=True)
        hf_compiled = torch.compile(build_hf(args, style, L), backend=args.backend)
        sides[f"ours {style} compiled"] = (ours_step, (compiled, mbs))
        if args.backend == "inductor":  # --torch-compile-cpp-wrapper: the kernels run from C++
            wrapped = build_ours(args, style, L, ctx=ctx, torch_compile=True, torch_compile_cpp_wrapper=True)
            sides[f"ours {style} compiled C++ wrapper"] = (ours_step, (wrapped, mbs))
        sides[f"transformers {style} compiled"] = (hf_step, (hf_compiled, mbs))
        for fn, fargs in sides.values():  # compile outside the timings
            fn(*fargs)
    out = {name: {} for name in sides}
    for name, (fn, fargs) in sides.items():
        fn(*fargs)
        calls, platform = python_calls(fn, *fargs)
        out[name].update(calls=calls / m, platform=platform / m)
    for name, ms in alternate(sides, args.steps, cuda_wall_ms if args.device == "cuda" else cpu_ms).items():
        out[name]["ms"] = ms / m
    deep = {
        f"ours {style} eager": build_ours(args, style, 2 * L, ctx=ctx),
        f"transformers {style} eager": build_hf(args, style, 2 * L),
    }
    for name, model in deep.items():
        shallow, fn = sides[name][1][0], sides[name][0]
        out[name]["ops"] = (count_ops(fn, model, mbs) - count_ops(fn, shallow, mbs)) / L / m
    out[f"ours {style} eager"]["syncs"] = count_syncs(ours_train_step, eager, mbs)
    out[f"transformers {style} eager"]["syncs"] = count_syncs(hf_train_step, hf, hf_opt, mbs)
    layer = unwrap_model(eager.model[0]).decoder.layers[0]
    out[f"ours {style} eager"]["explain"] = explain_layer(layer, lambda: ours_step(eager, mbs[:1]))
    hf_layer = hf.transformer.h[0] if style == "gpt2" else hf.model.layers[0]
    out[f"transformers {style} eager"]["explain"] = explain_layer(hf_layer, lambda: hf_step(hf, mbs[:1]))
    if compiled is not None:
        name = f"ours {style} compiled"
        out[name]["syncs"] = count_syncs(ours_train_step, compiled, mbs)
        probe = build_ours(args, style, L, ctx=ctx)  # eager, with what --torch-compile installs, for explain
        mark_static_shapes([probe.model[0].module])
        probe_layer = unwrap_model(probe.model[0]).decoder.layers[0]
        install_compilable_linears(probe_layer)
        install_compilable_recompute(probe_layer)
        out[name]["explain"] = explain_layer(probe_layer, lambda: ours_step(probe, mbs[:1]))
        out[name]["recompiles"] = count_packed_recompiles(args, style, ctx)
        out[name]["loss_rel"], out[name]["grad_rel"] = compare_compiled(args, style, ctx, mbs[:1])
    return out, ctx


def print_style(style: str, out: dict, args, tp2: dict | None = None) -> None:
    hf_eager = out[f"transformers {style} eager"]["calls"]
    cuda = args.device == "cuda"
    print(
        f"\n== {style} style: hidden {args.hidden_size}, {args.num_layers} layers, seq {args.seq_length}, "
        f"micro-batch {args.micro_batch_size}, {args.microbatches} micro-batches a step, fp32, 1 thread"
        + (", CUDA (ms: synchronized wall time)" if cuda else "")
    )
    print(
        f"{'side':32} {'py calls/mb':>12} {'(platform)':>11} {'x hf eager':>10} {'aten ops/layer':>15} "
        f"{'syncs/step':>10} {'wall ms/mb' if cuda else 'host ms/mb':>10} {'graphs/breaks':>14}"
    )
    for name, row in out.items():
        graphs = f"{row['explain'][0]}/{row['explain'][1]}" if "explain" in row else "-"
        ops = f"{row['ops']:.0f}" if "ops" in row else "-"
        syncs = f"{row['syncs']}" if "syncs" in row else "-"
        print(
            f"{name:32} {row['calls']:12.0f} {row['platform']:11.0f} {row['calls'] / hf_eager:10.2f} {ops:>15} "
            f"{syncs:>10} {row['ms']:10.2f} {graphs:>14}"
        )
    ours_eager = out[f"ours {style} eager"]
    print(
        f"targets: eager Python calls <= 2x transformers eager: {ours_eager['calls'] / hf_eager:.2f}x; "
        f"syncs per step <= 1 (ours, TP=PP=DP=1, fp32, NaN guard on, no exit flags): {ours_eager['syncs']}"
    )
    compiled = out.get(f"ours {style} compiled")
    if compiled:
        late, buckets, n = compiled["recompiles"]
        wrapped = out.get(f"ours {style} compiled C++ wrapper")
        print(
            f"targets: compiled Python calls <= transformers eager: {compiled['calls'] / hf_eager:.2f}x"
            + (f" (--torch-compile-cpp-wrapper {wrapped['calls'] / hf_eager:.2f}x)" if wrapped else "")
            + "; "
            f"graph breaks per layer 0 (TP 1): {compiled['explain'][1]}; recompiles after each bucket's first "
            f"micro-batch 0: "
            f"{late} ({buckets} buckets over {n} packed micro-batches); compiled vs eager <= 1e-5 relative "
            f"(fp32): loss {compiled['loss_rel']:.1e}, worst parameter gradient {compiled['grad_rel'][0]:.1e} "
            f"({compiled['grad_rel'][1]})"
        )
    if tp2:
        compiled_tp2, upstream_tp2 = tp2["compiled"], tp2["upstream"]
        print(
            f"targets: graph breaks per layer at TP 2 with sequence parallelism: only at named collective "
            f"boundaries, capped (0 is the cap here): compiled {compiled_tp2[1]} ({compiled_tp2[0]} graph(s)); "
            f"megatron-core's own linears (eager at TP 2) {upstream_tp2[1]}"
            + (f", first at: {upstream_tp2[2][0]}" if upstream_tp2[2] else "")
        )
        if compiled_tp2[2]:
            print(f"  compiled TP 2 breaks at: {'; '.join(compiled_tp2[2][:3])}")
    reasons = ours_eager["explain"][2]
    if reasons:
        print(f"ours eager (megatron-core's linears) breaks at: {reasons[0]} ...")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench.host_overhead --device cuda: torch sees no CUDA GPU here; run it on a GPU machine, "
            "or leave --device out for the CPU figures",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    import os

    from megatron_ext.testing import run_ranks

    print(
        f"host overhead | torch {torch.__version__} | load average {os.getloadavg()[0]:.1f} | "
        f"backend {args.backend if not args.skip_compiled else '-'}"
        + (f" | {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "")
    )
    tp2 = None
    if args.device == "cuda":
        if not args.skip_compiled:
            print(
                "TP 2 with sequence parallelism: skipped on CUDA (its forked ranks cannot run dynamo once this "
                "process has initialised CUDA); python -m bench.host_overhead (on the CPU) measures it"
            )
        start_cuda_world()
    else:
        # TP 2 first, in forked ranks of their own world (before this process joins its one-rank world)
        tp2 = None if args.skip_compiled else run_ranks(explain_tp2, 2, args, STYLES, timeout=900)[0]
        init_single_rank_world(timeout_minutes=30)
    ctx = None
    for style in STYLES:
        out, ctx = measure_style(args, style, ctx)
        print_style(style, out, args, tp2[style] if tp2 else None)
    return 0


def start_cuda_world() -> None:
    """A one-rank NCCL world on GPU 0, as ``pretrain_gpt.py`` starts one without torchrun."""
    import os

    from megatron_ext.parallel import init_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    init_distributed(torch.device("cuda", 0), 30)


if __name__ == "__main__":
    sys.exit(main())
