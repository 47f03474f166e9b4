"""Distributed checkpoints: save, publish atomically, resume exactly, reshard on load.

Invariant: under ``--save DIR`` a directory named ``iter_<7 digits>`` always holds a complete
checkpoint. Every save goes through these phases:

1. all ranks write their shards into ``DIR/iter_XXXXXXX.tmp-<nonce>/`` (megatron-core's
   ``dist_checkpointing`` in ``torch_dist`` format, written in-process: ``ckpt_writer.py``);
2. all ranks barrier (every shard and megatron-core's ``.metadata`` are on disk);
3. rank 0 fsyncs the files megatron-core's coordinator wrote unsynced (``common.pt``,
   ``metadata.json``) and the directory, writes ``complete.json`` into it, fsyncs that, renames
   the directory to ``iter_XXXXXXX`` and fsyncs ``DIR``;
4. rank 0 replaces ``latest_checkpointed_iteration.txt`` atomically (temp file + ``os.replace``);
5. rank 0 applies ``--keep-last N`` (older complete checkpoints only, never the newest) and removes
   leftovers of interrupted saves; all ranks barrier.

A crash in any phase leaves the previous complete checkpoint untouched. Loading takes the newest
directory that carries ``complete.json`` (a ``.tmp-`` directory never counts), so a crash between
phases 3 and 4 loses nothing either. ``MEGATRON_EXT_CKPT_FAULT=<phase>:<rank>`` makes that rank
SIGKILL itself at a named phase (optionally ``:<iteration>``: ``after_shards``, ``before_publish``, ``during_pointer_update``,
``before_retention``), for the crash tests.

Content: every model chunk (``chunk.sharded_state_dict()`` per virtual stage; megatron-core keys
layers by their global number, so the layout is not part of the format), the optimizer (the
distributed optimizer in its ``fully_reshardable`` form), the LR scheduler, ``TrainState``, each
rank's RNG states (CPU generator and megatron-core's model-parallel tracker), the flat run config,
the tokenizer identity and the padded vocabulary. The RNG states are per rank and are restored
only when the layout is unchanged; everything else reshards to any TP x PP x VPP x DP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.config import ConfigError, JobConfig

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "complete.json"
FAULT_ENV = "MEGATRON_EXT_CKPT_FAULT"
FAULT_PHASES = ("after_shards", "before_publish", "during_pointer_update", "before_retention")
FORMAT_VERSION = 1
# The distributed optimizer's form that can change TP/PP/DP on load (shared/design: the default
# 'fully_sharded_model_space' fails with "ShardedTensor.flattened_range is not supported").
SHARDED_STATE_DICT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}
_ITER_DIR = re.compile(r"^iter_(\d{7})$")

# Settings that fix the shapes and meaning of the saved weights: (config field, flag).
MODEL_SHAPE_SETTINGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "normalization", "swiglu", "disable_bias_linear",
    "untie_embeddings_and_output_weights", "position_embedding_type",
)


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about the run besides its state (built by the entry point)."""

    tokenizer: dict[str, Any]  # tokenizer.identity()
    padded_vocab_size: int


# ----------------------------------------------------------------------------- directory layout


def get_checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def list_complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(iteration, path) of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        match = _ITER_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            out.append((int(match.group(1)), path))
    return sorted(out)


def find_latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest complete checkpoint, or None. Incomplete and ``.tmp-`` directories are ignored."""
    complete = list_complete_checkpoints(root)
    return complete[-1] if complete else None


def select_checkpoints_to_delete(iterations: list[int], keep_last: int | None) -> list[int]:
    """Iterations to delete so that the newest ``keep_last`` remain; never the newest one."""
    if not keep_last or keep_last < 1:
        return []
    ordered = sorted(iterations)
    return ordered[: max(len(ordered) - keep_last, 0)]


def read_tracker(root: str) -> int | None:
    """The iteration in ``latest_checkpointed_iteration.txt`` (informational; Megatron-LM's file)."""
    try:
        with open(os.path.join(root, TRACKER_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def should_inject_fault(spec: str | None, phase: str, rank: int, iteration: int) -> bool:
    """Whether ``spec`` = ``<phase>:<rank>[:<iteration>]`` names this point (pure)."""
    if not spec:
        return False
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in FAULT_PHASES:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected <phase>:<rank>[:<iteration>] with phase one of {FAULT_PHASES}"
        )
    return (parts[0] == phase and int(parts[1]) == rank
            and (len(parts) == 2 or int(parts[2]) == iteration))


def maybe_inject_fault(phase: str, rank: int, iteration: int) -> None:
    """SIGKILL this process at a named save phase when ``MEGATRON_EXT_CKPT_FAULT`` says so."""
    if should_inject_fault(os.environ.get(FAULT_ENV), phase, rank, iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_coordinator_files(tmp_dir: str) -> None:
    """Make the files megatron-core's coordinator wrote durable (``common.pt`` and
    ``metadata.json`` are written without fsync; torch's ``.metadata`` is fsynced already, which
    makes a second fsync nearly free), and the directory's entries. Every rank's ``*.distcp``
    shards were fsynced by their writer (``ckpt_writer.py``) and are not reopened here: on a
    shared file system that would be one open per rank file."""
    for name in os.listdir(tmp_dir):
        path = os.path.join(tmp_dir, name)
        if name.endswith(".distcp") or not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(tmp_dir)


def publish_checkpoint(tmp_dir: str, final_dir: str, root: str, iteration: int, rank: int) -> None:
    """Rank 0, after every rank wrote its shards: marker, rename, pointer (phases 3-4). Before
    the marker, everything in the directory is durable, so a power loss after the publish cannot
    leave a marked checkpoint with a missing or torn file."""
    maybe_inject_fault("before_publish", rank, iteration)
    _fsync_coordinator_files(tmp_dir)
    _write_file_durably(
        os.path.join(tmp_dir, COMPLETE_MARKER),
        json.dumps({"iteration": iteration, "format_version": FORMAT_VERSION, "time": time.time()}),
    )
    if os.path.exists(final_dir):  # the same iteration saved again (e.g. after a resume)
        stale = f"{final_dir}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final_dir, stale)
        os.rename(tmp_dir, final_dir)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    tracker_tmp = os.path.join(root, f".{TRACKER_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    _write_file_durably(tracker_tmp, str(iteration))
    maybe_inject_fault("during_pointer_update", rank, iteration)
    os.replace(tracker_tmp, os.path.join(root, TRACKER_FILE))
    _fsync_dir(root)


def apply_retention(root: str, keep_last: int | None, keep_dir: str) -> list[str]:
    """Delete old complete checkpoints beyond ``keep_last`` and leftovers of interrupted saves
    (``*.tmp-*``, ``*.old-*``, stale pointer temp files); returns the deleted paths."""
    complete = list_complete_checkpoints(root)
    doomed = set(select_checkpoints_to_delete([it for it, _ in complete], keep_last))
    deleted = [path for it, path in complete if it in doomed and path != keep_dir]
    for name in os.listdir(root):
        if ".tmp-" in name or ".old-" in name:
            deleted.append(os.path.join(root, name))
    for path in deleted:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # a pointer temp file may already be gone
                os.remove(path)
    return deleted



# ----------------------------------------------------------------------------- state


def get_layout(run) -> dict[str, int]:
    ctx = run.ctx
    return {"world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size,
            "dp": ctx.dp_size, "vp": ctx.vp_size or 1}


def get_rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def build_model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    """{"model<i>": sharded state dict of virtual stage i}. Keys inside are global (megatron-core
    offsets each chunk's layers), so the nesting does not tie the checkpoint to a VPP size."""
    return {
        f"model{i}": chunk.module.sharded_state_dict(prefix="", metadata=dict(SHARDED_STATE_DICT_METADATA))
        for i, chunk in enumerate(model)
    }


def build_sharded_state_dict(
    run, meta: CheckpointMeta, *, is_loading: bool, include_optimizer: bool, include_rng: bool
) -> dict[str, Any]:
    """The whole checkpoint as megatron-core's sharded state dict."""
    from megatron.core.dist_checkpointing import ShardedObject

    state = build_model_sharded_state_dict(run.model)
    if include_optimizer:
        # megatron-core finds each parameter's ShardedTensor anywhere in the nested dict
        state["optimizer"] = run.optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=dict(SHARDED_STATE_DICT_METADATA)
        )
        state["opt_param_scheduler"] = run.scheduler.state_dict()
    if include_rng:
        ctx = run.ctx
        state["rng_state"] = ShardedObject(
            "rng_state", get_rng_state(), (ctx.world_size,), (ctx.rank,), replica_id=0
        )
    state["train_state"] = dataclasses.asdict(run.state)
    state["args"] = run.cfg.to_flat_dict()
    state["tokenizer"] = dict(meta.tokenizer)
    state["padded_vocab_size"] = meta.padded_vocab_size
    state["layout"] = get_layout(run)
    state["checkpoint_version"] = FORMAT_VERSION
    return state


def write_checkpoint(state: dict[str, Any], root: str, iteration: int, keep_last: int | None = None) -> str:
    """Write a sharded state dict as ``root/iter_<iteration>`` through the phases of the module
    docstring; collective over the world. Returns the published directory."""
    from megatron.core import dist_checkpointing

    from megatron_ext.ckpt_writer import InProcessTorchDistSaveStrategy

    rank = dist.get_rank()
    final_dir = get_checkpoint_dir(root, iteration)
    nonce = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    tmp_dir = f"{final_dir}.tmp-{nonce[0]}"
    if rank == 0:
        os.makedirs(tmp_dir)
    dist.barrier()
    dist_checkpointing.save(state, tmp_dir, sharded_strategy=InProcessTorchDistSaveStrategy())
    maybe_inject_fault("after_shards", rank, iteration)
    dist.barrier()
    if rank == 0:
        publish_checkpoint(tmp_dir, final_dir, root, iteration, rank)
        maybe_inject_fault("before_retention", rank, iteration)
        apply_retention(root, keep_last, final_dir)
    dist.barrier()
    return final_dir


def save_checkpoint(run, root: str, meta: CheckpointMeta, keep_last: int | None = None) -> str:
    """Save the run at its current iteration under ``root``; collective over the world.
    Returns the published directory."""
    start = time.perf_counter()
    with _catch_megatron_state_corruption() as corrupted:
        state = build_sharded_state_dict(run, meta, is_loading=False, include_optimizer=True, include_rng=True)
    for message in sorted(set(corrupted)):
        # megatron-core 0.16.1 (its issue #504): part of this parameter's optimizer state is
        # written as zeros; say so on every rank where it happens instead of a buried log line
        run.log(f"WARNING rank {run.ctx.rank}: the saved optimizer state is incomplete, a resume "
                f"will not be exact: {message}")
    final_dir = write_checkpoint(state, root, run.state.iteration, keep_last)
    if run.ctx.is_logging_rank:
        run.log(f"saved checkpoint at iteration {run.state.iteration:8d} to {final_dir} "
                f"in {time.perf_counter() - start:.2f} s")
    return final_dir


@contextlib.contextmanager
def _catch_megatron_state_corruption():
    """Collect megatron-core's "param range exceeds unpadded buffer" warnings while building
    the optimizer's sharded state dict."""
    import logging

    found: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "exceeds unpadded buffer" in message:
                found.append(message)

    mcore_logger = logging.getLogger("megatron.core.optimizer.distrib_optimizer")
    handler = _Catch(level=logging.WARNING)
    mcore_logger.addHandler(handler)
    try:
        yield found
    finally:
        mcore_logger.removeHandler(handler)


# ----------------------------------------------------------------------------- load


def check_compatible(
    saved: dict[str, Any], cfg: JobConfig, meta: CheckpointMeta, load_optimizer: bool = True
) -> list[str]:
    """Problems that make a checkpoint unusable for this run, each naming the flag and values."""
    problems = []
    args = saved.get("args", {})
    current = cfg.to_flat_dict()
    for name in MODEL_SHAPE_SETTINGS:
        if name in args and args[name] != current[name]:
            problems.append(
                f"--{name.replace('_', '-')}: the checkpoint was saved with {args[name]!r}, this run "
                f"has {current[name]!r}; use the checkpoint's value or another --load directory"
            )
    if load_optimizer and "use_distributed_optimizer" in args and (
        args["use_distributed_optimizer"] != current["use_distributed_optimizer"]
    ):
        problems.append(
            f"--use-distributed-optimizer: the checkpoint was saved with "
            f"{args['use_distributed_optimizer']}, this run has {current['use_distributed_optimizer']}; "
            f"their optimizer states differ in form: use the checkpoint's setting, or --no-load-optim "
            f"to load the weights only"
        )
    if saved.get("padded_vocab_size") not in (None, meta.padded_vocab_size):
        problems.append(
            f"vocabulary: the checkpoint's padded vocabulary is {saved['padded_vocab_size']}, this run's "
            f"is {meta.padded_vocab_size} (--vocab-size / --tokenizer-model, "
            f"--make-vocab-size-divisible-by x --tensor-model-parallel-size): use the checkpoint's "
            f"tokenizer and padding"
        )
    saved_tok = saved.get("tokenizer")
    if saved_tok is not None and saved_tok != meta.tokenizer:
        problems.append(
            f"--tokenizer-type/--tokenizer-model: the checkpoint was saved with tokenizer {saved_tok}, "
            f"this run uses {meta.tokenizer}"
        )
    return problems


def load_full_tensors(ckpt_dir: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """{checkpoint key: full unsharded tensor} for every tensor whose key starts with ``prefix``,
    read in this process without a process group (for tools and tests). Layer-stacked keys
    (``decoder.layers.*``) have the global layer index as dimension 0."""
    from torch.distributed import checkpoint as dcp

    reader = dcp.FileSystemReader(ckpt_dir)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(md, "size")
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def read_checkpoint_common(ckpt_dir: str) -> dict[str, Any]:
    """The non-sharded part of a checkpoint (args, train state, scheduler, ...), no process group."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    return load_common_state_dict(ckpt_dir)


def init_empty_optimizer_state(optimizer) -> None:
    """Give Adam parameters without state (no step taken yet) zero moments and step 0, as
    ``torch.optim.AdamW`` would on its first step. megatron-core's distributed optimizer reads the
    step count from that state while building its sharded state dict, also for a load (0.16.1,
    torch optimizers: it asserts one common step)."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def load_optimizer_state(optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` plus two fixes for megatron-core 0.16.1's distributed
    optimizer over torch's Adam (no Apex/TE):

    - its fully-reshardable load copies every per-parameter state entry from the checkpoint but
      skips "step" on the source side, then fails on it (``KeyError: 'step'``); we hand each
      parameter's own (already restored) step back as the source;
    - it gives all parameters one shared ``step`` tensor, which torch's Adam increments in place
      once per parameter, so after a resume the bias correction would run N times too fast; each
      parameter gets its own copy.
    """
    patched = []
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(wrapper, "_set_main_param_and_optimizer_states"):
            patched.append(wrapper)
            wrapper._set_main_param_and_optimizer_states = _keep_own_step(wrapper)
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for wrapper in patched:
            del wrapper._set_main_param_and_optimizer_states  # back to the class method
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _keep_own_step(dist_opt):
    original = type(dist_opt)._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = dist_opt.model_param_group_index_map[model_param]
        main_param = dist_opt.optimizer.param_groups[group_index]["params"][group_order]
        step = dist_opt.optimizer.state[main_param].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}
        return original(dist_opt, model_param, tensors)

    return set_states


def load_checkpoint(run, root: str, meta: CheckpointMeta, load_optimizer: bool = True) -> int | None:
    """Restore ``run`` from the newest complete checkpoint under ``root``; collective.

    Returns the loaded iteration, or None when ``root`` holds no complete checkpoint (a fresh
    start). Raises ConfigError, before anything is written, when the model or tokenizer differ.
    """
    from megatron.core import dist_checkpointing

    found = find_latest_checkpoint(root)
    if found is None:
        return None
    iteration, ckpt_dir = found
    common = read_checkpoint_common(ckpt_dir)
    problems = check_compatible(common, run.cfg, meta, load_optimizer)
    if problems:
        raise ConfigError([f"--load {root} ({os.path.basename(ckpt_dir)}): {p}" for p in problems])
    if load_optimizer and "opt_param_scheduler" not in common:
        load_optimizer = False  # weights only, e.g. converted by tools/convert_checkpoint.py
        if run.ctx.is_logging_rank:
            run.log(f"{ckpt_dir} holds no optimizer state: starting with a fresh optimizer")
    same_layout = common.get("layout") == get_layout(run)
    if load_optimizer:
        init_empty_optimizer_state(run.optimizer)
    state = build_sharded_state_dict(
        run, meta, is_loading=True, include_optimizer=load_optimizer, include_rng=same_layout
    )
    from megatron_ext.ckpt_reader import DirectReadTorchDistLoadStrategy

    loaded = dist_checkpointing.load(state, ckpt_dir, sharded_strategy=DirectReadTorchDistLoadStrategy())
    if load_optimizer:
        load_optimizer_state(run.optimizer, loaded["optimizer"])
        run.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    for i, chunk in enumerate(run.model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if same_layout:
        set_rng_state(loaded["rng_state"])
    run.state = type(run.state)(**loaded.get("train_state", {}))
    if run.ctx.is_logging_rank:
        how = "same layout" if same_layout else f"resharded from {common.get('layout')}"
        run.log(f"loaded checkpoint {ckpt_dir} at iteration {iteration} ({how})")
    return iteration


# ----------------------------------------------------------------------------- wiring


def build_checkpoint_hook(cfg: JobConfig, meta: CheckpointMeta, decider=None):
    """A ``TrainingRun.after_step`` hook: decide (agreed by all ranks) whether to stop, save on
    ``--save-interval``, at ``--train-iters`` and before stopping; returns "stop"."""
    from megatron_ext.signals import ExitDecider, describe_exit

    c = cfg.checkpoint
    if decider is None:
        decider = ExitDecider(c.exit_signal_handler, c.exit_interval, c.exit_duration_in_mins)

    def after_step(run) -> bool:
        iteration = run.state.iteration
        flags = decider.decide(iteration)
        due = bool(c.save_interval) and iteration % c.save_interval == 0
        if c.save and (due or flags or iteration == cfg.training.train_iters):
            save_checkpoint(run, c.save, meta, c.keep_last)
        if flags and run.ctx.is_logging_rank:
            run.log(f"exiting after iteration {iteration}: {describe_exit(flags)}")
        return bool(flags)

    after_step.decider = decider
    return after_step


def build_exit_decider(cfg: JobConfig):
    """The exit decider of a run, built first thing in the entry point so that a SIGTERM during
    start-up is recorded too, and --exit-duration-in-mins counts from the job's start."""
    from megatron_ext.signals import ExitDecider

    c = cfg.checkpoint
    return ExitDecider(c.exit_signal_handler, c.exit_interval, c.exit_duration_in_mins)


def setup_checkpointing(run, meta: CheckpointMeta, decider=None) -> int | None:
    """Entry-point wiring: resume from ``--load`` (if it holds a checkpoint), then register the
    save/exit hook. Returns the loaded iteration or None."""
    c = run.cfg.checkpoint
    loaded = None
    if c.load:
        loaded = load_checkpoint(run, c.load, meta, load_optimizer=not c.no_load_optim)
    if c.save or c.exit_signal_handler or c.exit_interval or c.exit_duration_in_mins:
        run.after_step.append(build_checkpoint_hook(run.cfg, meta, decider))
    return loaded
