"""Run length and LR schedule in samples, and WSD (Megatron-LM's flags over megatron-core's
OptimizerParamScheduler): the sample flags give the schedule the iteration flags give; WSD follows
its formula (written out here); the checks name the flags; a changed WSD phase is refused on resume."""

from __future__ import annotations

import math
import types

import pytest

from megatron_ext.checkpoint.compatibility import check_optimizer_flags, check_scheduler_flags
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.derived import get_schedule_steps, get_train_iters
from megatron_ext.optim import apply_flag_settings, get_scheduler_state, load_scheduler_state, record_flag_settings
from megatron_ext.training.optimizer import build_scheduler, get_schedule_lr_range
from megatron_ext.validation import validate

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128, global_batch_size=8, micro_batch_size=1)


def _cfg(**values):
    return build_job_config({**MOCK, **values})


def _stub_optimizer():
    return types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])


def _lrs(cfg, steps: int, gbs: int = 8) -> list[float]:
    opt = _stub_optimizer()
    sched = build_scheduler(cfg, opt, gbs)
    out = []
    for _ in range(steps):
        sched.step(increment=gbs)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_run_length_defaults_and_samples():
    assert _cfg().training.train_iters == 100
    cfg = _cfg(train_samples=83)
    assert cfg.training.train_iters is None and get_train_iters(cfg, 8) == 10  # 83 // 8, as Megatron-LM


@pytest.mark.parametrize("style", ["cosine", "linear", "WSD"])
def test_sample_flags_give_the_iteration_schedule(style):
    wsd_iters = dict(lr_wsd_decay_iters=4) if style == "WSD" else {}
    wsd_samples = dict(lr_wsd_decay_samples=32) if style == "WSD" else {}
    by_iters = _cfg(
        train_iters=20, lr_warmup_iters=3, lr_decay_iters=16, lr_decay_style=style, lr=1e-3, min_lr=1e-4, **wsd_iters
    )
    by_samples = _cfg(
        train_samples=160,
        lr_warmup_samples=24,
        lr_decay_samples=128,
        lr_decay_style=style,
        lr=1e-3,
        min_lr=1e-4,
        **wsd_samples,
    )
    by_samples.training.train_iters = get_train_iters(by_samples, 8)
    assert get_schedule_steps(by_iters, 8, 20) == get_schedule_steps(by_samples, 8, 20)
    assert _lrs(by_iters, 20) == _lrs(by_samples, 20)


def test_warmup_fraction_is_of_the_decay_length():
    steps = get_schedule_steps(_cfg(train_iters=10, lr_warmup_fraction=0.25), 8, 10)
    assert (steps.lr_warmup_steps, steps.lr_decay_steps) == (20, 80)


def test_wsd_follows_warmup_stable_decay():
    """Written out: linear warm-up, the peak until the last lr_wsd_decay samples of the decay
    length, then 2 * 0.5^r - 1 of the way from min to peak (exponential), r the decay fraction."""
    lr, min_lr, gbs = 1e-3, 1e-4, 8
    cfg = _cfg(
        train_samples=160, lr_warmup_samples=16, lr_decay_style="WSD", lr_wsd_decay_samples=64, lr=lr, min_lr=min_lr
    )
    cfg.training.train_iters = 20
    expected = []
    for i in range(1, 21):
        n = i * gbs
        if n <= 16:
            expected.append(lr * n / 16)
        elif n <= 160 - 64:
            expected.append(lr)
        else:
            r = (n - 96) / 64
            expected.append(min_lr + (2.0 * math.pow(0.5, r) - 1.0) * (lr - min_lr))
    assert _lrs(cfg, 20) == pytest.approx(expected, rel=1e-12)
    assert expected[-1] == pytest.approx(min_lr)  # ends at --min-lr


@pytest.mark.parametrize(
    "values, needle",
    [
        (dict(train_iters=10, train_samples=80), "--train-iters 10 and --train-samples 80 are exclusive"),
        (
            dict(train_samples=80, lr_warmup_iters=2),
            "--lr-warmup-iters 2 counts steps but --train-samples counts the run in samples: use --lr-warmup-samples",
        ),
        (dict(train_samples=80, lr_decay_iters=5), "use --lr-decay-samples"),
        (
            dict(train_iters=10, lr_decay_samples=40),
            "--lr-decay-samples 40 needs --train-samples (with --train-iters use --lr-decay-iters)",
        ),
        (dict(train_iters=10, lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters N"),
        (dict(train_samples=80, lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-samples N"),
        (
            dict(train_iters=10, lr_decay_style="WSD", lr_wsd_decay_iters=11),
            "--lr-wsd-decay-iters 11 is longer than --lr-decay-iters 10",
        ),
        (
            dict(train_iters=10, lr_warmup_iters=10, lr_decay_iters=10),
            "--lr-warmup-iters 10 must lie in [0, --lr-decay-iters 10)",
        ),
        # the decay length was not given: its default, the run's length, is named
        (
            dict(train_iters=5, lr_warmup_iters=5),
            "--lr-warmup-iters 5 must lie in [0, --lr-decay-iters 5 (not given: it defaults to --train-iters 5))",
        ),
        (
            dict(train_samples=40, lr_warmup_samples=48, lr_decay_samples=40),
            "--lr-warmup-samples 48 must lie in [0, --lr-decay-samples 40)",
        ),
        (
            dict(train_iters=10, lr_warmup_fraction=0.1, lr_warmup_iters=1),
            "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive",
        ),
        (dict(train_iters=10, lr_warmup_fraction=1.5), "--lr-warmup-fraction must be in [0, 1)"),
        (dict(train_samples=4), "--train-samples 4 is less than one global batch (8 samples)"),
        (
            dict(rampup_batch_size=["4", "4", "1000"], train_iters=10),
            "--rampup-batch-size 4 4 1000 needs sample-based training (as Megatron-LM",
        ),
    ],
)
def test_schedule_flags_are_checked_by_name(values, needle):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**values), 1)
    assert any(needle in p for p in err.value.problems), err.value.problems


def test_a_changed_wsd_phase_is_refused_on_resume_and_restored_when_the_checkpoint_wins():
    saved_cfg = _cfg(train_iters=20, lr_decay_style="WSD", lr_wsd_decay_iters=4)
    saved = get_scheduler_state(build_scheduler(saved_cfg, _stub_optimizer(), 8))
    assert saved["wsd_decay_steps"] == 32 and saved["lr_wsd_decay_style"] == "exponential"
    for changed, flag in (
        (dict(lr_wsd_decay_iters=6), "--lr-wsd-decay-iters or --lr-wsd-decay-samples"),
        (dict(lr_wsd_decay_iters=4, lr_wsd_decay_style="linear"), "--lr-wsd-decay-style"),
    ):
        cfg = _cfg(train_iters=20, lr_decay_style="WSD", **changed)
        problems = check_scheduler_flags(saved, build_scheduler(cfg, _stub_optimizer(), 8), cfg, 8)
        assert len(problems) == 1 and problems[0].startswith(flag), problems
    cfg = _cfg(train_iters=20, lr_decay_style="WSD", lr_wsd_decay_iters=6, use_checkpoint_opt_param_scheduler=True)
    sched = build_scheduler(cfg, _stub_optimizer(), 8)
    load_scheduler_state(sched, {**saved, "num_steps": 80})
    assert (sched.wsd_decay_steps, sched.lr_wsd_decay_style) == (32, "exponential")


def _group(max_lr, min_lr, betas=(0.8, 0.95), eps=1e-6):
    return {
        "params": [],
        "lr": 0.0,
        "weight_decay": 0.0,
        "max_lr": max_lr,
        "min_lr": min_lr,
        "betas": betas,
        "eps": eps,
    }


def test_override_restores_each_groups_built_settings_by_index():
    """megatron-core's groups may carry their own LR (a decoupled LR for the embeddings): a load gives
    every group the checkpoint's values, and --override-opt-param-scheduler gives each group back what
    it was built with, not --lr for all."""
    cfg = _cfg(train_iters=10, lr=1e-3, min_lr=1e-4, lr_decay_style="linear", override_opt_param_scheduler=True)
    optimizer = types.SimpleNamespace(param_groups=[_group(1e-3, 1e-4), _group(5e-3, 5e-4)])  # group 1 decoupled
    recorded = record_flag_settings(optimizer)
    scheduler = build_scheduler(cfg, optimizer, 8)
    saved = get_scheduler_state(scheduler)
    # the load replaced the group dicts with the checkpoint's (an older --lr 3e-4, another Adam)
    optimizer.param_groups = [_group(3e-4, 3e-5, (0.9, 0.999), 1e-8), _group(2e-3, 2e-4, (0.9, 0.999), 1e-8)]
    apply_flag_settings(optimizer, recorded)
    load_scheduler_state(scheduler, {**saved, "max_lr": 3e-4, "min_lr": 3e-5, "num_steps": 40})
    # linear decay over 80 samples from 0, half-way: each group at the middle of its own range
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5.5e-4, 2.75e-3])
    assert [(g["betas"], g["eps"]) for g in optimizer.param_groups] == [((0.8, 0.95), 1e-6)] * 2
    assert get_schedule_lr_range(scheduler) == (1e-3, 1e-4)  # what the start-up line shows: group 0's


def test_the_schedule_line_reads_the_groups_own_learning_rates():
    """megatron-core's get_lr reads a group's max_lr/min_lr before the scheduler's fields."""
    optimizer = types.SimpleNamespace(param_groups=[_group(3e-4, 3e-5)])
    scheduler = types.SimpleNamespace(optimizer=optimizer, max_lr=1e-3, min_lr=1e-4)
    assert get_schedule_lr_range(scheduler) == (3e-4, 3e-5)
    assert get_schedule_lr_range(types.SimpleNamespace(max_lr=1e-3, min_lr=1e-4)) == (1e-3, 1e-4)


def test_changed_adam_options_are_refused_unless_a_flag_says_which_wins():
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "max_lr": 1e-3}
    saved = {"optimizer": {0: {"optimizer": {"param_groups": [group, dict(group)]}}}}  # chained, mixed precision
    assert check_optimizer_flags(saved, _cfg(adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)) == []
    (problem,) = check_optimizer_flags(saved, _cfg(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8))
    assert problem.startswith(
        "--adam-beta2: the checkpoint's Adam beta2 is 0.999, this run's flags give 0.95; "
        "add --override-opt-param-scheduler"
    ), problem
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        assert check_optimizer_flags(saved, _cfg(adam_beta2=0.95, **{flag: True})) == []
    sgd = {"optimizer": {"param_groups": [{"momentum": 0.9, "max_lr": 1e-3}]}}
    assert check_optimizer_flags(sgd, _cfg(optimizer="sgd", adam_beta2=0.95)) == []


def test_a_changed_decoupled_lr_is_named_like_a_changed_adam_option():
    """Issue 31: a load restores the embedding and output groups' saved max_lr/min_lr, so a new
    --decoupled-lr / --decoupled-min-lr would be dropped silently; named unless a flag says which wins."""
    saved = {"args": {"decoupled_lr": 5e-4, "decoupled_min_lr": 5e-5}, "optimizer": {}}
    same = _cfg(decoupled_lr=5e-4, decoupled_min_lr=5e-5)
    assert check_optimizer_flags(saved, same) == []
    problems = check_optimizer_flags(saved, _cfg(decoupled_lr=1e-3, decoupled_min_lr=5e-5))
    assert problems == [
        "--decoupled-lr: the checkpoint's learning rate of the embedding and output layer is 0.0005, this run's "
        "flags give 0.001; add --override-opt-param-scheduler to use this run's flags or "
        "--use-checkpoint-opt-param-scheduler to keep the checkpoint's"
    ], problems
    (dropped,) = check_optimizer_flags(saved, _cfg(decoupled_lr=5e-4, decoupled_min_lr=None))
    assert dropped.startswith("--decoupled-min-lr: the checkpoint's minimum learning rate"), dropped
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        assert check_optimizer_flags(saved, _cfg(decoupled_lr=1e-3, **{flag: True})) == []
    assert check_optimizer_flags({"optimizer": {}}, _cfg(decoupled_lr=1e-3)) == []  # older checkpoints: no args
