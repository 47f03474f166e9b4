"""--torch-compile and --cuda-graph-* as flags (issue 30): what validation refuses, each with one error
naming the flag and the fix, and what reaches megatron-core's config. No process group, no layer built
(the wiring that needs one is tests/distributed/test_cuda_graph_wiring.py and test_torch_compile.py)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.data.padding import get_step_length
from megatron_ext.derived import resolve_config
from megatron_ext.model.compile_checks import count_padded_lengths, get_shape_notes
from megatron_ext.model.gpt import build_transformer_config
from megatron_ext.pipeline.names import SCHEDULES, splits_backward
from megatron_ext.testing import VOCAB, tiny_values
from megatron_ext.validation import validate

ZERO_BUBBLE = [name for name in SCHEDULES if splits_backward(name)]
# the layout each zero-bubble schedule accepts (so that the compile refusal is the only problem)
SCHEDULE_LAYOUT = {"InterleavedZeroBubble": dict(num_virtual_stages_per_pipeline_rank=2)}


def _problems(values: dict, world_size: int = 1, cuda: bool = False) -> list[str]:
    try:
        validate(build_job_config(tiny_values(**values)), world_size=world_size, cuda=cuda)
    except ConfigError as err:
        return err.problems
    return []


@pytest.mark.parametrize(
    "values,cuda,message",
    [
        (dict(cuda_graph_impl="local"), False, "--cuda-graph-impl local needs CUDA"),
        (dict(cuda_graph_impl="local", cuda_graph_scope="attn"), True, "--cuda-graph-scope attn"),
        (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"), True, "with the NaN check on"),
        (
            dict(
                cuda_graph_impl="local",
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
            ),
            True,
            "--recompute-granularity full",
        ),
        (dict(cuda_graph_warmup_steps=-1), False, "--cuda-graph-warmup-steps"),
        (dict(torch_compile=True, cuda_graph_impl="local"), True, "--torch-compile with --cuda-graph-impl local"),
        (
            dict(
                torch_compile=True,
                recompute_granularity="selective",
                recompute_modules=["mlp"],
                disable_bias_linear=True,
            ),
            False,
            "--torch-compile with --recompute-modules mlp",
        ),
        (dict(torch_compile_cpp_wrapper=True), False, "--torch-compile-cpp-wrapper without --torch-compile"),
    ],
)
def test_refused_with_one_error_naming_the_flag(values, cuda, message):
    problems = _problems(values, cuda=cuda)
    assert sum(message in p for p in problems) == 1, problems


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def test_full_recompute_with_cuda_graphs_offers_only_fixes_that_validate():
    """The refusal once said "use --cuda-graph-scope full_iteration", itself refused (not wired here): each
    fix it names now must validate on its own, and it names no refused scope as the way out."""
    [problem] = _problems(dict(cuda_graph_impl="local", **FULL_RECOMPUTE), cuda=True)
    assert "--recompute-granularity full" in problem
    assert "use --cuda-graph-scope full_iteration" not in problem
    assert "use --recompute-granularity selective or drop it, or run without --cuda-graph-impl" in problem
    assert _problems(dict(cuda_graph_impl="local", recompute_granularity="selective"), cuda=True) == []
    assert _problems(dict(cuda_graph_impl="local"), cuda=True) == []
    assert _problems(dict(FULL_RECOMPUTE), cuda=True) == []
    # and the scope it no longer offers is still refused with full recompute
    assert _problems(dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration", **FULL_RECOMPUTE), cuda=True)


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_zero_bubble_schedule_with_torch_compile_is_one_error_naming_both_flags_and_the_fix(schedule):
    """The zero-bubble schedules defer each linear's weight gradient into a Python queue from inside its
    backward (model/wgrad_deferral.py), which a compiled layer's backward cannot do."""
    values = dict(pipeline_model_parallel_size=2, pipeline_schedule=schedule, **SCHEDULE_LAYOUT.get(schedule, {}))
    without = _problems(values, world_size=2)  # none, or DualPipeV's "not implemented yet"
    assert len(without) == (schedule == "DualPipeV"), without
    problems = [p for p in _problems(dict(values, torch_compile=True), world_size=2) if p not in without]
    assert len(problems) == 1, problems
    assert f"--torch-compile with --pipeline-schedule {schedule}" in problems[0]
    assert "drop --torch-compile or use 1F1B" in problems[0]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_torch_compile_with_megatron_cores_schedules_is_accepted(schedule):
    values = dict(pipeline_model_parallel_size=2, pipeline_schedule=schedule, torch_compile=True)
    if schedule == "Interleaved1F1B":
        values["num_virtual_stages_per_pipeline_rank"] = 2
    assert _problems(values, world_size=2) == []


def test_transformer_engine_graphs_need_transformer_engine():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    assert (
        sum(
            "transformer_engine is not installed" in p
            for p in _problems(dict(cuda_graph_impl="transformer_engine"), cuda=True)
        )
        == 1
    )


def test_defaults_are_off():
    cfg = build_job_config(tiny_values())
    assert cfg.training.torch_compile is False and cfg.training.cuda_graph_impl == "none"
    assert cfg.data.pad_length_bucket == "multiple"
    validate(cfg, world_size=1)


def test_the_flags_reach_megatron_cores_config():
    cfg = build_job_config(tiny_values(cuda_graph_impl="local", cuda_graph_warmup_steps=2))
    config = build_transformer_config(cfg, resolve_config(cfg, 1, VOCAB - 1), torch.device("cpu"))
    assert (config.cuda_graph_impl, config.cuda_graph_scope, config.cuda_graph_warmup_steps) == ("local", [], 2)
    plain = build_job_config(tiny_values())
    assert (
        build_transformer_config(plain, resolve_config(plain, 1, VOCAB - 1), torch.device("cpu")).cuda_graph_impl
        == "none"
    )


@pytest.mark.parametrize(
    "values,whole",
    [
        ({}, True),
        (dict(recompute_granularity="selective"), True),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), False),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), False),
    ],
    ids=["plain", "selective", "full-recompute", "sequence-parallel"],
)
def test_the_compiled_scope_is_the_whole_block_unless_it_cannot_trace(values, whole):
    """--torch-compile compiles each chunk's decoder whole (fewer Python calls per micro-batch), each
    layer alone where the block cannot trace: full recompute (megatron-core's checkpoint saves RNG
    states), sequence parallelism (the block forks the RNG tracker). Read off megatron-core's config."""
    from megatron_ext.model.compile import block_compiles

    cfg = build_job_config(tiny_values(torch_compile=True, **values))
    world = values.get("tensor_model_parallel_size", 1)
    config = build_transformer_config(cfg, resolve_config(cfg, world, VOCAB - 1), torch.device("cpu"))
    assert block_compiles(config) is whole


# --torch-compile with variable lengths: start-up names the padding that would recompile per length
PACKED_2048 = dict(packed_sequences=True, seq_length=2048, max_position_embeddings=2048)


@pytest.mark.parametrize(
    "values,warned",
    [
        (dict(torch_compile=True, **PACKED_2048), True),  # negotiated, multiple 64: 32 lengths
        (dict(torch_compile=True, one_document_per_row=True, seq_length=2048), True),
        (dict(torch_compile=True, sequence_padding="variable", **PACKED_2048), True),
        (dict(torch_compile=True, pad_length_bucket="power-of-two", **PACKED_2048), False),
        (dict(torch_compile=True, sequence_padding="static", **PACKED_2048), False),
        (dict(torch_compile=True, seq_length=2048), False),  # fixed-length windows: static
        (dict(torch_compile=True, packed_sequences=True, seq_length=256), False),  # 4 lengths: a handful
        (dict(PACKED_2048), False),  # eager: a length costs nothing more
    ],
    ids=["packed", "one-doc-per-row", "variable", "power-of-two", "static", "windows", "short", "eager"],
)
def test_compiled_runs_warn_once_when_padding_allows_many_lengths(values, warned):
    notes = get_shape_notes(build_job_config(tiny_values(**values)))
    assert len(notes) == int(warned), notes
    if warned:
        assert "--torch-compile with --pad-length-bucket multiple" in notes[0]
        assert "add --pad-length-bucket power-of-two" in notes[0] and "\n" not in notes[0]


def test_the_shape_warning_counts_what_padding_gives_and_reaches_start_up():
    """The counts are data/padding.get_step_length's, and the note is one of parse_args_with_notes' (what
    pretrain_gpt.py prints as a WARNING line at start-up)."""
    for longest, multiple in ((2048, 64), (8192, 64), (1000, 64), (4096, 128)):
        for bucket in ("multiple", "power-of-two"):
            expected = {get_step_length(n, multiple, longest, bucket) for n in range(1, longest + 1)}
            assert count_padded_lengths(longest, multiple, bucket) == len(expected)
    argv = ["--mock-data", "--packed-sequences", "--seq-length", "2048", "--max-position-embeddings", "2048"]
    argv += ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--torch-compile"]
    _, notes = parse_args_with_notes(argv)
    [note] = [n for n in notes if "--pad-length-bucket" in n]
    assert "up to 32 padded lengths" in note and "power-of-two (6 lengths" in note
    _, notes = parse_args_with_notes(argv + ["--pad-length-bucket", "power-of-two"])
    assert not [n for n in notes if "--pad-length-bucket" in n]


def test_recompute_on_the_local_spec_prints_no_transformer_engine_advice():
    # megatron-core's "If you are using transformer_engine ... core_attn" advice was printed by every
    # rank for --recompute-activations on the local spec, which has no fused attention to not recompute
    cfg = build_job_config(tiny_values(recompute_activations=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = build_transformer_config(cfg, resolve_config(cfg, 1, VOCAB - 1), torch.device("cpu"))
    assert config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
    assert not [w for w in caught if "core_attn" in str(w.message)], [str(w.message) for w in caught]
