"""Megatron-LM's example scripts, as bash really hands their argv to pretrain_gpt.py (issue 43).

The argv lists in tests/data/megatron_lm_argv/*.json were captured by running each script with a
stand-in torchrun (``capture.py`` there; each file names the Megatron-LM commit and script): bash's
word splitting and the quotes it keeps inside unquoted array elements are in them, as a user's job
gets them. Each script is accepted but for what we lack, and that is refused by name: Llama-3 8B's
four FP8 flags, GPT-3 175B's batch-size schedule (which bash splits into words, and Megatron-LM's own
parser refuses too), Mixtral's mixture-of-experts flags."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.config import ConfigError
from megatron_ext.data.gpt_datasets import parse_split
from megatron_ext.megatron_flags import MEGATRON_FLAG_NAMES
from megatron_ext.validation import validate

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CAPTURES = os.path.join(REPO, "tests", "data", "megatron_lm_argv")
SHIPPED_DATA = os.path.join(REPO, "data", "default", "corpus_text_document")
SHIPPED_MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")
REFS = ["core_v0.16.1", "d98e8a64"]
FP8 = ["--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"]
MIXTRAL_MOE = [
    "--num-experts",
    "--expert-model-parallel-size",
    "--moe-router-topk",
    "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type",
]
SCHEDULE = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"


def load_capture(name: str) -> dict:
    with open(os.path.join(CAPTURES, name + ".json")) as f:
        return json.load(f)


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    """Each placeholder of the captures, as a path that passes the start-up checks."""
    (tmp_path / "hf_tokenizer").mkdir()  # the checks want a directory; nothing loads it
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return {
        "<CHECKPOINT_PATH>": str(tmp_path / "ckpt"),
        "<TENSORBOARD_LOGS_PATH>": str(tmp_path / "tb"),
        "<PWD>": str(tmp_path),
        "<DATA_PATH>": SHIPPED_DATA,
        "<VOCAB_FILE>": str(tmp_path / "vocab.json"),
        "<MERGE_FILE>": str(tmp_path / "merges.txt"),
    }


def script_argv(name: str, paths: dict[str, str], tokenizer_model: str) -> list[str]:
    """The captured argv with its placeholders replaced by ``paths``."""
    fill = {**paths, "<TOKENIZER_MODEL>": tokenizer_model}
    out = []
    for word in load_capture(name)["argv"]:
        for placeholder, path in fill.items():
            word = word.replace(placeholder, path)
        out.append(word)
    return out


def without(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` less each of ``flags`` and the words of its value."""
    out, skipping = [], False
    for word in argv:
        if word.startswith("--"):
            skipping = word in flags
        if not skipping:
            out.append(word)
    return out


def refused_flags(argv: list[str]) -> list[str]:
    """The flag each problem of parsing ``argv`` begins with, in order."""
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(argv)
    return [p.split(":")[0].split(" ")[0] for p in err.value.problems]


# ----------------------------------------------------------------------------- the captures


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(CAPTURES) if f.endswith(".json")))
def test_each_capture_names_the_megatron_lm_commit_and_script_it_came_from(name):
    record = load_capture(name)
    assert len(record["megatron_lm_commit"]) == 40 and record["megatron_lm_ref"] in REFS, record
    assert record["script"].startswith("examples/") and record["script"].endswith(".sh")
    assert record["torchrun_arguments"][:2] == ["--nproc_per_node", "8"]
    assert record["argv"][0].startswith("--")


def test_the_captures_hold_the_words_bash_passes_quotes_and_all():
    # the counts: each 8B branch passes 75 flags at d98e8a64, 74 at core_v0.16.1
    for ref, count in (("d98e8a64", 75), ("core_v0.16.1", 74)):
        for branch in ("mock", "data"):
            argv = load_capture(f"llama3_8b_{branch}_{ref}")["argv"]
            assert sum(w.startswith("--") for w in argv) == count, (branch, ref)
            # the array element "--split '99,1,0'": bash splits it at the space and keeps the quotes
            assert argv[argv.index("--split") + 1] == "'99,1,0'"
    argv = load_capture("gpt3_175b_d98e8a64")["argv"]
    at = argv.index("--step-batch-size-schedule")
    assert argv[at + 1 : at + 7] == SCHEDULE.split()  # quoted in its array, split by ${TRAINING_ARGS[@]}


# ----------------------------------------------------------------------------- Llama-3 8B


@pytest.mark.parametrize("name", [f"llama3_8b_{b}_{ref}" for b in ("mock", "data") for ref in REFS])
def test_llama3_8b_is_accepted_but_for_its_four_fp8_flags(name, paths, tmp_path):
    argv = script_argv(name, paths, tokenizer_model=str(tmp_path / "hf_tokenizer"))
    assert refused_flags(argv) == FP8
    cfg, notes = parse_args_with_notes(without(argv, FP8))
    assert cfg.data.split == "99,1,0" and parse_split(cfg.data.split) == pytest.approx([0.99, 0.01, 0.0])
    assert cfg.model.apply_layernorm_1p and cfg.training.train_samples == 1953125000
    assert not [n for n in notes if "unrecognized" in n]
    validate(cfg, 8, cuda=True)  # the script's world size: TP 1 x PP 1 x DP 8


# ----------------------------------------------------------------------------- GPT-3 175B


def test_gpt3_175b_word_split_schedule_gets_its_own_message(paths):
    argv = script_argv("gpt3_175b_d98e8a64", paths, tokenizer_model="")
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(argv)
    (problem,) = err.value.problems
    assert problem.startswith(f"--step-batch-size-schedule {SCHEDULE}: bash split it into 6 words: quote it"), problem
    assert "--step-batch-size-schedule 0:16,2.4B:320,4.8B:624,7.2B:928,9.6B:1232,12B:1536" in problem, problem
    assert (
        '(Megatron-LM reads commas too; it stops on the split value as well: "unrecognized arguments: 2.4B:320'
        in problem
    )
    # quoted, as the script meant it, it is one value (what the schedule's rules then say is theirs)
    at = argv.index("--step-batch-size-schedule")
    quoted = argv[: at + 1] + [SCHEDULE] + argv[at + 7 :]
    cfg, _ = parse_args_with_notes(quoted)
    assert cfg.training.step_batch_size_schedule == SCHEDULE


@pytest.mark.parametrize("ref", REFS)
def test_gpt3_175b_is_accepted_but_for_its_batch_size_schedule(ref, paths):
    argv = script_argv(f"gpt3_175b_{ref}", paths, tokenizer_model="")
    if ref == "core_v0.16.1":  # its ramp-up with --train-iters: Megatron-LM 0.16.1 refuses that too
        with pytest.raises(ConfigError) as err:
            validate(parse_args_with_notes(argv)[0], 128, cuda=True)
        assert [p for p in err.value.problems if p.startswith("--rampup-batch-size")], err.value.problems
    schedule = {"core_v0.16.1": "--rampup-batch-size", "d98e8a64": "--step-batch-size-schedule"}[ref]
    cfg, notes = parse_args_with_notes(without(argv, [schedule]))
    # the GPT-2 files without a tokenizer type: GPT2BPETokenizer, Megatron-LM's pretrain_gpt.py default
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    assert notes[0].startswith("--tokenizer-type GPT2BPETokenizer: inferred from --vocab-file and --merge-file")
    assert cfg.data.split == "949,50,1" and cfg.training.train_iters == 500000
    validate(cfg, 128, cuda=True)  # TP 8 x PP 16, one data-parallel replica


# ----------------------------------------------------------------------------- Mixtral 8x7B


@pytest.mark.parametrize("ref", REFS)
def test_mixtral_non_moe_flags_are_accepted_and_its_moe_flags_refused_by_name(ref, paths):
    argv = script_argv(f"mixtral_8x7b_{ref}", paths, tokenizer_model=SHIPPED_MODEL)
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(argv)
    problems = err.value.problems
    assert sorted(p.split(":")[0].split(" ")[0] for p in problems) == sorted(MIXTRAL_MOE), problems
    assert all("mixture-of-experts (MoE) models are not supported" in p for p in problems), problems
    assert "--moe-aux-loss-coeff 1e-2: " in "\n".join(problems)  # each names its flag and value
    cfg, notes = parse_args_with_notes(without(argv, MIXTRAL_MOE))
    assert cfg.data.tokenizer_type == "Llama2Tokenizer" and cfg.parallel.overlap_grad_reduce
    assert cfg.data.split == "99990,8,2" and cfg.checkpoint.no_load_optim and cfg.checkpoint.no_load_rng
    validate(cfg, 8, cuda=True)  # TP 1 x PP 4 x DP 2 (no expert parallelism)


def test_expert_parallel_size_1_states_what_we_do_and_is_silent():
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    assert parse_args_with_notes(base + ["--expert-model-parallel-size", "1"])[1] == parse_args_with_notes(base)[1]
    assert refused_flags(base + ["--moe-aux-loss-coeff", "1e-2", "1e-3"]) == ["--moe-aux-loss-coeff"]


def test_every_moe_flag_of_megatron_core_0_16_1_is_refused_by_name():
    """core_v0.16.1's parser makes a flag of every MoE field of megatron-core's TransformerConfig (but
    the two it excludes, and num_moe_experts, which is its --num-experts): none may be unknown here."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    no_flag = {"moe_token_dropping", "moe_router_topk_limited_devices", "num_moe_experts"}
    fields = [
        f.name
        for f in dataclasses.fields(TransformerConfig)
        if f.init and ("moe" in f.name or "expert" in f.name) and f.name not in no_flag
    ]
    flags = ["--" + name.replace("_", "-") for name in fields] + ["--num-experts", "--moe-use-upcycling"]
    assert len(fields) > 40
    assert [f for f in flags if f not in MEGATRON_FLAG_NAMES] == []


# ----------------------------------------------------------------------------- --split


@pytest.mark.parametrize(
    "given, read",
    [
        ("'99,1,0'", "99,1,0"),  # the 8B script's, quotes kept by bash
        ('"99,1,0"', "99,1,0"),
        ("\"'949,50,1'\"", "949,50,1"),
        ("99 1 0", "99,1,0"),
        ("99:1:0", "99,1,0"),
        ("'98.5, 1.5'", "98.5,1.5"),
        ("99,1,0", "99,1,0"),
        ("99/1/0", "99/1/0"),  # our own grammar's: as given
    ],
)
def test_split_reads_what_megatron_lm_reads_as_written(given, read):
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    cfg, _ = parse_args_with_notes(["--split", given])
    assert cfg.data.split == read
    assert parse_split(cfg.data.split) == pytest.approx(parse_and_normalize_split(given))


@pytest.mark.parametrize("given", ["'-1,2,0'", "'1,2,3,4'", "'99,1,0"])
def test_a_split_megatron_lm_would_misread_or_refuse_is_still_refused(given):
    # its regular expression reads '-1,2,0' as 1,2,0 (the minus dropped); four numbers fail its assert
    cfg, _ = parse_args_with_notes(["--split", given])
    assert cfg.data.split == given
    with pytest.raises(ConfigError, match="--split"):
        parse_split(cfg.data.split)
