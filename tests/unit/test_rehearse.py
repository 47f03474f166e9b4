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


# ----------------------------------------------------------------------------- context parallelism

LLAMA_8B = os.path.join(ROOT, "configs", "llama3-8b.yaml")
LLAMA_8B_CP2 = os.path.join(ROOT, "configs", "llama3-8b-cp2.yaml")


def _env(monkeypatch, **env):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_cp_group_map_follows_megatron_lms_rank_arithmetic():
    """Order tp-cp-ep-dp-pp: rank = tp + TP x (cp + CP x (dp + DP x pp)). The CP group varies cp, DP x CP
    varies both, and TP / PP / DP keep their meaning."""
    tp, cp, dp, pp = 2, 2, 2, 2
    gm = build_group_map(tp, pp, dp, 4, cp=cp)

    def rank(t, c, d, p):
        return t + tp * (c + cp * (d + dp * p))

    coords = [(t, c, d, p) for t in range(tp) for c in range(cp) for d in range(dp) for p in range(pp)]
    assert sorted(rank(*x) for x in coords) == list(range(16))
    for t, c, d, p in coords:
        r = rank(t, c, d, p)
        mine = lambda groups: next(set(g) for g in groups if r in g)  # noqa: E731
        assert mine(gm.tp_groups) == {rank(x, c, d, p) for x in range(tp)}
        assert mine(gm.cp_groups) == {rank(t, x, d, p) for x in range(cp)}
        assert mine(gm.dp_groups) == {rank(t, c, x, p) for x in range(dp)}
        assert mine(gm.dp_cp_groups) == {rank(t, x, y, p) for x in range(cp) for y in range(dp)}
        assert mine(gm.pp_groups) == {rank(t, c, d, x) for x in range(pp)}
        assert (gm.tp_rank[r], gm.cp_rank[r], gm.dp_rank[r], gm.pp_rank[r]) == (t, c, d, p)
    assert gm.get_nodes_per_group(gm.cp_groups) == 1  # TP x CP = 4 ranks: one node of 4
    assert build_group_map(tp, pp, dp, 2, cp=cp).get_nodes_per_group(gm.cp_groups) == 2  # nodes of 2: across two


def test_llama3_8b_cp2_rehearses_at_8_ranks(capsys, monkeypatch):
    """configs/llama3-8b-cp2.yaml at WORLD_SIZE=8: TP 1 x CP 2 x PP 1 x DP 4, CP groups of consecutive
    ranks on one node, the optimizer state sharded over DP x CP = 8 (the CP 1 config's bytes), the
    activations half of CP 1's with the gathered K/V for the local ones."""
    _env(monkeypatch, WORLD_SIZE="8")
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B_CP2, "--rehearse"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rehearsal: "), out
    assert "8 ranks on 1 node of 8 (LOCAL_WORLD_SIZE unset: 8 per node assumed): TP 1 x CP 2 x PP 1 x DP 4" in out
    assert "  CP: 4 groups of 2, e.g. ranks 0, 1 (node 0) ... 6, 7; each inside one node" in out
    assert "  DP: 2 groups of 4, e.g. ranks 0..6 step 2 (node 0) ... 1..7 step 2" in out
    assert "  DP x CP: 1 group of 8, e.g. ranks 0..7 (node 0)" in out
    assert "adam state sharded over DP x CP" in out and "DP rank 3: samples 3..127 step 4" in out
    cp2 = rehearse(parse_args(["--config", LLAMA_8B_CP2, "--rehearse"]), 8, {})
    cp1 = rehearse(parse_args(["--config", LLAMA_8B, "--rehearse"]), 8, {})
    n = cp2.params.per_pp_rank()[0]
    assert cp2.state_bytes == cp1.state_bytes and cp2.state_bytes[0].optimizer == 12 * -(-n // 8)
    # half of CP 1's, plus each layer's gathered K/V for its local repeated k and v, plus the index
    layer = 5 / 4 * 8192 * 2 * 8 * 128 * 2 - 2 * 4096 * 2 * 4096
    assert cp2.predicted[0].activations == cp1.predicted[0].activations / 2 + 32 * layer + 8 * 5 / 4 * 8192


def test_a_cp_group_across_nodes_is_allowed_and_said(capsys, monkeypatch):
    _env(monkeypatch, WORLD_SIZE="8", LOCAL_WORLD_SIZE="1")
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B_CP2, "--rehearse"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks on 8 nodes of 1" in out
    assert "CP: 4 groups of 2, e.g. ranks 0, 1 (nodes 0, 1) ... 6, 7; each spans 2 nodes: its K/V all-gather" in out


def test_a_world_that_tp_x_cp_x_pp_does_not_divide_names_cp(capsys, monkeypatch):
    _env(monkeypatch, WORLD_SIZE="7")
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B_CP2, "--rehearse"]) == 2
    err = capsys.readouterr().err
    assert "--context-parallel-size 2" in err and "not divisible" in err and "per node" not in err, err


# ----------------------------------------------------------------------------- --gpu-memory-gib (issue 43)


def test_without_gpu_memory_gib_nothing_changes_and_a_roomy_one_passes(capsys, monkeypatch):
    """configs/llama3-8b.yaml is predicted at 128.9 GiB: printed, not an error, without the flag; the
    same summary (but its timing) with a budget above it."""
    _env(monkeypatch, WORLD_SIZE="8")
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B, "--rehearse"]) == 0
    plain = capsys.readouterr().out
    assert "predicted 128.9 GiB" in plain
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B, "--rehearse", "--gpu-memory-gib", "141"]) == 0
    roomy = capsys.readouterr().out
    assert plain.rsplit("rehearsal passed", 1)[0] == roomy.rsplit("rehearsal passed", 1)[0]


def test_a_predicted_peak_above_gpu_memory_gib_names_the_largest_term_the_cheapest_change_and_a_layout(
    capsys, monkeypatch
):
    """At 80 GiB: an error (rc 2) naming the fullest GPU's largest term (activations 67.3 GiB), the
    cheapest change that keeps TP 1 x PP 1 x DP 8 and the planner's best layout for 8 GPUs. The change
    fits by the model and is needed whole (selective recompute alone does not fit); the layout's
    flags validate and fit."""
    from megatron_ext.planning.memory import GIB
    from megatron_ext.planning.predict import predict_memory
    from megatron_ext.validation import validate

    _env(monkeypatch, WORLD_SIZE="8")
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B, "--rehearse", "--gpu-memory-gib", "80"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "rehearsal passed" not in err
    assert "--gpu-memory-gib 80: pipeline rank 0 is predicted to need 128.9 GiB" in err, err
    assert "the largest term is activations (67.3 GiB)" in err, err
    change = err.split("the cheapest change keeping this layout: add ", 1)[1].split(" (predicted")[0].split()
    assert change == ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    layout = err.split("the planner's best layout for 8 GPUs of 80 GiB: ", 1)[1].split("): ", 1)[1].split(" (tools")[0]

    def peak(*flags):
        cfg = parse_args(["--config", LLAMA_8B, *flags])
        validate(cfg, 8, cuda=True)
        return max(r.total for r in predict_memory(cfg, 8, cfg.data.vocab_size)) / GIB

    assert peak(*change) <= 80 < peak("--recompute-granularity", "selective")
    assert peak(*layout.split()) <= 80


def test_gpu_memory_gib_must_be_positive(capsys, monkeypatch):
    _env(monkeypatch, WORLD_SIZE="8")
    assert pretrain_gpt.run_cli(["--config", LLAMA_8B, "--rehearse", "--gpu-memory-gib", "0"]) == 2
    assert "--gpu-memory-gib 0: give the GPUs' memory in GiB" in capsys.readouterr().err


def test_gpu_memory_gib_without_rehearse_is_a_warning_naming_rehearse(monkeypatch):
    """A launch with the rehearsal's --gpu-memory-gib runs (the rehearsed command line is the job's),
    and says once, with the other flag notices, that nothing checked it."""
    from megatron_ext.rehearse import get_unrehearsed_notes

    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--device", "cpu"]
    assert get_unrehearsed_notes(parse_args(argv)) == []
    assert get_unrehearsed_notes(parse_args([*argv, "--gpu-memory-gib", "80", "--rehearse"])) == []
    seen = []
    monkeypatch.setattr(pretrain_gpt, "validate", lambda *a, **k: None)
    monkeypatch.setattr(pretrain_gpt, "_train", lambda cfg, notes, *a: seen.extend(notes) or [])
    assert pretrain_gpt.main([*argv, "--gpu-memory-gib", "80"]) == []
    (note,) = [n for n in seen if "--gpu-memory-gib" in n]
    assert note.startswith("--gpu-memory-gib 80 is ignored without --rehearse:") and "\n" not in note, note
