"""What the tests and benchmarks share: forked gloo worlds and a tiny GPT job on synthetic data.

``run_ranks(fn, N)`` forks N gloo ranks from the calling process and collects what each returns.
Forking from a process that already imported torch and megatron-core costs well under a second
per world (a fresh interpreter costs 7-10 s here); the parent's objects are frozen for the fork, so
that the ranks' garbage collections skip them. Any rank's exception is re-raised in the
caller with that rank's traceback; a rank that hangs fails the call after ``timeout`` seconds.

The tiny job's data is a fixed random first-order Markov chain over a small vocabulary (so the
model can learn it within a few steps), with a deterministic fraction of labels masked per sample
so that valid-token counts differ between micro-batches and DP ranks. ``build_tiny_run`` goes
through ``megatron_ext.run.build_training_run``, the same assembly as ``pretrain_gpt.py``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import operator
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import fetch_step_samples
from megatron_ext.data.packed_dataset import build_packed_sample
from megatron_ext.data.padding import collate
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import ParallelContext
from megatron_ext.run import build_training_run
from megatron_ext.training.loop import TrainingRun


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
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **env,
        )
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
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
        ctx.Process(target=_worker, args=(fn, r, world_size, port, out, args, env or {}))  # may fork DataLoader workers
        for r in range(world_size)
    ]
    # The ranks' garbage collections skip the parent's objects (torch, megatron-core, pytest: some
    # 450,000): otherwise each full collection in a rank walks them all, copying every page it
    # touches, 0.25 s alone and 1-2 s with 8 ranks on 2 cores (destroy_parallel_context runs one
    # per layout). Python's recipe for fork without exec; the parent unfreezes once they are forked.
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout}s"
                ) from None
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


# ----------------------------------------------------------------------------- the tiny job

VOCAB = 128


class MarkovDataset:
    """Samples of a random Markov chain; sample i is a pure function of (seed, i)."""

    def __init__(
        self,
        seq_length: int,
        num_samples: int = 10_000,
        seed: int = 0,
        mask_every: int = 0,
        empty_samples: tuple[int, ...] = (),
    ):
        rng = np.random.default_rng(seed)
        logits = rng.normal(size=(VOCAB, VOCAB)) * 3.0
        self.probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        self.seq_length, self.n, self.seed, self.mask_every = seq_length, num_samples, seed, mask_every
        self.empty_samples = set(empty_samples)  # samples with no valid label at all

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng([self.seed, i])
        seq = np.empty(self.seq_length + 1, dtype=np.int64)
        seq[0] = rng.integers(VOCAB)
        u = rng.random(self.seq_length)
        cdf = self.probs.cumsum(1)
        for t in range(self.seq_length):
            seq[t + 1] = min(int(np.searchsorted(cdf[seq[t]], u[t])), VOCAB - 1)
        loss_mask = np.ones(self.seq_length, dtype=np.float32)
        if self.mask_every:
            # uneven valid counts: sample i loses its first (i * 7) % seq_length labels
            loss_mask[: (i * 7) % self.seq_length] = 0.0
        if i in self.empty_samples:
            loss_mask[:] = 0.0
        return {
            "tokens": seq[:-1],
            "labels": seq[1:],
            "loss_mask": loss_mask,
            "position_ids": np.arange(self.seq_length),
        }


def tiny_values(**overrides) -> dict:
    values = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        make_vocab_size_divisible_by=32,
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=20,
        lr=3e-3,
        min_lr=3e-3,
        lr_decay_style="constant",
        clip_grad=1.0,
        weight_decay=0.0,
        mock_data=True,
        tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1,
        log_interval=1,
        seed=1234,
    )
    values.update(overrides)
    return values


# the Llama-style flags of the tests' tiny models (GQA added where a test wants it)
LLAMA_STYLE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
)


class ScalarRecorder:
    """Stands in for the TensorBoard/wandb writer (``run.writer``): what was written, at which iteration."""

    active = True  # as MetricWriter.active: scalars read only for the writer are read

    def __init__(self):
        self.written: list[tuple[int, dict]] = []

    def write(self, values: dict, step: int) -> None:
        self.written.append((step, dict(values)))

    def close(self) -> None:
        pass


def build_tiny_run(values: dict, dataset: Any, valid_dataset: Any = None) -> TrainingRun:
    """The run ``pretrain_gpt.py`` would build from ``values`` (flag names), on the CPU, training
    on ``dataset``, printing nothing."""
    return build_training_run(
        build_job_config(values),
        device=torch.device("cpu"),
        data=(dataset, valid_dataset),
        log=lambda s: None,
        metrics=False,
    )


def fetch_step_microbatches(dataset: Any, indices: list[list[int]]) -> list[dict]:
    """The step's micro-batches, each padded to its own longest sample (no negotiation): what a
    test feeds ``run_forward_backward`` directly."""
    return [collate(mb) for mb in fetch_step_samples(dataset, indices)]


def _gather_dp_shards(model, ctx: ParallelContext) -> None:
    """Distributed optimizer: each DP rank holds the reduced grads of its shard only; all-gather
    the shards so every rank's buffer holds the full reduced gradient."""
    for chunk in model:
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                data = bucket.grad_data
                shard = data.numel() // ctx.dp_size
                mine = data[ctx.dp_rank * shard : (ctx.dp_rank + 1) * shard].clone()
                dist.all_gather_into_tensor(data, mine, group=ctx.dp_group)


def gather_full_grads(run: TrainingRun) -> dict[str, torch.Tensor]:
    """{global parameter name: full gradient} of this rank's parameters (after finalize)."""
    ctx, cfg = run.ctx, run.cfg
    if cfg.parallel.use_distributed_optimizer and ctx.dp_size > 1:
        _gather_dp_shards(run.model, ctx)
    out = {}
    for chunk in run.model:
        module = chunk.module
        if not hasattr(module, "share_embeddings_and_output_weights"):  # bf16/fp16: Float16Module
            module = module.module
        offset = get_layer_offset(module)
        for local_name, param in module.named_parameters():
            name = get_global_name(local_name, offset)
            if module.share_embeddings_and_output_weights and name == "output_layer.weight":
                name = "embedding.word_embeddings.weight"
            grad = param.main_grad.detach().clone()
            if getattr(param, "tensor_model_parallel", False) and ctx.tp_size > 1:
                parts = [torch.empty_like(grad) for _ in range(ctx.tp_size)]
                dist.all_gather(parts, grad, group=ctx.tp_group)
                dim = param.partition_dim
                if cfg.model.swiglu and "linear_fc1" in name:
                    halves = [p.chunk(2, dim=dim) for p in parts]
                    grad = torch.cat(
                        [torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim
                    )
                else:
                    grad = torch.cat(parts, dim=dim)
            out[name] = grad
    return out


class PackedMarkovDataset:
    """Packed samples of Markov documents with real-looking skewed lengths (lognormal), each
    sample shorter than or equal to ``seq_length``; sample i is a pure function of (seed, i)."""

    def __init__(
        self, seq_length: int, seed: int = 0, num_samples: int = 10_000, median: float = 12.0, full: bool = False
    ):
        self.docs = MarkovDataset(seq_length, seed=seed)
        self.seq_length, self.seed, self.n, self.median, self.full = seq_length, seed, num_samples, median, full

    def __len__(self) -> int:
        return self.n

    def get_documents(self, i: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, 7, i])
        budget = self.seq_length if self.full else int(rng.integers(self.seq_length // 3, self.seq_length + 1))
        docs, used, k = [], 0, 0
        while used < budget:
            n = int(min(budget - used, max(2, rng.lognormal(np.log(self.median), 0.8))))
            seq = self.docs[i * 1000 + k]["tokens"]
            docs.append(np.resize(seq, n))  # a document of n tokens
            used, k = used + n, k + 1
        return docs

    def __getitem__(self, i: int) -> dict:
        return build_packed_sample(self.get_documents(i))


class RunsThenReturns:
    """What a forger puts in a checkpoint file: pickled, it calls ``os.system(command)`` and then
    yields ``value`` (the file's real content), so a load that runs it also succeeds and nothing
    looks wrong. Tests check that ``command`` (e.g. ``touch SENTINEL``) never runs."""

    def __init__(self, command: str, value: Any):
        self.command, self.value = command, value

    def __reduce__(self):
        # itemgetter(1)((os.system(command), value)): the call happens while the tuple is built
        return operator.itemgetter(1), ((_SystemCall(self.command), self.value),)


class _SystemCall:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)
