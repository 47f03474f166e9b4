"""Megatron-LM flags we have no field for: accepted where their value is what we do anyway, refused
by name where they would change the model or the training and we lack them.

Megatron-LM launch scripts carry flags that select its own code paths (``--use-mcore-models``),
kernels (``--attention-backend``, fusions) or file-reading details (``--no-mmap-bin-files``).
Rejecting them as unknown makes a user edit every script; silently ignoring one that changes the
model would train something else. So each flag here is one of:

- accepted: its value matches what we do; one warning line says it changes nothing (silent when it
  states our behaviour exactly, e.g. ``--ckpt-format torch_dist``);
- refused: an error naming the flag and what to do instead (model-changing flags we lack, other
  values of the accepted ones).

``parse_args`` adds them to the parser, evaluates them against the finished JobConfig and returns
the warnings for the start-up log; the refusals join one ConfigError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron_ext.config import JobConfig
from megatron_ext.megatron_moe_flags import MOE_FLAG_ROWS

STORE_TRUE = None


@dataclasses.dataclass(frozen=True)
class MegatronFlag:
    flag: str
    nargs: Any  # STORE_TRUE, 1 (one value) or an argparse nargs ("+": one or more values, a list)
    # (value, cfg) -> (warning or None, problem or None)
    judge: Callable[[Any, JobConfig], tuple[str | None, str | None]]
    help: str

    @property
    def dest(self) -> str:
        return "megatron_flag__" + self.flag[2:].replace("-", "_")


def _noop(why: str) -> Callable:
    return lambda value, cfg: (why, None)


def _refuse(why: str) -> Callable:
    return lambda value, cfg: (None, why)


def _one_of(accepted: dict[str, str | None], refusal: str) -> Callable:
    """Accept the listed values (with their warning, None: silent); refuse the others."""

    def judge(value, cfg):
        if str(value) in accepted:
            return accepted[str(value)], None
        return None, refusal.format(value=value)

    return judge


def _needs_rope(flag: str) -> Callable:
    def judge(value, cfg):
        if cfg.model.position_embedding_type == "rope":
            return None, None
        return None, f"{flag} means rotary position embeddings: add --position-embedding-type rope"

    return judge


def _lr_warmup_init(value, cfg):
    try:
        zero = float(value) == 0.0
    except ValueError:
        zero = False
    if zero:
        return None, None
    return None, (
        f"--lr-warmup-init {value}: the warm-up starts from learning rate 0 (Megatron-LM's default); another "
        f"starting learning rate is not supported: leave it out"
    )


def _attention_backend(value, cfg):
    if cfg.model.transformer_impl == "transformer_engine":
        return None, (
            f"--attention-backend {value}: choosing Transformer Engine's attention backend is not "
            f"supported yet (leave it out: Transformer Engine picks one)"
        )
    if value in ("auto", "local", "flash", "fused", "unfused"):
        return (
            f"--attention-backend {value} changes nothing with the local layer spec: attention runs on torch "
            f"SDPA, and packed sequences on flash's varlen kernel on CUDA in bf16/fp16 (the start-up line names the kernels)"
        ), None
    return None, f"--attention-backend {value}: not a Megatron-LM attention backend"


FLAGS = [
    MegatronFlag(
        "--use-mcore-models",
        STORE_TRUE,
        _noop("--use-mcore-models changes nothing: the models are always megatron-core's"),
        "Accepted, no effect (one warning line): the models are always megatron-core's.",
    ),
    MegatronFlag(
        "--use-dist-ckpt",
        STORE_TRUE,
        _noop(
            "--use-dist-ckpt changes nothing: checkpoints are always megatron-core distributed checkpoints (torch_dist)"
        ),
        "Accepted, no effect (one warning line): checkpoints are always megatron-core distributed "
        "checkpoints (torch_dist).",
    ),
    MegatronFlag(
        "--ckpt-format",
        1,
        _one_of(
            {"torch_dist": None},
            "--ckpt-format {value}: only torch_dist (megatron-core distributed checkpoints) is written and read",
        ),
        "torch_dist accepted silently (the only format written and read); other formats refused.",
    ),
    MegatronFlag(
        "--no-create-attention-mask-in-dataloader",
        STORE_TRUE,
        _noop(
            "--no-create-attention-mask-in-dataloader changes nothing: no dense attention mask is ever built (causal kernels; packed documents through cu_seqlens)"
        ),
        "Accepted, no effect (one warning line): no dense attention mask is ever built (causal "
        "kernels; packed documents through cu_seqlens).",
    ),
    MegatronFlag(
        "--no-mmap-bin-files",
        STORE_TRUE,
        _noop("--no-mmap-bin-files changes nothing here: .bin files are memory-mapped"),
        "Accepted, no effect (one warning line): .bin files are memory-mapped.",
    ),
    MegatronFlag(
        "--log-throughput",
        STORE_TRUE,
        _noop("--log-throughput changes nothing: tokens/s and TFLOP/s per GPU are always logged"),
        "Accepted, no effect (one warning line): tokens/s and TFLOP/s per GPU are always logged.",
    ),
    MegatronFlag(
        "--cross-entropy-loss-fusion",
        STORE_TRUE,
        _noop(
            "--cross-entropy-loss-fusion changes nothing: the loss is our fused vocab-parallel cross-entropy (model/cross_entropy.py) in any case"
        ),
        "Accepted, no effect (one warning line): the loss is our fused vocab-parallel "
        "cross-entropy (model/cross_entropy.py) in any case.",
    ),
    MegatronFlag(
        "--use-flash-attn",
        STORE_TRUE,
        _noop(
            "--use-flash-attn changes nothing: the attention kernels are chosen by device (torch SDPA / flash's varlen kernel; the start-up line names them)"
        ),
        "Accepted, no effect (one warning line): attention kernels are chosen by device (torch "
        "SDPA; flash's varlen kernel for packed sequences on CUDA).",
    ),
    MegatronFlag(
        "--no-masked-softmax-fusion",
        STORE_TRUE,
        _noop("--no-masked-softmax-fusion changes nothing: the local spec uses no masked-softmax kernel"),
        "Accepted, no effect (one warning line): the local spec uses no masked-softmax kernel.",
    ),
    MegatronFlag(
        "--no-bias-gelu-fusion",
        STORE_TRUE,
        _noop("--no-bias-gelu-fusion changes nothing here"),
        "Accepted, no effect (one warning line).",
    ),
    MegatronFlag(
        "--no-bias-swiglu-fusion",
        STORE_TRUE,
        _noop("--no-bias-swiglu-fusion changes nothing here"),
        "Accepted, no effect (one warning line).",
    ),
    MegatronFlag(
        "--no-bias-dropout-fusion",
        STORE_TRUE,
        _noop("--no-bias-dropout-fusion changes nothing here"),
        "Accepted, no effect (one warning line).",
    ),
    MegatronFlag(
        "--no-rope-fusion",
        STORE_TRUE,
        _noop("--no-rope-fusion changes nothing: rotary embeddings are applied by our packed-aware code, unfused"),
        "Accepted, no effect (one warning line): rotary embeddings are applied by our packed-aware code, unfused.",
    ),
    MegatronFlag(
        "--distributed-backend",
        1,
        _one_of(
            {"nccl": None, "gloo": None}, "--distributed-backend {value}: nccl (CUDA) or gloo (CPU), chosen by device"
        ),
        "nccl or gloo accepted silently: the backend is chosen by device (nccl on CUDA, gloo on "
        "CPU); other values refused.",
    ),
    MegatronFlag(
        "--use-rotary-position-embeddings",
        STORE_TRUE,
        _needs_rope("--use-rotary-position-embeddings"),
        "Accepted silently with --position-embedding-type rope; refused without it.",
    ),
    MegatronFlag(
        "--no-position-embedding",
        STORE_TRUE,
        _needs_rope("--no-position-embedding"),
        "Accepted silently with --position-embedding-type rope (no learned absolute embedding "
        "then); refused without it.",
    ),
    MegatronFlag(
        "--attention-backend",
        1,
        _attention_backend,
        "Accepted with the local spec, no effect (one warning line: attention runs on torch SDPA, "
        "packed sequences on flash's varlen kernel on CUDA in bf16/fp16); refused with Transformer Engine.",
    ),
    MegatronFlag(
        "--lr-warmup-init",
        1,
        _lr_warmup_init,
        "0 accepted silently (the warm-up starts from learning rate 0, Megatron-LM's default); other values refused.",
    ),
    MegatronFlag(
        "--timing-log-option",
        1,
        _one_of(
            {
                v: f"--timing-log-option {v} changes nothing: the timers line (--timing-log-level) reports the "
                f"logging rank's own times; --log-straggler reports the slowest and fastest ranks"
                for v in ("max", "minmax", "all")
            },
            "--timing-log-option {value}: Megatron-LM's values are max, minmax and all",
        ),
        "max, minmax or all accepted, no effect (one warning line): the timers line reports the logging "
        "rank's own times (--log-straggler reports the slowest and fastest ranks); other values refused.",
    ),
    MegatronFlag(
        "--ckpt-fully-parallel-save",
        STORE_TRUE,
        _noop(
            "--ckpt-fully-parallel-save changes nothing (deprecated in Megatron-LM too): the checkpoint is the "
            "same torch_dist checkpoint; its replicated parts are written by their main replica (data-parallel "
            "rank 0) rather than spread over the data-parallel ranks"
        ),
        "Accepted, no effect (one warning line; deprecated in Megatron-LM too): the checkpoint is the same; its "
        "replicated parts are written by their main replica (data-parallel rank 0).",
    ),
    MegatronFlag(
        "--no-ckpt-fully-parallel-save",
        STORE_TRUE,
        lambda value, cfg: (None, None),  # states what our saves do: silent
        "Accepted silently: our saves already write each replicated part from its main replica "
        "(data-parallel rank 0), which is what this selects in Megatron-LM.",
    ),
    MegatronFlag(
        "--dist-ckpt-optim-fully-reshardable",
        STORE_TRUE,
        lambda value, cfg: (None, None),  # states what our saves do: silent
        "Accepted silently: our saves always store the distributed optimizer's state fully_reshardable "
        "(loadable at any TP x PP x VPP x DP), which is what this selects in Megatron-LM.",
    ),
    MegatronFlag(
        "--ckpt-assume-constant-structure",
        STORE_TRUE,
        _noop(
            "--ckpt-assume-constant-structure changes nothing: each save makes its save plan afresh (caching it "
            "is a speed-up in Megatron-LM; the files are the same)"
        ),
        "Accepted, no effect (one warning line): each save makes its save plan afresh (Megatron-LM's cached "
        "plan is a speed-up; the files are the same).",
    ),
    MegatronFlag(
        "--auto-detect-ckpt-format",
        STORE_TRUE,
        _noop(
            "--auto-detect-ckpt-format changes nothing: --load reads torch_dist checkpoints, the only format "
            "written and read (a legacy torch checkpoint is not read: convert it with Megatron-LM first)"
        ),
        "Accepted, no effect (one warning line): --load reads torch_dist checkpoints, the only format written and read.",
    ),
    MegatronFlag(
        "--dist-ckpt-strictness",
        1,
        _one_of(
            {"assume_ok_unexpected": None},
            "--dist-ckpt-strictness {value}: loads here are assume_ok_unexpected (Megatron-LM's default: every "
            "tensor the run expects must be in the checkpoint, and a checkpoint of another model "
            "is refused by name before reading); leave it out",
        ),
        "assume_ok_unexpected (Megatron-LM's default, what loads do here) accepted silently; other values "
        "(logging, tolerating or returning mismatched keys) refused.",
    ),
    MegatronFlag(
        "--use-cpu-initialization",
        STORE_TRUE,
        _noop(
            "--use-cpu-initialization changes nothing: the initial weights are drawn from --seed and each "
            "parameter's global name, the same under every layout (what CPU initialisation gives in "
            "Megatron-LM: model/init_weights.py)"
        ),
        "Accepted, no effect (one warning line): the initial weights are drawn from --seed and each parameter's "
        "global name, the same under every layout (what CPU initialisation gives in Megatron-LM).",
    ),
    MegatronFlag(
        "--no-persist-layer-norm",
        STORE_TRUE,
        _noop("--no-persist-layer-norm changes nothing: no persistent layer-norm kernel (Apex's) is used here"),
        "Accepted, no effect (one warning line): no persistent layer-norm kernel (Apex's) is used here.",
    ),
    # refused: they would change the model or the training, and we lack them
    MegatronFlag(
        "--tp-comm-overlap",
        STORE_TRUE,
        _refuse(
            "--tp-comm-overlap: overlapping tensor-parallel communication with the GEMMs needs Transformer "
            "Engine's userbuffers, which are not wired here; leave it out (the TP collectives run unoverlapped)"
        ),
        "Refused: overlapping tensor-parallel communication with the GEMMs needs Transformer Engine's "
        "userbuffers, which are not wired here.",
    ),
    MegatronFlag(
        "--fp8-format",
        1,
        _refuse("--fp8-format: FP8 training is not supported (it needs Transformer Engine's FP8 recipes); use --bf16"),
        "Refused: FP8 training is not supported (it needs Transformer Engine's FP8 recipes); use --bf16.",
    ),
    MegatronFlag(
        "--fp8-amax-history-len",
        1,
        _refuse("--fp8-amax-history-len: FP8 training is not supported"),
        "Refused: FP8 training is not supported.",
    ),
    MegatronFlag(
        "--fp8-amax-compute-algo",
        1,
        _refuse("--fp8-amax-compute-algo: FP8 training is not supported"),
        "Refused: FP8 training is not supported.",
    ),
    MegatronFlag(
        "--fp8-param-gather",
        STORE_TRUE,
        _refuse("--fp8-param-gather: FP8 training is not supported"),
        "Refused: FP8 training is not supported.",
    ),
    # Megatron-LM's rerun state machine (core_v0.16.1 megatron/training/arguments.py): a spiky loss (>= 10x the
    # largest of the first 100) or large gradients re-run the step under --rerun-mode validate_results to tell
    # a hardware fault from the data; there is no such machine here, and silently dropping the check would
    # not be what the script asked for
    MegatronFlag(
        "--check-for-spiky-loss",
        STORE_TRUE,
        _refuse(
            "--check-for-spiky-loss: Megatron-LM's spike check re-runs the step (its rerun state machine, "
            "--rerun-mode validate_results), which is not here; leave it out (a non-finite loss or gradient is "
            "still caught: --check-for-nan-in-loss-and-grad, on by default, skips that step; ours, "
            "--skip-spiky-loss-factor 10, skips a spiky step instead of re-running it)"
        ),
        "Refused: the loss-spike check re-runs steps with Megatron-LM's rerun state machine, which is not here.",
    ),
    MegatronFlag(
        "--check-for-large-grads",
        STORE_TRUE,
        _refuse(
            "--check-for-large-grads: Megatron-LM's large-gradient check re-runs the step (its rerun state "
            "machine), which is not here; leave it out (--clip-grad bounds the update)"
        ),
        "Refused: the large-gradient check re-runs steps with Megatron-LM's rerun state machine, which is not here.",
    ),
    MegatronFlag(
        "--rerun-mode",
        1,
        _one_of(
            {"disabled": None},
            "--rerun-mode {value}: Megatron-LM's rerun state machine (re-running a step to tell a hardware fault "
            "from the data) is not here; use --rerun-mode disabled or leave it out (a non-finite loss or gradient "
            "skips the step: --check-for-nan-in-loss-and-grad)",
        ),
        "Accepted as disabled (silent); validate_results and report_stats are refused: no rerun state machine here.",
    ),
    MegatronFlag(
        "--use-checkpoint-args",
        STORE_TRUE,
        _refuse(
            "--use-checkpoint-args is not supported: give the model flags (a mismatch with the checkpoint is refused by name)"
        ),
        "Refused: give the model flags (a mismatch with the checkpoint is refused by name).",
    ),
    # Context parallelism's variants (ours: --context-parallel-size with --cp-comm-type all_gather)
    MegatronFlag(
        "--hierarchical-context-parallel-sizes",
        "+",
        _refuse(
            "--hierarchical-context-parallel-sizes: hierarchical (a2a+p2p) context parallelism is not supported; "
            "use --context-parallel-size N with --cp-comm-type all_gather"
        ),
        "Refused: hierarchical context parallelism is not supported (--context-parallel-size with all_gather is).",
    ),
    MegatronFlag(
        "--hybrid-context-parallel",
        STORE_TRUE,
        _refuse(
            "--hybrid-context-parallel: a CP size chosen per sequence is not supported; use one "
            "--context-parallel-size for the run"
        ),
        "Refused: a context-parallel size per sequence is not supported.",
    ),
    MegatronFlag(
        "--max-seqlen-per-dp-cp-rank",
        1,
        _refuse(
            "--max-seqlen-per-dp-cp-rank: hybrid context parallelism's per-rank budget is not supported; leave it "
            "out (each rank holds --seq-length / --context-parallel-size tokens)"
        ),
        "Refused: hybrid context parallelism's per-rank budget is not supported.",
    ),
    MegatronFlag(
        "--use-tp-pp-dp-mapping",
        STORE_TRUE,
        _refuse(
            "--use-tp-pp-dp-mapping: only megatron-core's default rank order (tp-cp-ep-dp-pp: TP inside a node) "
            "is supported; leave it out"
        ),
        "Refused: only megatron-core's default rank order tp-cp-ep-dp-pp is supported.",
    ),
    MegatronFlag(
        "--dataloader-inter-document-masking",
        STORE_TRUE,
        _refuse(
            "--dataloader-inter-document-masking (Megatron-LM 0.19+): our document masking for GPTDataset windows "
            "is --reset-attention-mask --reset-position-ids (document boundaries as THD cu_seqlens, with "
            "--context-parallel-size too), or pack whole documents with --packed-sequences: use those"
        ),
        "Refused by name: use --reset-attention-mask --reset-position-ids (the same document masking) or --packed-sequences.",
    ),
]
# Megatron-LM's mixture-of-experts flags: refused by name (megatron_moe_flags.py)
FLAGS += [MegatronFlag(*row) for row in MOE_FLAG_ROWS]
BY_DEST = {f.dest: f for f in FLAGS}
MEGATRON_FLAG_NAMES = frozenset(f.flag for f in FLAGS)


def escape_help(text: str) -> str:
    """argparse formats help text with ``%``: a literal percent sign ("+42-48% of load time") must be
    doubled, or ``--help`` fails with a TypeError."""
    return text.replace("%", "%%")


def add_megatron_flags(parser: Any) -> None:
    group = parser.add_argument_group(
        "Megatron-LM compatibility (accepted where they change nothing, refused otherwise)"
    )
    for f in FLAGS:
        if f.nargs is STORE_TRUE:
            group.add_argument(f.flag, dest=f.dest, action="store_true", default=None, help=escape_help(f.help))
        else:
            nargs = None if f.nargs == 1 else f.nargs
            group.add_argument(f.flag, dest=f.dest, nargs=nargs, default=None, help=escape_help(f.help))


def pop_megatron_flags(values: dict[str, Any]) -> dict[str, Any]:
    """Remove the given compatibility flags from parsed ``values``; returns them by dest."""
    return {dest: values.pop(dest) for dest in list(values) if dest in BY_DEST}


def judge_megatron_flags(given: dict[str, Any], cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(warnings, problems) of the compatibility flags given, in the table's order."""
    warnings, problems = [], []
    for f in FLAGS:
        if given.get(f.dest) is None:
            continue
        warning, problem = f.judge(given[f.dest], cfg)
        if warning:
            warnings.append(warning)
        if problem:
            problems.append(problem)
    return warnings, problems
