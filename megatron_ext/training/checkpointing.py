"""A training run's checkpoints: the ``TrainingRun`` taken apart into ``checkpoint/``'s typed parts.

``checkpoint/`` saves and loads ``CheckpointParts`` (model chunks, optimizer, scheduler, train state,
flags, meta) and imports nothing from ``training/``; these three functions are the run's side of
that boundary, for the loop, the entry point, the tests and the benchmarks. The parts are the run's
own objects, so a load restores the run in place.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_ext.checkpoint.directory import NonFiniteCheckpoint, select_checkpoints_to_delete
from megatron_ext.checkpoint.parts import CheckpointMeta, CheckpointParts
from megatron_ext.checkpoint.state import load_parts, save_parts, start_async_save
from megatron_ext.hf.export import (
    HF_SUBDIR,
    describe_abandoned_exports,
    export_hf_model,
    find_owed_export,
    recover_interrupted_publish,
    should_export_hf,
)


def get_checkpoint_parts(run: Any, meta: CheckpointMeta | None = None) -> CheckpointParts:
    """The parts of ``run`` (a ``loop.TrainingRun``) a checkpoint holds; ``meta`` replaces the
    run's own (a test saving or loading as another tokenizer would)."""
    return CheckpointParts(
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        train_state=run.state,
        cfg=run.cfg,
        meta=meta or run.checkpoint_meta,
        optimizer_flags=run.optimizer_flags,
        global_batch_size=run.global_batch_size,
        marker_record=run.weight_hash.get_marker_record() if run.weight_hash is not None else {},
    )


def save_checkpoint(run: Any, root: str, keep_last: int | None = None, meta: CheckpointMeta | None = None) -> str:
    """Save the run at its current iteration under ``root`` (``state.save_parts``); collective."""
    return save_parts(get_checkpoint_parts(run, meta), run.ctx, root, keep_last, run.log)


def maybe_export_hf(run: Any, last: bool) -> str | None:
    """--save-hf: after the save of this iteration, the Hugging Face directory of the run's model
    when it is due (``hf.export.should_export_hf``); collective. Returns the published directory
    on the logging rank, else None."""
    it = run.state.iteration
    if not should_export_hf(run.cfg.checkpoint, it, last):
        return None
    meta = run.checkpoint_meta
    final = export_hf_model(run.model, run.ctx, run.cfg, meta.tokenizer, meta.padded_vocab_size, it, run.log)
    if final is not None:  # the publishing rank, after a published export
        prune_hf_exports(os.path.dirname(final), run.cfg.checkpoint.keep_last, run.log, keep=it)
    return final


def maybe_redo_hf_export(run: Any) -> str | None:
    """At start-up, after the load: the --save-hf export a killed run owed for the checkpoint this
    run resumed from in --save (``hf.export.find_owed_export``), written now from the loaded
    weights; an abandoned export of another iteration is a warning with the command that redoes it.
    Collective (one all-gather of the logging rank's finding). Returns the published directory on the
    logging rank, else None."""
    c, it = run.cfg.checkpoint, run.state.iteration
    if not (c.save_hf and c.load) or os.path.abspath(c.load) != os.path.abspath(c.save):
        return None
    owed = None
    if run.ctx.is_logging_rank:
        recover_interrupted_publish(os.path.join(c.save, HF_SUBDIR), run.log)
        owed = find_owed_export(c, it, run.cfg.training.train_iters)
        for line in describe_abandoned_exports(c.save, but=it):
            run.log(line)
    findings = [None] * run.ctx.world_size
    dist.all_gather_object(findings, owed)
    owed = next((f for f in findings if f), None)
    if owed is None:
        return None
    if run.ctx.is_logging_rank:
        run.log(
            f"> --save-hf: the export of iteration {it} is missing ({owed}): exporting it now from the loaded checkpoint"
        )
    meta = run.checkpoint_meta
    final = export_hf_model(run.model, run.ctx, run.cfg, meta.tokenizer, meta.padded_vocab_size, it, run.log)
    if final is not None:  # as after the killed run's own export
        prune_hf_exports(os.path.dirname(final), c.keep_last, run.log, keep=it)
    return final


def prune_hf_exports(
    hf_root: str, keep_last: int | None, log: Callable[[str], None], keep: int | None = None
) -> list[str]:
    """--keep-last applied to the exports in ``hf_root`` (``<save>/hf``) as to the checkpoints: the
    newest N ``iter_XXXXXXX`` remain, never the newest one, so that --save-hf-interval cannot fill the
    disk the checkpoints need; a failure to delete is a warning. ``keep``: the iteration just
    exported, which stays; exports of later iterations (left by the run a --ckpt-step resume rolled
    back from) are neither counted nor deleted, as ``apply_retention`` does for the checkpoints. An
    export interrupted between its renames is recovered first (it counts). Each is renamed out of the
    ``iter_XXXXXXX`` names before it is deleted, so a delete cut short leaves no partial export under
    them (the next export removes the ``.tmp_`` leftover). Returns the deleted directories."""
    recover_interrupted_publish(hf_root, log)
    found = {int(m.group(1)): m.group(0) for m in map(re.compile(r"iter_(\d{7})$").match, os.listdir(hf_root)) if m}
    own = [it for it in found if keep is None or it <= keep]
    deleted = []
    for it in select_checkpoints_to_delete(own, keep_last):
        path = os.path.join(hf_root, found[it])
        aside = os.path.join(hf_root, f".tmp_{found[it]}.deleted")
        try:
            shutil.rmtree(aside, ignore_errors=True)  # an earlier delete's leftover
            os.rename(path, aside)
            shutil.rmtree(aside)
            deleted.append(path)
        except OSError as err:
            log(f"WARNING: --keep-last {keep_last}: could not delete the old Hugging Face export {path}: {err}")
    if deleted:
        log(f"--keep-last {keep_last}: deleted {len(deleted)} older Hugging Face export(s) in {hf_root}")
    return deleted


def describe_non_finite_save(run: Any, err: NonFiniteCheckpoint) -> str:
    """Which updates made the weights non-finite, the refused save, and the last good checkpoint.
    Weights are checked at saves only, so the update is named as a range: after the last save this
    process published (every rank found its weights finite) or, before any, after this run's start,
    up to the refused save's iteration; with a save at every step, exactly."""
    started = run.state.iteration - run.steps_this_run
    first = (run.weights_finite_at if run.weights_finite_at is not None else started) + 1
    checked = (
        f"finite at the save of iteration {run.weights_finite_at}"
        if run.weights_finite_at is not None
        else f"not checked since this run started at iteration {started}"
    )
    updates = (
        f"the update of iteration {err.iteration}"
        if first == err.iteration
        else f"one of the updates of iterations {first} to {err.iteration}"
    )
    fix = "with a lower --lr, or check --init-method-std and the data"
    then = (
        f"Resume from that last good checkpoint (--load {err.root} loads it) {fix}"
        if err.newest
        else f"No checkpoint holds this run's weights: start again {fix}"
    )
    return (
        f"training diverged: {updates} made the weights non-finite (they were {checked}; weights are "
        f"checked at saves only). {err}. {then}"
    )


def start_async_checkpoint(run: Any, root: str, keep_last: int | None = None) -> None:
    """--async-save: snapshot the run and write it in the background with its saver
    (``state.start_async_save``); collective."""
    start_async_save(get_checkpoint_parts(run), run.ctx, run.async_saver, root, keep_last, run.log)


def load_checkpoint(
    run: Any,
    root: str,
    meta: CheckpointMeta | None = None,
    load_optimizer: bool = True,
    *,
    step: int | None = None,
    weights_only: bool = False,
    load_rng: bool = True,
) -> int | None:
    """Restore the run in place from ``root`` (``state.load_parts``, which says what is loaded and
    refused); returns the loaded iteration, or None when ``root`` holds no complete checkpoint."""
    return load_parts(
        get_checkpoint_parts(run, meta),
        run.ctx,
        root,
        run.log,
        load_optimizer,
        step=step,
        weights_only=weights_only,
        load_rng=load_rng,
    )
