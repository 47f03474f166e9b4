"""Packed micro-batches of several packs (``--micro-batch-size b`` with ``--packed-sequences``).

The b packs of a micro-batch are joined into one THD sequence (joined ``cu_seqlens``, negotiated
length up to b x ``--seq-length``); attention still never crosses a document and the global batch
still counts packs, so the step is the same computation whatever b is. For b = 1, 2, 4 under
TP2 x PP2 x VPP2 x DP2 (negotiated padding, token-sum loss), the step-1 gradient of every parameter
and 6 iterations of losses equal one process training the same packs with b = 1; GPT-2 and
Llama style (RoPE through our packed rotation; with --sequence-parallel).
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import PackedMarkovDataset, build_tiny_run, gather_full_grads, run_ranks, tiny_values
from megatron_ext.training.loop import train
from megatron_ext.training.step import build_step_microbatches, run_forward_backward

pytestmark = pytest.mark.distributed

SEQ, GBS, ITERS, TOL = 32, 16, 6, 1e-5
BASE = dict(
    seq_length=SEQ, global_batch_size=GBS, train_iters=ITERS, packed_sequences=True, pad_to_multiple_of=8, clip_grad=0.3
)
LAYOUT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    group_query_attention=True,
    num_query_groups=2,
    disable_bias_linear=True,
    ffn_hidden_size=128,
)
STYLES = {"gpt2": {}, "llama": LLAMA}
PACKS = (1, 2, 4)


def _runs(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict:
    out = {}
    layout = LAYOUT if world_size == 8 else {}
    for style, b in cases:
        # Llama style with sequence parallelism: each TP rank holds a slice of the joined THD sequence
        sp = dict(sequence_parallel=True) if layout and style == "llama" else {}
        run = build_tiny_run(
            tiny_values(**BASE, **STYLES[style], **layout, **sp, micro_batch_size=b), PackedMarkovDataset(SEQ)
        )
        mbs, length = build_step_microbatches(run, run.train_ds, 0)
        run_forward_backward(run.model, mbs, length)
        grads = gather_full_grads(run)
        train(run)
        keep = run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0
        out[(style, b)] = {
            "grads": grads if keep else {},
            "losses": [r["loss"] for r in run.records],
            "shapes": [tuple(mb.tokens.shape) for mb in mbs],
            "length": length,
        }
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_runs, 1, [(style, 1) for style in STYLES])[0]


@pytest.fixture(scope="module")
def eight():
    per_rank = run_ranks(_runs, 8, [(style, b) for style in STYLES for b in PACKS])
    merged = {}
    for key in per_rank[0]:
        grads = {}
        for r in per_rank:
            grads.update(r[key]["grads"])
        merged[key] = {**per_rank[-1][key], "grads": grads}
    return merged


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("packs", PACKS)
def test_joined_packs_train_like_one_process(eight, reference, style, packs):
    got, ref = eight[(style, packs)], reference[(style, 1)]
    # each DP rank's micro-batches are single THD rows of up to b x seq tokens
    assert all(shape[0] == 1 for shape in got["shapes"]) and len(got["shapes"]) == GBS // (2 * packs)
    assert got["length"] <= packs * SEQ and got["length"] % 8 == 0
    assert set(got["grads"]) == set(ref["grads"])
    worst = max(ref["grads"], key=lambda k: _relative(got["grads"][k], ref["grads"][k]))
    assert _relative(got["grads"][worst], ref["grads"][worst]) <= TOL, worst
    losses, ref_losses = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    assert losses.shape == (ITERS,) and ((losses - ref_losses).abs() / ref_losses).max() <= TOL
    assert ref_losses[-1] < ref_losses[0]


def test_more_packs_per_microbatch_means_fewer_longer_microbatches(eight):
    lengths = [eight[("gpt2", b)]["length"] for b in PACKS]
    assert lengths[0] < lengths[1] < lengths[2], lengths
