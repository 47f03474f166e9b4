"""megatron_ext/restart.py: what a worker restarted by launch/torchrun.sh (MAX_RESTARTS) loads, the
"do not retry" marker and the iteration record. tests/unit/test_launchers.py plays the launcher's
decisions; tests/distributed/test_restart.py runs the whole path."""

from __future__ import annotations

import os

import pytest

from megatron_ext.checkpoint.directory import COMPLETE_MARKER, get_checkpoint_dir
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.restart import apply_restart, check_restart_settings, open_iteration_record, write_no_retry_marker
from megatron_ext.testing import tiny_values

RESTART = {"MEGATRON_EXT_RESUME_FROM_SAVE": "1", "MEGATRON_EXT_RESTART_ATTEMPT": "2"}


def _complete(root, iteration: int) -> None:
    path = get_checkpoint_dir(str(root), iteration)
    os.makedirs(path)
    open(os.path.join(path, COMPLETE_MARKER), "w").close()


def test_a_restart_resumes_from_saves_newest_checkpoint_whatever_the_first_start_loaded(tmp_path):
    save = str(tmp_path / "save")
    values = tiny_values(
        save=save, load=str(tmp_path / "pretrained"), finetune=True, no_load_optim=True, no_load_rng=True, ckpt_step=3
    )
    cfg = build_job_config(values)
    assert apply_restart(cfg, {}) is None and cfg.checkpoint.load == str(tmp_path / "pretrained")  # a first start
    note = apply_restart(cfg, RESTART)  # --save holds nothing yet: the first start's flags, as given
    assert note == f"> restart 2: --save {save} holds no complete checkpoint yet: starting as the first run did"
    assert cfg.checkpoint.finetune and cfg.checkpoint.load == str(tmp_path / "pretrained")
    _complete(save, 4)
    _complete(save, 8)
    os.makedirs(get_checkpoint_dir(save, 12))  # incomplete: never resumed from
    note = apply_restart(cfg, RESTART)
    c = cfg.checkpoint
    assert (c.load, c.ckpt_step, c.finetune, c.no_load_optim, c.no_load_rng) == (save, None, False, False, False)
    assert note == (
        f"> restart 2: resuming from the newest complete checkpoint in --save {save} (iteration 8) "
        f"(instead of the first start's --load {tmp_path / 'pretrained'}, --ckpt-step 3, --finetune, "
        f"--no-load-optim, --no-load-rng)"
    )
    # the Megatron-LM idiom (--load = --save) and no --load at all: nothing replaced, said plainly
    for load in (save, None):
        cfg = build_job_config(tiny_values(save=save, load=load))
        assert apply_restart(cfg, RESTART).endswith("(iteration 8)") and cfg.checkpoint.load == save


def test_restarts_need_save(tmp_path):
    cfg = build_job_config(tiny_values())
    check_restart_settings(cfg, {"MEGATRON_EXT_MAX_RESTARTS": "0"})
    with pytest.raises(ConfigError, match="MAX_RESTARTS=3 needs --save DIR"):
        check_restart_settings(cfg, {"MEGATRON_EXT_MAX_RESTARTS": "3"})
    check_restart_settings(build_job_config(tiny_values(save=str(tmp_path))), {"MEGATRON_EXT_MAX_RESTARTS": "3"})


def test_markers_go_to_the_attempts_directory_only(tmp_path):
    env = {"MEGATRON_EXT_EXIT_MARKER_DIR": str(tmp_path), "RANK": "5"}
    write_no_retry_marker(2, "a user error", env)
    assert (tmp_path / "rank5.noretry").read_text() == "2 a user error\n"
    record = open_iteration_record(env)
    for it in (9, 10, 1234567):
        record.record(it)
    record.close()
    assert (tmp_path / "rank5.iteration").read_text().split() == ["1234567"]
    record = open_iteration_record(env)  # a new attempt's rank starts afresh
    record.record(3)
    record.close()
    assert (tmp_path / "rank5.iteration").read_text().split() == ["3"]
    # not under the launcher: nothing written anywhere
    assert open_iteration_record({"RANK": "0"}) is None
    write_no_retry_marker(1, "x", {"RANK": "0", "MEGATRON_EXT_EXIT_MARKER_DIR": str(tmp_path / "gone")})
    assert sorted(os.listdir(tmp_path)) == ["rank5.iteration", "rank5.noretry"]


def test_a_requeued_slurm_job_says_requeue_not_restart(tmp_path):
    """launch/slurm.sbatch exports MEGATRON_EXT_RESUME_FROM_SAVE and MEGATRON_EXT_REQUEUE on a requeued job
    (the launcher's attempt 0): the log line names the requeue."""
    cfg = build_job_config(tiny_values(save=str(tmp_path / "ckpt")))
    env = {"MEGATRON_EXT_RESUME_FROM_SAVE": "1", "MEGATRON_EXT_RESTART_ATTEMPT": "0", "MEGATRON_EXT_REQUEUE": "2"}
    assert apply_restart(cfg, env).startswith("> requeue 2: --save ")
    env = {**env, "MEGATRON_EXT_RESTART_ATTEMPT": "1"}  # a launcher restart inside the requeued job
    assert apply_restart(cfg, env).startswith("> restart 1: --save ")


def test_a_restart_after_a_rollback_resumes_the_rolled_back_run(tmp_path):
    """A --ckpt-step 4 resume rolled back below iteration 12 (kept in --save) and saved 6 and 8
    since: a crash's restart resumed from 12, the run rolled back from, and its next save's
    --keep-last deleted 6 and 8. The restart now takes the checkpoint published last."""
    import json

    save = str(tmp_path / "save")
    for it, published in ((4, 100.0), (12, 300.0), (6, 400.0), (8, 500.0)):
        os.makedirs(get_checkpoint_dir(save, it))
        with open(os.path.join(get_checkpoint_dir(save, it), COMPLETE_MARKER), "w") as f:
            json.dump({"iteration": it, "format_version": 1, "time": published}, f)
    cfg = build_job_config(tiny_values(save=save, load=save, ckpt_step=4))
    note = apply_restart(cfg, RESTART)
    assert (cfg.checkpoint.load, cfg.checkpoint.ckpt_step) == (save, 8)
    assert f"published last in --save {save} (iteration 8, as --ckpt-step 8; iteration 12" in note, note
    with open(os.path.join(get_checkpoint_dir(save, 12), COMPLETE_MARKER), "w") as f:  # no rollback: 12 is newest
        json.dump({"iteration": 12, "format_version": 1, "time": 600.0}, f)
    cfg = build_job_config(tiny_values(save=save, load=save, ckpt_step=4))
    assert apply_restart(cfg, RESTART).endswith("(iteration 12) (instead of the first start's --ckpt-step 4)")
    assert cfg.checkpoint.ckpt_step is None
