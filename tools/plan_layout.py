"""Plan a job's layout: the few best TP / CP / PP / VPP / schedule / micro-batch / recompute choices for
a model on a cluster, by predicted step time among those that fit in memory, with the memory per
GPU, the bubble, the communication per step and the pretrain_gpt.py flags (docs/planning.md).

    python tools/plan_layout.py --config configs/llama3-70b.yaml --gpus 512 --gpus-per-node 8 \\
        --gpu-memory-gib 80 [--seq-length 8192] [--global-batch-size 512] [--fix tp=8 --fix schedule=ZBH1]
        [--top 5] [--show "tp=4 pp=8 vpp=5"]

The model and the training flags come from the config (``--config``, or any pretrain_gpt.py flags
after ``--``), loaded as pretrain_gpt.py loads them; ``--hf-config config.json`` takes the model
(Llama / Qwen2: layers, widths, heads, vocabulary, ...) from a Hugging Face config instead, as
``megatron_ext/hf/config.py`` maps it (the converter's mapping), over the training settings of ``--config`` and the flags.
``--show`` prints the layouts matching the given settings whether or not they fit, with why not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()

from megatron_ext.arguments import adjust_like_megatron, parse_args  # noqa: E402
from megatron_ext.cli_args import ToolParser, fail, input_file, integer, real  # noqa: E402
from megatron_ext.config import ConfigError, JobConfig, build_job_config  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer, get_tokenizer_args  # noqa: E402
from megatron_ext.hf.config import hf_config_to_values  # noqa: E402
from megatron_ext.planning.memory import GIB  # noqa: E402
from megatron_ext.planning.planner import MAX_VPP, MICRO_BATCHES, RECOMPUTE, Candidate, get_cp_sizes, plan  # noqa: E402
from megatron_ext.planning.predict import count_parts  # noqa: E402
from megatron_ext.planning.step_time import (  # noqa: E402
    DEFAULT_ACHIEVABLE,
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    Cluster,
)


def parse_settings(items: list[str]) -> dict[str, str]:
    """["tp=8", "schedule=ZBH1 pp=4"] -> {"tp": "8", "schedule": "ZBH1", "pp": "4"}."""
    out = {}
    for item in " ".join(items).split():
        key, _, value = item.partition("=")
        if key not in ("tp", "cp", "pp", "vpp", "schedule", "mbs", "recompute") or not value:
            raise SystemExit(
                f"error: --fix/--show takes KEY=VALUE with KEY one of tp, cp, pp, vpp, schedule, mbs, recompute: "
                f"{item!r}"
            )
        out[key] = value
    return out


SCHEDULES = ("none", "1F1B", "ZBH1", "ZBVZeroBubble", "Interleaved1F1B", "InterleavedZeroBubble")


def check_pinned(settings: dict[str, str], flag: str) -> None:
    """Each --fix/--show value one the planner can match (a typo matched no layout: "0 fit", silently)."""
    for key, value in settings.items():
        if key in ("tp", "pp", "vpp", "cp", "mbs") and not (value.isdecimal() and int(value) >= 1):
            fail(f"{flag} {key}={value}: give a whole number >= 1")
        if key == "schedule" and value.lower() not in {s.lower() for s in SCHEDULES}:
            fail(f"{flag} schedule={value}: give one of {', '.join(SCHEDULES)} (none: no pipeline)")
        if key == "recompute" and value not in RECOMPUTE:
            fail(f"{flag} recompute={value}: give one of {', '.join(RECOMPUTE)}")


def get_terms(c: Candidate) -> dict[str, float]:
    """The fullest GPU's predicted bytes by term, as ``describe`` prints them."""
    mem = c.memory
    return {
        "weights": mem.state.parameters,
        "grads": mem.state.gradients,
        "optimizer": mem.state.optimizer,
        "activations": mem.activations,
        "temporaries": mem.temporaries,
        "margin": mem.margin,
    }


def describe_no_fit(candidates: list[Candidate], pinned: dict[str, str], cfg: JobConfig, cluster: Cluster) -> str:
    """Why no layout fits: none matches the pinned settings, none is valid (the commonest reason),
    or none fits the memory: the layout closest to fitting, its largest term and what it needs."""
    if not candidates:
        return (
            f"no layout has {' '.join(f'{k}={v}' for k, v in pinned.items())}: the planner tries TP dividing "
            f"--gpus-per-node {cluster.gpus_per_node}, the CP sizes the sequence allows, PP dividing the "
            f"{cfg.model.num_layers} layers and the "
            f"{cluster.gpus} GPUs, VPP up to {MAX_VPP} dividing a rank's layers, mbs {'/'.join(map(str, MICRO_BATCHES))}: "
            f"change or drop a --fix/--show"
        )
    valid = [c for c in candidates if c.memory is not None]
    if not valid:
        reasons = [c.problems[0] for c in candidates if c.problems]
        common = max(set(reasons), key=reasons.count)
        return (
            f"none of the {len(candidates)} layouts is valid; the commonest reason ({reasons.count(common)}): {common}"
        )
    closest = min(valid, key=lambda c: c.memory.total)
    term, size = max(get_terms(closest).items(), key=lambda item: item[1])
    need = closest.memory.total / GIB
    return (
        f"none of the {len(valid)} valid layouts fits {cluster.gpu_memory_gib:g} GiB per GPU: the closest, "
        f"{closest.layout.describe()} (DP {closest.dp}), needs {need:.1f} GiB on its fullest GPU, the largest term "
        f"{term} ({size / GIB:.1f} GiB); it fits GPUs of --gpu-memory-gib {math.ceil(need)}; else more GPUs "
        f"(--gpus), a shorter --seq-length or a smaller model"
    )


def describe(
    c: Candidate, rank: int | None = None, cfg: JobConfig | None = None, gpu_memory_gib: float | None = None
) -> str:
    head = f"{'' if rank is None else f'{rank}. '}{c.layout.describe()} | DP {c.dp}"
    if c.memory is None:  # (no micro-batch count: the batch may be what is invalid)
        return head + "\n   invalid: " + "; ".join(c.problems)
    head += f", {c.num_microbatches} micro-batches"
    mem, t = c.memory, c.time
    lines = [
        head + f" | step {t.total:.2f} s predicted (bubble {t.bubble:.1%}, DP exposed {t.dp_exposed:.2f} s)",
        f"   memory on the fullest GPU {mem.total / GIB:.1f} GiB = weights {mem.state.parameters / GIB:.1f} + grads "
        f"{mem.state.gradients / GIB:.1f} + optimizer {mem.state.optimizer / GIB:.1f} + activations "
        f"{mem.activations / GIB:.1f} + temporaries {mem.temporaries / GIB:.1f} + margin {mem.margin / GIB:.1f}",
        "   comm per GPU per step: " + ", ".join(f"{k.upper()} {v / GIB:.1f} GiB" for k, v in t.comm_bytes.items()),
        "   flags: " + " ".join(c.layout.flags()),
    ]
    if c.even_memory is not None:
        lines.insert(2, describe_lighter_first(c, gpu_memory_gib))
    remove = c.layout.get_settings_to_remove(cfg) if cfg is not None else []
    if remove:
        lines.append("   and remove from the config: " + " ".join(remove))
    if c.problems:
        lines.append("   does not fit: " + "; ".join(c.problems))
    return "\n".join(lines)


def describe_lighter_first(c: Candidate, gpu_memory_gib: float | None) -> str:
    """The line under a lighter first stage's memory: the even split's fullest GPU, and whether the
    layout fits only thanks to the lighter first stage."""
    line = (
        f"   lighter first stage ({c.layout.first_layers} layers): {c.memory.total / GIB:.1f} GiB on the fullest GPU "
        f"against {c.even_memory / GIB:.1f} GiB with the even split"
    )
    if gpu_memory_gib is not None and not c.problems and c.even_memory > gpu_memory_gib * GIB:
        line += f", which does not fit {gpu_memory_gib:g} GiB: fits only with this split"
    return line


def load_config(args: argparse.Namespace, extra: list[str]) -> tuple[JobConfig, int | None]:
    """The job's config, and with ``--hf-config`` its model from that file and the vocabulary size
    (the HF config's; else None: the tokenizer's)."""
    argv = (["--config", args.config] if args.config else []) + extra
    if args.seq_length:
        argv += ["--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length)]
    if args.global_batch_size:
        argv += ["--global-batch-size", str(args.global_batch_size)]
    cfg = parse_args(argv)
    if not args.hf_config:
        return cfg, None
    with open(args.hf_config) as f:
        hf = json.load(f)
    values = cfg.to_flat_dict()
    values.update(hf_config_to_values(hf, values.get("make_vocab_size_divisible_by") or 128))
    cfg = build_job_config(values)
    adjust_like_megatron(cfg)
    return cfg, hf["vocab_size"]


def count_total_parameters(cfg: JobConfig, vocab_size: int) -> int:
    """The model's parameters (one copy, TP 1: sequence parallelism off, as TP 1 turns it off; a config
    that sets it would fail megatron-core's TransformerConfig at TP 1)."""
    tp1 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=False))
    parts = count_parts(tp1, vocab_size, 1)
    return cfg.model.num_layers * parts.layer + parts.embedding + parts.head


def build_parser() -> ToolParser:
    """The arguments, each number checked as it is read (``cli_args``: 0, negative, nan, inf refused
    where they mean nothing, naming the argument)."""
    p = ToolParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=input_file, help="a pretrain_gpt.py config (YAML/TOML); more flags after --")
    p.add_argument(
        "--hf-config", type=input_file, help="the model from a Hugging Face config.json (Llama, Qwen2) instead"
    )
    p.add_argument("--gpus", type=integer(1, what="the GPUs to plan for"), required=True)
    p.add_argument("--gpus-per-node", type=integer(1, what="GPUs per node"), default=8)
    p.add_argument("--gpu-memory-gib", type=real(0, what="each GPU's memory in GiB", low_open=True), default=80.0)
    p.add_argument(
        "--peak-tflops",
        type=real(0, what="dense bf16 TFLOP/s per GPU", low_open=True),
        default=989.0,
        help="dense bf16 peak per GPU (H100 SXM: 989)",
    )
    p.add_argument(
        "--achievable",
        type=real(0, 1, what="the fraction of --peak-tflops the GEMMs reach", low_open=True),
        default=DEFAULT_ACHIEVABLE,
        help="fraction of peak the GEMMs reach",
    )
    gbps = real(0, what="GB/s per GPU", low_open=True)
    p.add_argument("--intra-node-gbps", type=gbps, default=DEFAULT_INTRA_NODE_GBPS)
    p.add_argument("--inter-node-gbps", type=gbps, default=DEFAULT_INTER_NODE_GBPS)
    p.add_argument("--seq-length", type=integer(1, what="tokens per sample"))
    p.add_argument("--global-batch-size", type=integer(1, what="samples per step"))
    p.add_argument("--fix", action="append", default=[], help="pin a setting: tp=8, schedule=ZBH1, ...")
    p.add_argument("--show", action="append", default=[], help="print the layouts matching these settings, fit or not")
    p.add_argument("--top", type=integer(1, what="layouts to print"), default=5)
    return p


def read_job(args: argparse.Namespace, extra: list[str]) -> tuple[JobConfig, int]:
    """``load_config`` and the vocabulary, a bad config or model file one ``error:`` line (exit 2)."""
    try:
        cfg, vocab = load_config(args, extra)
        return cfg, vocab or build_tokenizer(**get_tokenizer_args(cfg.data)).vocab_size
    except ConfigError as err:
        fail(str(err))
    except (OSError, ValueError, KeyError, TypeError) as err:  # a malformed --hf-config
        if not args.hf_config:
            raise
        fail(f"--hf-config {args.hf_config}: not a Hugging Face model config ({type(err).__name__}: {err})")


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        fail(
            f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}: give a "
            f"multiple of {args.gpus_per_node} (torchrun starts as many processes on every node)"
        )
    start = time.perf_counter()
    cfg, vocab = read_job(args, extra)
    cluster = Cluster(
        args.gpus, args.gpus_per_node, args.gpu_memory_gib, args.peak_tflops, args.achievable,
        args.intra_node_gbps, args.inter_node_gbps,
    )  # fmt: skip
    try:
        show, fixed = parse_settings(args.show), parse_settings(args.fix)
    except SystemExit as err:  # parse_settings' one line, exit 2 as every argument's error
        fail(f"{str(err.code).removeprefix('error: ')}: give KEY=VALUE with one of those keys")
    check_pinned(fixed, "--fix")
    check_pinned(show, "--show")
    candidates = plan(cfg, cluster, vocab, {**fixed, **show})
    fitting = [c for c in candidates if not c.problems]
    print(
        f"{count_total_parameters(cfg, vocab):,} parameters, {cfg.model.num_layers} layers x hidden "
        f"{cfg.model.hidden_size}, seq {cfg.model.seq_length}, global batch "
        f"{cfg.training.global_batch_size} on {args.gpus} GPUs ({args.gpus_per_node} per node, {args.gpu_memory_gib:g} GiB, "
        f"{args.peak_tflops:g} TFLOP/s x {args.achievable:g}): {len(candidates)} layouts, "
        f"{sum(c.memory is not None for c in candidates)} valid, {len(fitting)} fit"
    )
    for reason in get_cp_sizes(cfg, args.gpus)[1]:
        print(f"context parallelism not searched: {reason}")
    for i, c in enumerate(fitting[: args.top], 1):
        print(describe(c, i, cfg, args.gpu_memory_gib))
    if not fitting:
        print(f"0 fit: {describe_no_fit(candidates, {**fixed, **show}, cfg, cluster)}")
    if show:
        print(f"layouts matching --show {' '.join(args.show)}:")
        for c in candidates:
            if c.problems:
                print(describe(c, cfg=cfg, gpu_memory_gib=args.gpu_memory_gib))
    print(f"planned in {time.perf_counter() - start:.1f} s")
    return 0 if fitting else 1


if __name__ == "__main__":
    raise SystemExit(main())
