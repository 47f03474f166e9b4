"""The padded vocabulary does not depend on TP, so every layout starts from the same model.

513 ids (NullTokenizer --vocab-size 512, plus EOD) through ``build_training_run``'s own padding
(``--make-vocab-size-divisible-by 128``): one process and TP2 both pad to 640 and train the same
losses (layout-parity tolerance). Megatron-LM's rule (divisible-by x TP) would pad TP2 to 768; one
process padded to 768 (the control) trains measurably different losses, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

VALUES = dict(vocab_size=512, train_iters=4, global_batch_size=8, micro_batch_size=2)


def _losses(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    out = []
    for overrides in runs:
        run = build_tiny_run(tiny_values(**VALUES, **overrides), MarkovDataset(32, mask_every=1))
        train(run)
        out.append({"padded": run.checkpoint_meta.padded_vocab_size, "losses": [r["loss"] for r in run.records]})
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results():
    ((one, megatron_rule),) = run_ranks(
        _losses, 1, [dict(make_vocab_size_divisible_by=128), dict(make_vocab_size_divisible_by=256)]
    )
    tp2 = run_ranks(_losses, 2, [dict(make_vocab_size_divisible_by=128, tensor_model_parallel_size=2)])[-1][0]
    return one, tp2, megatron_rule


def _max_rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b).max())


def test_tp2_pads_as_one_process_and_trains_the_same_model(results):
    one, tp2, _ = results
    assert one["padded"] == tp2["padded"] == 640
    assert _max_rel(tp2["losses"], one["losses"]) <= 1e-5


def test_megatron_lm_rule_would_start_from_another_model(results):
    one, _, megatron_rule = results
    assert megatron_rule["padded"] == 768
    assert _max_rel(megatron_rule["losses"], one["losses"]) > 1e-3
