"""Megatron-LM style log lines, throughput as users compare runs, and TensorBoard / Weights &
Biases scalars on request.

Only the logging rank (last rank: last pipeline stage, where the loss is known) writes.

Throughput counts real tokens only (padding is work, not progress). Model FLOPs follow Megatron-LM's
``num_floating_point_operations`` (training.py; GQA and SwiGLU aware; Korthikanti et al. 2022:
72 B s L h^2 (1 + s/6h + V/12hL) for GPT-2 shapes), with the attention-score term counted per
document for packed micro-batches and per row's real length otherwise. MFU divides the achieved
TFLOP/s per GPU by the dense bf16 peak of the device (``PEAK_BF16_TFLOPS``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from typing import Any

from megatron_ext.config import JobConfig, ModelConfig
from megatron_ext.derived import get_ffn_hidden_size, get_kv_channels, get_num_query_groups

# Dense bf16 peak TFLOP/s by device name, most specific first (vendor data sheets).
PEAK_BF16_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
)


def get_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name, or None when unknown (no MFU is printed)."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def num_floating_point_operations(
    m: ModelConfig, padded_vocab_size: int, num_tokens: float, attention_pairs: float
) -> float:
    """Training FLOPs (forward + backward) of ``num_tokens`` real tokens whose attention covers
    ``attention_pairs`` = sum of (document or row length)^2, in Megatron-LM's accounting:
    12 L h^2 [T ((1 + g/a) r + (f/h) k + V/(2Lh)) + r P/h] with r = a d_head / h, k = 3/2 with
    SwiGLU (else 1). For T = B s and P = B s^2 this is Megatron-LM's formula exactly."""
    h, layers, heads = m.hidden_size, m.num_layers, m.num_attention_heads
    query_ratio = get_kv_channels(m) * heads / h  # the queries' width over hidden (Qwen3-0.6B: 2)
    groups = get_num_query_groups(m)
    gated = 1.5 if m.swiglu else 1.0
    per_token = (
        (1 + groups / heads) * query_ratio + get_ffn_hidden_size(m) / h * gated + padded_vocab_size / (2 * layers * h)
    )
    return 12.0 * layers * h * h * (num_tokens * per_token + query_ratio * attention_pairs / h)


def get_memory_stats(device) -> dict[str, float]:
    """Peak memory in GiB: allocated and reserved on CUDA, the process's max RSS on the CPU."""
    import torch

    gib = 1024**3
    if getattr(device, "type", "cpu") == "cuda":
        return {
            "allocated-GiB": torch.cuda.max_memory_allocated(device) / gib,
            "reserved-GiB": torch.cuda.max_memory_reserved(device) / gib,
        }
    import resource

    return {"max-rss-GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}


def get_memory_report(device) -> str:
    """Peak memory so far: allocated/reserved on CUDA, the process's max RSS on the CPU."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        gib = 1024**3
        return (
            f"mem allocated (GiB): {torch.cuda.max_memory_allocated(device) / gib:.2f} | "
            f"mem reserved (GiB): {torch.cuda.max_memory_reserved(device) / gib:.2f}"
        )
    import resource

    return f"max RSS (GiB): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f}"


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
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    num_zeros_in_grad: float | None = None  # --log-num-zeros-in-grad
    params_norm: float | None = None  # --log-params-norm


def get_log_line_scalars(
    s: IterationStats, loss_scale: float | None = None, world_size: int | None = None
) -> dict[str, float]:
    """What TensorBoard/wandb get at a log line (the per-iteration scalars are written apart): throughput,
    and the loss scale (--log-loss-scale-to-tensorboard), world size (--log-world-size-to-tensorboard) and
    parameters' norm (--log-params-norm) where given."""
    values = {"tokens/s": s.tokens_per_second, "throughput per GPU (TFLOP/s/GPU)": s.tflops_per_gpu}
    named = {"loss scale": loss_scale, "world size": world_size, "params norm": s.params_norm}
    return values | {k: v for k, v in named.items() if v is not None}


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
    if s.tflops_per_gpu is not None:
        parts.insert(
            4,
            f"throughput per GPU (TFLOP/s/GPU): {s.tflops_per_gpu:.1f}"
            if s.tflops_per_gpu >= 10
            else f"throughput per GPU (TFLOP/s/GPU): {s.tflops_per_gpu:.3f}",
        )
    if s.mfu is not None:
        parts.insert(5, f"MFU: {100 * s.mfu:.1f}%")
    if s.grad_norm is not None:
        parts.append(f"grad norm: {s.grad_norm:.3f}")
    if s.num_zeros_in_grad is not None:
        parts.append(f"num zeros: {s.num_zeros_in_grad}")
    if s.params_norm is not None:
        parts.append(f"params norm: {s.params_norm:.3f}")
    if s.seq_length is not None:
        parts.append(f"seq length: {s.seq_length}")
    if s.padding_fraction is not None:
        parts.append(f"padding fraction: {s.padding_fraction:.3f}")
    parts.append(f"number of skipped iterations: {s.skipped_iterations:3d}")
    parts.append(f"number of nan iterations: {s.nan_iterations:3d}")
    return " | ".join(parts) + " |"


def get_perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) as Megatron-LM's validation line caps it."""
    return math.exp(min(20.0, loss))


def format_validation_line(iteration: int, loss: float, suffix: str = "", name: str = "") -> str:
    """Megatron-LM's validation line; ``suffix`` "-K" for the K-th of --multiple-validation-sets, whose
    ``name`` (its prefix) ends the line."""
    ppl = get_perplexity(loss)
    line = f" validation{suffix} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
    return line + (f" set: {name} |" if name else "")


def check_wandb_ready(wandb_project: str | None) -> str | None:
    """A problem that would stop ``wandb.init`` on the logging rank alone, after start-up (the other
    ranks would wait in a collective), said before any work; None when wandb will start. Looks
    only at the environment: the package, WANDB_MODE, WANDB_API_KEY, ~/.netrc (``wandb login``)."""
    if not wandb_project:
        return None
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return f"--wandb-project {wandb_project} needs the wandb package: pip install wandb"
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (
        f"--wandb-project {wandb_project}: wandb has no API key on this machine: run `wandb login`, set "
        f"WANDB_API_KEY, or WANDB_MODE=offline (then `wandb sync` the run directory)"
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

            self.tb = SummaryWriter(log_dir=lg.tensorboard_dir, max_queue=lg.tensorboard_queue_size)
        if lg.wandb_project:
            import wandb

            save_dir = lg.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=lg.wandb_project,
                name=lg.wandb_exp_name,
                dir=save_dir,
                config=cfg.to_flat_dict(),
            )

    @property
    def active(self) -> bool:
        """Whether anything is written (a scalar read only for it, e.g. a device value, can be skipped)."""
        return self.tb is not None or self.wandb is not None

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
