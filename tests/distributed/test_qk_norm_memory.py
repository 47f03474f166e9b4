"""The memory model with ``--qk-layernorm`` (Qwen3's per-head q/k norms) against measurement.

One micro-batch's forward and loss of a 2-layer model under ``SavedBytesMeter`` (exact, one count per
storage; ``tools/calibrate_memory.measure``, as the calibration measures) against the calibrated
figure plus ``memory.get_qk_norm_per_token``, through ``predict_stage_bytes`` as the planner prices
a stage. Qwen3 style (RMSNorm, SwiGLU, RoPE, GQA, a head dimension of twice hidden / heads) in fp32
and bf16, no and selective recompute, at TP 1 (two query groups of four heads: megatron-core's query
copy) and TP 2 with sequence parallelism (one group a rank: a view); full recompute (nothing more
kept); without GQA (V keeps the QKV output already), and GPT style (LayerNorm, no RoPE) with and
without attention dropout (SDPA keeps the normed q and k; the CPU math path keeps neither).

Measured (the tests print each): the norms add 21-31% to a layer in fp32 and 36-49% in bf16 at this
Qwen3-like shape (10-16% for GPT style), more with selective recompute than without in bf16 (the
checkpoint keeps the normed q and k where it kept views); every case exact (the stage within 0.004%,
the calibration's rounded head coefficients) with the term, and each but full recompute 9-33% under
the measurement without it. Under CP: tests/distributed/test_cp_memory.py.
"""

from __future__ import annotations

import pytest

from megatron_ext.testing import run_ranks, tiny_values

pytestmark = pytest.mark.distributed

TOLERANCE = 0.001
# hidden, heads, query groups, MLP width, sequence, micro-batch, vocabulary ids (calibrate_memory's)
SHAPE = (64, 4, 2, 192, 32, 1, 127)
QWEN3 = dict(qk_layernorm=True, kv_channels=32)  # head dim 32: twice hidden / heads, as Qwen3's
CASES_TP1 = {
    "qwen3 fp32 none": ("llama", "fp32", "none", QWEN3),
    "qwen3 fp32 selective": ("llama", "fp32", "selective", QWEN3),
    "qwen3 bf16 none": ("llama", "bf16", "none", QWEN3),
    "qwen3 bf16 selective": ("llama", "bf16", "selective", QWEN3),
    "qwen3 bf16 full": ("llama", "bf16", "full", QWEN3),
    "qwen3 without GQA bf16 none": ("llama", "bf16", "none", dict(QWEN3, num_query_groups=4)),
    "gpt LayerNorm bf16 none": ("gpt-nodropout", "bf16", "none", dict(qk_layernorm=True)),
    "gpt LayerNorm with dropout bf16 none": ("gpt", "bf16", "none", dict(qk_layernorm=True)),
}
CASES_TP2 = {
    f"TP2 + SP, qwen3 {precision} {recompute}": ("llama", precision, recompute, QWEN3)
    for precision in ("fp32", "bf16")
    for recompute in ("none", "selective")
}


def get_values(case: tuple, tp: int) -> dict:
    from tools.calibrate_memory import PRECISIONS, RECOMPUTE, get_flags

    family, precision, recompute, extra = case
    return {**get_flags(family, SHAPE, tp, tp > 1), **PRECISIONS[precision], **RECOMPUTE[recompute], **extra}


def _measure(rank: int, world_size: int, cases: dict) -> dict:
    from tools.calibrate_memory import measure

    return {name: measure(get_values(case, world_size)) for name, case in cases.items()}


@pytest.fixture(scope="module")
def measured() -> dict:
    return {**run_ranks(_measure, 1, CASES_TP1)[0], **run_ranks(_measure, 2, CASES_TP2)[0]}


def predict(values: dict) -> tuple[float, float, float]:
    """(a layer's bytes with the norms' term, without it, the stage's bytes) of one micro-batch."""
    import dataclasses

    from megatron_ext.config import build_job_config
    from megatron_ext.derived import get_padded_vocab_size
    from megatron_ext.planning.memory import get_recompute_kind, get_shape
    from megatron_ext.planning.predict import get_layer_per_token, predict_stage_bytes

    cfg = build_job_config(tiny_values(**values))  # as calibrate_memory.measure builds it
    ids = values["vocab_size"] + 1  # NullTokenizer: the ids and EOD
    shape = get_shape(cfg, get_padded_vocab_size(ids, cfg))
    kind = get_recompute_kind(cfg)
    without = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_layernorm=False))
    layer, plain = (get_layer_per_token(c, kind, shape).layer * shape.tokens for c in (cfg, without))
    return layer, plain, predict_stage_bytes(cfg, ids, cuda=False).saved[0]


@pytest.mark.parametrize("name", [*CASES_TP1, *CASES_TP2])
def test_qk_norms_saved_bytes_are_the_models(measured, name):
    tp = 2 if name in CASES_TP2 else 1
    values = get_values({**CASES_TP1, **CASES_TP2}[name], tp)
    got = measured[name]
    layer, plain, stage = predict(values)
    total = got["embedding"] + got["layer"] * values["num_layers"] + got["head"]
    tokens = values["seq_length"] * values["micro_batch_size"]
    print(
        f"{name}: layer measured {got['layer']} predicted {layer:.0f} ({got['layer'] / layer - 1:+.3%}), "
        f"{(layer - plain) / tokens:.0f} bytes a token for the norms; without them {plain:.0f} "
        f"({plain / got['layer'] - 1:+.2%}); stage measured {total} predicted {stage:.0f} ({stage / total - 1:+.3%})"
    )
    assert abs(layer / got["layer"] - 1) <= TOLERANCE, (name, got, layer)
    assert abs(stage / total - 1) <= TOLERANCE, (name, got, stage)
    if "full" not in name:  # (a checkpointed layer keeps its input alone: the norms add nothing)
        assert plain / got["layer"] - 1 < -0.05, (name, got, plain)
