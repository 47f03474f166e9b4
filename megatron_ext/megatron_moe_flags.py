"""Megatron-LM's mixture-of-experts flags, each refused by name: the models here are dense.

A Megatron-LM MoE script (``examples/mixtral/train_mixtral_8x7b_distributed.sh``: its ``MOE_ARGS``)
must not train a dense model silently, nor stop on "unrecognized arguments" that never say why.
The list is every MoE flag of Megatron-LM core_v0.16.1's parser (``megatron/training/arguments.py``:
``_add_moe_args`` and the ``moe_*`` / expert fields of megatron-core's ``TransformerConfig``, which
its ``ArgumentGroupFactory`` turns into flags), with its arity; ``--expert-model-parallel-size 1``
(no expert parallelism, Megatron-LM's default) states what we do and is accepted silently.

Rows feed ``megatron_flags.FLAGS`` as ``(flag, nargs, judge, help)``; nargs as there: None for a
switch, 1 for one value, "+" for one or more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SWITCH = None  # megatron_flags.STORE_TRUE

# (flag, nargs) as core_v0.16.1's parser defines them
MOE_FLAGS = (
    ("--num-experts", 1),
    ("--expert-model-parallel-size", 1),
    ("--expert-tensor-parallel-size", 1),
    ("--moe-layer-freq", 1),
    ("--moe-ffn-hidden-size", 1),
    ("--moe-router-topk", 1),
    ("--moe-router-load-balancing-type", "+"),
    ("--moe-aux-loss-coeff", "+"),
    ("--moe-z-loss-coeff", 1),
    ("--moe-input-jitter-eps", 1),
    ("--moe-router-score-function", 1),
    ("--moe-router-dtype", 1),
    ("--moe-router-topk-scaling-factor", 1),
    ("--moe-router-num-groups", 1),
    ("--moe-router-group-topk", 1),
    ("--moe-router-bias-update-rate", 1),
    ("--moe-router-pre-softmax", SWITCH),
    ("--moe-router-enable-expert-bias", SWITCH),
    ("--moe-router-force-load-balancing", SWITCH),
    ("--moe-router-padding-for-quantization", SWITCH),
    ("--moe-router-padding-for-fp8", SWITCH),
    ("--moe-router-fusion", SWITCH),
    ("--moe-enable-routing-replay", SWITCH),
    ("--moe-shared-expert-intermediate-size", 1),
    ("--moe-shared-expert-gate", SWITCH),
    ("--moe-shared-expert-overlap", SWITCH),
    ("--moe-latent-size", 1),
    ("--moe-grouped-gemm", SWITCH),
    ("--moe-use-legacy-grouped-gemm", SWITCH),
    ("--moe-token-dispatcher-type", 1),
    ("--moe-flex-dispatcher-backend", 1),
    ("--moe-enable-deepep", SWITCH),
    ("--moe-deepep-num-sms", 1),
    ("--moe-hybridep-num-sms", 1),
    ("--moe-expert-capacity-factor", 1),
    ("--moe-pad-expert-input-to-capacity", SWITCH),
    ("--moe-token-drop-policy", 1),
    ("--moe-permute-fusion", SWITCH),
    ("--moe-apply-probs-on-input", SWITCH),
    ("--moe-layer-recompute", SWITCH),
    ("--moe-per-layer-logging", SWITCH),
    ("--moe-extended-tp", SWITCH),
    ("--overlap-moe-expert-parallel-comm", SWITCH),
    ("--moe-use-upcycling", SWITCH),
    ("--moe-upcycling-granularity", 1),
    ("--moe-pad-experts-for-cuda-graph-inference", SWITCH),
)
HELP = "Refused: mixture-of-experts (MoE) models are not supported (dense models only)."
EXPERT_PARALLEL_HELP = "1 accepted silently (no expert parallelism); other sizes refused: MoE is not supported."


def _given(flag: str, value: Any) -> str:
    """The flag as the user gave it: ``--num-experts 8``, ``--moe-aux-loss-coeff 1e-2 1e-3``, ``--moe-grouped-gemm``."""
    if value is True:
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def _refuse_moe(flag: str) -> Callable[[Any, Any], tuple[None, str]]:
    def judge(value, cfg):
        return None, (
            f"{_given(flag, value)}: mixture-of-experts (MoE) models are not supported (dense models only); "
            f"leave out the MoE flags (--num-experts, --moe-*, --expert-*)"
        )

    return judge


def _expert_parallel_size(value, cfg):
    if str(value).strip() == "1":
        return None, None
    return _refuse_moe("--expert-model-parallel-size")(value, cfg)


def _row(flag: str, nargs: Any) -> tuple[str, Any, Callable, str]:
    if flag == "--expert-model-parallel-size":
        return flag, nargs, _expert_parallel_size, EXPERT_PARALLEL_HELP
    return flag, nargs, _refuse_moe(flag), HELP


MOE_FLAG_ROWS = [_row(flag, nargs) for flag, nargs in MOE_FLAGS]
