"""Loading one of Megatron-LM's checkpoints (``megatron_lm.py`` chose it) into a run's parts; collective.

Invariant: what loads means what it meant in Megatron-LM. The weights load at any TP x PP x VPP x DP
(megatron-core keys them by global name) into a model built with the checkpoint's padded vocabulary
(``LoadPlan.padded_vocab``). The optimizer state loads in the form its content metadata records
(``distrib_optim_sharding_type``): ``fully_reshardable`` and the non-distributed optimizer's at any
layout; ``dp_reshardable`` (Megatron-LM's default: flat per-bucket buffers) only at the same TP x PP x
VPP and DDP bucket sizes, DP free, read with megatron-core's own bucket sizes
(``optimizer_state.megatron_bucket_sizes``), never the offset fix's; any other form is refused by name.
The position is Megatron-LM's: ``iteration`` from ``common.pt``, consumed samples from its args. The
random-number states load under Megatron-LM's rules (same TP and PP, not --finetune, not a release
checkpoint, not --no-load-rng) and only on CUDA (they are CUDA generator states); the load line says
what was not taken and why. Everything is checked before anything is read; a refusal changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.checkpoint.compatibility import (
    check_compatible,
    check_optimizer_flags,
    check_scheduler_flags,
    describe_changed_settings,
)
from megatron_ext.checkpoint.megatron_lm import (
    UNVERIFIED,
    MegatronLMCheckpoint,
    Selection,
    check_format,
    get_common_safe_globals,
    get_rng_safe_globals,
    read_megatron_lm_common,
    read_sharded_object,
)
from megatron_ext.checkpoint.megatron_lm_args import describe_tokenizer_difference, map_megatron_lm_args
from megatron_ext.checkpoint.optimizer_state import (
    get_megatron_bucket_sizes,
    init_empty_optimizer_state,
    load_optimizer_state,
    megatron_bucket_sizes,
)
from megatron_ext.checkpoint.parts import CheckpointParts
from megatron_ext.checkpoint.reader import (
    ChecksumMismatch,
    UnsafeCheckpointFile,
    VerifyingTorchDistLoadStrategy,
    find_named_failure,
)
from megatron_ext.checkpoint.unpickler import allowing
from megatron_ext.config import ConfigError
from megatron_ext.optim import apply_flag_settings, load_scheduler_state
from megatron_ext.parallel import ParallelContext

Log = Callable[[str], None]
READ_ANYWHERE = ("fully_reshardable", None)  # None: the non-distributed optimizer's per-parameter state
SAME_LAYOUT_ONLY = "dp_reshardable"
RE_SAVE = (
    "--no-load-optim loads the weights with a fresh optimizer (the iteration and consumed samples kept), or "
    "re-save it with Megatron-LM (any layout) adding --dist-ckpt-optim-fully-reshardable"
)


@dataclasses.dataclass(frozen=True)
class ForeignLoad:
    """What ``check_megatron_lm_load`` decided a load takes of one checkpoint."""

    checkpoint: MegatronLMCheckpoint
    common: dict[str, Any]
    sharding: str | None  # distrib_optim_sharding_type; None: Megatron-LM's non-distributed optimizer
    load_optimizer: bool
    weights_only: bool
    restore_rng: bool
    notes: tuple[str, ...]  # what the load line adds: optimizer, RNG, tokenizer, data stream

    @property
    def args(self) -> Any:
        return self.common["args"]


def get_saved_layout(args: Any) -> tuple[int, int, int]:
    """(TP, PP, VPP) the checkpoint was saved at."""
    return (
        int(args.tensor_model_parallel_size),
        int(args.pipeline_model_parallel_size),
        int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
    )


def check_optimizer_form(common: dict[str, Any], ctx: ParallelContext) -> list[str]:
    """The optimizer state's form (content metadata's ``distrib_optim_sharding_type``) against this
    run's layout: a problem naming the form, the layouts and the fix where it cannot load."""
    args = common["args"]
    if not args.use_distributed_optimizer:
        return []
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if sharding in READ_ANYWHERE:
        return []
    if sharding != SAME_LAYOUT_ONLY:
        return [f"optimizer: its distributed optimizer state is {sharding!r}, which is not read here; {RE_SAVE}"]
    saved, ours = get_saved_layout(args), (ctx.tp_size, ctx.pp_size, ctx.vp_size or 1)
    if saved == ours:
        return []
    show = "TP x PP x VPP = {} x {} x {}".format
    return [
        f"optimizer: its distributed optimizer state is dp_reshardable (Megatron-LM's default: flat buffers of its "
        f"DDP buckets), saved at {show(*saved)}; this run is {show(*ours)}: that form loads only at the layout it "
        f"was saved at (the data-parallel size may change); {RE_SAVE}"
    ]


def decide_rng(common: dict[str, Any], ctx: ParallelContext, ckpt: MegatronLMCheckpoint, wanted: bool) -> str | None:
    """None when the checkpoint's random-number states load, else why not (Megatron-LM's rules: the
    same TP and PP, not --finetune, not a release checkpoint, not --no-load-rng; and CUDA, whose
    generators they are). ``wanted``: neither --no-load-rng nor --finetune."""
    args = common["args"]
    saved = get_saved_layout(args)[:2]
    if ckpt.release:
        return "a release checkpoint holds none"
    if not wanted:
        return "--no-load-rng / --finetune"
    if getattr(args, "no_save_rng", False):
        return "it was saved with --no-save-rng"
    if saved != (ctx.tp_size, ctx.pp_size):
        return f"saved at TP x PP = {saved[0]} x {saved[1]}, this run is {ctx.tp_size} x {ctx.pp_size}"
    if ctx.device.type != "cuda":
        return f"they are CUDA generator states and this run is on {ctx.device.type}"
    return None


def _data_names(data_path: list[str] | None) -> list[str]:
    """--data-path's weights and prefixes by file name: a corpus moved to another directory (another
    cluster, another checkout) is the same corpus; its files' contents are not compared."""
    return [os.path.basename(str(entry)) for entry in data_path or []]


def describe_stream_difference(args: Any, cfg) -> str:
    """One line: whether this run's samples after the resume are the ones megatron-core's GPTDataset
    gives Megatron-LM at the checkpoint's consumed samples (with these data flags), or which of our
    flags make them differ."""
    d = cfg.data
    ours = [
        flag
        for flag, on in (("--packed-sequences", d.packed_sequences), ("--one-document-per-row", d.one_document_per_row))
        if on
    ]
    changed = [
        f"{flag} {getattr(args, name)!r} -> {value!r}"
        for flag, name, value in (
            ("--data-path", "data_path", list(d.data_path)),
            ("--split", "split", d.split),
            ("--seq-length", "seq_length", cfg.model.seq_length),
            ("--seed", "seed", cfg.training.seed),
        )
        if hasattr(args, name)
        and (
            _data_names(getattr(args, name)) != _data_names(value)
            if name == "data_path"
            else getattr(args, name) != value
        )
    ]
    start = f"samples from {args.consumed_train_samples} on"
    if ours or changed:
        return f"{start} differ from Megatron-LM's stream: {', '.join(ours + changed)}"
    return f"{start} as megatron-core's GPTDataset gives Megatron-LM with these data flags"


def _check_optimizer(common: dict[str, Any], values: dict, parts: CheckpointParts, ctx: ParallelContext) -> list[str]:
    """The scheduler and Adam flags against the checkpoint's (as for our own checkpoints), and the
    optimizer state's form against this layout."""
    args, cfg = common["args"], parts.cfg
    problems = check_scheduler_flags(common["opt_param_scheduler"], parts.scheduler, cfg, parts.global_batch_size)
    # its Adam options as our checkpoints' parameter groups record them (its groups are in byte items)
    groups = [{"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_eps}] if args.optimizer == "adam" else []
    problems += check_optimizer_flags({"args": values, "optimizer": {"param_groups": groups}}, cfg)
    return problems + check_optimizer_form(common, ctx)


def check_megatron_lm_load(
    parts: CheckpointParts,
    ctx: ParallelContext,
    ckpt: MegatronLMCheckpoint,
    common: dict[str, Any],
    load_optimizer: bool,
    weights_only: bool,
    load_rng: bool,
) -> ForeignLoad:
    """Every reason the checkpoint cannot load into the parts, as one ConfigError (the same on every
    rank: pure in the checkpoint, the flags and the layout), else what the load takes."""
    problems = check_format(ckpt.path, common)
    if problems:
        raise ConfigError(problems)
    args, cfg = common["args"], parts.cfg
    weights_only = weights_only or ckpt.release  # Megatron-LM: a release checkpoint loads as --finetune
    has_optimizer = "opt_param_scheduler" in common and not getattr(args, "no_save_optim", False)
    load_optimizer = load_optimizer and not weights_only and has_optimizer
    values, problems = map_megatron_lm_args(args)
    saved = {"args": values, "padded_vocab_size": args.padded_vocab_size, "tokenizer": None}
    problems += check_compatible(saved, cfg, parts.meta, load_optimizer)
    if values.get("position_embedding_type") == "learned_absolute":
        ours = cfg.model.max_position_embeddings or cfg.model.seq_length
        if values.get("max_position_embeddings") != ours:
            problems.append(
                f"--max-position-embeddings: the checkpoint's learned position embedding has "
                f"{values.get('max_position_embeddings')} rows, this run's {ours}: give the checkpoint's"
            )
    tokenizer_problem, tokenizer_note = describe_tokenizer_difference(args, parts.meta.tokenizer)
    problems += [tokenizer_problem] if tokenizer_problem else []
    if load_optimizer:
        problems += _check_optimizer(common, values, parts, ctx)
    if problems:
        raise ConfigError([f"--load {ckpt.path} (Megatron-LM's): {p}" for p in problems])
    no_rng = decide_rng(common, ctx, ckpt, load_rng and not weights_only)
    notes = [f"random-number states not taken: {no_rng}" if no_rng else "random-number states taken"]
    if not weights_only:
        notes.append(describe_stream_difference(args, cfg))
        changed = describe_changed_settings(saved, cfg)
        notes += [changed] if changed else []
    if not has_optimizer and not weights_only:
        notes.append("it holds no optimizer state (--no-save-optim): a fresh optimizer")
    notes += [tokenizer_note] if tokenizer_note else []
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    return ForeignLoad(
        ckpt,
        common,
        sharding if args.use_distributed_optimizer else None,
        load_optimizer,
        weights_only,
        no_rng is None,
        tuple(notes),
    )


def check_bucket_layout(parts: CheckpointParts, plan: ForeignLoad) -> None:
    """A ``dp_reshardable`` state loads only into the DDP buckets it was saved from: every rank's
    (data-parallel group, megatron-core's bucket sizes) against the checkpoint's record, gathered so
    that every rank reaches the same verdict (one all_gather_object)."""
    mine = [
        (opt.data_parallel_group_idx, get_megatron_bucket_sizes(opt))
        for opt in getattr(parts.optimizer, "chained_optimizers", [parts.optimizer])
        if hasattr(opt, "per_bucket_numel_unpadded")
    ]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    ours = dict(pair for per_rank in gathered for pair in per_rank)
    differ = []
    for idx, sizes in sorted(ours.items()):
        key = f"optimizer.distributed.dp_group_idx_{idx}.per_bucket_numel_unpadded/shard_0_1"
        try:
            saved = read_sharded_object(plan.checkpoint.path, key)
        except KeyError:
            saved = None
        if saved != sizes:
            differ.append(f"model-parallel rank {idx}: saved {saved}, this run {sizes}")
    if differ:
        raise ConfigError(
            [
                f"--load {plan.checkpoint.path} (Megatron-LM's): optimizer: its dp_reshardable state is stored per "
                f"DDP bucket, and this run's buckets differ ({'; '.join(differ[:2])}): give Megatron-LM's "
                f"--ddp-bucket-size / --overlap-grad-reduce settings; {RE_SAVE}"
            ]
        )


def build_state(parts: CheckpointParts, ctx: ParallelContext, plan: ForeignLoad) -> dict[str, Any]:
    """The sharded state dict to read: the model, the optimizer in the checkpoint's form, the RNG
    ShardedObject as Megatron-LM saves it (one per (PP, TP) rank, replicated over DP)."""
    from megatron.core.dist_checkpointing import ShardedObject

    metadata = dict(plan.common["content_metadata"])
    state = {
        f"model{i}": chunk.module.sharded_state_dict(prefix="", metadata=dict(metadata))
        for i, chunk in enumerate(parts.model)
    }
    if plan.load_optimizer:
        init_empty_optimizer_state(parts.optimizer)
        state["optimizer"] = parts.optimizer.sharded_state_dict(dict(state), is_loading=True, metadata=dict(metadata))
        drop_absent_grad_scaler(state["optimizer"], plan.checkpoint.path)
    if plan.restore_rng:
        shape, offset = (ctx.pp_size, ctx.tp_size), (ctx.pp_rank, ctx.tp_rank)
        state["rng_state"] = ShardedObject("rng_state", None, shape, offset, replica_id=ctx.dp_rank)
    return state


def drop_absent_grad_scaler(optimizer_state: Any, ckpt_dir: str) -> None:
    """Our fp32 runs keep a constant loss scaler of 1 (its found-inf check guards the step:
    ``training.optimizer.get_loss_scale``); Megatron-LM's fp32 runs have none, so its dp_reshardable
    state stores no ``grad_scaler`` object. Not requested then: ours keeps its scale of 1."""
    from megatron.core.dist_checkpointing import ShardedObject
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    nodes = [optimizer_state]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            scaler = node.get("grad_scaler")
            if isinstance(scaler, ShardedObject) and scaler.unique_key not in stored:
                del node["grad_scaler"]
            nodes.extend(node.values())
        elif isinstance(node, (list, tuple)):
            nodes.extend(node)


def set_megatron_lm_rng_state(states: list[dict[str, Any]], dp_rank: int, data_parallel_random_init: bool) -> None:
    """Megatron-LM's random-number states of this rank (its load_checkpoint's order): Python's,
    NumPy's, torch's CPU and CUDA generators, megatron-core's tracker."""
    from megatron.core import tensor_parallel

    state = states[dp_rank] if data_parallel_random_init else states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    graph_safe = tensor_parallel.is_graph_safe_cuda_rng_tracker(tracker)
    converted = {
        k: tensor_parallel.convert_cuda_rng_state(v, to_graphable=graph_safe)
        for k, v in state["rng_tracker_states"].items()
    }
    tracker.set_states(converted)


def restore_parts(parts: CheckpointParts, ctx: ParallelContext, plan: ForeignLoad, loaded: dict[str, Any]) -> None:
    """Put what was read into the parts, in place; the train state from Megatron-LM's position."""
    if plan.load_optimizer:
        # megatron-core 0.16.1's dp_reshardable load copies into the fp32 main parameters, which
        # without --bf16/--fp16 are views of the model's (grad-requiring) parameters, outside no_grad:
        # torch refuses the in-place copy ("a view of a leaf Variable that requires grad")
        with torch.no_grad():
            load_optimizer_state(parts.optimizer, loaded["optimizer"])
        if parts.cfg.checkpoint.override_opt_param_scheduler:
            apply_flag_settings(parts.optimizer, parts.optimizer_flags)
        load_scheduler_state(parts.scheduler, plan.common["opt_param_scheduler"])
    for i, chunk in enumerate(parts.model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if not plan.load_optimizer:
        parts.optimizer.reload_model_params()  # the fp32 main parameters from the loaded weights
    if plan.restore_rng:
        set_megatron_lm_rng_state(loaded["rng_state"], ctx.dp_rank, bool(plan.args.data_parallel_random_init))
    if not plan.weights_only:
        parts.train_state.restore(
            {"iteration": int(plan.common["iteration"]), "consumed_samples": int(plan.args.consumed_train_samples)}
        )


def describe_load(plan: ForeignLoad, ctx: ParallelContext, cfg) -> str:
    """The "loaded Megatron-LM checkpoint" line."""
    args, ckpt = plan.args, plan.checkpoint
    tp, pp, vp = get_saved_layout(args)
    saved = f"saved at TP {tp} x PP {pp}{f' x VPP {vp}' if vp > 1 else ''} x DP {args.data_parallel_size}"
    if plan.weights_only:
        what = f"weights only ({'a release checkpoint' if ckpt.release else '--finetune'}): iteration, optimizer and LR schedule start afresh"
    else:
        skipped = getattr(args, "skipped_train_samples", 0)
        position = f"consumed samples {args.consumed_train_samples}{f' ({skipped} of them skipped)' if skipped else ''}"
        form = plan.sharding or "non-distributed"
        optimizer = (
            f"optimizer ({form}) and LR schedule loaded" if plan.load_optimizer else "fresh optimizer and LR schedule"
        )
        what = f"{position}; {optimizer}"
    verify = " (--ckpt-verify has nothing to compare with)" if cfg.checkpoint.ckpt_verify else ""
    return (
        f"loaded Megatron-LM checkpoint {ckpt.path} at iteration {0 if plan.weights_only else plan.common['iteration']} "
        f"({saved}, padded vocabulary {args.padded_vocab_size}; {what}; {'; '.join(plan.notes)}; {UNVERIFIED}{verify})"
    )


def _load_one(parts: CheckpointParts, ctx: ParallelContext, ckpt: MegatronLMCheckpoint, log: Log, flags: tuple) -> int:
    """Check, read and restore one checkpoint; ChecksumMismatch when a file of it is damaged."""
    from megatron.core import dist_checkpointing

    try:
        common = read_megatron_lm_common(ckpt.path)
    except UnsafeCheckpointFile as err:
        raise ConfigError([f"--load {ckpt.path}: {err}"]) from None
    plan = check_megatron_lm_load(parts, ctx, ckpt, common, *flags)
    in_buckets = plan.load_optimizer and plan.sharding == SAME_LAYOUT_ONLY
    if in_buckets:
        check_bucket_layout(parts, plan)
    # megatron-core's load reads common.pt again, and the byte items, through our allowlist: its
    # classes allowed for this load only, and NumPy's where the RNG states (NumPy's among them) are read
    allowed = get_common_safe_globals() + (get_rng_safe_globals() if plan.restore_rng else [])
    with megatron_bucket_sizes(parts.optimizer) if in_buckets else contextlib.nullcontext():
        state = build_state(parts, ctx, plan)
        try:
            with allowing(allowed):
                loaded = dist_checkpointing.load(state, ckpt.path, sharded_strategy=VerifyingTorchDistLoadStrategy())
        except BaseException as err:  # torch's CheckpointException is a BaseException, raised on every rank
            found = find_named_failure(err)
            if isinstance(found, ChecksumMismatch):
                raise found from None
            if found is not None:
                raise ConfigError([f"--load {ckpt.path}: {found}"]) from None
            raise
        restore_parts(parts, ctx, plan, loaded)
    if ctx.is_logging_rank:
        log(describe_load(plan, ctx, parts.cfg))
    return 0 if plan.weights_only else int(common["iteration"])


def load_megatron_lm_parts(
    parts: CheckpointParts,
    ctx: ParallelContext,
    root: str,
    selection: Selection,
    log: Log,
    load_optimizer: bool = True,
    weights_only: bool = False,
    load_rng: bool = True,
) -> int:
    """Restore ``parts`` from the Megatron-LM checkpoint ``selection`` names (``--load root``);
    collective. Returns the iteration the run continues from (0 for weights only). A damaged file
    is an error naming it, unless --ckpt-fallback-on-corruption, which tries the older checkpoints the
    tracker named; a refused checkpoint is a ConfigError and changes nothing."""
    if ctx.is_logging_rank:
        for note in selection.notes:
            log(note)
    fallback = parts.cfg.checkpoint.ckpt_fallback_on_corruption
    candidates = [selection.checkpoint, *(selection.fallback if fallback else ())]
    for i, ckpt in enumerate(candidates):
        try:
            return _load_one(parts, ctx, ckpt, log, (load_optimizer, weights_only, load_rng))
        except ChecksumMismatch as err:
            if i + 1 == len(candidates):
                hint = "" if fallback else "; --ckpt-fallback-on-corruption loads an older one the tracker named"
                raise ConfigError([f"--load {root}: {err}{hint}"]) from None
            if ctx.is_logging_rank:
                log(f"WARNING: {err}; --ckpt-fallback-on-corruption: trying {os.path.basename(candidates[i + 1].path)}")
    raise AssertionError("unreachable: the loop returns or raises")
