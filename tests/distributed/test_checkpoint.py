"""Checkpoints: exact resume, resharding across layouts, refusal of a different model.

One 8-rank world (TP2 x PP2 x VPP2 x DP2 with the distributed optimizer, 8 layers) trains the
uninterrupted reference, then a run that stops at iteration K through --exit-interval (saving
there), then resumes it in the same layout (losses must be bit-identical), then loads the same
checkpoint under PP4 x DP2 and TP2 x DP4, each time saving it again at iteration K and training
on. A 1-rank world does the same in one process. Every load runs twice, without and with
``--ckpt-verify`` (every item hashed and checked, in every layout). The re-saved checkpoints must
hold exactly the weights and Adam moments of the original (compared as full tensors, read without
a process group), and the next iterations must match the reference within the layout-parity
tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.checkpoint.directory import find_latest_checkpoint, read_tracker
from megatron_ext.checkpoint.state import load_full_tensors
from megatron_ext.config import ConfigError
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

ITERS, K = 6, 3
TOL = 1e-5  # layout-parity tolerance (tests/distributed/test_layout_parity.py)
BASE = dict(num_layers=8, train_iters=ITERS, clip_grad=0.3, global_batch_size=8, micro_batch_size=2)
SAVE_LAYOUT = dict(
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    num_layers_per_virtual_pipeline_stage=2,
    use_distributed_optimizer=True,
)
CHECKPOINT_READERS = ("unverified", "verified")  # each load without and with --ckpt-verify
RESHARD_LAYOUTS = {
    "PP4xDP2": dict(pipeline_model_parallel_size=4, use_distributed_optimizer=True),
    "TP2xDP4": dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
}


def _build(overrides: dict, **checkpoint):
    return build_tiny_run(tiny_values(**BASE, **overrides, **checkpoint), MarkovDataset(32, mask_every=1))


def _train_and_close(run) -> list[dict]:
    train(run)
    destroy_parallel_context()
    return run.records


def _eight_rank_world(rank: int, world_size: int, root: str) -> dict:
    out = {"reference": _train_and_close(_build(SAVE_LAYOUT))}

    run = _build(SAVE_LAYOUT, save=os.path.join(root, "saved"), exit_interval=K)
    out["stopped"] = _train_and_close(run)

    for reader in CHECKPOINT_READERS:
        run = _build(SAVE_LAYOUT, ckpt_verify=reader == "verified")
        out[("loaded_iteration", reader)] = load_checkpoint(run, os.path.join(root, "saved"))
        out[("fused_after_load", reader)] = _fused_adam_state(run.optimizer)
        out[("resumed", reader)] = _train_and_close(run)
        for name, layout in RESHARD_LAYOUTS.items():
            out[(name, reader)] = _load_resave_train(layout, root, name, reader)
    return out


def _fused_adam_state(optimizer) -> list[tuple[bool, bool, str]]:
    """(fused, foreach, step device and dtype) of every torch Adam param group and state."""
    from megatron_ext.optim import torch_adam_optimizers

    return [
        (g["fused"], g["foreach"], f"{o.state[p]['step'].device.type}/{o.state[p]['step'].dtype}")
        for o in torch_adam_optimizers(optimizer)
        for g in o.param_groups
        for p in g["params"]
    ]


def _load_resave_train(layout: dict, root: str, name: str, reader: str) -> list[dict]:
    run = _build(layout, ckpt_verify=reader == "verified")
    assert load_checkpoint(run, os.path.join(root, "saved")) == K
    save_checkpoint(run, os.path.join(root, f"{name}-{reader}"))
    return _train_and_close(run)


def _one_rank_world(rank: int, world_size: int, root: str) -> dict:
    return {
        ("single", reader): _load_resave_train(dict(use_distributed_optimizer=True), root, "single", reader)
        for reader in CHECKPOINT_READERS
    }


def _last_stage(per_rank: list[dict], key) -> list[dict]:
    return per_rank[-1][key]  # the last rank is on the last pipeline stage in every layout


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    per_rank = run_ranks(_eight_rank_world, 8, root, timeout=300)
    (single,) = run_ranks(_one_rank_world, 1, root, timeout=300)
    return root, per_rank, single


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


@pytest.mark.parametrize("reader", CHECKPOINT_READERS)
def test_resumed_optimizer_steps_with_torchs_fused_adam(results, reader):
    """megatron-core's distributed optimizer restores Adam states itself: the fused option and a
    float32 step on the parameter's device (what the fused kernel takes) survive the load."""
    _, per_rank, _ = results
    for rank in per_rank:
        states = rank[("fused_after_load", reader)]
        assert states and set(states) == {(True, False, "cpu/torch.float32")}


@pytest.mark.parametrize("reader", CHECKPOINT_READERS)
def test_resume_after_clean_stop_is_bit_identical(results, reader):
    root, per_rank, _ = results
    reference = _last_stage(per_rank, "reference")
    assert [r["iteration"] for r in _last_stage(per_rank, "stopped")] == list(range(1, K + 1))
    assert _losses(_last_stage(per_rank, "stopped")) == _losses(reference[:K])
    assert all(r[("loaded_iteration", reader)] == K for r in per_rank)
    resumed = _last_stage(per_rank, ("resumed", reader))
    assert [r["iteration"] for r in resumed] == list(range(K + 1, ITERS + 1))
    assert _losses(resumed) == _losses(reference[K:])
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in reference[K:]]
    saved = os.path.join(root, "saved")
    assert find_latest_checkpoint(saved)[0] == K and read_tracker(saved) == K
    assert not [n for n in os.listdir(saved) if ".tmp-" in n]


def _compared_keys(tensors: dict) -> list[str]:
    return sorted(k for k in tensors if not k.startswith("optimizer.") or ".exp_avg" in k)


@pytest.mark.parametrize("reader", CHECKPOINT_READERS)
@pytest.mark.parametrize("name", [*RESHARD_LAYOUTS, "single"])
def test_resharded_load_restores_weights_and_optimizer_exactly(results, name, reader):
    root = results[0]
    original = load_full_tensors(os.path.join(root, "saved", f"iter_{K:07d}"))
    resaved = load_full_tensors(os.path.join(root, f"{name}-{reader}", f"iter_{K:07d}"))
    keys = _compared_keys(original)
    assert any(".exp_avg_sq." in k for k in keys) and any(k.startswith("decoder.layers.") for k in keys)
    missing = [k for k in keys if k not in resaved]
    assert not missing, f"{name}: re-saved checkpoint lacks {missing}"
    differ = [k for k in keys if not torch.equal(original[k], resaved[k])]
    assert not differ, f"{name}: tensors differ after a load under {name}: {differ}"


@pytest.mark.parametrize("reader", CHECKPOINT_READERS)
@pytest.mark.parametrize("name", [*RESHARD_LAYOUTS, "single"])
def test_resharded_training_continues_the_curve(results, name, reader):
    _, per_rank, single = results
    reference = _last_stage(per_rank, "reference")
    records = single[(name, reader)] if name == "single" else _last_stage(per_rank, (name, reader))
    assert [r["iteration"] for r in records] == list(range(K + 1, ITERS + 1))
    ref = torch.tensor(_losses(reference[K:]), dtype=torch.float64)
    got = torch.tensor(_losses(records), dtype=torch.float64)
    assert ((got - ref).abs() / ref).max().item() <= TOL, f"{name}: {got} vs {ref}"


def _mismatch_world(rank: int, world_size: int, root: str) -> str:
    run = _build(dict(hidden_size=32))
    before = sorted(os.listdir(os.path.join(root, "saved")))
    try:
        load_checkpoint(run, os.path.join(root, "saved"))
    except ConfigError as err:
        message = str(err)
    else:
        message = ""
    destroy_parallel_context()
    assert sorted(os.listdir(os.path.join(root, "saved"))) == before  # nothing written
    return message


def test_mismatched_model_is_refused_naming_the_flag(results):
    root = results[0]
    (message,) = run_ranks(_mismatch_world, 1, root, timeout=300)
    assert "--hidden-size" in message and "64" in message and "32" in message, message
