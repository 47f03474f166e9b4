"""Flags with Megatron-LM's names mean what they mean there: the defaults Megatron-LM resolves for
them (core_v0.16.1: megatron/training/arguments.py ``validate_args`` and
``get_optimizer_param_scheduler`` in training.py), written out here rather than read from our code."""

from __future__ import annotations

import pytest

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.derived import resolve_ffn_hidden_size
from megatron_ext.validation import validate

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128, global_batch_size=8, micro_batch_size=1)


def megatron_lm_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's validate_args: ``int((4 * h * 2 / 3) / 64) * 64`` with --swiglu, else 4h."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@pytest.mark.parametrize("hidden_size", [64, 128, 256, 768, 1024, 2048, 4096, 5120, 8192])
@pytest.mark.parametrize("swiglu", [False, True])
def test_default_ffn_hidden_size_is_megatron_lms(hidden_size, swiglu):
    # --swiglu rounds 2/3 of 4h DOWN to a multiple of 64: 4096 -> 10880 (rounding up gave 10944,
    # another model than a Megatron-LM script without --ffn-hidden-size builds)
    assert resolve_ffn_hidden_size(None, hidden_size, swiglu) == megatron_lm_ffn_hidden_size(hidden_size, swiglu)
    assert resolve_ffn_hidden_size(1000, hidden_size, swiglu) == 1000  # given: used as it is


def test_swiglu_default_width_of_zero_is_refused_naming_the_flag():
    with pytest.raises(
        ConfigError,
        match="--swiglu with --hidden-size 16: the default --ffn-hidden-size .* is 0; give --ffn-hidden-size",
    ):
        validate(build_job_config({**MOCK, "hidden_size": 16, "num_attention_heads": 4, "swiglu": True}), 1)
    validate(
        build_job_config({**MOCK, "hidden_size": 16, "num_attention_heads": 4, "swiglu": True, "ffn_hidden_size": 32}),
        1,
    )


def test_hf_export_of_a_default_width_checkpoint_names_the_width_it_trained():
    from tools.convert_checkpoint import build_hf_config

    args = dict(
        swiglu=True,
        normalization="RMSNorm",
        disable_bias_linear=True,
        position_embedding_type="rope",
        hidden_size=256,
        ffn_hidden_size=None,
        num_layers=2,
        num_attention_heads=4,
        group_query_attention=False,
        norm_epsilon=1e-5,
        rotary_base=10000,
        seq_length=32,
        untie_embeddings_and_output_weights=True,
    )
    # the checkpoint records the width its model was built with
    assert build_hf_config(args, {"padded_vocab_size": 256, "ffn_hidden_size": 640})["intermediate_size"] == 640
    # one saved before it did had our earlier default: 2/3 of 4h rounded UP to 64 (256 -> 704)
    assert build_hf_config(args, {"padded_vocab_size": 256})["intermediate_size"] == 704


def test_a_checkpoint_of_the_earlier_swiglu_default_names_its_width_on_load():
    from megatron_ext.checkpoint.compatibility import check_compatible
    from megatron_ext.checkpoint.parts import CheckpointMeta

    run = build_job_config({**MOCK, "hidden_size": 256, "num_attention_heads": 4, "swiglu": True})
    meta = CheckpointMeta(tokenizer={}, padded_vocab_size=128)
    recorded = {"args": run.to_flat_dict(), "ffn_hidden_size": 640}
    assert check_compatible(recorded, run, meta) == []
    (problem,) = check_compatible({"args": run.to_flat_dict()}, run, meta)  # saved before the width was recorded
    assert "--ffn-hidden-size: the checkpoint was saved with 704, this run has 640" in problem, problem
    given = build_job_config(
        {**MOCK, "hidden_size": 256, "num_attention_heads": 4, "swiglu": True, "ffn_hidden_size": 704}
    )
    assert check_compatible({"args": run.to_flat_dict()}, given, meta) == []  # the fix the message names


def megatron_lm_cosine_lr(num_samples: float, warmup: float, decay: float, lr: float, min_lr: float) -> float:
    """megatron-core's OptimizerParamScheduler.get_lr for cosine decay, written out."""
    import math

    if warmup > 0 and num_samples <= warmup:
        return lr * num_samples / warmup
    ratio = min(1.0, (num_samples - warmup) / (decay - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.mark.parametrize("by", ["iters", "samples"])
def test_warmup_fraction_is_not_rounded_and_the_lr_of_each_step_is_megatron_lms(by):
    """Megatron-LM's get_optimizer_param_scheduler passes lr_warmup_fraction * lr_decay_steps as it
    is: 0.07 x 80 samples = 5.6, not 5 (which moved every step's learning rate of the run)."""
    import types

    from megatron_ext.derived import get_schedule_steps
    from megatron_ext.training.optimizer import build_scheduler

    length = dict(train_iters=10) if by == "iters" else dict(train_samples=80)
    cfg = build_job_config(
        {**MOCK, **length, "lr_warmup_fraction": 0.07, "lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": "cosine"}
    )
    validate(cfg, 1)
    cfg.training.train_iters = 10  # what run.build_training_run resolves --train-samples 80 to
    assert get_schedule_steps(cfg, 8, 10).lr_warmup_steps == pytest.approx(5.6)
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    scheduler = build_scheduler(cfg, optimizer, 8)
    got = [optimizer.param_groups[0]["lr"]]  # the first step's, set when the scheduler is built
    for _ in range(10):
        scheduler.step(increment=8)
        got.append(optimizer.param_groups[0]["lr"])
    expected = [megatron_lm_cosine_lr(8 * i, 0.07 * 80, 80, 1e-3, 1e-4) for i in range(11)]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


# Megatron-LM core_v0.16.1 defaults of the flags we share (megatron/training/arguments.py,
# training_config.py, common_config.py; megatron/core/transformer/transformer_config.py), after
# validate_args resolves them. eval_interval None there (no evaluation during training) is our 0.
MEGATRON_LM_DEFAULTS = {
    "clip_grad": 1.0,
    "weight_decay": 0.01,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "optimizer": "adam",
    "init_method_std": 0.02,
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "lr_warmup_samples": 0,
    "lr_warmup_fraction": None,
    "lr_decay_iters": None,
    "lr_decay_samples": None,
    "lr_wsd_decay_style": "exponential",
    "eval_iters": 100,
    "eval_interval": 0,
    "log_interval": 100,
    "tensorboard_log_interval": 1,
    "split": "969,30,1",
    "seed": 1234,
    "untie_embeddings_and_output_weights": False,
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "swiglu": False,
    "ffn_hidden_size": None,
    "make_vocab_size_divisible_by": 128,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rope_scaling_factor": 8.0,
    "global_batch_size": None,
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "loss_scale": None,
    "distributed_timeout_minutes": 10,
    "check_for_nan_in_loss_and_grad": True,
    "timing_log_level": 0,
    "profile_step_start": 10,
    "profile_step_end": 12,
    "manual_gc_interval": 0,
    "empty_unused_memory_level": 0,
    "disable_bias_linear": False,
    "group_query_attention": False,
    "num_query_groups": None,
    "use_distributed_optimizer": False,
    "sequence_parallel": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "ddp_bucket_size": None,
}
# Defaults docs/running.md lists as differing from Megatron-LM's (give the flag for Megatron-LM's).
DOCUMENTED_DIFFERENCES = {
    "lr_decay_style": "linear",
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "calculate_per_token_loss": False,
    "num_workers": 2,
}


def test_defaults_are_megatron_lms_unless_documented():
    flat = build_job_config({}).to_flat_dict()
    differ = {k: (flat[k], v) for k, v in MEGATRON_LM_DEFAULTS.items() if flat[k] != v}
    assert differ == {}, f"(ours, Megatron-LM's) defaults: {differ}"
    import pathlib

    documented = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "running.md").read_text()
    for name, theirs in DOCUMENTED_DIFFERENCES.items():
        assert flat[name] != theirs and f"--{name.replace('_', '-')}" in documented, name
