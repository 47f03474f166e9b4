"""--rampup-batch-size and --step-batch-size-schedule (megatron_ext/data/batch_schedule.py) against
independent references: megatron-core 0.16.1's RampupBatchsizeNumMicroBatchesCalculator (installed)
and Megatron-LM main's StepBatchsizeNumMicroBatchesCalculator (tests/unit/megatron_main_step_batch.py,
copied verbatim), stepped as Megatron-LM's training loop steps them; the flags' rules through
``validation.validate`` (one ConfigError, each problem naming the flag); Megatron-LM's GPT-3 175B
example scripts."""

from __future__ import annotations

import shlex

import pytest
from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
)

from megatron_ext.arguments import parse_args_with_notes
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.data.batch_schedule import BatchSchedule, get_train_iters, parse_rampup, parse_step_schedule
from megatron_ext.data.builder import get_num_samples
from megatron_ext.data.step_data import StepDataSpec
from megatron_ext.derived import describe_batch_decrease, get_batch_schedule, get_num_microbatches, resolve_config
from megatron_ext.derived import get_train_iters as get_run_train_iters
from megatron_ext.layout_rules import check_steps_left
from megatron_ext.validation import validate
from tests.unit.megatron_main_step_batch import StepBatchsizeNumMicroBatchesCalculator


def reference_steps(calculator, train_iters: int) -> list[tuple[int, int, int]]:
    """(consumed samples, global batch, micro-batches) of each step, as Megatron-LM's train loop
    gets them: update(consumed, consistency_check=True) before the step, then consumed += batch."""
    out, consumed = [], 0
    for _ in range(train_iters):
        calculator.update(consumed, True)
        batch = calculator.get_current_global_batch_size()
        out.append((consumed, batch, calculator.get()))
        consumed += batch
    return out


def reference_ramp_train_iters(calculator, rampup_samples: int, gbs: int, train_samples: int) -> int:
    """Megatron-LM core_v0.16.1's training.update_train_iters with a ramp-up, on the calculator."""
    iterations = consumed = 0
    while consumed <= rampup_samples and consumed <= train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


def reference_step_train_iters(calculator, train_samples: int) -> int:
    """Megatron-LM main's training.update_train_iters with a step schedule, on the calculator."""
    iterations = consumed = 0
    while consumed < train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations


def ours_steps(schedule: BatchSchedule, mbs: int, dp: int, train_iters: int) -> list[tuple[int, int, int]]:
    spec = StepDataSpec(schedule.global_batch_size, mbs, 0, dp, "static", 1, 8, 0, None, batch_schedule=schedule)
    steps = [(c, b) for _, (c, b) in zip(range(train_iters), schedule.iter_steps())]
    return [(c, b, spec.get_num_microbatches(c)) for c, b in steps]


RAMPS = [  # (start, increment, ramp-up samples, global batch, micro-batch, DP, train samples)
    (16, 16, 5859375, 1536, 1, 8, 6_000_000),  # the GPT-3 175B script's ramp (at DP 8)
    (4, 4, 100, 32, 2, 2, 400),
    (8, 8, 37, 64, 1, 8, 300),  # ramp samples not a multiple of anything: the float step
    (6, 6, 1000, 60, 3, 2, 500),  # the run ends mid-ramp
    (2, 6, 50, 32, 1, 2, 1),  # one sample: one step
]


@pytest.mark.parametrize("start, inc, samples, gbs, mbs, dp, train_samples", RAMPS)
def test_rampup_matches_megatron_core_every_step(start, inc, samples, gbs, mbs, dp, train_samples):
    ref = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 1, start, inc, samples)
    schedule = BatchSchedule(gbs, rampup=parse_rampup([str(start), str(inc), str(samples)], gbs))
    iters = get_train_iters(schedule, train_samples)
    assert iters == reference_ramp_train_iters(ref, samples, gbs, train_samples)
    expected = reference_steps(ref, iters + 3)  # and a few past the run's end
    assert ours_steps(schedule, mbs, dp, iters + 3) == expected
    assert schedule.get_consumed_samples(iters) == sum(b for _, b, _ in expected[:iters])
    assert set(schedule.get_batch_sizes(iters)) == {b for _, b, _ in expected[:iters]} | {gbs}


STEP_SCHEDULES = [  # (schedule, seq length, micro-batch, DP, train samples)
    ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048, 1, 8, 7_000_000),  # main's GPT-3 175B script
    ("0:768 250B:1536 500B:3072 750B:6144", 4096, 2, 8, 200_000_000),  # main's docstring example
    ("1K:32, 0:8 ,3.5k:16", 10, 2, 2, 900),  # unsorted, commas, a lower-case suffix, a batch that shrinks
    ("0:4 1000:8", 1, 1, 4, 2),
]


@pytest.mark.parametrize("text, seq, mbs, dp, train_samples", STEP_SCHEDULES)
def test_step_schedule_matches_megatron_lm_main_every_step(text, seq, mbs, dp, train_samples):
    ref = StepBatchsizeNumMicroBatchesCalculator(mbs, dp, False, 1, text, seq_length=seq)
    steps = parse_step_schedule(text, seq)
    assert list(steps) == ref.schedule
    schedule = BatchSchedule(steps[-1][1], steps=steps)
    iters = get_train_iters(schedule, train_samples)
    assert iters == reference_step_train_iters(ref, train_samples)
    assert ours_steps(schedule, mbs, dp, iters + 3) == reference_steps(ref, iters + 3)


def test_the_run_reads_each_step_in_order_and_resumes_mid_ramp():
    """The sample stream is the steps' batches back to back, whatever step the run starts from."""
    schedule = BatchSchedule(32, rampup=(4, 4, 100))
    whole = [b for _, b in zip(range(40), schedule.iter_steps())]
    assert [c for c, _ in whole] == [sum(b for _, b in whole[:k]) for k in range(40)]
    resumed = [b for _, b in zip(range(30), schedule.iter_steps(whole[10][0]))]
    assert resumed == whole[10:40]
    spec = StepDataSpec(32, 2, 1, 2, "static", 1, 8, 0, None, batch_schedule=schedule)
    c, b = whole[3]
    assert spec.get_indices(c) == [list(range(c + j * 4 + 2, c + j * 4 + 4)) for j in range(b // 4)]
    assert spec.get_indices(0, 32)[-1] == [30, 31]  # evaluation passes the settled batch


BASE = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=16,
    max_position_embeddings=16,
    mock_data=True,
    tokenizer_type="NullTokenizer",
    vocab_size=64,
    micro_batch_size=1,
    global_batch_size=16,
    train_samples=200,
)


def problems(world_size: int = 2, **values) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(build_job_config({**BASE, **values}), world_size)
    return err.value.problems


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(rampup_batch_size=["4", "4"]), "--rampup-batch-size 4 4: takes 3 values"),
        (dict(rampup_batch_size=["4", "x", "8"]), "--rampup-batch-size 4 x 8: takes 3 integers"),
        (dict(rampup_batch_size=["4", "4", "0"]), "must be positive"),
        (dict(rampup_batch_size=["16", "4", "8"]), "not below --global-batch-size 16"),
        (dict(rampup_batch_size=["4", "5", "8"]), "16 - start 4 = 12 is not divisible by the increment 5"),
        (
            dict(rampup_batch_size=["3", "1", "8"]),
            "global batches 3, 7 not divisible by --micro-batch-size 1",
        ),
        (dict(rampup_batch_size=["4", "4", "8"], train_samples=None, train_iters=10), "replace --train-iters 10"),
        (
            dict(rampup_batch_size=["4", "4", "8"], step_batch_size_schedule="0:4 64:16", global_batch_size=None),
            "are exclusive (Megatron-LM main replaced the first by the second)",
        ),
        (dict(step_batch_size_schedule="0:4 64:16"), "and --global-batch-size 16 are exclusive"),
        (dict(step_batch_size_schedule="16:4 64:16", global_batch_size=None), "first entry's threshold must be 0"),
        (dict(step_batch_size_schedule="0:4 8:8", global_batch_size=None), "strictly increasing in samples"),
        (dict(step_batch_size_schedule="0:4 64", global_batch_size=None), 'entry "64" is not THRESHOLD:BATCH'),
        (dict(step_batch_size_schedule="0:4 6x:8", global_batch_size=None), "must be numbers"),
        (dict(step_batch_size_schedule="0:0", global_batch_size=None), "every batch must be positive"),
        (dict(step_batch_size_schedule="0:3 64:16", global_batch_size=None), "global batch 3 not divisible"),
    ],
)
def test_bad_schedules_are_one_error_naming_the_flag(values, needle):
    found = problems(**values)
    assert len(found) == 1 and needle in found[0], found
    flag = "--rampup-batch-size" if "rampup_batch_size" in values else "--step-batch-size-schedule"
    assert found[0].startswith(flag), found


def test_every_ramp_step_is_checked_against_the_interleaved_rule():
    """Interleaving needs at least PP micro-batches per step in every step, the ramp's first too."""
    interleaved = dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2, num_layers=4)
    validate(build_job_config({**BASE, **interleaved, "rampup_batch_size": ["4", "4", "40"]}), 2)
    found = problems(**interleaved, rampup_batch_size=["1", "1", "40"])
    assert len(found) == 1 and "interleaved schedule: 1 micro-batch per step" in found[0], found
    # a batch the run never reaches is not checked: the run ends before the ramp's steps pass 3
    validate(build_job_config({**BASE, **interleaved, "rampup_batch_size": ["2", "1", "400"], "train_samples": 3}), 2)


# Megatron-LM's GPT-3 175B example, examples/gpt3/train_gpt3_175b_distributed.sh: model, training and
# parallel arrays verbatim (core_v0.16.1 and main), mock data instead of the GPT-2 files.
GPT3_MODEL = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto"""
GPT3_V0161 = """--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-iters 500000"""
GPT3_MAIN = """--micro-batch-size 1 --global-batch-size 1536
--step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536" --train-iters 500000"""
GPT3_REST = """--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
--fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save /tmp/gpt3-ckpt --load /tmp/gpt3-ckpt
--eval-iters 10"""


def gpt3_argv(training: str) -> list[str]:
    return shlex.split(" ".join([GPT3_MODEL, training, GPT3_REST]))


def as_samples(argv: list[str]) -> list[str]:
    """The script counted in samples, as Megatron-LM needs with a ramp-up: x 1536 per iteration."""
    text = " ".join(shlex.quote(a) for a in argv)
    text = text.replace("--train-iters 500000", "--train-samples 768000000")
    return shlex.split(text.replace("--lr-decay-iters 430000", "--lr-decay-samples 660480000"))


def test_gpt3_175b_v0161_script_is_refused_as_megatron_lm_refuses_it():
    """core_v0.16.1's script gives --rampup-batch-size with --train-iters, which its own
    arguments.py asserts against ('expected no batch-size rampup for iteration-based training')."""
    cfg, _ = parse_args_with_notes(gpt3_argv(GPT3_V0161))
    with pytest.raises(ConfigError) as err:
        validate(cfg, 128, cuda=True)
    assert len(err.value.problems) == 1 and "replace --train-iters 500000 with --train-samples" in str(err.value)


def test_gpt3_175b_v0161_script_in_samples_runs_megatron_core_ramp():
    cfg, _ = parse_args_with_notes(as_samples(gpt3_argv(GPT3_V0161)))
    validate(cfg, 128, cuda=True)
    ref = RampupBatchsizeNumMicroBatchesCalculator(1536, 1, 1, False, 1, 16, 16, 5859375)
    assert get_run_train_iters(cfg, 128) == reference_ramp_train_iters(ref, 5859375, 1536, 768000000)
    schedule = get_batch_schedule(cfg, 128)
    assert ours_steps(schedule, 1, 1, 2000) == reference_steps(ref, 2000)


def test_gpt3_175b_main_script_is_refused_as_megatron_lm_main_refuses_it():
    """main's script gives --global-batch-size with the schedule (main's arguments.py raises 'Cannot
    specify both'), and --train-iters, whose LR schedule main counts in micro-batch x DP samples."""
    cfg, _ = parse_args_with_notes(gpt3_argv(GPT3_MAIN))
    with pytest.raises(ConfigError) as err:
        validate(cfg, 128, cuda=True)
    assert len(err.value.problems) == 2, err.value.problems
    assert "drop --global-batch-size" in err.value.problems[0] and "needs sample-based" in err.value.problems[1]
    fixed = [a for a in as_samples(gpt3_argv(GPT3_MAIN)) if a not in ("--global-batch-size", "1536")]
    cfg, _ = parse_args_with_notes(fixed)
    validate(cfg, 128, cuda=True)
    ref = StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 1, cfg.training.step_batch_size_schedule, 2048)
    assert get_run_train_iters(cfg, 128) == reference_step_train_iters(ref, 768000000)
    assert ours_steps(get_batch_schedule(cfg, 128), 1, 1, 2000) == reference_steps(ref, 2000)


# ----------------------------------------------------------------------------- resuming on another layout
# --rampup-batch-size 2 3 12 with --global-batch-size 8: steps of 2, 2, 2, 5, 5, then 8 from sample 16
RESUMABLE = dict(global_batch_size=8, rampup_batch_size=["2", "3", "12"], train_samples=48)


@pytest.mark.parametrize("first_sample", [0, 4, 6, 11, 16, 40])
def test_batches_from_a_consumed_offset_are_megatron_cores(first_sample):
    """The batches of the steps from a resumed run's consumed samples: megatron-core's calculator
    updated at each step's consumed count from there."""
    ref = RampupBatchsizeNumMicroBatchesCalculator(8, 1, 1, False, 1, 2, 3, 12)
    schedule = BatchSchedule(8, rampup=parse_rampup(["2", "3", "12"], 8))
    consumed, expected = first_sample, set()
    for _ in range(4):
        ref.update(consumed, True)
        expected.add(ref.get_current_global_batch_size())
        consumed += ref.get_current_global_batch_size()
    assert set(schedule.get_batch_sizes(4, first_sample)) == expected | {8}


def test_resume_past_the_ramp_on_a_dp_the_ramp_does_not_divide_is_accepted(tmp_path):
    """DP 2 breaks the ramp's batch 5: a new run is refused; a run resuming after the ramp (--load
    holds a checkpoint) is not, and the loop's check of the steps left passes from sample 16 on."""
    assert "global batch 5 not divisible" in problems(**RESUMABLE)[0]
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000005" / "complete.json").write_text("{}")
    cfg = build_job_config({**BASE, **RESUMABLE, "load": str(tmp_path)})
    validate(cfg, 2)
    schedule = get_batch_schedule(cfg, 2)
    assert check_steps_left(cfg, 2, schedule, 16, 4) == []  # 8, 8, 8, 8
    assert check_steps_left(cfg, 1, schedule, 0, 9) == []  # the run that saved it, at DP 1
    # --finetune starts at step 0 whatever --load holds: the ramp is checked
    assert "global batch 5 not divisible" in problems(**RESUMABLE, load=str(tmp_path), finetune=True)[0]


@pytest.mark.parametrize("first_sample", [0, 6, 11])
def test_resume_with_a_step_left_that_does_not_divide_is_refused(first_sample):
    """A step of batch 5 still to come (from sample 6 or 11) on DP 2: one problem naming the flag,
    the batch, the resume and the fix."""
    cfg = build_job_config({**BASE, **RESUMABLE})
    (problem,) = check_steps_left(cfg, 2, get_batch_schedule(cfg, 2), first_sample, 9)
    assert problem.startswith("--rampup-batch-size 2 3 12") and "global batch 5 not divisible" in problem
    assert "data-parallel size 2 = 2" in problem and "a multiple of 2" in problem
    resumed = f"resumed after {first_sample} consumed samples"
    assert (
        (resumed in problem and "resume on a data-parallel size that divides")
        if first_sample
        else "resumed" not in problem
    )


def test_a_step_schedule_whose_batch_shrinks_then_grows_back_is_checked_in_full():
    """Batch 8, then 4 from sample 64, then 8 again: the 4 is checked, not only the last batch."""
    values = dict(step_batch_size_schedule="0:8 1024:4 2048:8", global_batch_size=None, train_samples=200)
    validate(build_job_config({**BASE, **values}), 4)
    (found,) = problems(8, **values)
    assert "global batch 4 not divisible by --micro-batch-size 1 x data-parallel size 8" in found


# ----------------------------------------------------------------------------- --decrease-batch-size-if-needed
DECREASING = [  # (global batch, micro-batch, DP)
    (10, 1, 4),  # 8: 2 micro-batches per rank
    (9, 2, 2),  # 8
    (7, 1, 2),  # 6
    (24, 2, 3),  # already divisible: 24
    (5, 5, 1),  # one micro-batch of 5
    (100, 3, 7),  # 84: 4 micro-batches per rank
]


def reference_running_steps(calculator, dp: int, train_iters: int) -> list[tuple[int, int, int]]:
    """(consumed samples, running global batch, micro-batches) of each step, as Megatron-LM's train
    loop takes them: update(consumed) before the step, then consumed += DP x micro-batch x
    num_micro_batches (its ``consumed_train_samples``: the running batch)."""
    out, consumed = [], 0
    for _ in range(train_iters):
        calculator.update(consumed, True)
        batch = calculator.get_current_running_global_batch_size()
        assert batch == calculator.get() * calculator.get_micro_batch_size() * dp
        out.append((consumed, batch, calculator.get()))
        consumed += batch
    return out


def decreasing_schedule(gbs: int, mbs: int, dp: int, **ramp) -> BatchSchedule:
    values = dict(BASE, global_batch_size=gbs, micro_batch_size=mbs, decrease_batch_size_if_needed=True, **ramp)
    cfg = build_job_config(values)
    validate(cfg, dp)
    return get_batch_schedule(cfg, dp)


@pytest.mark.parametrize("gbs, mbs, dp", DECREASING)
def test_decreased_constant_batch_is_megatron_cores_running_batch(gbs, mbs, dp):
    ref = ConstantNumMicroBatchesCalculator(gbs, mbs, dp, True, 1)
    schedule = decreasing_schedule(gbs, mbs, dp)
    assert schedule.running_global_batch_size == ref.get_current_running_global_batch_size()
    assert ours_steps(schedule, mbs, dp, 6) == reference_running_steps(ref, dp, 6)
    cfg = build_job_config(dict(BASE, global_batch_size=gbs, micro_batch_size=mbs, decrease_batch_size_if_needed=True))
    assert get_num_microbatches(cfg, dp) == ref.get()
    # the resolved view a run reads (data, scheduler, logs, evaluation): the running batch
    resolved = resolve_config(cfg, dp, 64)
    assert resolved.global_batch_size == ref.get_current_running_global_batch_size()
    assert resolved.num_microbatches == ref.get()


DECREASING_RAMPS = [  # (start, increment, ramp-up samples, global batch, micro-batch, DP)
    (2, 3, 12, 8, 1, 2),  # 2, 2, 2, 5 -> 4, ..., then 8
    (8, 4, 100, 32, 3, 2),  # every batch rounded to a multiple of 6
    (8, 8, 37, 64, 1, 5),
    (6, 6, 1000, 60, 2, 3),
]


@pytest.mark.parametrize("start, inc, samples, gbs, mbs, dp", DECREASING_RAMPS)
def test_decreased_ramp_is_megatron_cores_running_batch_every_step(start, inc, samples, gbs, mbs, dp):
    """The ramp's batch of the consumed samples (counted in running batches), rounded down."""
    ref = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, True, 1, start, inc, samples)
    schedule = decreasing_schedule(gbs, mbs, dp, rampup_batch_size=[str(start), str(inc), str(samples)])
    steps = 60
    expected = reference_running_steps(ref, dp, steps)
    assert ours_steps(schedule, mbs, dp, steps) == expected
    assert schedule.get_consumed_samples(steps) == sum(b for _, b, _ in expected)
    # the flags' batches (as the calculator's current global batch) are what validation checks
    ref = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, True, 1, start, inc, samples)
    scheduled = set()
    for consumed, _, _ in expected[:10]:
        ref.update(consumed, True)
        scheduled.add(ref.get_current_global_batch_size())
    assert set(schedule.get_batch_sizes(10)) == scheduled | {gbs}


@pytest.mark.parametrize("gbs, mbs, dp", DECREASING)
@pytest.mark.parametrize("train_samples", [1000, 1003])
def test_decreased_train_samples_run_reads_what_the_flags_plan_and_no_more(gbs, mbs, dp, train_samples):
    """A --train-samples run trains until one more running batch would pass the samples the flags'
    batches read (what the train split is sized for): within one batch of them, never past."""
    schedule = decreasing_schedule(gbs, mbs, dp)
    planned = train_samples // gbs * gbs  # Megatron-LM's train_samples // G steps of G
    iters = get_train_iters(schedule, train_samples)
    running = schedule.running_global_batch_size
    assert iters * running <= planned < (iters + 1) * running
    cfg = build_job_config(
        dict(
            BASE,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            decrease_batch_size_if_needed=True,
            train_samples=train_samples,
        )
    )
    assert get_num_samples(cfg.training, gbs, schedule)[0] == planned
    # resumed after k steps taken at the undecreased batch (another layout): the steps left
    for k in (0, 3, planned // gbs):
        left = get_train_iters(schedule, train_samples, first_sample=k * gbs)
        assert k * gbs + left * running <= planned < k * gbs + (left + 1) * running


def test_without_the_flag_an_indivisible_batch_is_refused_naming_the_flag():
    (found,) = problems(4, global_batch_size=10)
    assert "--global-batch-size 10 is not divisible by --micro-batch-size 1 x data-parallel size 4 = 4" in found
    assert "or add --decrease-batch-size-if-needed to run 8 per step" in found
    validate(build_job_config({**BASE, "global_batch_size": 10, "decrease_batch_size_if_needed": True}), 4)


def test_with_the_flag_a_batch_below_one_micro_batch_per_rank_is_refused():
    (found,) = problems(4, global_batch_size=3, decrease_batch_size_if_needed=True)
    assert "--global-batch-size 3 is less than --micro-batch-size 1 x data-parallel size 4 = 4" in found
    assert "--decrease-batch-size-if-needed cannot round it down" in found
    (found,) = problems(4, global_batch_size=3)  # without the flag, adding it would not help: not suggested
    assert "not divisible" in found and "--decrease-batch-size-if-needed" not in found
    # a ramp that starts below micro-batch x DP: its first steps would run no micro-batch
    (found,) = problems(4, global_batch_size=16, rampup_batch_size=["2", "2", "40"], decrease_batch_size_if_needed=True)
    assert found.startswith("--rampup-batch-size 2 2 40") and "global batch 2 is less than" in found
    validate(
        build_job_config({**BASE, "rampup_batch_size": ["5", "1", "40"], "decrease_batch_size_if_needed": True}), 4
    )


def test_the_flag_with_a_step_schedule_is_refused_as_megatron_lm_main_refuses_it():
    values = dict(step_batch_size_schedule="0:4 64:16", global_batch_size=None, decrease_batch_size_if_needed=True)
    (found,) = problems(2, **values)
    assert "--decrease-batch-size-if-needed and --step-batch-size-schedule are exclusive" in found
    with pytest.raises(ValueError, match="do not support decrease_batch_size_if_needed"):
        StepBatchsizeNumMicroBatchesCalculator(1, 2, True, 1, "0:4 64:16", seq_length=16)


def test_the_flag_parses_as_megatron_lms_switch_and_notices_the_decrease():
    argv = shlex.split(
        "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --global-batch-size 10 --train-iters 5 "
        "--decrease-batch-size-if-needed"
    )
    cfg, _ = parse_args_with_notes(argv)
    assert cfg.training.decrease_batch_size_if_needed
    assert not parse_args_with_notes(argv[:-1])[0].training.decrease_batch_size_if_needed  # off by default
    note = describe_batch_decrease(cfg, 4)
    assert "decreasing batch size from 10 to 8" in note and "data-parallel size 4 = 4" in note
    assert describe_batch_decrease(cfg, 5) is None  # 10 divides by 5
