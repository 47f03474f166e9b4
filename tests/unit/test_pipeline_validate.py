"""--pipeline-schedule: each impossible combination is one ConfigError naming the flags and the fix, before
any work; the V schedules imply 2 chunks per rank; megatron-core's own schedules stay today's choice."""

from __future__ import annotations

import pytest

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.derived import get_schedule_name, get_virtual_pipeline_size, uses_our_runtime
from megatron_ext.testing import tiny_values
from megatron_ext.validation import validate

BASE = dict(num_layers=8, global_batch_size=8, micro_batch_size=1)


def _problems(world_size: int, **values) -> list[str]:
    try:
        validate(build_job_config(tiny_values(**{**BASE, **values})), world_size)
    except ConfigError as err:
        return err.problems
    return []


@pytest.mark.parametrize(
    "values,world,needles",
    [
        (dict(pipeline_schedule="zbv"), 1, ["--pipeline-schedule zbv: not a schedule", "ZBVZeroBubble"]),
        (dict(pipeline_schedule="DualPipeV", pipeline_model_parallel_size=2), 2, ["DualPipeV: not implemented yet"]),
        (dict(pipeline_schedule="ZBH1"), 1, ["ZBH1 is a pipeline schedule", "--pipeline-model-parallel-size > 1"]),
        (
            dict(pipeline_schedule="1F1B", pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
            2,
            ["1F1B runs one model chunk per rank", "Interleaved1F1B"],
        ),
        (
            dict(pipeline_schedule="Interleaved1F1B", pipeline_model_parallel_size=2),
            2,
            ["Interleaved1F1B needs virtual stages", "--num-virtual-stages-per-pipeline-rank 2"],
        ),
        (
            dict(pipeline_schedule="ZBH1", pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
            2,
            ["ZBH1 runs one model chunk per rank", "InterleavedZeroBubble"],
        ),
        (
            dict(pipeline_schedule="InterleavedZeroBubble", pipeline_model_parallel_size=2),
            2,
            ["InterleavedZeroBubble needs virtual stages", "ZBH1"],
        ),
        (
            dict(
                pipeline_schedule="ZBVZeroBubble",
                pipeline_model_parallel_size=2,
                num_layers=16,
                num_virtual_stages_per_pipeline_rank=4,
            ),
            2,
            ["exactly 2 model chunks per pipeline rank", "but 4 are set"],
        ),
        (
            dict(pipeline_schedule="ZBVZeroBubble", pipeline_model_parallel_size=4, num_layers=12),
            4,
            ["--num-layers 12 does not split into 2 x --pipeline-model-parallel-size 4 = 8"],
        ),
        (
            dict(pipeline_schedule="ZBVZeroBubble", pipeline_model_parallel_size=4, global_batch_size=2),
            4,
            ["2 micro-batches per step", "fewer than the 4 pipeline stages", "--global-batch-size"],
        ),
        (
            dict(pipeline_schedule="ZBH1", pipeline_model_parallel_size=2, sequence_padding="variable", seq_length=64),
            2,
            ["--sequence-padding variable", "--sequence-padding negotiated"],
        ),
        (
            dict(
                pipeline_schedule="InterleavedZeroBubble",
                pipeline_model_parallel_size=2,
                num_virtual_stages_per_pipeline_rank=2,
                microbatch_group_size_per_vp_stage=2,
            ),
            2,
            ["--microbatch-group-size-per-vp-stage applies to megatron-core's Interleaved1F1B only"],
        ),
    ],
)
def test_each_impossible_combination_is_one_error_naming_flags_and_fix(values, world, needles):
    problems = [p for p in _problems(world, **values) if "pipeline-schedule" in p or "microbatch-group" in p]
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], problems[0]


def test_valid_combinations_pass_and_v_implies_two_chunks():
    assert _problems(4, pipeline_schedule="ZBVZeroBubble", pipeline_model_parallel_size=4) == []
    cfg = build_job_config(tiny_values(**BASE, pipeline_schedule="zbvzerobubble", pipeline_model_parallel_size=4))
    assert get_virtual_pipeline_size(cfg) == 2 and get_schedule_name(cfg) == "ZBVZeroBubble"
    assert _problems(2, pipeline_schedule="ZBH1", pipeline_model_parallel_size=2) == []
    # megatron-core's interleaved micro-batch grouping rule is its own: m = 6 at PP 4 is fine for ours
    assert (
        _problems(
            4,
            pipeline_schedule="InterleavedZeroBubble",
            pipeline_model_parallel_size=4,
            num_virtual_stages_per_pipeline_rank=2,
            global_batch_size=6,
        )
        == []
    )
    assert any(
        "last group" in p
        for p in _problems(
            4, pipeline_model_parallel_size=4, num_virtual_stages_per_pipeline_rank=2, global_batch_size=6
        )
    )


def test_megatron_core_schedules_stay_megatron_core_s():
    for values in (
        dict(),
        dict(pipeline_schedule="1F1B"),
        dict(pipeline_schedule="interleaved1f1b", num_virtual_stages_per_pipeline_rank=2),
    ):
        cfg = build_job_config(tiny_values(**BASE, pipeline_model_parallel_size=2, **values))
        assert not uses_our_runtime(cfg)
    assert uses_our_runtime(build_job_config(tiny_values(**BASE, pipeline_schedule="zbh1")))
