"""Context parallelism in the planning models (megatron_ext/planning), each term against a figure
computed by hand here or in docs/context-parallel.md:

- memory: a rank holds 1/c of each micro-batch's activations, P2P buffers and temporaries; a layer
  whose core attention is not recomputed also keeps the gathered keys and values, (2c+1)/(2c) x T x
  2 x ng/TP x hn x bytes (one layer's at a time, outside autograd, when it is recomputed; in the
  rebuilt layer's backward under full recompute); the distributed optimizer shards over DP x CP;
- time: compute over TP x CP x PP x DP GPUs, TP traffic of T / c tokens, per layer and micro-batch one
  all-gather of K/V forward and one reduce-scatter backward of (c-1)/c x T x 2 ng/TP x hn x bytes each
  (plus one all-gather when recomputed), the DP reduce over DP x CP;
- the planner: CP searched, and chosen where it beats more TP or PP (long sequences), not where the
  config refuses it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_ext.arguments import parse_args
from megatron_ext.planning import memory
from megatron_ext.planning.memory import GIB, Shape, get_gathered_kv_per_token, get_state_bytes
from megatron_ext.planning.planner import apply_layout, get_cp_sizes, plan
from megatron_ext.planning.predict import predict_memory
from megatron_ext.planning.step_time import Cluster, CPTraffic, predict_step_time
from megatron_ext.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_8B = os.path.join(ROOT, "configs", "llama3-8b.yaml")
MIB = 1024**2

# Llama 3 8B: 32 layers, hidden 4096, 32 heads of 128 in 8 groups; K and V of a token in bf16 at TP 1:
# 2 x 8 x 128 x 2 = 4,096 bytes
KV_BYTES = 2 * 8 * 128 * 2


def llama_8b(tp: int = 1, cp: int = 1, seq: int = 8192) -> Shape:
    return Shape(4096, 32, 8, 14336, seq, 1, 128384, tp, tp > 1, True, cp=cp)


def job(cp: int, *flags: str):
    """configs/llama3-8b.yaml at CP ``cp`` (DP 8 / cp on 8 GPUs)."""
    return parse_args(["--config", LLAMA_8B, "--context-parallel-size", str(cp), *flags])


# ----------------------------------------------------------------------------- memory


def test_gathered_kv_per_layer_is_2c_plus_1_over_2c_of_the_micro_batchs_keys_and_values():
    t = 8192
    for cp, per_layer in ((2, 5 / 4 * t * KV_BYTES), (4, 9 / 8 * t * KV_BYTES), (8, 17 / 16 * t * KV_BYTES)):
        shape = llama_8b(cp=cp)
        assert shape.tokens == t // cp
        assert get_gathered_kv_per_token(shape, 2) * shape.tokens == per_layer
    assert get_gathered_kv_per_token(llama_8b(cp=2), 2) * 4096 == 41_943_040  # 40 MiB a layer at c = 2
    assert get_gathered_kv_per_token(llama_8b(cp=1), 2) == 0.0  # no CP: the local K/V are calibrated
    # TP 8: one group a rank; TP 16 > 8 groups: one replicated group (not half a group)
    assert llama_8b(tp=8).kv_width == 2 * 128 == llama_8b(tp=16).kv_width


def test_activations_are_one_c_th_with_the_gathered_kv_for_the_local_kv():
    """No recompute, no pipeline: every per-token term is over the T / c local tokens; each of the 32
    layers keeps its gathered K and V ((2c+1)/(2c) x T x 4,096 bytes) and not the local attention's
    repeated k and v (2 x 4,096 x 2 bytes a local token: Llama 3 8B's query width in bf16); the stage
    keeps one int64 index of the (2c+1)/(2c) x T repacked keys. At c = 2: -0.75 GiB against 1/2 of CP 1
    (configs/llama3-8b-cp2.yaml's 32.9 GiB = 67.3 / 2 - 0.75)."""
    vocab, t = 128256, 8192
    one = predict_memory(job(1), 8, vocab)[0]
    for cp in (2, 4):
        got = predict_memory(job(cp), 8, vocab)[0]
        keys = (2 * cp + 1) / (2 * cp) * t
        per_layer = keys * KV_BYTES - 2 * 4096 * 2 * t / cp
        assert got.activations == pytest.approx(one.activations / cp + 32 * per_layer + 8 * keys, rel=1e-12)
        # the last stage's logits and cross-entropy temporaries (2 x 4 B x vocabulary per token): 1/c
        assert got.temporaries == pytest.approx(one.temporaries / cp, rel=1e-12)
    got = predict_memory(job(2), 8, vocab)[0].activations - one.activations / 2
    assert got == pytest.approx(32 * (41_943_040 - 67_108_864) + 81_920) and round(got / GIB, 2) == -0.75


def test_recomputed_core_attention_gathers_kv_one_layer_at_a_time(monkeypatch):
    """Selective recompute: the gathered K/V is not saved (no 32 x term) but one layer's exists in its
    forward and again in its recompute: a temporary. Full recompute: the rebuilt layer holds it during
    its backward (with a vocabulary of 32,000, so that the rebuilt layer outweighs the head's saves its
    backward freed first, and shows in the peak). Both against the same prediction with the gathered
    term taken out."""
    vocab = 32000
    layer = 5 / 4 * 8192 * KV_BYTES
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    for flags, where in ((["--recompute-granularity", "selective"], "temporaries"), (full, "activations")):
        cfg = job(2, "--vocab-size", str(vocab), *flags)
        with monkeypatch.context() as m:
            m.setattr(memory, "get_gathered_kv_per_token", lambda *args: 0.0)
            without = predict_memory(cfg, 8, vocab)[0]
        with_kv = predict_memory(cfg, 8, vocab)[0]
        assert getattr(with_kv, where) - getattr(without, where) == pytest.approx(layer, rel=1e-12), flags
        other = "activations" if where == "temporaries" else "temporaries"
        assert getattr(with_kv, other) == getattr(without, other), flags


def test_the_distributed_optimizer_shards_over_dp_x_cp():
    """CP 2 x DP 4 holds the optimizer state of CP 1 x DP 8: 12 bytes a parameter over 8 ranks (Adam's
    m, v and the fp32 main weights); without the distributed optimizer every rank holds all of it."""
    vocab = 128256
    cp1, cp2 = predict_memory(job(1), 8, vocab)[0].state, predict_memory(job(2), 8, vocab)[0].state
    assert cp2 == cp1
    n = cp1.parameters // 2  # bf16 weights
    assert cp2.optimizer == 12 * -(-n // 8)
    assert get_state_bytes(job(2), n, 8).optimizer == 12 * -(-n // 8)
    plain = dataclasses.replace(job(2), parallel=dataclasses.replace(job(2).parallel, use_distributed_optimizer=False))
    assert predict_memory(plain, 8, vocab)[0].state.optimizer == 12 * n


# ----------------------------------------------------------------------------- time


def test_cp_traffic_is_the_design_docs():
    """docs/context-parallel.md: Llama 3 8B at T = 128k, TP 8, c = 8, bf16: the gathered K/V is 64 MiB a
    layer per rank; the all-gather moves 7/8 of it, the reduce-scatter as much again, 112 MiB against
    the 896 MiB of TP's four all-reduces of the rank's 16k tokens: 12.5%."""
    t, c = 131072, 8
    kv = 2 * 1 * 128 * 2  # one group a rank at TP 8
    assert t * kv == 64 * MIB
    traffic = CPTraffic(c, kv, recomputed=False, inter_node=False)
    assert traffic.get_bytes(t) == 2 * 7 / 8 * 64 * MIB
    assert CPTraffic(c, kv, recomputed=True, inter_node=False).get_bytes(t) == 3 * 7 / 8 * 64 * MIB
    step = predict_step_time(
        Cluster(64, 8, 80.0), 1e18, t, 4096, 32, 8, 1, 1, 1, 1, None, True, 2, 0.0, False, None, traffic
    )
    assert step.comm_bytes["tp"] == 32 * 896 * MIB and step.comm_bytes["cp"] == 32 * 112 * MIB
    assert step.comm_bytes["cp"] / step.comm_bytes["tp"] == 0.125


def test_cp_divides_compute_and_moves_the_dp_reduce_over_dp_x_cp():
    cluster = Cluster(16, 8, 80.0)
    kw = dict(overlap_grad_reduce=False)
    args = (1e16, 8192, 4096, 32, 1, 1, 1)
    one = predict_step_time(cluster, *args, 8, 4, None, False, 2, 1e9, **kw)  # TP 1 x PP 1 x DP 8 on 8 GPUs
    two = predict_step_time(cluster, *args, 8, 4, None, False, 2, 1e9, cp=CPTraffic(2, KV_BYTES, False, False), **kw)
    flops_time = 1e16 / 8 / (989e12 * 0.5)
    assert one.compute == pytest.approx(flops_time) and two.compute > flops_time / 2  # twice the GPUs, plus CP
    assert two.compute - flops_time / 2 == pytest.approx(2 * 0.5 * 8192 * KV_BYTES * 32 * 4 / 360e9)
    assert two.comm_bytes["dp"] == 2 * 15 / 16 * 1e9 and one.comm_bytes["dp"] == 2 * 7 / 8 * 1e9
    # a CP group across nodes: the same bytes at the inter-node bandwidth
    far = predict_step_time(cluster, *args, 8, 4, None, False, 2, 1e9, cp=CPTraffic(2, KV_BYTES, False, True), **kw)
    assert far.compute - flops_time / 2 == pytest.approx(2 * 0.5 * 8192 * KV_BYTES * 32 * 4 / 40e9)
    assert "cp" not in one.comm_bytes  # no CP, no CP line


# ----------------------------------------------------------------------------- the planner


def test_the_planner_chooses_cp_at_long_sequences_and_its_flags_validate():
    """Llama 3 8B on one node of 8 GPUs of 80 GiB at 32,768 tokens, global batch 16: without CP the
    activations force TP 8 (its all-reduces are the slowest traffic) or more pipeline; with CP the
    planner's best layout uses it, predicted faster than the best layout at CP 1, and its flags pass
    the validation."""
    extra = ["--seq-length", "32768", "--max-position-embeddings", "32768", "--global-batch-size", "16"]
    cfg = parse_args(["--config", LLAMA_8B, *extra])
    cluster = Cluster(8, 8, 80.0)
    assert get_cp_sizes(cfg, 8) == ([1, 2, 4, 8], [])
    fits = [c for c in plan(cfg, cluster, cfg.data.vocab_size, {"pp": "1", "mbs": "1"}) if not c.problems]
    best, best_cp1 = fits[0], next(c for c in fits if c.layout.cp == 1)
    print(best.layout.describe(), best.time.total, "|", best_cp1.layout.describe(), best_cp1.time.total)
    assert best.layout.cp > 1 and best.time.total < best_cp1.time.total
    job = apply_layout(cfg, best.layout)
    validate(job, 8, cuda=True)
    flags = parse_args(["--config", LLAMA_8B, *extra, *best.layout.flags()])
    assert flags.parallel.context_parallel_size == best.layout.cp
    assert max(r.total for r in predict_memory(flags, 8, cfg.data.vocab_size)) == best.memory.total


def test_cp_is_not_searched_where_the_config_refuses_it_or_the_rows_are_short():
    gpt3 = parse_args(["--config", os.path.join(ROOT, "configs", "gpt3-175b.yaml")])
    sizes, why = get_cp_sizes(gpt3, 1024)
    assert sizes == [1] and any("--attention-dropout" in w for w in why), why
    cfg = job(1)
    assert get_cp_sizes(cfg, 64)[0] == [1, 2]  # 8,192 tokens: at least 4,096 a rank
    assert get_cp_sizes(cfg, 64, fixed="8")[0] == [8]  # --fix cp=8 lifts that floor
    assert get_cp_sizes(cfg, 12)[0] == [1, 2]  # (and CP divides the GPUs)
    assert get_cp_sizes(cfg, 6, fixed="4")[0] == []
