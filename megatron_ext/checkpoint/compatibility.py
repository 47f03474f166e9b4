"""What may differ between a checkpoint and the run that loads it, and what may not.

Pure functions of a checkpoint's common part (its recorded flags, scheduler state, tokenizer and
padded vocabulary) and this run's flags and ``CheckpointMeta``: each problem names the flag, the
checkpoint's value and this run's, and the fix. ``state.load_parts`` calls them before it reads any
tensor, so a refused resume writes and changes nothing.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.checkpoint.parts import CheckpointMeta
from megatron_ext.config import JobConfig
from megatron_ext.data.context_split import get_document_padding
from megatron_ext.derived import precision_name, resolve_ffn_hidden_size

# Settings that fix the shapes and meaning of the saved weights: (config field, flag).
MODEL_SHAPE_SETTINGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",  # compared resolved: None and hidden / heads are the same heads
    "qk_layernorm",
    "normalization",
    "apply_layernorm_1p",  # the same weights mean another model with or without the 1
    "swiglu",
    "disable_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "add_qkv_bias",
)


def check_compatible(
    saved: dict[str, Any], cfg: JobConfig, meta: CheckpointMeta, load_optimizer: bool = True
) -> list[str]:
    """Problems that make a checkpoint unusable for this run, each naming the flag and values."""
    problems = []
    args = saved.get("args", {})
    current = cfg.to_flat_dict()
    saved_shape, shape = effective_model_shape(args), effective_model_shape(current)
    saved_shape["ffn_hidden_size"] = saved_ffn_hidden_size(saved)
    for name in MODEL_SHAPE_SETTINGS:
        if name in args and saved_shape[name] != shape[name]:
            if (
                name == "ffn_hidden_size"
                and args[name] is None
                and current[name] is None
                and any(args.get(n) != current[n] for n in ("hidden_size", "swiglu"))
            ):
                continue  # both defaults: the --hidden-size or --swiglu difference is the one named
            flag = (
                "--group-query-attention/--num-query-groups (key/value heads)"
                if name == "num_query_groups"
                else f"--{name.replace('_', '-')}"
            )
            problems.append(
                f"{flag}: the checkpoint was saved with {saved_shape[name]!r}, this run "
                f"has {shape[name]!r}; use the checkpoint's value or another --load directory"
            )
    if (
        load_optimizer
        and "use_distributed_optimizer" in args
        and (args["use_distributed_optimizer"] != current["use_distributed_optimizer"])
    ):
        problems.append(
            f"--use-distributed-optimizer: the checkpoint was saved with "
            f"{args['use_distributed_optimizer']}, this run has {current['use_distributed_optimizer']}; "
            f"their optimizer states differ in form: use the checkpoint's setting, or --no-load-optim "
            f"to load the weights only"
        )
    saved_precision = precision_name(bool(args.get("bf16")), bool(args.get("fp16")))
    precision = precision_name(current["bf16"], current["fp16"])
    if load_optimizer and "bf16" in args and saved_precision != precision:
        # megatron-core keeps the fp32 optimizer's state and the mixed-precision one's in different
        # forms (unless the distributed optimizer holds both), and a switch to fp16 finds no loss
        # scaler state to load (KeyError 'scale', with either optimizer)
        distributed = args.get("use_distributed_optimizer") and current["use_distributed_optimizer"]
        if precision == "fp16" or not distributed:
            problems.append(
                f"precision: the checkpoint was saved in {saved_precision}, this run is {precision}; their "
                f"optimizer states differ in form{'' if distributed else ' without --use-distributed-optimizer'}: "
                f"train in {saved_precision}, or --no-load-optim to load the weights only"
            )
    if saved.get("padded_vocab_size") not in (None, meta.padded_vocab_size):
        problems.append(
            f"vocabulary: the checkpoint's padded vocabulary is {saved['padded_vocab_size']}, this run's "
            f"is {meta.padded_vocab_size} (--vocab-size / --tokenizer-model, "
            f"--make-vocab-size-divisible-by): use the checkpoint's tokenizer and padding"
        )
    problems += check_same_tokenizer(saved.get("tokenizer"), meta.tokenizer)
    return problems


def get_document_pad_record(cfg: JobConfig) -> int:
    """The g a run's packs are built with (a checkpoint records it as ``document_pad_multiple``)."""
    return get_document_padding(cfg.data, cfg.parallel.context_parallel_size)


def check_document_pad_multiple(saved: dict[str, Any], cfg: JobConfig) -> list[str]:
    """A resume of packed documents at the checkpoint's --seq-length and --packing-strategy whose g
    differs from the checkpoint's (a checkpoint without the record was packed with g = 1): g decides
    the packs, so a resume at another CP keeps the checkpoint's g or is refused, naming the flag."""
    args = saved.get("args", {})
    same_packs = all(args.get(k) == v for k, v in cfg.to_flat_dict().items() if k in ("seq_length", "packing_strategy"))
    if not (cfg.data.packed_sequences and args.get("packed_sequences") and same_packs):
        return []  # other packs anyway (a changed --seq-length is warned about)
    kept, g = int(saved.get("document_pad_multiple", 1)), get_document_pad_record(cfg)
    if kept == g:
        return []
    c = cfg.parallel.context_parallel_size
    allowed = [1] + [k for k in range(2, kept // 2 + 1) if kept % (2 * k) == 0]
    fix = f"pass --document-pad-multiple {kept}"
    if c not in allowed:
        fix += f" with a --context-parallel-size in {allowed} (2 x CP must divide it)"
    return [
        f"--document-pad-multiple: the checkpoint's packed documents were padded to a multiple of {kept}, this "
        f"run's to {g} (--context-parallel-size {c}); g decides the packs, so the samples after the resume would "
        f"differ from an uninterrupted run's: {fix}, or --finetune to start the data over"
    ]


def check_same_tokenizer(
    saved: dict[str, Any] | None, current: dict[str, Any], whose: str = "this run uses"
) -> list[str]:
    """A problem when a checkpoint's tokenizer identity (``tokenizer.identity()``: type, sha256 of
    its files, vocabulary) is not ``current`` (the resuming run's, or the one given to the
    converter: ``whose`` says which); none when the checkpoint records none (converted from HF)."""
    if saved is None or saved == current:
        return []
    return [f"--tokenizer-type/--tokenizer-model: the checkpoint was saved with tokenizer {saved}, {whose} {current}"]


# settings a checkpoint loads under whatever their value, but that change what the model computes
# or which samples come next: a resume that changes one says so (Megatron-LM is silent)
WARNED_SETTINGS = (
    "rotary_base",
    "rotary_percent",
    "use_rope_scaling",
    "rope_scaling_factor",
    "norm_epsilon",
    "seed",
    "seq_length",
    "hidden_dropout",
    "attention_dropout",
    "packed_sequences",
)


def describe_changed_settings(saved: dict[str, Any], cfg: JobConfig) -> str | None:
    """One warning line naming each WARNED_SETTINGS value that differs from the checkpoint's, or None."""
    args, current = saved.get("args", {}), cfg.to_flat_dict()
    changed = [
        f"--{n.replace('_', '-')} {args[n]!r} -> {current[n]!r}"
        for n in WARNED_SETTINGS
        if n in args and n in current and args[n] != current[n]
    ]
    if not changed:
        return None
    return (
        f"this run changes settings the checkpoint was trained with: {', '.join(changed)} (the weights "
        f"load; what the model computes or which samples come next differs from an uninterrupted run)"
    )


def effective_model_shape(args: dict[str, Any]) -> dict[str, Any]:
    """The MODEL_SHAPE_SETTINGS of flat config values with defaults resolved, so that a default and
    the same value given explicitly compare equal: the MLP width, and the key/value heads (GQA with
    as many groups as heads is plain multi-head attention)."""
    shape = {name: args.get(name) for name in MODEL_SHAPE_SETTINGS}
    if args.get("hidden_size") is not None:
        shape["ffn_hidden_size"] = resolve_ffn_hidden_size(
            args.get("ffn_hidden_size"), args["hidden_size"], bool(args.get("swiglu"))
        )
    heads = args.get("num_attention_heads")
    shape["num_query_groups"] = args.get("num_query_groups") if args.get("group_query_attention") else heads
    shape["group_query_attention"] = None  # its meaning is in num_query_groups
    if args.get("hidden_size") and heads:
        shape["kv_channels"] = args.get("kv_channels") or args["hidden_size"] // heads
    return shape


def saved_ffn_hidden_size(saved: dict[str, Any]) -> int | None:
    """The MLP width a checkpoint's model had: recorded since the --swiglu default became
    Megatron-LM's (2/3 of 4h rounded down to 64); before, a --swiglu run without --ffn-hidden-size
    got 2/3 of 4h rounded UP to 64, which the width of its older checkpoints is computed by."""
    if saved.get("ffn_hidden_size") is not None:
        return saved["ffn_hidden_size"]
    args = saved.get("args", {})
    if args.get("ffn_hidden_size") or not args.get("swiglu") or args.get("hidden_size") is None:
        return effective_model_shape(args)["ffn_hidden_size"]
    return int(64 * ((int(8 * args["hidden_size"] / 3) + 63) // 64))  # our default before 2026-11-23


# OptimizerParamScheduler state -> (the flags that set it, how to show a value, what it is)
_SCHEDULE_FLAGS = {
    "max_lr": ("--lr", None, "peak learning rate"),
    "min_lr": ("--min-lr", None, "minimum learning rate"),
    "lr_decay_style": ("--lr-decay-style", None, "decay style"),
    "lr_warmup_steps": ("--lr-warmup-iters/-samples/-fraction", "samples", "warm-up length"),
    "lr_decay_steps": ("--lr-decay-iters or --lr-decay-samples (default the run's length)", "samples", "decay length"),
    "start_wd": ("--weight-decay", None, "weight decay"),
    "end_wd": ("--weight-decay", None, "final weight decay"),
    "wd_incr_steps": (
        "the run's length (--train-iters x --global-batch-size, or --train-samples)",
        "samples",
        "weight-decay schedule length",
    ),
    "wd_incr_style": ("weight-decay schedule", None, "weight-decay schedule"),
    "wsd_decay_steps": ("--lr-wsd-decay-iters or --lr-wsd-decay-samples", "samples", "WSD decay phase"),
    "lr_wsd_decay_style": ("--lr-wsd-decay-style", None, "WSD decay style"),
}
_SCHEDULE_CHOICE = (
    "add --override-opt-param-scheduler to use this run's flags or "
    "--use-checkpoint-opt-param-scheduler to keep the checkpoint's"
)


def check_scheduler_flags(saved: dict[str, Any], scheduler, cfg: JobConfig, global_batch_size: int) -> list[str]:
    """Schedule values this run's flags give that differ from the checkpoint's, unless
    --override-opt-param-scheduler or --use-checkpoint-opt-param-scheduler says which wins
    (megatron-core would assert without naming a flag; silently keeping the checkpoint's schedule
    ran a longer --train-iters at learning rate 0). A changed run length (the usual resume with a
    larger --train-iters) is one line, though it moves two of the scheduler's values."""
    c, t = cfg.checkpoint, cfg.training
    if c.override_opt_param_scheduler or c.use_checkpoint_opt_param_scheduler:
        return []
    changed = [key for key in _SCHEDULE_FLAGS if key in saved and saved[key] != getattr(scheduler, key)]

    def show(key: str, v, iterations: bool) -> str:  # the checkpoint's in samples: its batch size may differ
        if _SCHEDULE_FLAGS[key][1] and isinstance(v, (int, float)) and not isinstance(v, bool):
            # a float: a --lr-warmup-fraction's warm-up, unrounded
            shown = f" ({v / global_batch_size:g} iterations)" if iterations and global_batch_size else ""
            return f"{v:g} samples{shown}"
        return repr(v)

    out = []
    decay_given = t.lr_decay_iters is not None or t.lr_decay_samples is not None
    if {"lr_decay_steps", "wd_incr_steps"} <= set(changed) and not decay_given:
        changed = [key for key in changed if key not in ("lr_decay_steps", "wd_incr_steps")]
        out.append(
            f"the run's length (--train-iters x --global-batch-size, or --train-samples): the checkpoint's "
            f"schedule runs over "
            f"{show('wd_incr_steps', saved['wd_incr_steps'], False)}, this run's over "
            f"{show('wd_incr_steps', scheduler.wd_incr_steps, True)} (the decay length follows the run's length "
            f"without --lr-decay-iters/-samples); add --override-opt-param-scheduler to stretch the schedule to "
            f"this run's length, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's (past its end the "
            f"learning rate stays at --min-lr)"
        )
    for key in changed:
        flag, _, label = _SCHEDULE_FLAGS[key]
        out.append(
            f"{flag}: the checkpoint's {label} is {show(key, saved[key], False)}, this run's flags give "
            f"{show(key, getattr(scheduler, key), True)}; {_SCHEDULE_CHOICE}"
        )
    return out


# Adam options of the optimizer's parameter groups -> (config field, flag, what it is)
_OPTIMIZER_FLAGS = {
    "beta1": ("adam_beta1", "--adam-beta1", "Adam beta1"),
    "beta2": ("adam_beta2", "--adam-beta2", "Adam beta2"),
    "eps": ("adam_eps", "--adam-eps", "Adam epsilon"),
}


# The embedding and output layer's parameter groups' own max_lr/min_lr (megatron-core's decoupled LR); a load
# restores the groups' saved values like --lr's, so a changed flag is named the same way
_DECOUPLED_LR_FLAGS = {
    "decoupled_lr": "learning rate of the embedding and output layer",
    "decoupled_min_lr": "minimum learning rate of the embedding and output layer",
}


def get_saved_adam_options(saved: dict[str, Any]) -> dict[str, set]:
    """{"beta1"/"beta2"/"eps": the values the checkpoint's parameter groups hold} (empty without Adam).
    These, not the saved flags, are what a load restores (torch keeps the saved groups' options), so a
    checkpoint that kept older values under --use-checkpoint-opt-param-scheduler is read right."""
    found: dict[str, set] = {}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "param_groups" and isinstance(value, list):
                    for group in value:
                        if isinstance(group, dict) and "betas" in group and "eps" in group:
                            for name, v in zip(("beta1", "beta2", "eps"), (*group["betas"], group["eps"])):
                                found.setdefault(name, set()).add(v)
                else:
                    visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(saved.get("optimizer"))
    return found


def describe_optimizer_flag_changes(saved: dict[str, Any], cfg: JobConfig) -> list[str]:
    """'--adam-beta1: the checkpoint's Adam beta1 is 0.9, this run's flags give 0.95' for each Adam
    option, and --decoupled-lr / --decoupled-min-lr, that this run's flags set differently from the
    checkpoint's optimizer (--lr and --min-lr are the scheduler's, compared by ``check_scheduler_flags``)."""
    out = []
    args = saved.get("args", {})
    for field, label in _DECOUPLED_LR_FLAGS.items():  # the embedding and output layer's own LR (--decoupled-lr)
        if field in args and args[field] != getattr(cfg.training, field):
            flag = "--" + field.replace("_", "-")
            out.append(
                f"{flag}: the checkpoint's {label} is {args[field]!r}, this run's flags give "
                f"{getattr(cfg.training, field)!r}"
            )
    if cfg.training.optimizer != "adam":
        return out
    for name, values in get_saved_adam_options(saved).items():
        field, flag, label = _OPTIMIZER_FLAGS[name]
        current = getattr(cfg.training, field)
        if values != {current}:
            shown = " and ".join(f"{v!r}" for v in sorted(values))
            out.append(f"{flag}: the checkpoint's {label} is {shown}, this run's flags give {current!r}")
    return out


def check_optimizer_flags(saved: dict[str, Any], cfg: JobConfig) -> list[str]:
    """Adam options this run's flags change, as ``check_scheduler_flags`` reports a changed schedule:
    an error unless --override-opt-param-scheduler (this run's flags win: ``apply_flag_settings``
    after the load) or --use-checkpoint-opt-param-scheduler (the checkpoint's win, as they always do
    in Megatron-LM) says which wins."""
    c = cfg.checkpoint
    if c.override_opt_param_scheduler or c.use_checkpoint_opt_param_scheduler:
        return []
    return [f"{change}; {_SCHEDULE_CHOICE}" for change in describe_optimizer_flag_changes(saved, cfg)]
