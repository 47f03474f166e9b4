"""Pretrain a GPT model with megatron-core: TP x PP x VPP x DP, on GPUs or on the CPU (gloo).

    torchrun --nproc-per-node 8 pretrain_gpt.py --config configs/default.yaml

Flags follow Megatron-LM's names (``--help`` lists them); a ``--config`` YAML/TOML file gives the
same keys, and flags override it.
"""

from __future__ import annotations

import os
import sys

from megatron_ext.cpu_platform import quiet_known_warnings, select_device

quiet_known_warnings()  # before megatron-core's imports, which warn about TE/Apex on CPU

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from megatron_ext.arguments import parse_args_with_notes  # noqa: E402
from megatron_ext.checkpoint.directory import CheckpointWriteFailed, probe_save_dir  # noqa: E402
from megatron_ext.checkpoint.exit_policy import ExitDecider, build_exit_decider  # noqa: E402
from megatron_ext.checkpoint.state import plan_load  # noqa: E402
from megatron_ext.config import ConfigError, JobConfig  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer, get_tokenizer_args  # noqa: E402
from megatron_ext.error_report import report_error_once  # noqa: E402
from megatron_ext.guards import apply_parent_death_signal, lock_save_dir  # noqa: E402
from megatron_ext.launch_env import check_launch_env  # noqa: E402
from megatron_ext.parallel import init_distributed  # noqa: E402
from megatron_ext.rehearse import get_unrehearsed_notes, rehearse_job  # noqa: E402
from megatron_ext.restart import (  # noqa: E402
    apply_restart,
    check_restart_settings,
    open_iteration_record,
    write_no_retry_marker,
)
from megatron_ext.run import build_training_run, describe_run, describe_schedule  # noqa: E402
from megatron_ext.training.checkpointing import load_checkpoint, maybe_redo_hf_export  # noqa: E402
from megatron_ext.training.loop import TrainingDiverged, train  # noqa: E402
from megatron_ext.training.metrics import check_wandb_ready  # noqa: E402
from megatron_ext.training.weight_hash import WEIGHT_HASH_EXIT_CODE, WeightHashMismatch  # noqa: E402
from megatron_ext.validation import check_data_tokenizer, validate  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: die with the agent, even on kill -9
        apply_parent_death_signal()
    check_launch_env(os.environ)  # WORLD_SIZE, RANK, OMP_NUM_THREADS, ...: read with int() from here on
    cfg, flag_notes = parse_args_with_notes(argv)
    if cfg.parallel.rehearse:  # this world size's checks, groups, model chunks and first step, on this machine
        rehearse_job(cfg, flag_notes, os.environ)
        return []
    flag_notes += get_unrehearsed_notes(cfg)  # --gpu-memory-gib without --rehearse: said, not silent
    device = select_device(cfg.parallel.device)
    check_restart_settings(cfg, os.environ)
    restart_note = apply_restart(cfg, os.environ)  # launch/torchrun.sh's restart: resume from --save
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), cuda=device.type == "cuda")
    exit_decider = build_exit_decider(cfg)  # SIGTERM during start-up is recorded too
    try:
        return _train(cfg, flag_notes, device, exit_decider, restart_note)
    finally:
        exit_decider.close()  # returned or raised: SIGTERM and Ctrl-C act as before main again


def _train(
    cfg: JobConfig,
    flag_notes: list[str],
    device: torch.device,
    exit_decider: ExitDecider,
    restart_note: str | None = None,
) -> list[float]:
    """``main`` from the start-up checks to the end of training, with the exit decider's
    signal handlers installed; ``restart_note``: what a restart by launch/torchrun.sh resumes from."""
    load_plan, load_message = plan_load(cfg)
    wandb_problem = check_wandb_ready(cfg.logging.wandb_project)
    if wandb_problem:
        raise ConfigError([wandb_problem])
    probe_save_dir(cfg.checkpoint.save)
    probe_save_dir(cfg.data.data_cache_path, "--data-cache-path")  # index caches are written there
    # one live job per --save (held until this process ends; the kernel releases it on any death)
    save_lock = lock_save_dir(cfg.checkpoint.save) if os.environ.get("RANK", "0") == "0" else None
    d = cfg.data
    tokenizer = build_tokenizer(**get_tokenizer_args(d))
    check_data_tokenizer(cfg.data, tokenizer.identity())  # data made by another tokenizer: one error, before any work

    init_distributed(device, cfg.parallel.distributed_timeout_minutes)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    padded_vocab = load_plan.padded_vocab if load_plan else None  # a checkpoint's model: its vocabulary rows
    run = build_training_run(
        cfg, device=device, tokenizer=tokenizer, exit_decider=exit_decider, padded_vocab=padded_vocab
    )
    if run.ctx.is_logging_rank:
        run.log(describe_run(run))
        for note in flag_notes:  # Megatron-LM flags accepted without effect, settings adjusted as it does, shapes
            run.log(f"WARNING: {note}")
        for line in (restart_note, load_message):
            if line:
                run.log(line)
    if load_plan is not None:
        load_checkpoint(
            run,
            load_plan.path,
            load_optimizer=not cfg.checkpoint.no_load_optim,
            step=load_plan.step,
            weights_only=load_plan.weights_only,
            load_rng=load_plan.load_rng,
        )
        maybe_redo_hf_export(run)  # the --save-hf export a killed run owed for this checkpoint
        if cfg.checkpoint.use_checkpoint_opt_param_scheduler and run.ctx.is_logging_rank:
            run.log(describe_schedule(run, "schedule taken from the checkpoint (--use-checkpoint-opt-param-scheduler)"))
    run.iteration_record = open_iteration_record()
    history = train(run)
    run.writer.close()
    if run.watchdog is not None:
        run.watchdog.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    write_exit_marker(run.state.iteration, cfg.training.train_iters)
    if save_lock is not None:
        save_lock.close()
    return history


def write_exit_marker(iteration: int, train_iters: int) -> None:
    """Tell launch/torchrun.sh this rank ended cleanly (torchrun's own code cannot say so after a
    SIGTERM): "finished" at --train-iters, else "stopped <iteration>" (a signal or an exit flag ended
    it early, after its checkpoint: a scheduler may start it again, launch/slurm.sbatch requeues)."""
    marker_dir = os.environ.get("MEGATRON_EXT_EXIT_MARKER_DIR")
    if marker_dir and os.path.isdir(marker_dir):
        state = "finished" if iteration >= train_iters else f"stopped {iteration}"
        with open(os.path.join(marker_dir, f"rank{os.environ.get('RANK', '0')}.ok"), "w") as f:
            f.write(state + "\n")


def run_cli(argv: list[str] | None = None) -> int:
    """``main`` as the command line runs it; returns the exit status. A user's error (2), a run that
    diverged or whose weights a save found non-finite, and a save that failed (1: the message is the
    same on every rank) are one ``error:`` block printed once per launch on a host, not a traceback
    per rank. The first two would fail again: they tell launch/torchrun.sh not to restart the job
    (a failed save may be a passing file-system fault: it may be retried). A weight-hash mismatch
    exits 3, and tells the launcher not to restart when no checked checkpoint is left to resume
    from (else a restart resumes from it: ``restart.py``)."""
    try:
        main(argv)
    except ConfigError as err:
        report_error_once(str(err))
        write_no_retry_marker(2, "a user error (the error: block above)")
        return 2
    except WeightHashMismatch as err:
        report_error_once(str(err))
        if err.checkpoint is None:
            write_no_retry_marker(
                WEIGHT_HASH_EXIT_CODE, "a weight-hash mismatch with no checked checkpoint to resume from"
            )
        return WEIGHT_HASH_EXIT_CODE
    except TrainingDiverged as err:
        report_error_once(str(err))
        write_no_retry_marker(1, "the run diverged (the error: block above)")
        return 1
    except CheckpointWriteFailed as err:
        report_error_once(str(err))
        return 1
    return 0


if __name__ == "__main__":
    # torchelastic's @record: under torchrun an unexpected exception's traceback also becomes the
    # root cause in torchrun's failure summary (our own errors write theirs: report_error_once)
    sys.exit(record(run_cli)())
