"""A synchronous, in-process ``torch_dist`` save strategy (safe on the CPU).

megatron-core 0.16.1's ``TorchDistSaveShardedStrategy`` always writes through
``FileSystemWriterAsync``: when a rank has data it starts a spawn-context
``multiprocessing.Manager()`` and forks one writer process per bucket, even for a synchronous
save. On CPU/gloo ranks that hung (see ``docs/megatron-core-on-cpu.md``).

``InProcessTorchDistSaveStrategy`` keeps everything else of megatron-core's strategy (the
MCore -> PyT sharded-tensor translation, the save planner with replica de-duplication, the
decentralised global plan, ``.metadata`` written by the coordinator) and swaps the writer for
``InProcessFileSystemWriter``: the same buckets, written by this process (one thread per bucket,
``thread_count`` buckets, each file fsync'ed), results kept in memory. The files and metadata are
the ones megatron-core's own writer produces, so megatron-core's loader reads them unchanged.

Checksums: every stored item's checksum (``checksum.py``) is computed from the bytes as they are
written (no second pass) and kept as ``(file, offset) -> (length, digest)`` in ``checksums``; ``directory.write_checkpoint``
gathers them into the completion marker, and ``reader.py`` checks what it reads against them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import os
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.filesystem import _write_item

from megatron_ext.checkpoint.checksum import new_hasher


@contextlib.contextmanager
def _no_results_queue():
    """``prepare_write_data`` asks for the Manager queue only to hand it to the forked writers;
    we write in-process, so answer None for the duration of the call."""
    original = filesystem_async._get_write_results_queue
    filesystem_async._get_write_results_queue = lambda: None
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = original


class _HashingStream:
    """A write-only file proxy that hashes what passes through it (``restart`` per item)."""

    def __init__(self, stream):
        self.stream, self.hasher = stream, new_hasher()

    def restart(self) -> None:
        self.hasher = new_hasher()

    def write(self, data) -> int:
        self.hasher.update(data)
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class InProcessFileSystemWriter(FileSystemWriterAsync):
    """megatron-core's bucketed writer, writing its buckets in this process."""

    def __init__(self, path: str | os.PathLike, *args: Any, snapshot: Any = None, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self._results: dict[int, list] | BaseException = {}
        self.checksums: dict[tuple[str, int], tuple[int, int]] = {}
        self.snapshot = snapshot

    def prepare_write_data(self, plan, planner) -> None:
        with _no_results_queue():
            super().prepare_write_data(plan, planner)
        if self.snapshot is not None and self.write_buckets:
            # megatron-core clones only CPU views and leaves device tensors for later: copy every
            # tensor into host memory the save owns, before training changes the originals
            self.write_buckets = [
                (path, key, (bytes_data, self.snapshot.copy([(item, t) for item, t in tensor_data])))
                for path, key, (bytes_data, tensor_data) in self.write_buckets
            ]
            self.snapshot.wait()

    def get_save_function_and_args(self) -> tuple[Callable | None, None, list]:
        if not self.write_buckets:
            return None, None, []
        return self.write_buckets_in_process, None, []

    def write_buckets_in_process(self) -> None:
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        extra = {}
        if "serialization_format" in inspect.signature(_write_item).parameters:
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            extra["serialization_format"] = SerializationFormat.TORCH_SAVE

        def write(bucket) -> list:
            path, storage_key, (bytes_data, tensor_data) = bucket
            results = []
            with open(path, "wb") as raw:
                stream = _HashingStream(raw)
                for item, data in chain(bytes_data, tensor_data):
                    if hasattr(data, "device") and data.device.type != "cpu":
                        data = data.cpu()
                    stream.restart()
                    result = _write_item(*transforms, stream, data, item, storage_key, **extra)
                    info = result.storage_data
                    self.checksums[(info.relative_path, info.offset)] = (info.length, stream.hasher.intdigest())
                    results.append(result)
                raw.flush()
                os.fsync(raw.fileno())
            return results

        try:
            if len(self.write_buckets) == 1:
                self._results = {0: write(self.write_buckets[0])}
            else:
                with concurrent.futures.ThreadPoolExecutor(len(self.write_buckets)) as pool:
                    self._results = dict(enumerate(pool.map(write, self.write_buckets)))
        except BaseException as exc:  # reported through retrieve_write_results, like the parent
            self._results = exc

    def write_error(self) -> BaseException | None:
        """The exception that stopped this rank's write (``retrieve_write_results`` returns it
        wrapped as torch's (exception, traceback) tuple, which is not an exception), or None."""
        if isinstance(self._results, BaseException):
            return self._results
        if len(self._results) != len(self.write_buckets or []):
            return RuntimeError(f"wrote {len(self._results)} of {len(self.write_buckets or [])} buckets")
        return None

    def retrieve_write_results(self):
        if isinstance(self._results, BaseException):
            return _wrap_exception(self._results)
        if len(self._results) != len(self.write_buckets or []):
            return _wrap_exception(
                RuntimeError(f"wrote {len(self._results)} of {len(self.write_buckets or [])} buckets")
            )
        return list(chain.from_iterable(self._results[i] for i in sorted(self._results)))


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """``torch_dist`` format, version 1, written synchronously by ``InProcessFileSystemWriter``.

    ``thread_count`` is the number of files (and writer threads) per rank.
    """

    def __init__(self, thread_count: int = 1, snapshot: Any = None):
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=thread_count)
        self.writer: InProcessFileSystemWriter | None = None  # the last save's (for its checksums)
        self.snapshot = snapshot  # async_save.HostSnapshot, for a save written in the background

    def async_save(self, sharded_state_dict, checkpoint_dir: Path) -> AsyncRequest:
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        writer = self.writer = InProcessFileSystemWriter(
            checkpoint_dir, thread_count=self.thread_count, snapshot=self.snapshot
        )
        ret, *_ = save_state_dict_async_plan(
            pyt_state_dict,
            writer,
            None,
            0,
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )
        save_fn, _, save_args = writer.get_save_function_and_args()
        return AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*ret)])
