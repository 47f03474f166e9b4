"""``pretrain_gpt.py --rehearse`` (megatron_ext/rehearse.py) at 64 and 512 simulated ranks, in this
process, with no process group.

Independent references: the group map against Megatron-LM's rank arithmetic for its default order
tp-cp-ep-dp-pp (rank = tp + TP x (dp + DP x pp), node = rank // ranks per node); the parameters
against the closed-form count of a Llama layer (tests/unit/test_reference_configs.py) and the
published Llama 3 70B total; the state bytes against Megatron-LM's theoretical-memory figures (18
bytes a parameter, 6 + 12/DP with the distributed optimizer); the first step's samples against the
sampler's arithmetic (DP rank r reads r x b + j x b x DP ...)."""

from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from megatron_ext.arguments import parse_args
from megatron_ext.config import ConfigError
from megatron_ext.rehearse import build_group_map, rehearse
from tests.unit.test_reference_configs import closed_form

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_70B = os.path.join(ROOT, "configs", "llama3-70b.yaml")
GPT3_175B = os.path.join(ROOT, "configs", "gpt3-175b.yaml")


def expected_groups(tp: int, pp: int, dp: int) -> dict[str, dict[int, set[int]]]:
    """rank -> the ranks of its TP, PP and DP group, from Megatron-LM's arithmetic."""

    def rank(t, d, p):
        return t + tp * (d + dp * p)

    out = {"tp": {}, "pp": {}, "dp": {}}
    for t in range(tp):
        for d in range(dp):
            for p in range(pp):
                r = rank(t, d, p)
                out["tp"][r] = {rank(x, d, p) for x in range(tp)}
                out["pp"][r] = {rank(t, d, x) for x in range(pp)}
                out["dp"][r] = {rank(t, x, p) for x in range(dp)}
    return out


def check_group_map(gm, tp: int, pp: int, dp: int, per_node: int) -> None:
    want = expected_groups(tp, pp, dp)
    for kind, groups in (("tp", gm.tp_groups), ("pp", gm.pp_groups), ("dp", gm.dp_groups)):
        assert sorted(r for g in groups for r in g) == list(range(tp * pp * dp))  # each rank once
        for g in groups:
            for r in g:
                assert set(g) == want[kind][r], (kind, r)
    for r in range(tp * pp * dp):
        assert (gm.tp_rank[r], gm.dp_rank[r], gm.pp_rank[r]) == (r % tp, (r // tp) % dp, r // (tp * dp))
        assert gm.get_node(r) == r // per_node
    for g in gm.tp_groups:  # TP inside a node
        assert len({r // per_node for r in g}) == 1
    # the word-embedding group: the first and the last pipeline stage's rank of each pipeline
    assert {tuple(g) for g in gm.embedding_groups} == {(p[0], p[-1]) for p in gm.pp_groups}


@pytest.mark.parametrize("world", [64, 512])
def test_llama3_70b_rehearsal_group_map_parameters_state_and_samples(world):
    cfg = parse_args(["--config", LLAMA_70B, "--rehearse"])
    r = rehearse(cfg, world, {"LOCAL_WORLD_SIZE": "8"})
    tp, pp, dp = 4, 8, world // 32
    check_group_map(r.groups, tp, pp, dp, 8)
    assert not torch.distributed.is_initialized()  # nothing but arithmetic and meta tensors

    # parameters: the published Llama 3 70B plus the 128 padded rows of the mock tokenizer's
    # embedding and output layer (128,257 ids with EOD -> 128,384)
    assert r.padded_vocab_size == 128_384
    assert r.params.total == 70_553_706_496 + 2 * (128_384 - 128_256) * 8192
    total, layer = closed_form(cfg, 128_384)
    assert r.params.total == total
    per_tp_layer = (layer - 2 * 8192) // tp + 2 * 8192  # norms replicated, matrices split
    embedding = 128_384 * 8192 // tp
    per_pp = r.params.per_pp_rank()
    assert per_pp == [10 * per_tp_layer + embedding] + [10 * per_tp_layer] * 6 + [10 * per_tp_layer + embedding + 8192]
    assert (r.embedding_pp_rank, r.output_pp_rank) == (0, 7)
    assert [c.num_layers for c in r.params.chunks] == [2] * 40

    # state: bf16 weights, bf16 gradient buffers (--grad-reduce-in-bf16), fp32 main params + Adam
    # moments sharded over DP: 4 + 12 / DP bytes a parameter
    for n, state in zip(per_pp, r.state_bytes):
        assert (state.parameters, state.gradients, state.optimizer) == (2 * n, 2 * n, 12 * -(-n // dp))

    # the planner's whole-GPU prediction per pipeline rank, the same as the planner gives this layout,
    # on the exact state (its own parameter counts, from tiny meta builds, agree with the rehearsal's)
    from megatron_ext.planning.predict import predict_memory

    assert len(r.predicted) == pp and [m.state for m in r.predicted] == list(r.state_bytes)
    assert [m.total for m in r.predicted] == [m.total for m in predict_memory(cfg, world, r.vocab_size)]
    assert all(m.total > m.state.total + m.activations > m.state.total for m in r.predicted)

    # first step: 128 samples; DP rank d reads d, d + DP, d + 2 DP, ... (micro-batches of 1)
    assert len(r.first_step_samples) == dp
    for d, mbs in enumerate(r.first_step_samples):
        assert [list(mb) for mb in mbs] == [[d + j * dp] for j in range(128 // dp)]


def test_gpt3_175b_state_bytes_are_megatron_lms_18_and_6_plus_12_over_dp():
    cfg = parse_args(["--config", GPT3_175B, "--rehearse"])
    r = rehearse(cfg, 128, {})  # 16 nodes of 8 assumed
    assert r.ranks_per_node == 8 and r.params.total == 174_604_836_864
    assert [s.total for s in r.state_bytes] == [18 * n for n in r.params.per_pp_rank()]  # fp16 Adam, not sharded
    cfg = parse_args(["--config", GPT3_175B, "--rehearse", "--use-distributed-optimizer"])
    r = rehearse(cfg, 256, {})
    assert [s.total for s in r.state_bytes] == [6 * n + 12 * -(-n // 2) for n in r.params.per_pp_rank()]
    # the tied output layer's copy on the last stage is held (memory), not counted in the model
    assert r.params.per_pp_rank()[-1] - r.params.per_pp_rank()[1] == 50304 * 12288 // 8 + 2 * 12288


def test_uneven_split_is_shown_per_rank(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "128")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    rc = pretrain_gpt.run_cli(
        [
            "--config",
            GPT3_175B,
            "--rehearse",
            "--decoder-first-pipeline-num-layers",
            "5",
            "--decoder-last-pipeline-num-layers",
            "7",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "5/6/7 layers (uneven split)" in out
    assert "pp  0 (ranks 0..7, 8): stages 0 of 5 layers embedding" in out
    assert "pp 15 (ranks 120..127, 8): stages 15 of 7 layers output" in out
    assert "rehearsal passed" in out


def test_group_map_with_v_placement_keeps_the_embedding_group_on_the_first_rank():
    gm = build_group_map(2, 4, 2, 8, placement="v")
    want = expected_groups(2, 4, 2)
    assert all(set(g) == want["pp"][g[0]] for g in gm.pp_groups)
    assert {tuple(g) for g in gm.embedding_groups} == {(p[0],) for p in gm.pp_groups}


@pytest.mark.parametrize(
    "env, flags, message",
    [
        # TP 4 over nodes of 2 ranks: TP groups would cross nodes
        (
            {"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "2"},
            [],
            "--tensor-model-parallel-size 4 does not divide the 2 ranks",
        ),
        # a world the layout (TP 4 x PP 8) does not divide
        ({"WORLD_SIZE": "100"}, [], "--tensor-model-parallel-size"),
        # no WORLD_SIZE: a rehearsal of one process is rarely what was meant
        ({}, [], "--rehearse rehearses a launch of WORLD_SIZE ranks: set WORLD_SIZE"),
        # a world that does not fill whole nodes
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "6"}, [], "WORLD_SIZE 64 is not a multiple of the 6 ranks per node"),
        # a batch the DP ranks cannot share: 128 samples over DP 16 in micro-batches of 16
        ({"WORLD_SIZE": "512"}, ["--micro-batch-size", "16"], "--global-batch-size"),
    ],
)
def test_a_bad_layout_fails_with_rc_2_naming_the_flag(capsys, monkeypatch, env, flags, message):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert pretrain_gpt.run_cli(["--config", LLAMA_70B, "--rehearse"] + flags) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert "rehearsal passed" not in captured.out


def test_512_rank_rehearsal_through_the_entry_point(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "512")
    monkeypatch.setenv("NPROC_PER_NODE", "8")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert pretrain_gpt.run_cli(["--config", LLAMA_70B, "--rehearse"]) == 0
    out = capsys.readouterr().out
    assert "512 ranks on 64 nodes of 8 (NPROC_PER_NODE=8): TP 4 x PP 8 x VPP 5 x DP 16" in out
    assert "TP: 128 groups of 4, e.g. ranks 0..3 (node 0)" in out
    assert "PP: 64 groups of 8, e.g. ranks 0..448 step 64 (nodes 0..56 step 8)" in out
    assert "70,555,803,648 parameters" in out
    assert "DP rank 15: samples 15..127 step 16" in out


def test_rehearse_errors_are_config_errors_listed_together():
    cfg = parse_args(["--config", LLAMA_70B, "--rehearse"])
    with pytest.raises(ConfigError) as err:
        rehearse(cfg, 512, {"LOCAL_WORLD_SIZE": "2"})
    assert len(err.value.problems) == 1 and "--tensor-model-parallel-size 4" in err.value.problems[0]
    with pytest.raises(ConfigError, match="NPROC_PER_NODE='eight' must be a positive number"):
        rehearse(cfg, 512, {"NPROC_PER_NODE": "eight"})
    # a bad batch and TP across nodes are reported together, before the model is built
    bad_batch = parse_args(["--config", LLAMA_70B, "--rehearse", "--micro-batch-size", "3"])
    with pytest.raises(ConfigError) as err:
        rehearse(bad_batch, 64, {"LOCAL_WORLD_SIZE": "2"})
    assert any("--micro-batch-size" in p for p in err.value.problems)
    assert any("--tensor-model-parallel-size 4 does not divide the 2 ranks per node" in p for p in err.value.problems)
    # a world the layout does not divide: that error alone (not a second one about nodes)
    with pytest.raises(ConfigError) as err:
        rehearse(cfg, 100, {"LOCAL_WORLD_SIZE": "8"})
    assert len(err.value.problems) >= 1 and not any("per node" in p for p in err.value.problems)


def test_v_schedule_puts_the_embedding_and_the_output_layer_on_pipeline_rank_0(caplog, monkeypatch):
    from megatron.core.models.common.language_module.language_module import LanguageModule

    monkeypatch.setattr(LanguageModule, "embedding_warning_printed", False, raising=False)  # warned once a process
    cfg = parse_args(
        [
            "--config",
            GPT3_175B,
            "--rehearse",
            "--pipeline-schedule",
            "ZBVZeroBubble",
            "--pipeline-model-parallel-size",
            "8",
        ]
    )
    r = rehearse(cfg, 128, {})
    assert (r.embedding_pp_rank, r.output_pp_rank) == (0, 0)
    assert [c.stage for c in r.params.chunks if c.pp_rank == 0] == [0, 15]
    assert {tuple(g) for g in r.groups.embedding_groups} == {(p[0],) for p in r.groups.pp_groups}
    # rank 0 holds both copies of the tied embedding (its memory), the model counts one
    assert r.params.total == 174_604_836_864
    assert r.params.per_pp_rank()[0] - r.params.per_pp_rank()[1] == 2 * 50304 * 12288 // 8 + 2048 * 12288 + 2 * 12288
    assert "Distributed processes aren't initialized" not in caplog.text  # megatron-core's tie warning, expected here


def test_real_data_path_is_checked_as_at_start_up(capsys, monkeypatch):
    """configs/default.yaml reads the shipped corpus (its headers and tokenizer record checked); a
    missing prefix is the start-up's error, rc 2."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    default = os.path.join(ROOT, "configs", "default.yaml")
    corpus = os.path.join(ROOT, "data", "default", "corpus_text_document")
    model = os.path.join(ROOT, "data", "default", "tokenizer.model")
    args = ["--config", default, "--rehearse", "--data-path", corpus, "--tokenizer-model", model]
    assert pretrain_gpt.run_cli(args) == 0
    out = capsys.readouterr().out
    assert "DP rank 1: samples 1..7 step 2" in out and "MiB = weights" in out
    assert pretrain_gpt.run_cli(args[:-3] + [corpus + "-missing", "--tokenizer-model", model]) == 2
    assert "-missing.bin" in capsys.readouterr().err
