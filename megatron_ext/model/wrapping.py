"""The model inside megatron-core's wrappers (DDP, Float16Module): one place for every module that
needs the GPTModel of a chunk."""

from __future__ import annotations

import torch


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron-core's DDP and Float16Module wrappers (the chunk itself if bare)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
