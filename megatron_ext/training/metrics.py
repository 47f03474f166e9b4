"""Megatron-LM style log lines, and TensorBoard / Weights & Biases scalars on request.

Only the logging rank (last rank: last pipeline stage, where the loss is known) writes.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from typing import Any

from megatron_ext.config import JobConfig


@dataclasses.dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    ms_per_iteration: float
    tokens_per_second: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    seq_length: int | None = None
    padding_fraction: float | None = None


def format_iteration_line(s: IterationStats) -> str:
    """One line in Megatron-LM's format (extra fields appended)."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {s.iteration:8d}/{s.train_iters:8d}",
        f"consumed samples: {s.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {s.ms_per_iteration:.1f}",
        f"tokens/s: {s.tokens_per_second:.0f}",
        f"learning rate: {s.learning_rate:.6E}",
        f"global batch size: {s.global_batch_size:5d}",
        f"lm loss: {s.lm_loss:.6E}",
    ]
    if s.grad_norm is not None:
        parts.append(f"grad norm: {s.grad_norm:.3f}")
    if s.seq_length is not None:
        parts.append(f"seq length: {s.seq_length}")
    if s.padding_fraction is not None:
        parts.append(f"padding fraction: {s.padding_fraction:.3f}")
    parts.append(f"number of skipped iterations: {s.skipped_iterations:3d}")
    parts.append(f"number of nan iterations: {s.nan_iterations:3d}")
    return " | ".join(parts) + " |"


def format_validation_line(iteration: int, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return (
        f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
        f"lm loss PPL: {ppl:.6E} |"
    )


class MetricWriter:
    """TensorBoard and wandb scalars; a no-op unless configured (and on non-logging ranks)."""

    def __init__(self, cfg: JobConfig, enabled: bool):
        self.tb: Any = None
        self.wandb: Any = None
        if not enabled:
            return
        lg = cfg.logging
        if lg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=lg.tensorboard_dir)
        if lg.wandb_project:
            import wandb

            save_dir = lg.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=lg.wandb_project, name=lg.wandb_exp_name, dir=save_dir,
                config=cfg.to_flat_dict(),
            )

    def write(self, values: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
