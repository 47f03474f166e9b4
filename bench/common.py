"""Shared bench set-up: a one-rank gloo world in this process (megatron-core needs its groups)."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def init_single_rank_world(timeout_minutes: int = 10) -> None:
    """RANK 0 of WORLD_SIZE 1 on loopback, on a free port."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
