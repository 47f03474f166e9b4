"""Fork N gloo ranks from the test process and collect what each returns.

Forking from a process that already imported torch and megatron-core costs well under a second
per world (a fresh interpreter costs 7-10 s here). Any rank's exception is re-raised in the
caller with that rank's traceback; a rank that hangs fails the call after ``timeout`` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable


def get_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, out: Any, args: tuple, env: dict) -> None:
    status, payload = "ok", None
    try:
        import datetime

        import torch
        import torch.distributed as dist

        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env,
        )
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        payload = fn(rank, world_size, *args)
    except BaseException:  # report everything, including SystemExit from a ConfigError path
        status, payload = "error", traceback.format_exc()
    try:
        # Plain pickle (by value): torch's fd-sharing reducer dies with the exiting worker.
        out.put((rank, status, pickle.dumps(payload)))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600, env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; results by rank."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = get_free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, out, args, env or {}), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout}s")
            payload = pickle.loads(payload)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the others are likely blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=2 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
