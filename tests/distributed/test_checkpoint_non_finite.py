"""A save never publishes non-finite weights, and the last finite checkpoint survives.

An update from finite gradients overflows the weights when the learning rate is absurd: here each
rank's optimizer groups get lr 1e39 after iteration 2 (on pipeline stage 1 only, or everywhere),
so the update of iteration 3 makes them Inf while its loss and gradients are finite (the NaN guard
sees nothing). With a save every step and ``--keep-last 1``:

- synchronous, PP2, stage 1 diverging: the save of iteration 3 is refused on every rank with
  WeightsNotFinite (a TrainingDiverged: the entry point exits 1) naming the update of iteration 3,
  rank 1 and its first non-finite parameter, and iteration 2's checkpoint, which stays the only
  one, byte for byte, with its pointer; no temporary directory is left. A run resumed from it
  trains the same losses as a run that never diverged;
- ``--async-save``, both stages diverging: the save of iteration 3 is refused at the next step
  boundary (the "not finite" bit rides in the exit decision's all-reduce), the same way;
- ``--async-save`` and a save that stays synchronous: the last one of the run (--train-iters 3),
  and the one before an exit (--exit-interval 3): refused at iteration 3 the same way;
- through the real entry point (``pretrain_gpt.run_cli``, DP2, ``--bf16
  --use-distributed-optimizer``: the bf16 model parameters are what megatron-core copies the fp32
  main parameters into after each update), ``--lr 1e39 --lr-warmup-iters 2``: exit status 1 on
  every rank and one ``error:`` line for the launch naming iteration 2 and the checkpoint of
  iteration 1; a disk that fills during the save of iteration 2 (ENOSPC injected into rank 1's
  shard writes) is exit status 1 and one ``error:`` line naming the directory and its free space,
  not a traceback per rank.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os

import pytest

from megatron_ext.checkpoint.directory import get_checkpoint_dir, list_complete_checkpoints, read_tracker
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import TrainingDiverged, train

pytestmark = pytest.mark.distributed

# every run is built for 6 iterations (one LR schedule, which a resume compares) and trained as far as a case needs
VALUES = dict(
    num_layers=2,
    pipeline_model_parallel_size=2,
    global_batch_size=4,
    micro_batch_size=1,
    save_interval=1,
    keep_last=1,
    train_iters=6,
)
ABSURD_LR = 1e39  # an Adam update of about lr x 1 overflows fp32 (max 3.4e38)


def _dataset():
    return MarkovDataset(32, mask_every=1)


def digest_files(path: str) -> dict[str, str] | None:
    """{file: sha256} of a checkpoint directory; None when it is gone."""
    if not os.path.isdir(path):
        return None
    return {
        name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(path))
    }


def make_lr_absurd(run) -> None:
    """From the next update on, this rank's every parameter group steps with ``ABSURD_LR`` (the
    scheduler set each group's ``lr`` for the next step already, and reads ``max_lr`` after it)."""
    for group in run.optimizer.param_groups:
        group["lr"] = group["max_lr"] = group["min_lr"] = ABSURD_LR


def train_to(run, iterations: int) -> None:
    run.cfg.training.train_iters = iterations
    train(run)


def _diverge(rank: int, root: str, async_save: bool, diverging_ranks: tuple[int, ...], end: int = 6, **values) -> dict:
    """Train 2 iterations (saved), make the lr absurd on ``diverging_ranks``, train on to ``end``."""
    run = build_tiny_run(tiny_values(**VALUES, save=root, async_save=async_save, **values), _dataset())
    train_to(run, 2)
    kept = digest_files(get_checkpoint_dir(root, 2)) if rank == 0 else None
    if rank in diverging_ranks:
        make_lr_absurd(run)
    try:
        train_to(run, end)
        error = None
    except TrainingDiverged as err:  # without the check: the NaN guard's, after the save was published
        error = (type(err).__name__, str(err))
    out = {
        "error": error,
        "iteration": run.state.iteration,
        "kept": kept,
        "intact": digest_files(get_checkpoint_dir(root, 2)) == kept if rank == 0 else None,
    }
    destroy_parallel_context()
    return out


def _losses(load: str | None = None) -> list[float]:
    """The losses of iterations 1-4, or of those after ``load``'s checkpoint."""
    run = build_tiny_run(tiny_values(**dict(VALUES, save=None)), _dataset())
    if load:
        load_checkpoint(run, load)
    train_to(run, 4)
    destroy_parallel_context()
    return [r["loss"] for r in run.records]


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {"sync": _diverge(rank, f"{root}/sync", False, diverging_ranks=(1,))}
    out["async"] = _diverge(rank, f"{root}/async", True, diverging_ranks=(0, 1))
    out["final"] = _diverge(rank, f"{root}/final", True, diverging_ranks=(0, 1), end=3)
    out["exit"] = _diverge(rank, f"{root}/exit", True, diverging_ranks=(0, 1), exit_interval=3)
    out["reference"] = _losses()
    out["resumed"] = _losses(load=f"{root}/sync")
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nonfinite"))
    return root, run_ranks(_world, 2, root, timeout=600)


@pytest.mark.parametrize("mode,stopped_after", [("sync", 3), ("async", 4), ("final", 3), ("exit", 3)])
def test_a_non_finite_save_is_refused_and_the_last_finite_checkpoint_survives(world, mode, stopped_after):
    root, results = world
    save = f"{root}/{mode}"
    errors = {r[mode]["error"] for r in results}
    assert len(errors) == 1 and None not in errors, errors  # every rank, the same message
    ((name, message),) = errors
    assert name == "WeightsNotFinite", (name, message)
    assert all(r[mode]["iteration"] == stopped_after for r in results)  # async: one step boundary later
    assert message.startswith("training diverged: the update of iteration 3 made the weights non-finite"), message
    assert "they were finite at the save of iteration 2" in message, message
    assert f"checkpoint of iteration 3 not saved to {save}" in message, message
    assert f"the newest complete one is {get_checkpoint_dir(save, 2)} (iteration 2)" in message, message
    if mode == "sync":  # stage 1 only: rank 1 named, with a parameter of its own layer
        assert "(rank 1: decoder.layers.1." in message and "rank 0" not in message, message
    else:
        assert "rank 0: embedding.word_embeddings.weight" in message and "rank 1: decoder.layers.1." in message
    assert [it for it, _ in list_complete_checkpoints(save)] == [2]  # --keep-last 1 deleted nothing
    assert read_tracker(save) == 2
    assert not [n for n in os.listdir(save) if ".tmp-" in n or ".old-" in n], os.listdir(save)
    assert results[0][mode]["intact"], "iteration 2's checkpoint changed"


def test_the_surviving_checkpoint_resumes_the_run_that_never_diverged(world):
    _, results = world
    reference = results[-1]["reference"]  # last stage
    assert len(reference) == 4 and results[-1]["resumed"] == reference[2:]


# ----------------------------------------------------------------------------- the entry point

ENTRY = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "127",
    "--device",
    "cpu",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--save-interval",
    "1",
    "--keep-last",
    "1",
    "--bf16",
    "--use-distributed-optimizer",
    "--log-interval",
    "1",
]


def _run_cli(argv: list[str]) -> tuple[int, str]:
    """``pretrain_gpt.run_cli`` in this rank: (exit status, what it wrote to stderr)."""
    import pretrain_gpt

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = pretrain_gpt.run_cli(argv)
    destroy_parallel_context()  # the entry point leaves it on an error; the next case builds its own
    return status, err.getvalue()


@contextlib.contextmanager
def fill_disk_at(rank: int, iteration: int):
    """ENOSPC from the real shard writer's every write on ``rank`` during the save of ``iteration``."""
    import megatron_ext.checkpoint.directory as directory
    import megatron_ext.checkpoint.writer as writer

    original_write, original_begin = writer._HashingStream.write, directory.begin_checkpoint_write
    saving = {"iteration": None}

    def begin(state, root, it, *args, **kwargs):
        saving["iteration"] = it
        return original_begin(state, root, it, *args, **kwargs)

    def write(self, data):
        if saving["iteration"] == iteration and int(os.environ["RANK"]) == rank:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original_write(self, data)

    directory.begin_checkpoint_write, writer._HashingStream.write = begin, write
    try:
        yield
    finally:
        directory.begin_checkpoint_write, writer._HashingStream.write = original_begin, original_write


def _entry_world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    with fill_disk_at(1, iteration=2):
        out["disk_full"] = _run_cli(ENTRY + ["--save", f"{root}/full", "--lr", "1e-3"])
    # last: a run that ends well destroys the process group
    out["non_finite"] = _run_cli(ENTRY + ["--save", f"{root}/lr", "--lr", "1e39", "--lr-warmup-iters", "2"])
    return out


@pytest.fixture(scope="module")
def entry(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("entry"))
    return root, run_ranks(_entry_world, 2, root, timeout=600)


def _one_error_line(results: list[dict], case: str) -> str:
    assert [r[case][0] for r in results] == [1, 1], [r[case] for r in results]
    printed = "".join(r[case][1] for r in results)
    assert printed.count("error: ") == 1 and "Traceback" not in printed, printed
    return printed


def test_the_entry_point_refuses_non_finite_bf16_weights_with_exit_status_1(entry):
    root, results = entry
    printed = _one_error_line(results, "non_finite")
    # --lr-warmup-iters 2: iteration 1 steps with lr 0 (saved, finite); iteration 2 with 5e38
    assert "error: training diverged: the update of iteration 2 made the weights non-finite" in printed, printed
    assert f"the newest complete one is {get_checkpoint_dir(f'{root}/lr', 1)} (iteration 1)" in printed, printed
    assert "ranks 0, 1: " in printed, printed  # DP replicas: the same parameters, the same finding
    assert [it for it, _ in list_complete_checkpoints(f"{root}/lr")] == [1]


def test_a_full_disk_during_a_save_is_one_error_naming_the_directory_and_its_free_space(entry):
    root, results = entry
    printed = _one_error_line(results, "disk_full")
    assert (
        f"error: checkpoint of iteration 2 not saved to {root}/full: the write failed on rank 1: OSError(28, "
        in printed
    ), printed
    assert "No space left on device (injected)" in printed and "MiB free" in printed, printed
    assert [it for it, _ in list_complete_checkpoints(f"{root}/full")] == [1]
    assert not [n for n in os.listdir(f"{root}/full") if ".tmp-" in n], os.listdir(f"{root}/full")
