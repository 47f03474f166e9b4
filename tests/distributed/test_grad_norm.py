"""The global gradient norm with pipeline parallelism, summed per parameter (``training/grad_norm.py``):
the same bits whichever stages share a rank, in our one-copy step and in megatron-core's own.

One 2-rank world, PP 2, 4 layers, clipping active: 1F1B (rank 0 holds layers 0-1), interleaved 1F1B
(megatron-core's, layers 0 and 2), InterleavedZeroBubble and ZBVZeroBubble (layers 0 and 3) train 4
iterations; 1F1B once more with --log-num-zeros-in-grad, which takes megatron-core's ``optimizer.step()``
(its ``get_grad_norm``). Every run logs the same gradient norms and losses and ends with the same
weights, bit for bit (megatron-core's per-rank sums differed in the norm's last bit at step 2 or 4).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.grad_norm import has_unit_grad_norm
from megatron_ext.training.loop import train
from tests.distributed.test_zero_bubble_model import _full_params

pytestmark = pytest.mark.distributed

CLIP = 0.3
BASE = dict(pipeline_model_parallel_size=2, num_layers=4, train_iters=4, clip_grad=CLIP, lr=3e-3)
CASES = {
    "1F1B": {},
    "1F1B, megatron-core's step": dict(log_num_zeros_in_grad=True),
    "Interleaved1F1B": dict(num_virtual_stages_per_pipeline_rank=2),
    "InterleavedZeroBubble": dict(pipeline_schedule="InterleavedZeroBubble", num_virtual_stages_per_pipeline_rank=2),
    "ZBVZeroBubble": dict(pipeline_schedule="ZBVZeroBubble"),
}


def _world(rank: int, world_size: int) -> dict:
    out = {}
    for name, flags in CASES.items():
        run = build_tiny_run(tiny_values(**BASE, **flags), MarkovDataset(32, mask_every=1))
        units = has_unit_grad_norm(run.optimizer.chained_optimizers)
        train(run)
        out[name] = {
            "records": [(r["iteration"], r["loss"], r["grad_norm"]) for r in run.records],
            "params": _full_params(run),
            "units": units,
        }
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 2, timeout=600)


@pytest.mark.parametrize("name", [c for c in CASES if c != "1F1B"])
def test_every_schedule_clips_by_the_same_norm(results, name):
    records = {}
    for case in ("1F1B", name):
        found = [out[case]["records"] for out in results if out[case]["records"]]  # the loss rank's
        assert len(found) == 1 and len(found[0]) == BASE["train_iters"], (case, found)
        records[case] = found[0]
    assert records[name] == records["1F1B"]
    assert all(norm > CLIP for _, _, norm in records["1F1B"])  # every update was clipped
    reference, other = {}, {}
    for out in results:
        assert out[name]["units"] and out["1F1B"]["units"]
        reference.update(out["1F1B"]["params"])
        other.update(out[name]["params"])
    assert reference.keys() == other.keys()
    assert not [k for k, w in reference.items() if not torch.equal(w, other[k])]
