"""What a checkpoint holds, and saving/loading a training run through the directory protocol.

Invariant: a checkpoint restores a run exactly in its own layout and reshards to any other
TP x PP x VPP x DP. Content: every model chunk (``chunk.sharded_state_dict()`` per virtual stage;
megatron-core keys layers by their global number, so the layout is not part of the format), the
optimizer (the distributed optimizer in its ``fully_reshardable`` form), the LR scheduler,
``TrainState``, each rank's RNG states (CPU generator and megatron-core's model-parallel tracker),
the flat run config, the tokenizer identity and the padded vocabulary. The RNG states are per
rank and are restored only when the layout is unchanged; everything else reshards.

Writing follows ``directory.py`` (atomic publish); loading reads with megatron-core's stock reader,
checked as ``reader.py`` describes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from megatron_ext.checkpoint.directory import (
    FORMAT_VERSION, list_complete_checkpoints, resolve_load_path, write_checkpoint,
)
from megatron_ext.checkpoint.optimizer_state import (
    catch_megatron_state_corruption, init_empty_optimizer_state, load_optimizer_state,
)
from megatron_ext.config import ConfigError, JobConfig, precision_name
from megatron_ext.training.optimizer import get_scheduler_state, load_scheduler_state

# The distributed optimizer's form that can change TP/PP/DP on load (docs/megatron-core-on-cpu.md:
# the default 'fully_sharded_model_space' fails with "ShardedTensor.flattened_range is not supported").
SHARDED_STATE_DICT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}

# Settings that fix the shapes and meaning of the saved weights: (config field, flag).
MODEL_SHAPE_SETTINGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "normalization", "swiglu", "disable_bias_linear",
    "untie_embeddings_and_output_weights", "position_embedding_type", "add_qkv_bias",
)


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about the run besides its state (built by the entry point)."""

    tokenizer: dict[str, Any]  # tokenizer.identity()
    padded_vocab_size: int


def get_layout(run) -> dict[str, int]:
    ctx = run.ctx
    return {"world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size,
            "dp": ctx.dp_size, "vp": ctx.vp_size or 1}


def get_rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators: the CPU one, the CUDA one on GPUs, megatron-core's model-parallel
    tracker (CUDA generator states on GPUs, CPU generator states on the CPU platform)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    get_cuda_rng_tracker().set_states(state["tracker"])


def build_model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    """{"model<i>": sharded state dict of virtual stage i}. Keys inside are global (megatron-core
    offsets each chunk's layers), so the nesting does not tie the checkpoint to a VPP size."""
    return {
        f"model{i}": chunk.module.sharded_state_dict(prefix="", metadata=dict(SHARDED_STATE_DICT_METADATA))
        for i, chunk in enumerate(model)
    }


def build_sharded_state_dict(
    run, meta: CheckpointMeta, *, is_loading: bool, include_optimizer: bool, include_rng: bool
) -> dict[str, Any]:
    """The whole checkpoint as megatron-core's sharded state dict."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = build_model_sharded_state_dict(run.model)
    if include_optimizer:
        # parameters no step has reached yet (fp16 steps skipped by the loss scaler) get Adam's
        # first-step state, so a save writes, and a load expects, every parameter's state
        init_empty_optimizer_state(run.optimizer)
        # megatron-core finds each parameter's ShardedTensor anywhere in the nested dict
        state["optimizer"] = run.optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=dict(SHARDED_STATE_DICT_METADATA)
        )
        state["opt_param_scheduler"] = get_scheduler_state(run.scheduler)
    if include_rng:
        ctx = run.ctx
        state["rng_state"] = ShardedObject(
            "rng_state", get_rng_state(ctx.device), (ctx.world_size,), (ctx.rank,), replica_id=0
        )
    state["train_state"] = dataclasses.asdict(run.state)
    state["args"] = run.cfg.to_flat_dict()
    state["tokenizer"] = dict(meta.tokenizer)
    state["padded_vocab_size"] = meta.padded_vocab_size
    state["ffn_hidden_size"] = effective_model_shape(state["args"])["ffn_hidden_size"]  # the width built
    state["layout"] = get_layout(run)
    state["device_type"] = run.ctx.device.type
    state["checkpoint_version"] = FORMAT_VERSION
    return state


def build_save_state(run, meta: CheckpointMeta | None = None) -> dict[str, Any]:
    """The sharded state dict of a save, warning where megatron-core would write part of it wrong."""
    with catch_megatron_state_corruption() as corrupted:
        state = build_sharded_state_dict(
            run, meta or run.checkpoint_meta, is_loading=False, include_optimizer=True, include_rng=True
        )
    for message in sorted(set(corrupted)):
        # megatron-core 0.16.1 (its issue #504): part of this parameter's optimizer state is
        # written as zeros; say so on every rank where it happens instead of a buried log line
        run.log(f"WARNING rank {run.ctx.rank}: the saved optimizer state is incomplete, a resume "
                f"will not be exact: {message}")
    return state


def start_async_checkpoint(run, root: str, keep_last: int | None = None) -> None:
    """``--async-save``: snapshot the run at its current iteration and write it in the background
    (``async_save.py``); collective over the world. It is published at a later step boundary."""
    held = run.async_saver.start(build_save_state(run), root, run.state.iteration, keep_last)
    if run.ctx.is_logging_rank:
        copied = run.async_saver.snapshot.bytes
        copied = f", {copied / 2**20:.1f} MiB copied to host memory on this rank" if copied else ""
        run.log(f"started asynchronous save of iteration {run.state.iteration:8d} to {root} "
                f"(training held {held:.2f} s{copied})")


def save_checkpoint(run, root: str, keep_last: int | None = None, meta: CheckpointMeta | None = None) -> str:
    """Save the run at its current iteration under ``root``; collective over the world.
    Returns the published directory."""
    start = time.perf_counter()
    state = build_save_state(run, meta)
    final_dir = write_checkpoint(state, root, run.state.iteration, keep_last)
    if run.ctx.is_logging_rank:
        run.log(f"saved checkpoint at iteration {run.state.iteration:8d} to {final_dir} "
                f"in {time.perf_counter() - start:.2f} s")
    return final_dir


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
            if (name == "ffn_hidden_size" and args[name] is None and current[name] is None
                    and any(args.get(n) != current[n] for n in ("hidden_size", "swiglu"))):
                continue  # both defaults: the --hidden-size or --swiglu difference is the one named
            flag = ("--group-query-attention/--num-query-groups (key/value heads)" if name == "num_query_groups"
                    else f"--{name.replace('_', '-')}")
            problems.append(
                f"{flag}: the checkpoint was saved with {saved_shape[name]!r}, this run "
                f"has {shape[name]!r}; use the checkpoint's value or another --load directory"
            )
    if load_optimizer and "use_distributed_optimizer" in args and (
        args["use_distributed_optimizer"] != current["use_distributed_optimizer"]
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
    saved_tok = saved.get("tokenizer")
    if saved_tok is not None and saved_tok != meta.tokenizer:
        problems.append(
            f"--tokenizer-type/--tokenizer-model: the checkpoint was saved with tokenizer {saved_tok}, "
            f"this run uses {meta.tokenizer}"
        )
    return problems


# settings a checkpoint loads under whatever their value, but that change what the model computes
# or which samples come next: a resume that changes one says so (Megatron-LM is silent)
WARNED_SETTINGS = ("rotary_base", "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "norm_epsilon",
                   "seed", "seq_length", "hidden_dropout", "attention_dropout", "packed_sequences")


def describe_changed_settings(saved: dict[str, Any], cfg: JobConfig) -> str | None:
    """One warning line naming each WARNED_SETTINGS value that differs from the checkpoint's, or None."""
    args, current = saved.get("args", {}), cfg.to_flat_dict()
    changed = [f"--{n.replace('_', '-')} {args[n]!r} -> {current[n]!r}" for n in WARNED_SETTINGS
               if n in args and n in current and args[n] != current[n]]
    if not changed:
        return None
    return (f"this run changes settings the checkpoint was trained with: {', '.join(changed)} (the weights "
            f"load; what the model computes or which samples come next differs from an uninterrupted run)")


def effective_model_shape(args: dict[str, Any]) -> dict[str, Any]:
    """The MODEL_SHAPE_SETTINGS of flat config values with defaults resolved, so that a default and
    the same value given explicitly compare equal: the MLP width, and the key/value heads (GQA with
    as many groups as heads is plain multi-head attention)."""
    from megatron_ext.model.gpt import resolve_ffn_hidden_size

    shape = {name: args.get(name) for name in MODEL_SHAPE_SETTINGS}
    if args.get("hidden_size") is not None:
        shape["ffn_hidden_size"] = resolve_ffn_hidden_size(args.get("ffn_hidden_size"), args["hidden_size"],
                                                           bool(args.get("swiglu")))
    heads = args.get("num_attention_heads")
    shape["num_query_groups"] = args.get("num_query_groups") if args.get("group_query_attention") else heads
    shape["group_query_attention"] = None  # its meaning is in num_query_groups
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
    "max_lr": ("--lr", None, "peak learning rate"), "min_lr": ("--min-lr", None, "minimum learning rate"),
    "lr_decay_style": ("--lr-decay-style", None, "decay style"),
    "lr_warmup_steps": ("--lr-warmup-iters/-samples/-fraction", "samples", "warm-up length"),
    "lr_decay_steps": ("--lr-decay-iters or --lr-decay-samples (default the run's length)", "samples", "decay length"),
    "start_wd": ("--weight-decay", None, "weight decay"), "end_wd": ("--weight-decay", None, "final weight decay"),
    "wd_incr_steps": ("the run's length (--train-iters x --global-batch-size, or --train-samples)", "samples",
                      "weight-decay schedule length"),
    "wd_incr_style": ("weight-decay schedule", None, "weight-decay schedule"),
    "wsd_decay_steps": ("--lr-wsd-decay-iters or --lr-wsd-decay-samples", "samples", "WSD decay phase"),
    "lr_wsd_decay_style": ("--lr-wsd-decay-style", None, "WSD decay style"),
}
_SCHEDULE_CHOICE = ("add --override-opt-param-scheduler to use this run's flags or "
                    "--use-checkpoint-opt-param-scheduler to keep the checkpoint's")


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
            return f"{v:g} samples" + (f" ({v / global_batch_size:g} iterations)" if iterations and global_batch_size else "")
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
            f"learning rate stays at --min-lr)")
    for key in changed:
        flag, _, label = _SCHEDULE_FLAGS[key]
        out.append(f"{flag}: the checkpoint's {label} is {show(key, saved[key], False)}, this run's flags give "
                   f"{show(key, getattr(scheduler, key), True)}; {_SCHEDULE_CHOICE}")
    return out


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What a run loads at start-up (``plan_load``)."""

    path: str
    step: int | None = None  # --ckpt-step
    weights_only: bool = False  # --finetune / --pretrained-checkpoint: iteration, optimizer, schedule reset
    load_rng: bool = True


def plan_load(cfg: JobConfig) -> tuple[LoadPlan | None, str | None]:
    """Before any work: what the run loads, and a line to print. --load's checkpoint (newest, or
    --ckpt-step's) resumes (weights only with --finetune); a --load holding none falls back to
    --pretrained-checkpoint (weights only), or starts from scratch when it is also --save (the
    restartable-job idiom); anything else is a ConfigError naming the flag, since it would silently
    start from scratch."""
    c = cfg.checkpoint
    if c.ckpt_step is not None and not c.load:
        raise ConfigError(["--ckpt-step needs --load DIR (the directory whose iteration it names)"])
    if c.load:
        found, _ = resolve_load_path(c.load, c.ckpt_step)
        if found is not None:
            return LoadPlan(c.load, c.ckpt_step, c.finetune, not (c.no_load_rng or c.finetune)), None
        if c.ckpt_step is not None:
            have = [it for it, _ in list_complete_checkpoints(c.load)]
            raise ConfigError([f"--ckpt-step {c.ckpt_step}: {c.load} holds no complete checkpoint of that iteration "
                               f"(complete ones: {have or 'none'})"])
    if c.pretrained_checkpoint:
        if resolve_load_path(c.pretrained_checkpoint)[0] is None:
            raise ConfigError([f"--pretrained-checkpoint {c.pretrained_checkpoint} holds no complete checkpoint"])
        where = f"--load {c.load} holds no checkpoint yet: " if c.load else ""
        return (LoadPlan(c.pretrained_checkpoint, weights_only=True, load_rng=False),
                f"> {where}fine-tuning from --pretrained-checkpoint {c.pretrained_checkpoint} (weights only)")
    if not c.load:
        held = list_complete_checkpoints(c.save) if c.save else []
        if held:  # e.g. the README's default job run twice: its config saves but does not --load
            return None, (f"WARNING: --save {c.save} already holds checkpoints (newest: iteration {held[-1][0]}) "
                          f"and no --load is given: this run starts from scratch and saves beside them; add "
                          f"--load {c.save} to resume, or give another --save")
        return None, None
    restartable = c.save and os.path.abspath(c.save) == os.path.abspath(c.load)
    if restartable and not c.exit_on_missing_checkpoint:
        return None, f"> --load {c.load} holds no checkpoint yet: starting from scratch (it is also --save)"
    what = "does not exist" if not os.path.exists(c.load) else "holds no complete checkpoint"
    why = " (--exit-on-missing-checkpoint)" if restartable else ""
    raise ConfigError([f"--load {c.load} {what}{why}: give a directory that --save wrote (or one of its "
                       f"iter_XXXXXXX directories), or drop --load to start from scratch"])


def check_load_flags(cfg: JobConfig) -> str | None:
    """``plan_load``'s line to print (a check without the plan)."""
    return plan_load(cfg)[1]


def load_full_tensors(ckpt_dir: str, prefix: str = "", exclude: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """{checkpoint key: full unsharded tensor} for every tensor whose key starts with ``prefix``
    and with none of ``exclude``, read in this process without a process group (for tools and
    tests). Layer-stacked keys (``decoder.layers.*``) have the global layer index as dimension 0.
    Everything read is checked as ``--ckpt-verify`` checks a load (``reader.open_checkpoint``, then
    every item against the marker); a damaged or unsafe file raises ``reader``'s named error."""
    from torch.distributed import checkpoint as dcp

    from megatron_ext.checkpoint.reader import VerifyingFileSystemReader, find_named_failure, open_checkpoint

    checksums, _ = open_checkpoint(ckpt_dir)  # every item checked, as --ckpt-verify does
    reader = VerifyingFileSystemReader(ckpt_dir, *((checksums["items"], checksums["algorithm"]) if checksums else ()))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and not key.startswith(exclude) and hasattr(md, "size")
    }
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except BaseException as err:  # torch's CheckpointException (a BaseException) wraps the reader's
        found = find_named_failure(err)
        if found is None:
            raise
        raise found from None
    return state


class CheckpointDamaged(Exception):
    """A checkpoint's bytes differ from what was written, or a file of it cannot be read."""


def load_checkpoint(
    run, root: str, meta: CheckpointMeta | None = None, load_optimizer: bool = True,
    *, step: int | None = None, weights_only: bool = False, load_rng: bool = True,
) -> int | None:
    """Restore ``run`` from the newest complete checkpoint under ``root`` (or from ``root`` itself when
    it is one checkpoint's ``iter_XXXXXXX`` directory); collective.

    Returns the loaded iteration, or None when ``root`` holds no complete checkpoint (a fresh
    start). Raises ConfigError, before anything is written, when the model or tokenizer differ, or
    the LR schedule flags differ with no flag saying which wins; and when the checkpoint is damaged
    (a checksum mismatch or an unreadable file, named), unless --ckpt-fallback-on-corruption asks to
    load the previous complete checkpoint instead; a file holding what a checkpoint never holds is a
    ConfigError saying it may have been tampered with (no fallback). ``meta`` defaults to the run's
    own. ``step`` loads that iteration; ``weights_only`` (fine-tuning) restores the
    model and nothing else (iteration 0, fresh optimizer and schedule); ``load_rng=False`` keeps the
    run's own random-number states.
    """
    meta = meta or run.checkpoint_meta
    found, warning = resolve_load_path(root, step)
    if found is None:
        return None
    if warning and run.ctx.is_logging_rank:
        run.log(f"WARNING: {warning}")
    candidates = [found]
    if run.cfg.checkpoint.ckpt_fallback_on_corruption:
        candidates += [c for c in reversed(list_complete_checkpoints(os.path.dirname(found[1]))) if c[0] < found[0]]
    for i, (iteration, ckpt_dir) in enumerate(candidates):
        try:
            return _load_from(run, root, iteration, ckpt_dir, meta, load_optimizer and not weights_only,
                              weights_only, load_rng and not weights_only)
        except CheckpointDamaged as err:
            if i + 1 == len(candidates):
                hint = ("" if run.cfg.checkpoint.ckpt_fallback_on_corruption else
                        "; --ckpt-fallback-on-corruption loads the previous complete checkpoint instead")
                raise ConfigError([f"--load {root}: {err}{hint}"]) from None
            if run.ctx.is_logging_rank:
                run.log(f"WARNING: {err}; --ckpt-fallback-on-corruption: trying {candidates[i + 1][1]}")
    return None


def _load_from(run, root: str, iteration: int, ckpt_dir: str, meta: CheckpointMeta, load_optimizer: bool,
               weights_only: bool = False, load_rng: bool = True) -> int:
    from megatron.core import dist_checkpointing

    checksums, common = _read_coordinator_files(run, root, ckpt_dir)
    # weights only, e.g. converted by tools/convert_checkpoint.py: no optimizer state whose form
    # (distributed optimizer, precision) must match this run's
    holds_no_optimizer = load_optimizer and "opt_param_scheduler" not in common
    if holds_no_optimizer:
        load_optimizer = False
    problems = check_compatible(common, run.cfg, meta, load_optimizer)
    if load_optimizer:
        problems += check_scheduler_flags(common["opt_param_scheduler"], run.scheduler, run.cfg, run.global_batch_size)
    if problems:
        raise ConfigError([f"--load {root} ({os.path.basename(ckpt_dir)}): {p}" for p in problems])
    changed = None if weights_only else describe_changed_settings(common, run.cfg)
    if changed and run.ctx.is_logging_rank:
        run.log(f"WARNING: {changed}")
    if holds_no_optimizer and run.ctx.is_logging_rank:
        run.log(f"{ckpt_dir} holds no optimizer state: starting with a fresh optimizer")
    same_layout = common.get("layout") == get_layout(run)
    saved_device = common.get("device_type", "cpu")
    restore_rng = load_rng and same_layout and saved_device == run.ctx.device.type
    if load_rng and same_layout and not restore_rng and run.ctx.is_logging_rank:
        run.log(f"WARNING: {ckpt_dir} holds random-number states of {saved_device} generators; this run "
                f"is on {run.ctx.device.type}: weights and optimizer load exactly, dropout and other "
                f"random streams start afresh from --seed {run.cfg.training.seed}")
    state = build_sharded_state_dict(
        run, meta, is_loading=True, include_optimizer=load_optimizer, include_rng=restore_rng
    )
    strategy = build_load_strategy(checksums if run.cfg.checkpoint.ckpt_verify else None)
    try:
        loaded = dist_checkpointing.load(state, ckpt_dir, sharded_strategy=strategy)
    except BaseException as err:  # torch's CheckpointException is a BaseException, raised on every rank
        _raise_named_load_error(err, root)
        raise
    if load_optimizer:
        load_optimizer_state(run.optimizer, loaded["optimizer"])
        load_scheduler_state(run.scheduler, loaded["opt_param_scheduler"])
    for i, chunk in enumerate(run.model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if not load_optimizer:
        # the optimizer's fp32 main parameters (--bf16/--fp16) were copied from the initial weights
        # when it was built: without this, its first step writes them back over the loaded weights
        # (Megatron-LM's load_checkpoint calls it for the same reason)
        run.optimizer.reload_model_params()
    if restore_rng:
        set_rng_state(loaded["rng_state"], run.ctx.device)
    if not weights_only:
        run.state = type(run.state)(**loaded.get("train_state", {}))
    if run.ctx.is_logging_rank:
        run.log(_describe_load(run, ckpt_dir, iteration, common, same_layout, weights_only, load_optimizer,
                               checksums, strategy))
    return iteration


def _read_coordinator_files(run, root: str, ckpt_dir: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The marker's checksums to verify (None: none usable) and ``common.pt``, each checked first
    (``reader.open_checkpoint``); CheckpointDamaged names the file that is not what the save wrote."""
    from megatron_ext.checkpoint.reader import ChecksumMismatch, UnsafeCheckpointFile, open_checkpoint

    def warn(message: str) -> None:
        if run.ctx.is_logging_rank:
            run.log(f"WARNING: {message}")

    try:
        return open_checkpoint(ckpt_dir, warn)
    except ChecksumMismatch as err:
        raise CheckpointDamaged(str(err)) from None
    except UnsafeCheckpointFile as err:
        raise ConfigError([f"--load {root}: {err}"]) from None


def _raise_named_load_error(err: BaseException, root: str) -> None:
    """One named error for what the reader found on any rank (torch's CheckpointException carries
    every failing rank's exception): damage (CheckpointDamaged, which the fallback acts on); a file
    holding what a checkpoint never holds, or an item torch cannot read (ConfigError). Returns for
    anything else."""
    from megatron_ext.checkpoint.reader import ChecksumMismatch, find_named_failure

    found = find_named_failure(err)
    if isinstance(found, ChecksumMismatch):
        raise CheckpointDamaged(str(found)) from None
    if found is not None:
        raise ConfigError([f"--load {root}: {found}"]) from None


def _describe_load(run, ckpt_dir: str, iteration: int, common: dict[str, Any], same_layout: bool,
                   weights_only: bool, load_optimizer: bool, checksums: dict[str, Any] | None, strategy: Any) -> str:
    """The "loaded checkpoint" line: layout, what was loaded, what was verified."""
    saved_layout = common.get("layout")
    how = ("same layout" if same_layout else f"resharded from {saved_layout}" if saved_layout
           else "written by tools/convert_checkpoint.py, laid out for this run")
    if weights_only:
        how += "; weights only: iteration, optimizer and LR schedule start afresh"
    elif not load_optimizer and "opt_param_scheduler" in common:
        how += "; optimizer and LR schedule not loaded (--no-load-optim): they start afresh"
    stats = strategy.stats
    if not run.cfg.checkpoint.ckpt_verify:
        checked = "; items not verified (--ckpt-verify is off)"
    elif checksums is None:
        checked = "; items not verified (--ckpt-verify: the checkpoint records no checksums this machine can check)"
    else:
        missing = f", {stats.unverified} with no recorded checksum" if stats.unverified else ""
        checked = (f"; checksums verified for {stats.verified} items on this rank ({stats.byte_items} of them "
                   f"byte items{missing})")
    return f"loaded checkpoint {ckpt_dir} at iteration {iteration} ({how}{checked})"


def build_load_strategy(checksums: dict[str, Any] | None = None):
    """megatron-core's ``torch_dist`` load strategy reading through ``reader.VerifyingFileSystemReader``:
    shard sizes always checked, every stored item the load touches hashed and compared with the
    marker's ``checksums`` record when given (``--ckpt-verify``)."""
    from megatron_ext.checkpoint.reader import VerifyingTorchDistLoadStrategy

    if checksums is None:
        return VerifyingTorchDistLoadStrategy()
    return VerifyingTorchDistLoadStrategy(checksums["items"], checksums["algorithm"])
