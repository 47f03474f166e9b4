"""What a checkpoint holds, and saving/loading a training run through the directory protocol.

Invariant: a checkpoint restores a run exactly in its own layout and reshards to any other
TP x CP x PP x VPP x DP (CP ranks hold whole replicas, as DP ranks do; the distributed optimizer's
state is sharded over DP x CP and saved gathered, ``fully_reshardable``). Content: every model chunk (``chunk.sharded_state_dict()`` per virtual stage;
megatron-core keys layers by their global number, so the layout is not part of the format), the
optimizer (the distributed optimizer in its ``fully_reshardable`` form), the LR scheduler,
``TrainState``, each rank's RNG states (CPU generator and megatron-core's model-parallel tracker),
the flat run config, the tokenizer identity and the padded vocabulary. The RNG states are per
rank and are restored only when the layout is unchanged; everything else reshards.

It works on a run's typed parts (``parts.CheckpointParts``: model chunks, optimizer, scheduler,
train state, flags and meta) with this rank's ``ParallelContext`` and a log function, never on the
``TrainingRun`` (``training/checkpointing.py`` adapts a run). Writing follows ``directory.py`` (atomic
publish); loading reads with megatron-core's stock reader, checked as ``reader.py`` describes, after
``compatibility.py`` has accepted the checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext.checkpoint.async_save import AsyncCheckpointSaver
from megatron_ext.checkpoint.compatibility import (
    check_compatible,
    check_document_pad_multiple,
    check_optimizer_flags,
    check_scheduler_flags,
    describe_changed_settings,
    describe_optimizer_flag_changes,
    effective_model_shape,
    get_document_pad_record,
)
from megatron_ext.checkpoint.directory import (
    FORMAT_VERSION,
    list_complete_checkpoints,
    resolve_load_path,
    write_checkpoint,
)
from megatron_ext.checkpoint.finite import describe_non_finite_weights
from megatron_ext.checkpoint.listing import list_megatron_lm_entries
from megatron_ext.checkpoint.megatron_lm import (
    check_format,
    check_megatron_lm_directories,
    describe_save_beside,
    get_padded_vocab,
    select_load,
)
from megatron_ext.checkpoint.megatron_lm_load import load_megatron_lm_parts
from megatron_ext.checkpoint.optimizer_state import (
    catch_megatron_state_corruption,
    init_empty_optimizer_state,
    load_optimizer_state,
)
from megatron_ext.checkpoint.parts import CheckpointParts
from megatron_ext.checkpoint.reader import (
    ChecksumMismatch,
    UnreadableCheckpointItem,
    UnsafeCheckpointFile,
    VerifyingFileSystemReader,
    VerifyingTorchDistLoadStrategy,
    find_named_failure,
    open_checkpoint,
    read_full_tensors,
)
from megatron_ext.config import ConfigError, JobConfig
from megatron_ext.optim import apply_flag_settings, get_scheduler_state, load_scheduler_state
from megatron_ext.parallel import ParallelContext

Log = Callable[[str], None]

# The distributed optimizer's form that can change TP/PP/DP on load (docs/megatron-core-on-cpu.md:
# the default 'fully_sharded_model_space' fails with "ShardedTensor.flattened_range is not supported").
SHARDED_STATE_DICT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}


def get_layout(ctx: ParallelContext) -> dict[str, int]:
    return {
        "world_size": ctx.world_size,
        "tp": ctx.tp_size,
        "cp": ctx.cp_size,
        "pp": ctx.pp_size,
        "dp": ctx.dp_size,
        "vp": ctx.vp_size or 1,
    }


def is_same_layout(saved: dict[str, int] | None, ctx: ParallelContext) -> bool:
    """Whether a checkpoint's layout record is this run's (a record without "cp", written before
    context parallelism, was saved at CP 1): only then are its per-rank RNG states restored."""
    return saved is not None and {"cp": 1, **saved} == get_layout(ctx)


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
    parts: CheckpointParts, ctx: ParallelContext, *, is_loading: bool, include_optimizer: bool, include_rng: bool
) -> dict[str, Any]:
    """The whole checkpoint as megatron-core's sharded state dict."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = build_model_sharded_state_dict(parts.model)
    if include_optimizer:
        # parameters no step has reached yet (fp16 steps skipped by the loss scaler) get Adam's
        # first-step state, so a save writes, and a load expects, every parameter's state
        init_empty_optimizer_state(parts.optimizer)
        # megatron-core finds each parameter's ShardedTensor anywhere in the nested dict
        state["optimizer"] = parts.optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=dict(SHARDED_STATE_DICT_METADATA)
        )
        state["opt_param_scheduler"] = get_scheduler_state(parts.scheduler)
    if include_rng:
        state["rng_state"] = ShardedObject(
            "rng_state", get_rng_state(ctx.device), (ctx.world_size,), (ctx.rank,), replica_id=0
        )
    state["train_state"] = dataclasses.asdict(parts.train_state)
    state["args"] = parts.cfg.to_flat_dict()
    state["tokenizer"] = dict(parts.meta.tokenizer)
    state["padded_vocab_size"] = parts.meta.padded_vocab_size
    if parts.meta.padded_vocab_from:  # not the flags' padding: a later load builds its model with it
        state["padded_vocab_from"] = parts.meta.padded_vocab_from
    state["ffn_hidden_size"] = effective_model_shape(state["args"])["ffn_hidden_size"]  # the width built
    state["layout"] = get_layout(ctx)
    state["document_pad_multiple"] = get_document_pad_record(parts.cfg)  # g: it decides the packs
    state["device_type"] = ctx.device.type
    state["checkpoint_version"] = FORMAT_VERSION
    return state


def build_save_state(parts: CheckpointParts, ctx: ParallelContext, log: Log) -> dict[str, Any]:
    """The sharded state dict of a save, warning where megatron-core would write part of it wrong."""
    with catch_megatron_state_corruption() as corrupted:
        state = build_sharded_state_dict(parts, ctx, is_loading=False, include_optimizer=True, include_rng=True)
    for message in sorted(set(corrupted)):
        # megatron-core 0.16.1 (its issue #504): part of this parameter's optimizer state is
        # written as zeros; say so on every rank where it happens instead of a buried log line
        log(f"WARNING rank {ctx.rank}: the saved optimizer state is incomplete, a resume will not be exact: {message}")
    return state


def start_async_save(
    parts: CheckpointParts,
    ctx: ParallelContext,
    saver: AsyncCheckpointSaver,
    root: str,
    keep_last: int | None,
    log: Log,
) -> None:
    """``--async-save``: snapshot the parts at their current iteration and write them in the
    background with ``saver`` (``async_save.py``); collective over the world. It is published at a
    later step boundary, or refused there (NonFiniteCheckpoint) when some rank's weights are not
    finite now."""
    iteration = parts.train_state.iteration
    held = saver.start(
        build_save_state(parts, ctx, log),
        root,
        iteration,
        keep_last,
        non_finite=describe_non_finite_weights(parts.model),
        record=parts.marker_record,
    )
    if ctx.is_logging_rank:
        copied = saver.snapshot.bytes
        copied = f", {copied / 2**20:.1f} MiB copied to host memory on this rank" if copied else ""
        log(f"started asynchronous save of iteration {iteration:8d} to {root} (training held {held:.2f} s{copied})")


def save_parts(parts: CheckpointParts, ctx: ParallelContext, root: str, keep_last: int | None, log: Log) -> str:
    """Save the parts at their current iteration under ``root``; collective over the world.
    Returns the published directory; raises NonFiniteCheckpoint on every rank, having written and
    deleted nothing, when some rank's weights are not finite (``finite.py``)."""
    start = time.perf_counter()
    iteration = parts.train_state.iteration
    state = build_save_state(parts, ctx, log)
    non_finite = describe_non_finite_weights(parts.model)
    final_dir = write_checkpoint(state, root, iteration, keep_last, non_finite, parts.marker_record)
    if ctx.is_logging_rank:
        log(f"saved checkpoint at iteration {iteration:8d} to {final_dir} in {time.perf_counter() - start:.2f} s")
    return final_dir


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What a run loads at start-up (``plan_load``)."""

    path: str
    step: int | None = None  # --ckpt-step
    weights_only: bool = False  # --finetune / --pretrained-checkpoint: iteration, optimizer, schedule reset
    load_rng: bool = True
    padded_vocab: tuple[int, str] | None = None  # the checkpoint's, when the model must be built with it


def plan_load(cfg: JobConfig) -> tuple[LoadPlan | None, str | None]:
    """Before any work: what the run loads, and a line to print. --load's checkpoint (newest, or
    --ckpt-step's) resumes (weights only with --finetune); a --load holding none falls back to
    --pretrained-checkpoint (weights only), or starts from scratch when it is also --save (the
    restartable-job idiom); anything else is a ConfigError naming the flag, since it would silently
    start from scratch."""
    c = cfg.checkpoint
    if c.ckpt_step is not None and not c.load:
        raise ConfigError(["--ckpt-step needs --load DIR (the directory whose iteration it names)"])
    check_megatron_lm_directories(c.load, c.save)
    beside = describe_save_beside(c.save)
    if c.load:
        foreign = select_load(c.load, c.ckpt_step)  # Megatron-LM's, when it is the one --load names
        found = (
            (foreign.checkpoint.iteration, foreign.checkpoint.path)
            if foreign
            else resolve_load_path(c.load, c.ckpt_step)[0]
        )
        if found is not None:
            if foreign is not None and check_format(found[1], None):  # a format not read here: before any work
                raise ConfigError([f"--load {c.load}: {check_format(found[1], None)[0]}"])
            padded = get_padded_vocab(found[1], megatron_lm=foreign is not None)
            return LoadPlan(c.load, c.ckpt_step, c.finetune, not (c.no_load_rng or c.finetune), padded), beside
        if c.ckpt_step is not None:
            have = [it for it, _ in list_complete_checkpoints(c.load)]
            raise ConfigError(
                [
                    f"--ckpt-step {c.ckpt_step}: {c.load} holds no complete checkpoint of that iteration "
                    f"(complete ones: {have or 'none'})"
                ]
            )
    if c.pretrained_checkpoint:
        foreign = select_load(c.pretrained_checkpoint)
        found = foreign.checkpoint.path if foreign else (resolve_load_path(c.pretrained_checkpoint)[0] or (0, None))[1]
        if found is None:
            raise ConfigError([f"--pretrained-checkpoint {c.pretrained_checkpoint} holds no complete checkpoint"])
        where = f"--load {c.load} holds no checkpoint yet: " if c.load else ""
        padded = get_padded_vocab(found, megatron_lm=foreign is not None)
        return (
            LoadPlan(c.pretrained_checkpoint, weights_only=True, load_rng=False, padded_vocab=padded),
            f"> {where}fine-tuning from --pretrained-checkpoint {c.pretrained_checkpoint} (weights only)",
        )
    if not c.load:
        held = list_complete_checkpoints(c.save) if c.save else []
        if held:  # e.g. the README's default job run twice: its config saves but does not --load
            return None, (
                f"WARNING: --save {c.save} already holds checkpoints (newest: iteration {held[-1][0]}) "
                f"and no --load is given: this run starts from scratch and saves beside them; add "
                f"--load {c.save} to resume, or give another --save"
            )
        return None, None
    restartable = c.save and os.path.abspath(c.save) == os.path.abspath(c.load)
    if restartable and not c.exit_on_missing_checkpoint:
        return None, f"> --load {c.load} holds no checkpoint yet: starting from scratch (it is also --save)"
    what = "does not exist" if not os.path.exists(c.load) else "holds no complete checkpoint"
    why = " (--exit-on-missing-checkpoint)" if restartable else ""
    raise ConfigError(
        [
            f"--load {c.load} {what}{why}: give a directory that --save wrote (or one of its "
            f"iter_XXXXXXX directories), or drop --load to start from scratch"
        ]
    )


def check_load_flags(cfg: JobConfig) -> str | None:
    """``plan_load``'s line to print (a check without the plan)."""
    return plan_load(cfg)[1]


def load_full_tensors(ckpt_dir: str, prefix: str = "", exclude: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """{checkpoint key: full unsharded tensor} for every tensor whose key starts with ``prefix``
    and with none of ``exclude``, read in this process without a process group (for tools and
    tests). Layer-stacked keys (``decoder.layers.*``) have the global layer index as dimension 0.
    Everything read is checked as ``--ckpt-verify`` checks a load (``reader.open_checkpoint``, then
    every item against the marker); a damaged or unsafe file raises ``reader``'s named error."""
    checksums, _ = open_checkpoint(ckpt_dir)  # every item checked, as --ckpt-verify does
    reader = VerifyingFileSystemReader(ckpt_dir, *((checksums["items"], checksums["algorithm"]) if checksums else ()))
    return read_full_tensors(reader, lambda key: key.startswith(prefix) and not key.startswith(exclude))


class CheckpointDamaged(Exception):
    """A checkpoint's bytes differ from what was written, or a file of it cannot be read."""


def load_parts(
    parts: CheckpointParts,
    ctx: ParallelContext,
    root: str,
    log: Log,
    load_optimizer: bool = True,
    *,
    step: int | None = None,
    weights_only: bool = False,
    load_rng: bool = True,
) -> int | None:
    """Restore ``parts`` in place from the newest complete checkpoint under ``root`` (or from ``root``
    itself when it is one checkpoint's ``iter_XXXXXXX`` directory); collective.

    Returns the loaded iteration, or None when ``root`` holds no complete checkpoint (a fresh
    start). Raises ConfigError, before anything is written, when the model or tokenizer differ
    (``parts.meta`` is what this run's must match), or the LR schedule flags differ with no flag
    saying which wins; and when the checkpoint is damaged (a checksum mismatch or an unreadable
    file, named), unless --ckpt-fallback-on-corruption asks to load the previous complete checkpoint
    instead; a file holding what a checkpoint never holds is a ConfigError saying it may have been
    tampered with (no fallback). ``step`` loads that iteration; ``weights_only`` (fine-tuning) restores
    the model and nothing else (iteration 0, fresh optimizer and schedule); ``load_rng=False`` keeps
    the run's own random-number states.
    """
    foreign = select_load(root, step)
    if foreign is not None:  # Megatron-LM's own checkpoint (megatron_lm_load.py)
        return load_megatron_lm_parts(parts, ctx, root, foreign, log, load_optimizer, weights_only, load_rng)
    found, warning = resolve_load_path(root, step)
    if found is None:
        return None
    if warning and ctx.is_logging_rank and not list_megatron_lm_entries(root):  # a tracker that is Megatron-LM's
        log(f"WARNING: {warning}")
    fallback = parts.cfg.checkpoint.ckpt_fallback_on_corruption
    candidates = [found]
    if fallback:
        candidates += [c for c in reversed(list_complete_checkpoints(os.path.dirname(found[1]))) if c[0] < found[0]]
    for i, (iteration, ckpt_dir) in enumerate(candidates):
        try:
            return _load_from(
                parts,
                ctx,
                log,
                root,
                iteration,
                ckpt_dir,
                load_optimizer and not weights_only,
                weights_only,
                load_rng and not weights_only,
            )
        except CheckpointDamaged as err:
            if i + 1 == len(candidates):
                hint = (
                    "" if fallback else "; --ckpt-fallback-on-corruption loads the previous complete checkpoint instead"
                )
                raise ConfigError([f"--load {root}: {err}{hint}"]) from None
            if ctx.is_logging_rank:
                log(f"WARNING: {err}; --ckpt-fallback-on-corruption: trying {candidates[i + 1][1]}")
    return None


def _load_from(
    parts: CheckpointParts,
    ctx: ParallelContext,
    log: Log,
    root: str,
    iteration: int,
    ckpt_dir: str,
    load_optimizer: bool,
    weights_only: bool = False,
    load_rng: bool = True,
) -> int:
    """``load_parts`` from one checkpoint directory: check it, read it, restore the parts."""
    from megatron.core import dist_checkpointing

    cfg = parts.cfg
    checksums, common = _read_coordinator_files(ctx, log, root, ckpt_dir)
    # weights only, e.g. converted by tools/convert_checkpoint.py: no optimizer state whose form
    # (distributed optimizer, precision) must match this run's
    holds_no_optimizer = load_optimizer and "opt_param_scheduler" not in common
    if holds_no_optimizer:
        load_optimizer = False
    _check_loadable(parts, ctx, log, root, ckpt_dir, common, load_optimizer, weights_only)
    if holds_no_optimizer and ctx.is_logging_rank:
        log(f"{ckpt_dir} holds no optimizer state: starting with a fresh optimizer")
    same_layout = is_same_layout(common.get("layout"), ctx)
    saved_device = common.get("device_type", "cpu")
    restore_rng = load_rng and same_layout and saved_device == ctx.device.type
    if load_rng and same_layout and not restore_rng and ctx.is_logging_rank:
        log(
            f"WARNING: {ckpt_dir} holds random-number states of {saved_device} generators; this run "
            f"is on {ctx.device.type}: weights and optimizer load exactly, dropout and other "
            f"random streams start afresh from --seed {cfg.training.seed}"
        )
    state = build_sharded_state_dict(
        parts, ctx, is_loading=True, include_optimizer=load_optimizer, include_rng=restore_rng
    )
    strategy = build_load_strategy(checksums if cfg.checkpoint.ckpt_verify else None)
    try:
        loaded = dist_checkpointing.load(state, ckpt_dir, sharded_strategy=strategy)
    except BaseException as err:  # torch's CheckpointException is a BaseException, raised on every rank
        _raise_named_load_error(err, root)
        raise
    _restore_parts(parts, ctx, loaded, load_optimizer, weights_only, restore_rng)
    if ctx.is_logging_rank:
        log(
            _describe_load(
                cfg, ckpt_dir, iteration, common, same_layout, weights_only, load_optimizer, checksums, strategy
            )
        )
    return iteration


def _check_loadable(
    parts: CheckpointParts,
    ctx: ParallelContext,
    log: Log,
    root: str,
    ckpt_dir: str,
    common: dict[str, Any],
    load_optimizer: bool,
    weights_only: bool,
) -> None:
    """ConfigError naming every reason the checkpoint cannot be loaded into the parts
    (``compatibility.py``), before anything is read; warnings for what loads but differs."""
    cfg = parts.cfg
    problems = check_compatible(common, cfg, parts.meta, load_optimizer)
    if not weights_only:  # --finetune starts the data over: another g reads other packs from sample 0
        problems += check_document_pad_multiple(common, cfg)
    if load_optimizer:
        problems += check_scheduler_flags(common["opt_param_scheduler"], parts.scheduler, cfg, parts.global_batch_size)
        problems += check_optimizer_flags(common, cfg)
    if problems:
        raise ConfigError([f"--load {root} ({os.path.basename(ckpt_dir)}): {p}" for p in problems])
    kept = describe_optimizer_flag_changes(common, cfg) if load_optimizer else []
    if kept and cfg.checkpoint.use_checkpoint_opt_param_scheduler and ctx.is_logging_rank:
        log(
            f"WARNING: --use-checkpoint-opt-param-scheduler keeps the checkpoint's optimizer settings: "
            f"{'; '.join(kept)}"
        )
    changed = None if weights_only else describe_changed_settings(common, cfg)
    if changed and ctx.is_logging_rank:
        log(f"WARNING: {changed}")


def _restore_parts(
    parts: CheckpointParts,
    ctx: ParallelContext,
    loaded: dict[str, Any],
    load_optimizer: bool,
    weights_only: bool,
    restore_rng: bool,
) -> None:
    """Put what a load read into the parts, in place."""
    if load_optimizer:
        load_optimizer_state(parts.optimizer, loaded["optimizer"])
        if parts.cfg.checkpoint.override_opt_param_scheduler:
            # the load gave every parameter group the checkpoint's max_lr/min_lr/betas/eps; this
            # run's flags win, already for the LR the scheduler's load sets for the first step
            apply_flag_settings(parts.optimizer, parts.optimizer_flags)
        load_scheduler_state(parts.scheduler, loaded["opt_param_scheduler"])
    for i, chunk in enumerate(parts.model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if not load_optimizer:
        # the optimizer's fp32 main parameters (--bf16/--fp16) were copied from the initial weights
        # when it was built: without this, its first step writes them back over the loaded weights
        # (Megatron-LM's load_checkpoint calls it for the same reason)
        parts.optimizer.reload_model_params()
    if restore_rng:
        set_rng_state(loaded["rng_state"], ctx.device)
    if not weights_only:
        parts.train_state.restore(loaded.get("train_state", {}))


def _read_coordinator_files(
    ctx: ParallelContext, log: Log, root: str, ckpt_dir: str
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The marker's checksums to verify (None: none usable) and ``common.pt``, each checked first
    (``reader.open_checkpoint``); CheckpointDamaged names the file that is not what the save wrote."""

    def warn(message: str) -> None:
        if ctx.is_logging_rank:
            log(f"WARNING: {message}")

    try:
        return open_checkpoint(ckpt_dir, warn)
    except ChecksumMismatch as err:
        raise CheckpointDamaged(str(err)) from None
    except (UnsafeCheckpointFile, UnreadableCheckpointItem) as err:
        raise ConfigError([f"--load {root}: {err}"]) from None


def _raise_named_load_error(err: BaseException, root: str) -> None:
    """One named error for what the reader found on any rank (torch's CheckpointException carries
    every failing rank's exception): damage (CheckpointDamaged, which the fallback acts on); a file
    holding what a checkpoint never holds, or an item torch cannot read (ConfigError). Returns for
    anything else."""
    found = find_named_failure(err)
    if isinstance(found, ChecksumMismatch):
        raise CheckpointDamaged(str(found)) from None
    if found is not None:
        raise ConfigError([f"--load {root}: {found}"]) from None


def _describe_load(
    cfg: JobConfig,
    ckpt_dir: str,
    iteration: int,
    common: dict[str, Any],
    same_layout: bool,
    weights_only: bool,
    load_optimizer: bool,
    checksums: dict[str, Any] | None,
    strategy: Any,
) -> str:
    """The "loaded checkpoint" line: layout, what was loaded, what was verified."""
    saved_layout = common.get("layout")
    how = (
        "same layout"
        if same_layout
        else f"resharded from {saved_layout}"
        if saved_layout
        else "written by tools/convert_checkpoint.py, laid out for this run"
    )
    if weights_only:
        how += "; weights only: iteration, optimizer and LR schedule start afresh"
    elif not load_optimizer and "opt_param_scheduler" in common:
        how += "; optimizer and LR schedule not loaded (--no-load-optim): they start afresh"
    stats = strategy.stats
    if not cfg.checkpoint.ckpt_verify:
        checked = "; items not verified (--ckpt-verify is off)"
    elif checksums is None:
        checked = "; items not verified (--ckpt-verify: the checkpoint records no checksums this machine can check)"
    else:
        missing = f", {stats.unverified} with no recorded checksum" if stats.unverified else ""
        checked = (
            f"; checksums verified for {stats.verified} items on this rank ({stats.byte_items} of them "
            f"byte items{missing})"
        )
    return f"loaded checkpoint {ckpt_dir} at iteration {iteration} ({how}{checked})"


def build_load_strategy(checksums: dict[str, Any] | None = None) -> VerifyingTorchDistLoadStrategy:
    """megatron-core's ``torch_dist`` load strategy reading through ``reader.VerifyingFileSystemReader``:
    shard sizes always checked, every stored item the load touches hashed and compared with the
    marker's ``checksums`` record when given (``--ckpt-verify``)."""
    if checksums is None:
        return VerifyingTorchDistLoadStrategy()
    return VerifyingTorchDistLoadStrategy(checksums["items"], checksums["algorithm"])
