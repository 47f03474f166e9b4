"""Validation: every rule the flags must satisfy, checked in one place, all problems reported at once.

``validate(cfg, world_size)`` runs before any process group, file or model is created (it reads
the data files' headers, whether --load holds a checkpoint and, resuming a batch ramp-up, that
checkpoint's ``common.pt``; it never writes) and raises one
ConfigError listing every problem, each naming the flags, the values and the fix. It sits above
``data/`` and ``model/``' pure checks and calls them (the tokenizer flags, the indexed files, the
blends, the one --split grammar); the layout, batch and model-shape rules are ``layout_rules.py``.
Settings Megatron-LM adjusts rather than refuses are adjusted by ``arguments.py`` (with a notice),
before this runs.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os

from megatron_ext.checkpoint.directory import resolve_load_path
from megatron_ext.checkpoint.reader import read_resumed_position
from megatron_ext.config import ConfigError, DataConfig, JobConfig, TrainingConfig
from megatron_ext.context_parallel.rules import check_context_parallel
from megatron_ext.data.blends import DataBlends, get_data_blends
from megatron_ext.data.gpt_datasets import parse_split
from megatron_ext.data.indexed_check import check_indexed_dataset, check_tokenizer_record
from megatron_ext.data.tokenizers import check_tokenizer_flags
from megatron_ext.derived import get_sequence_padding, precision_name, uses_variable_lengths
from megatron_ext.hf.config import get_exportable_problems
from megatron_ext.layout_rules import (
    check_batch,
    check_batch_schedule,
    check_layout,
    check_model,
    check_pipeline_schedule_layout,
    check_v_split,
)
from megatron_ext.model.compile_checks import check_compile_and_graphs
from megatron_ext.setting_values import check_setting_values


def validate(cfg: JobConfig, world_size: int, cuda: bool = False) -> None:
    """Raise ConfigError listing every problem; pure (no process group, no file written)."""
    problems = (
        _check_positive(cfg)
        + check_layout(cfg, world_size)
        + check_model(cfg, world_size)
        + check_batch(cfg, world_size)
        + _check_batch_schedule(cfg, world_size)
        + _check_schedule(cfg)
        + check_pipeline_schedule_layout(cfg, world_size)
        + check_v_split(cfg)
        + _check_data(cfg)
        + _check_device(cfg, cuda)
        + _check_loss_scaling(cfg)
        + _check_stall_limits(cfg)
        + _check_keep_last(cfg)
        + _check_hf_export(cfg)
        + _check_decoupled_lr_and_grad_dtype(cfg)
        + _check_validation_sets(cfg)
        + _check_spike_guard(cfg.training)
        + check_compile_and_graphs(cfg, cuda)
        + check_context_parallel(cfg, cuda)
    )
    problems += check_setting_values(cfg, reported=problems)  # nan, inf, beyond int64: the flags not named yet
    if problems:
        raise ConfigError(problems)


def _check_batch_schedule(cfg: JobConfig, world_size: int) -> list[str]:
    """``check_batch_schedule``; resuming with a ramp-up or a step schedule, from the checkpoint's
    iteration and consumed samples (``common.pt``): a resume on a layout whose batch rules break a step
    still to come is refused now, before the model is built and the checkpoint loaded."""
    resuming = resumes_training(cfg)
    scheduled = bool(cfg.training.rampup_batch_size) or cfg.training.step_batch_size_schedule is not None
    c = cfg.checkpoint
    resumed_at = read_resumed_position(c.load, c.ckpt_step) if resuming and scheduled else None
    return check_batch_schedule(cfg, world_size, resuming=resuming, resumed_at=resumed_at)


def resumes_training(cfg: JobConfig) -> bool:
    """--load holds a complete checkpoint whose training state this run resumes (not --finetune,
    which starts at step 0): its consumed samples, and so the steps left, are known once it is
    loaded (``training/loop.check_steps_left``). Reads the directory listing only."""
    c = cfg.checkpoint
    return bool(c.load) and not c.finetune and resolve_load_path(c.load, c.ckpt_step)[0] is not None


def check_data_tokenizer(d: DataConfig, identity: dict) -> None:
    """ConfigError naming each data prefix whose ``PREFIX.tokenizer.json`` (written by
    tools/preprocess_data.py) records another tokenizer than this run's ``identity``: the start-up
    check that needs the tokenizer built, so it runs after ``validate``."""
    blends = None if d.mock_data else get_data_blends(d)
    problems = [
        f"{blends.source} {p}"
        for prefix in dict.fromkeys(blends.prefixes if blends else [])
        for p in check_tokenizer_record(prefix, identity)
    ]
    if problems:
        raise ConfigError(problems)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_positive(cfg: JobConfig) -> list[str]:
    """Sizes that cannot be zero, optional sizes that must be positive when given, rates >= 0."""
    p, m, t, d = cfg.parallel, cfg.model, cfg.training, cfg.data
    sizes = [
        ("tensor_model_parallel_size", p),
        ("pipeline_model_parallel_size", p),
        ("context_parallel_size", p),
        ("num_layers", m),
        ("hidden_size", m),
        ("num_attention_heads", m),
        ("seq_length", m),
        ("micro_batch_size", t),
        ("log_interval", cfg.logging),
        ("straggler_minmax_count", cfg.logging),
        ("tensorboard_log_interval", cfg.logging),
        ("tensorboard_queue_size", cfg.logging),
        ("make_vocab_size_divisible_by", m),
        ("pad_to_multiple_of", d),
        ("max_nan_iterations", t),
        ("distributed_timeout_minutes", p),  # 0: torch's process-group creation times out at once
        ("rotary_base", m),  # 0 or below: NaN RoPE frequencies, a NaN loss from the first step
    ]
    optional_sizes = [
        ("global_batch_size", t),
        ("ffn_hidden_size", m),
        ("num_query_groups", m),
        ("max_position_embeddings", m),
        ("lr_decay_iters", t),
        ("vocab_size", d),
        ("train_iters", t),
        ("train_samples", t),
        ("lr_decay_samples", t),
        ("lr_wsd_decay_iters", t),
        ("lr_wsd_decay_samples", t),
        ("check_weight_hash_across_dp_replicas_interval", t),
    ]
    rates = [
        ("lr", t),
        ("min_lr", t),
        ("weight_decay", t),
        ("adam_eps", t),
        ("clip_grad", t),
        ("init_method_std", m),
        ("norm_epsilon", m),
    ]
    out = [
        f"{_flag(n)} must be a positive integer, got {getattr(s, n)!r}"
        for n, s in sizes
        if not (type(getattr(s, n)) is int and getattr(s, n) > 0)
    ]
    out += [
        f"{_flag(n)} must be a positive integer when given, got {getattr(s, n)!r}"
        for n, s in optional_sizes
        if getattr(s, n) is not None and not (type(getattr(s, n)) is int and getattr(s, n) > 0)
    ]
    out += [
        f"{_flag(n)} must be a number >= 0, got {getattr(s, n)!r}"
        for n, s in rates
        if not (isinstance(getattr(s, n), (int, float)) and getattr(s, n) >= 0)
    ]
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            out.append(f"{_flag(name)} must be in [0, 1), got {getattr(t, name)}")
    threshold = cfg.logging.straggler_threshold
    if not (isinstance(threshold, (int, float)) and 0.0 < threshold < float("inf")):
        out.append(f"--straggler-threshold must be a fraction > 0 (0.2: 20% slower than the median), got {threshold!r}")
    return out


def _check_stall_limits(cfg: JobConfig) -> list[str]:
    """The watchdog's limits: positive and finite (0, -1 and nan used to turn it off silently or end
    rank 0 in iteration 1), and below the collective timeout, which would otherwise end the run first
    with a message that names no rank."""
    p, out = cfg.parallel, []
    for name in ("step_timeout_minutes", "save_timeout_minutes"):
        value = getattr(p, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            out.append(
                f"{_flag(name)} must be a positive number of minutes, got {value!r} (leave it out to turn the "
                f"watchdog off)"
            )
        elif isinstance(p.distributed_timeout_minutes, int) and value >= p.distributed_timeout_minutes:
            out.append(
                f"{_flag(name)} {value:g} must be below --distributed-timeout-minutes "
                f"{p.distributed_timeout_minutes}, or the collective timeout ends a stalled run first, naming "
                f"no rank: lower it, or raise --distributed-timeout-minutes"
            )
    return out


def _check_keep_last(cfg: JobConfig) -> list[str]:
    """--keep-last: 0 keeps every checkpoint, as when it is not given (as 0 turns Megatron-LM's
    --save-interval or --exit-interval off, and torchtitan's keep_latest_k 0 keeps all), so that a flag
    can switch off a config file's retention; a negative value is an error (-1 silently kept them all)."""
    keep = cfg.checkpoint.keep_last
    if keep is not None and not (type(keep) is int and keep >= 0):
        return [f"--keep-last must be a number of checkpoints > 0, or 0 to keep every checkpoint; got {keep!r}"]
    return []


def _check_hf_export(cfg: JobConfig) -> list[str]:
    """--save-hf / --save-hf-interval: a --save to write beside, a model Hugging Face's Llama/Qwen2/Qwen3
    can express (a GPT-2-style model has learned positions and LayerNorm: refused, not exported wrong),
    and safetensors to write it with."""
    c, out = cfg.checkpoint, []
    if c.save_hf_interval is not None and (not c.save_hf or c.save_hf_interval <= 0):
        out.append(f"--save-hf-interval {c.save_hf_interval} needs --save-hf and a positive interval")
    if not c.save_hf:
        return out
    if not c.save:
        out.append("--save-hf writes the Hugging Face model beside the checkpoints of --save: give --save DIR")
    model = cfg.model
    args = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    problems = get_exportable_problems(args)
    if problems:
        out.append(
            "--save-hf exports Llama/Qwen2/Qwen3-style models only (RMSNorm, SwiGLU, RoPE over the whole head, no "
            f"linear biases but q/k/v): this model needs {'; '.join(problems)}; or drop --save-hf"
        )
    if importlib.util.find_spec("safetensors") is None:
        out.append("--save-hf writes safetensors, which is not installed: pip install safetensors")
    return out


def _check_decoupled_lr_and_grad_dtype(cfg: JobConfig) -> list[str]:
    """--decoupled-lr / --decoupled-min-lr (megatron-core silently ignores a min without the peak) and
    --grad-reduce-in-bf16 (the buffers take the parameters' dtype: fp32, or fp16 under --fp16)."""
    t, out = cfg.training, []
    for name in ("decoupled_lr", "decoupled_min_lr"):
        value = getattr(t, name)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            out.append(f"{_flag(name)} must be a number >= 0, got {value!r}")
    if t.decoupled_min_lr is not None and t.decoupled_lr is None:
        out.append(
            f"--decoupled-min-lr {t.decoupled_min_lr} needs --decoupled-lr (the embedding and output layer's "
            f"peak learning rate): give it, or drop --decoupled-min-lr"
        )
    elif not out and t.decoupled_lr is not None and (t.decoupled_min_lr or t.min_lr) > t.decoupled_lr:
        which = (
            f"--decoupled-min-lr {t.decoupled_min_lr}"
            if t.decoupled_min_lr is not None
            else f"--min-lr {t.min_lr} (the default of --decoupled-min-lr)"
        )
        out.append(f"{which} is larger than --decoupled-lr {t.decoupled_lr}: give --decoupled-min-lr <= --decoupled-lr")
    if cfg.parallel.grad_reduce_in_bf16 and not t.bf16:
        out.append(
            f"--grad-reduce-in-bf16 needs --bf16: the gradient buffers take the parameters' dtype "
            f"({precision_name(t.bf16, t.fp16)} here); add --bf16 or drop --grad-reduce-in-bf16"
        )
    return out


def _check_loss_scaling(cfg: JobConfig) -> list[str]:
    """--fp16's loss-scale flags, which megatron-core's grad scalers assert on (an AssertionError
    with no message after the model is built); without --fp16 they are ignored with a notice."""
    t = cfg.training
    if not t.fp16:
        return []
    if t.loss_scale is not None:
        if not t.loss_scale > 0:  # megatron-core reads 0 as "dynamic", below 0 it asserts
            return [f"--loss-scale must be > 0, got {t.loss_scale} (leave it out for dynamic loss scaling)"]
        return []
    out = [
        f"{_flag(name)} must be > 0, got {getattr(t, name)}"
        for name in ("initial_loss_scale", "min_loss_scale")
        if not getattr(t, name) > 0
    ]
    if not out and t.min_loss_scale > t.initial_loss_scale:
        out.append(
            f"--min-loss-scale {t.min_loss_scale} is larger than --initial-loss-scale {t.initial_loss_scale}: lower it"
        )
    out += [
        f"{_flag(name)} must be a positive integer, got {getattr(t, name)}"
        for name in ("loss_scale_window", "hysteresis")
        if not getattr(t, name) > 0
    ]
    return out


def _check_run_length(t: TrainingConfig) -> list[str]:
    """--train-iters or --train-samples, and a schedule counted in the same unit (Megatron-LM's
    rules), with the lengths megatron-core asserts on named first."""
    if t.train_iters is not None and t.train_samples is not None:
        return [
            f"--train-iters {t.train_iters} and --train-samples {t.train_samples} are exclusive: give the run "
            f"length one way"
        ]
    out = []
    by_samples = t.train_samples is not None
    pairs = [
        ("--lr-warmup-iters", t.lr_warmup_iters or None, "--lr-warmup-samples", t.lr_warmup_samples or None),
        ("--lr-decay-iters", t.lr_decay_iters, "--lr-decay-samples", t.lr_decay_samples),
        ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters, "--lr-wsd-decay-samples", t.lr_wsd_decay_samples),
    ]
    for iter_flag, iters, sample_flag, samples in pairs:
        if by_samples and iters is not None:
            out.append(
                f"{iter_flag} {iters} counts steps but --train-samples counts the run in samples: use {sample_flag}"
            )
        if not by_samples and samples is not None:
            out.append(f"{sample_flag} {samples} needs --train-samples (with --train-iters use {iter_flag})")
    unit, total = ("samples", t.train_samples) if by_samples else ("iters", t.train_iters)
    decay = (t.lr_decay_samples if by_samples else t.lr_decay_iters) or total
    warmup = t.lr_warmup_samples if by_samples else t.lr_warmup_iters
    if t.lr_warmup_fraction is not None:
        if t.lr_warmup_iters or t.lr_warmup_samples:
            out.append(
                "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive: give the warm-up one way"
            )
        if not 0.0 <= t.lr_warmup_fraction < 1.0:
            out.append(f"--lr-warmup-fraction must be in [0, 1), got {t.lr_warmup_fraction}")
        warmup = t.lr_warmup_fraction * decay if decay else 0
    if warmup < 0 or (decay and warmup >= decay):
        # the decay length defaults to the run's: name the flag the user gave
        given_decay = t.lr_decay_samples if by_samples else t.lr_decay_iters
        decay_flag = (
            f"--lr-decay-{unit} {decay}"
            if given_decay
            else f"--lr-decay-{unit} {decay} (not given: it defaults to --train-{unit} {total})"
        )
        out.append(
            f"--lr-warmup-{unit} {warmup} must lie in [0, {decay_flag}) (megatron-core's scheduler needs a "
            f"warm-up shorter than the decay): shorten the warm-up or lengthen the decay"
        )
    if t.lr_decay_style == "WSD":
        wsd = t.lr_wsd_decay_samples if by_samples else t.lr_wsd_decay_iters
        if wsd is None:
            out.append(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N (the decay phase's length)")
        elif decay and wsd > decay:
            out.append(f"--lr-wsd-decay-{unit} {wsd} is longer than --lr-decay-{unit} {decay}")
    return out


def _check_schedule(cfg: JobConfig) -> list[str]:
    t, out = cfg.training, []
    if t.min_lr > t.lr:
        out.append(f"--min-lr {t.min_lr} is larger than --lr {t.lr}: give --min-lr <= --lr")
    out += _check_run_length(t)
    if t.eval_interval < 0 or t.eval_iters < 0:
        out.append("--eval-interval and --eval-iters must be >= 0")
    if not 0 <= t.seed < 2**32:
        out.append(f"--seed must be in [0, 2**32 - 1] (numpy's range, which the data sampling uses), got {t.seed}")
    c = cfg.checkpoint
    if c.save_interval is not None and (c.save_interval <= 0 or not c.save):
        out.append("--save-interval needs --save DIR and a positive interval")
    if c.async_save and not c.save:
        out.append("--async-save writes the checkpoints of --save in the background: give --save DIR")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        out.append(
            "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive: "
            "say which schedule wins with one of them"
        )
    if c.exit_duration_in_mins is not None and c.exit_duration_in_mins <= 0:
        out.append(f"--exit-duration-in-mins must be > 0, got {c.exit_duration_in_mins}")
    return out


def _check_data(cfg: JobConfig) -> list[str]:
    """Where the tokens come from: the data flags, the tokenizer flags, the files they name (O(1)
    header checks), packing and padding, and the one --split grammar (``data/gpt_datasets.parse_split``)."""
    d, out = cfg.data, []
    blends = None
    try:
        blends = get_data_blends(d)
    except ConfigError as exc:
        out += exc.problems
    if d.mock_data and blends is not None:
        out.append(f"--mock-data and {blends.source} are exclusive: give one")
    if not d.mock_data and blends is None and not out:
        out.append(
            "no data: give --data-path PREFIX (an indexed .bin/.idx pair; or --train-data-path ...) or --mock-data"
        )
    tokenizer_problems = check_tokenizer_flags(
        d.tokenizer_type, d.tokenizer_model, d.vocab_size, d.vocab_file, d.merge_file
    )
    if d.mock_data and tokenizer_problems and not d.tokenizer_model:
        tokenizer_problems = [
            p + " (with --mock-data, --tokenizer-type NullTokenizer --vocab-size N needs no file)"
            for p in tokenizer_problems
        ]
    out += tokenizer_problems
    if d.num_workers < 0:
        out.append(f"--num-workers {d.num_workers} must be >= 0 (0: samples are read in the training process)")
    if d.one_document_per_row and (d.reset_attention_mask or d.reset_position_ids):
        out.append(
            "--reset-attention-mask/--reset-position-ids split GPTDataset windows at EOD; "
            "--one-document-per-row rows hold one document already: drop them"
        )
    out += _check_data_files(blends)
    if blends is not None and blends.per_split is not None:
        if cfg.training.eval_interval > 0 and blends.per_split[1] is None:
            out.append(
                f"--eval-interval {cfg.training.eval_interval} needs a validation blend: give "
                f"--valid-data-path (or 'valid' in --per-split-data-args-path), or --eval-interval 0"
            )
        return out + _check_packing(cfg)  # each split is read whole: no --split
    return out + _check_packing(cfg) + _check_split(d, cfg.training.eval_interval)


def _check_validation_sets(cfg: JobConfig) -> list[str]:
    """--full-validation and --multiple-validation-sets as Megatron-LM 0.16.1 can run them: the
    second needs the first, a validation blend per split (each prefix a set) without weights;
    whole-split reads need megatron-core's one-epoch GPTDataset (no weighted blend, no packing)."""
    t, d = cfg.training, cfg.data
    if not (t.full_validation or t.multiple_validation_sets):
        return []
    out = []
    if t.multiple_validation_sets and not t.full_validation:
        out.append(
            "--multiple-validation-sets needs --full-validation (as in Megatron-LM 0.16.1: each set is "
            "read whole): add --full-validation"
        )
    if t.eval_interval <= 0:
        out.append("--full-validation/--multiple-validation-sets need --eval-interval N > 0 (0: never evaluates)")
    if uses_variable_lengths(d):
        out.append(
            "--full-validation reads megatron-core GPTDataset windows only (as Megatron-LM's): drop "
            "--packed-sequences/--one-document-per-row or --full-validation"
        )
    try:
        blends = None if d.mock_data else get_data_blends(d)
    except ConfigError:
        return out  # reported by _check_data
    valid = blends.for_split(1) if blends is not None else None
    if valid is not None and valid[1] is not None:
        out.append(
            f"--full-validation reads one epoch of the validation blend, which megatron-core cannot do "
            f"for a weighted one ({blends.source} gives weights {valid[1]}): drop the weights"
        )
    if t.multiple_validation_sets and (blends is None or blends.per_split is None or valid is None):
        out.append(
            "--multiple-validation-sets evaluates each prefix of --valid-data-path (or 'valid' of "
            "--per-split-data-args-path) as its own set: give one (not --data-path or --mock-data)"
        )
    return out


def _check_spike_guard(t: TrainingConfig) -> list[str]:
    """--skip-spiky-loss-factor (ours) must exceed 1 (a factor <= 1 would skip ordinary steps)."""
    out = []
    if t.skip_spiky_loss_factor is not None and not t.skip_spiky_loss_factor > 1.0:
        out.append(
            f"--skip-spiky-loss-factor {t.skip_spiky_loss_factor} must be > 1 (a step is skipped when its "
            f"loss exceeds factor x the largest recent loss), e.g. 10; leave it out to turn the guard off"
        )
    if t.skip_spiky_loss_window < 1:
        out.append(f"--skip-spiky-loss-window must be >= 1, got {t.skip_spiky_loss_window}")
    return out


def _check_data_files(blends: DataBlends | None) -> list[str]:
    """Each prefix's .bin/.idx pair exists (with a hint at the prefix meant) and its headers agree."""
    out = []
    for prefix in dict.fromkeys(blends.prefixes if blends else []):
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = " (give the prefix of a .bin/.idx pair tools/preprocess_data.py wrote)"
            written = sorted(glob.glob(glob.escape(prefix) + "_*_document.bin"))
            if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix[:-4] + ".bin"):
                hint = f" (give the prefix without the extension: {prefix[:-4]})"
            elif written:  # preprocess_data.py --output-prefix P writes P_{json key}_document.bin/.idx
                hint = (
                    f" (preprocess_data.py --output-prefix {prefix} wrote "
                    f"{', '.join(w[:-4] for w in written)}: give that prefix)"
                )
            elif os.path.isdir(prefix):  # Megatron-LM's --data-path is a file prefix, never a directory
                inside = sorted(glob.glob(os.path.join(glob.escape(prefix), "*.bin")))[:3]
                named = f": {', '.join(b[:-4] for b in inside)}" if inside else ""
                hint = f" ({prefix} is a directory: give the prefix of a .bin/.idx pair in it{named})"
            out.append(f"{blends.source} {prefix}: missing {', '.join(missing)}{hint}")
        else:
            out += [f"{blends.source} {prefix}: {p}" for p in check_indexed_dataset(prefix)]
    return out


def _check_split(d: DataConfig, eval_interval: int) -> list[str]:
    """--split in the grammar the dataset builders parse it with (``parse_split``: 1 to 3 weights),
    and a validation split when the run evaluates."""
    try:
        fractions = parse_split(d.split)
    except ConfigError as exc:
        return exc.problems
    if eval_interval > 0 and not d.mock_data and fractions[1] == 0:
        return [f"--eval-interval {eval_interval} needs a validation split, but --split '{d.split}' gives it no weight"]
    return []


def _check_packing(cfg: JobConfig) -> list[str]:
    d, m = cfg.data, cfg.model
    out = []
    if d.packed_sequences and d.one_document_per_row:
        out.append("--packed-sequences and --one-document-per-row are exclusive: give one")
    if uses_variable_lengths(d):
        flag = "--packed-sequences" if d.packed_sequences else "--one-document-per-row"
        if d.mock_data:
            out.append(f"{flag} needs documents: give --data-path (not --mock-data)")
    if get_sequence_padding(d) != "static":
        k = d.pad_to_multiple_of
        if k <= 0 or m.seq_length % k:
            out.append(
                f"--seq-length {m.seq_length} is not a multiple of --pad-to-multiple-of {k}: padded "
                f"lengths are rounded up to the multiple and must never exceed --seq-length"
            )
        if cfg.parallel.sequence_parallel and k % cfg.parallel.tensor_model_parallel_size:
            out.append(
                f"--pad-to-multiple-of {k} must be a multiple of --tensor-model-parallel-size with --sequence-parallel"
            )
    elif cfg.parallel.sequence_parallel and m.seq_length % cfg.parallel.tensor_model_parallel_size:
        out.append(
            f"--seq-length {m.seq_length} must be a multiple of --tensor-model-parallel-size "
            f"{cfg.parallel.tensor_model_parallel_size} with --sequence-parallel (each rank holds an equal "
            f"slice)"
        )
    return out


def _check_overlap(cfg: JobConfig) -> list[str]:
    p, out = cfg.parallel, []
    if p.use_distributed_optimizer and cfg.training.optimizer != "adam":
        # megatron-core asserts it in DistributedOptimizer.__init__, after the model is built
        out.append(
            f"--optimizer {cfg.training.optimizer} with --use-distributed-optimizer: megatron-core 0.16.1's "
            f"distributed optimizer shards Adam only: use --optimizer adam or drop --use-distributed-optimizer"
        )
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        out.append(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)"
        )
    if p.ddp_bucket_size is not None and p.ddp_bucket_size <= 0:
        out.append(f"--ddp-bucket-size {p.ddp_bucket_size} must be a positive number of elements")
    elif p.ddp_bucket_size is not None and not p.overlap_grad_reduce:
        out.append(
            f"--ddp-bucket-size {p.ddp_bucket_size} has no effect without --overlap-grad-reduce: add it or drop "
            f"--ddp-bucket-size"
        )
    return out


def _check_profiling(cfg: JobConfig, cuda: bool) -> list[str]:
    lg = cfg.logging
    out = []
    if lg.profile:
        if lg.use_pytorch_profiler and not lg.tensorboard_dir:
            out.append("--use-pytorch-profiler writes its traces into --tensorboard-dir: give one")
        if not lg.use_pytorch_profiler and not cuda:
            out.append(
                "--profile without --use-pytorch-profiler marks CUDA profiler ranges for nsys, which needs "
                "CUDA: add --use-pytorch-profiler on the CPU"
            )
        if not 0 <= lg.profile_step_start < lg.profile_step_end:
            out.append(
                f"--profile-step-start {lg.profile_step_start} must be >= 0 and below --profile-step-end "
                f"{lg.profile_step_end}"
            )
        if not all(r.strip().isdigit() for r in lg.profile_ranks):
            out.append(f"--profile-ranks {' '.join(lg.profile_ranks)}: give global rank numbers")
    elif lg.use_pytorch_profiler:
        out.append("--use-pytorch-profiler needs --profile")
    if lg.timing_log_level not in (0, 1, 2):
        out.append(f"--timing-log-level {lg.timing_log_level}: use 0, 1 or 2")
    if lg.log_timers_to_tensorboard and not lg.timing_log_level:
        out.append("--log-timers-to-tensorboard needs --timing-log-level 1 or 2")
    if lg.manual_gc_interval < 0 or (lg.manual_gc_interval and not lg.manual_gc):
        out.append(f"--manual-gc-interval {lg.manual_gc_interval} needs --manual-gc (and >= 0)")
    return out


def _check_device(cfg: JobConfig, cuda: bool) -> list[str]:
    p = cfg.parallel
    out = _check_profiling(cfg, cuda) + _check_overlap(cfg)
    for flag, value in (("--use-torch-fsdp2", p.use_torch_fsdp2), ("--use-custom-fsdp", p.use_custom_fsdp)):
        if value:
            out.append(
                f"{flag}: FSDP is not supported; shard the optimizer state with --use-distributed-optimizer "
                f"(ZeRO-1) and the model with --tensor/--pipeline-model-parallel-size"
            )
    if p.optimizer_cpu_offload:
        out.append(
            "--optimizer-cpu-offload is not supported: shard the optimizer state with --use-distributed-optimizer"
        )
    if cfg.training.bf16 and cfg.training.fp16:
        out.append("--bf16 and --fp16 are exclusive: give one (--no-bf16 turns off a --bf16 from --config)")
    if cfg.model.transformer_impl == "transformer_engine" and not cuda:
        out.append("--transformer-impl transformer_engine needs CUDA: use local or auto on CPU")
    return out
