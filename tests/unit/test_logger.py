"""Log lines in Megatron-LM's format; TensorBoard and offline wandb writers produce files."""

from __future__ import annotations

import glob
import re

from megatron_ext.config import build_job_config
from megatron_ext.training.metrics import IterationStats, MetricWriter, format_iteration_line, format_validation_line


def test_iteration_line_has_megatron_fields():
    line = format_iteration_line(
        IterationStats(
            iteration=5,
            train_iters=100,
            consumed_samples=640,
            ms_per_iteration=123.4,
            tokens_per_second=5000.0,
            learning_rate=3e-4,
            global_batch_size=128,
            lm_loss=10.40344,
            grad_norm=1.25,
            skipped_iterations=0,
            nan_iterations=0,
            seq_length=256,
            padding_fraction=0.125,
        )
    )
    assert re.search(r"iteration\s+5/\s+100 \| consumed samples:\s+640 \|", line)
    assert "lm loss: 1.040344E+01" in line and "learning rate: 3.000000E-04" in line
    assert "grad norm: 1.250" in line and "tokens/s: 5000" in line
    assert "elapsed time per iteration (ms): 123.4" in line
    assert "seq length: 256" in line and "padding fraction: 0.125" in line
    assert "lm loss value: 2.000000E+00" in format_validation_line(10, 2.0)


def test_tensorboard_and_offline_wandb_write_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_job_config(
        {"tensorboard_dir": str(tmp_path / "tb"), "wandb_project": "test", "wandb_save_dir": str(tmp_path / "wb")}
    )
    writer = MetricWriter(cfg, enabled=True)
    writer.write({"lm loss": 3.0}, 1)
    writer.close()
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    silent = MetricWriter(cfg, enabled=False)  # non-logging ranks write nothing
    assert silent.tb is None and silent.wandb is None
    # what the loop asks before a device read for the writer alone (the loss scale)
    assert writer.active and not silent.active and not MetricWriter(build_job_config({}), enabled=True).active


def test_wandb_without_a_key_is_named_before_any_work(tmp_path, monkeypatch):
    from megatron_ext.training.metrics import check_wandb_ready

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no ~/.netrc entry: never logged in
    problem = check_wandb_ready("proj")
    assert problem and "run `wandb login`, set WANDB_API_KEY, or WANDB_MODE=offline" in problem
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert check_wandb_ready("proj") is None  # what `wandb login` writes
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check_wandb_ready("proj") is None
    assert check_wandb_ready(None) is None


def test_tensorboard_queue_size_is_summary_writers_max_queue(tmp_path):
    # Megatron-LM's --tensorboard-queue-size (default 1000) is SummaryWriter's max_queue (torch's default 10)
    for given, expected in (({}, 1000), ({"tensorboard_queue_size": 7}, 7)):
        cfg = build_job_config({"tensorboard_dir": str(tmp_path / "tb"), **given})
        writer = MetricWriter(cfg, enabled=True)
        queue = writer.tb._get_file_writer().event_writer._async_writer._byte_queue
        writer.close()
        assert queue.maxsize == expected


def test_a_tensorboard_queue_size_below_one_is_refused_naming_the_flag():
    import pytest

    from megatron_ext.config import ConfigError
    from megatron_ext.validation import validate

    with pytest.raises(ConfigError) as err:
        validate(build_job_config({"mock_data": True, "tensorboard_queue_size": 0}), 1)
    assert [p for p in err.value.problems if p.startswith("--tensorboard-queue-size must be a positive integer")]
