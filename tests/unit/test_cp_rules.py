"""Context parallelism's flag rules (context_parallel/rules.py, layout_rules.check_layout): each
refusal names the flag and the fix, a valid CP job passes them, DP counts CP out."""

from __future__ import annotations

import pytest

from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.context_parallel.rules import check_context_parallel
from megatron_ext.derived import (
    get_cp_length_multiple,
    get_data_parallel_size,
    get_document_pad_multiple,
    get_num_microbatches,
)
from megatron_ext.layout_rules import check_batch, check_layout

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128)
PACKED = dict(data_path=["x"], packed_sequences=True, tokenizer_type="NullTokenizer", vocab_size=128)


def cp_problems(**values) -> list[str]:
    return check_context_parallel(build_job_config({**MOCK, **values}))


def test_a_valid_cp_job_passes_the_cp_rules_and_dp_counts_cp_out():
    cfg = build_job_config(
        {
            **MOCK,
            "context_parallel_size": 2,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "seq_length": 256,
            "global_batch_size": 8,
        }
    )
    assert check_context_parallel(cfg) == [] and check_layout(cfg, 16) == [] and check_batch(cfg, 16) == []
    assert get_data_parallel_size(cfg, 16) == 2
    assert get_num_microbatches(cfg, 16) == 4


def test_a_world_not_divisible_by_tp_cp_pp_is_named():
    cfg = build_job_config({**MOCK, "context_parallel_size": 3, "tensor_model_parallel_size": 2})
    (problem,) = check_layout(cfg, 8)
    assert "--context-parallel-size 3" in problem and "multiple of 6 processes" in problem


@pytest.mark.parametrize(
    ("values", "needles"),
    [
        (
            dict(context_parallel_size=2, seq_length=250),
            ["--seq-length 250", "2 x --context-parallel-size 2 = 4", "248 or 252"],
        ),
        (
            dict(context_parallel_size=2, seq_length=256, tensor_model_parallel_size=3, sequence_parallel=True),
            ["lcm(2, --tensor-model-parallel-size 3)", "= 12", "252 or 264"],
        ),
        (
            dict(context_parallel_size=4, seq_length=256, sequence_padding="negotiated", pad_to_multiple_of=4),
            [
                "--pad-to-multiple-of 4 is not a multiple of 2 x --context-parallel-size 4 = 8",
                "use --pad-to-multiple-of 8",
            ],
        ),
        (dict(context_parallel_size=2, cp_comm_type=["p2p"]), ["--cp-comm-type p2p", "use --cp-comm-type all_gather"]),
        (dict(cp_comm_type=["all_gather", "all_gather"]), ["one value or one per layer (--num-layers 4), got 2"]),
        (dict(context_parallel_size=2, calculate_per_token_loss=False), ["--no-calculate-per-token-loss"]),
        (
            dict(context_parallel_size=2, torch_compile=True),
            ["--torch-compile is not supported with --context-parallel-size 2"],
        ),
        (dict(context_parallel_size=2, cuda_graph_impl="local"), ["--cuda-graph-impl local"]),
        (
            dict(context_parallel_size=2, transformer_impl="transformer_engine"),
            ["--transformer-impl transformer_engine"],
        ),
        (dict(context_parallel_size=2, attention_dropout=0.1), ["--attention-dropout > 0"]),
        (dict(context_parallel_size=2, sequence_padding="variable"), ["--sequence-padding variable"]),
        (
            dict(document_pad_multiple=4),
            ["--document-pad-multiple 4 pads packed documents: it needs --packed-sequences"],
        ),
        (dict(document_pad_multiple=0), ["--document-pad-multiple must be >= 1"]),
    ],
)
def test_each_cp_refusal_names_the_flag_and_the_fix(values, needles):
    problems = cp_problems(**values)
    assert len(problems) == 1, problems
    assert all(n in problems[0] for n in needles), problems[0]


def test_the_document_pad_multiple_must_hold_2c_and_divide_the_sequence():
    cfg = build_job_config({**PACKED, "context_parallel_size": 4, "document_pad_multiple": 12, "seq_length": 96})
    (problem,) = check_context_parallel(cfg)
    assert "--document-pad-multiple 12 is not a multiple of 2 x --context-parallel-size 4 = 8" in problem
    assert "use 8 or 16" in problem
    cfg = build_job_config({**PACKED, "context_parallel_size": 2, "document_pad_multiple": 24, "seq_length": 256})
    (problem,) = check_context_parallel(cfg)
    assert "--seq-length 256 is not a multiple of --document-pad-multiple 24" in problem


def test_the_document_pad_multiple_defaults_to_2c_with_cp_and_1_without():
    d = build_job_config(PACKED).data
    assert get_document_pad_multiple(d, 1) == 1 and get_document_pad_multiple(d, 4) == 8
    d = build_job_config({**PACKED, "document_pad_multiple": 16}).data
    assert get_document_pad_multiple(d, 2) == 16
    cfg = build_job_config(
        {**MOCK, "context_parallel_size": 2, "tensor_model_parallel_size": 4, "sequence_parallel": True}
    )
    assert get_cp_length_multiple(cfg) == 8


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--hierarchical-context-parallel-sizes", "2", "4"], "--hierarchical-context-parallel-sizes: hierarchical"),
        (["--hybrid-context-parallel"], "--hybrid-context-parallel: a CP size chosen per sequence"),
        (["--max-seqlen-per-dp-cp-rank", "4096"], "--max-seqlen-per-dp-cp-rank: hybrid"),
        (["--use-tp-pp-dp-mapping"], "--use-tp-pp-dp-mapping: only megatron-core's default rank order"),
        (["--dataloader-inter-document-masking"], "use those"),
    ],
)
def test_megatron_lms_other_cp_flags_are_refused_by_name(argv, needle):
    with pytest.raises(ConfigError) as err:
        parse_args_with_notes(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", *argv])
    assert any(needle in p for p in err.value.problems), err.value.problems


def test_allgather_is_accepted_as_all_gather_once_or_per_layer():
    assert cp_problems(context_parallel_size=2, cp_comm_type=["allgather"]) == []
    assert cp_problems(context_parallel_size=2, cp_comm_type=["all_gather"] * 4) == []


def test_fp32_under_cp_on_cuda_is_refused_naming_bf16():
    """The CUDA path of the CP attention is flash varlen (bf16/fp16): fp32 under CP is refused on CUDA at
    start-up, accepted on the CPU (the flash pieces there take fp32)."""
    cfg = build_job_config({**MOCK, "context_parallel_size": 2, "seq_length": 256})
    (problem,) = check_context_parallel(cfg, cuda=True)
    assert "--context-parallel-size 2 on CUDA needs --bf16 (or --fp16)" in problem
    assert check_context_parallel(cfg) == []
    for half in ("bf16", "fp16"):
        assert (
            check_context_parallel(build_job_config({**MOCK, "context_parallel_size": 2, half: True}), cuda=True) == []
        )
    assert check_context_parallel(build_job_config(MOCK), cuda=True) == []  # no CP: fp32 on CUDA is fine
