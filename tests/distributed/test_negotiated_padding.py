"""Negotiated padding: the pipeline agrees on one length per step with one collective, and
padding changes neither the loss nor the gradients (reference: one process, no padding at all).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packed_dataset import build_packed_sample
from megatron_ext.data.padding import collate, negotiate_step_length
from megatron_ext.derived import resolve_config
from megatron_ext.model.gpt import build_model_chunks
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
from megatron_ext.testing import (
    VOCAB,
    PackedMarkovDataset,
    build_tiny_run,
    count_collectives,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.loop import train
from megatron_ext.training.step import build_step_microbatches, get_packed_seq_params, run_forward_backward

pytestmark = pytest.mark.distributed

SEQ, MULTIPLE, GBS = 64, 16, 8
PAR = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)


class ExplicitDataset:
    """Packed samples from explicit document lengths (edge cases)."""

    def __init__(self, lengths: list[list[int]]):
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        return build_packed_sample([rng.integers(0, VOCAB, n) for n in self.lengths[i]])


class RowsDataset(ExplicitDataset):
    """Unpacked variable-length rows (one document each, no boundaries): SFT-like samples."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        super().__init__([[int(min(SEQ, max(2, rng.lognormal(np.log(12), 0.9))))] for _ in range(64)])

    def __getitem__(self, i: int) -> dict:
        sample = super().__getitem__(i)
        del sample["cu_seqlens"]
        return sample


DATASETS = {
    "skewed": lambda: PackedMarkovDataset(SEQ),
    # every micro-batch shorter than the multiple (step length = 16)
    "all shorter than the multiple": lambda: ExplicitDataset([[3, 4], [5], [2, 2, 2], [7], [9], [4, 4], [6], [3]]),
    # one micro-batch exactly at --seq-length; others whose last (and only) document grows
    "one at seq-length": lambda: ExplicitDataset([[SEQ], [10], [30, 3], [1, 1], [40], [2], [63], [17]]),
    # unpacked rows, two per micro-batch, padded at the end of each row
    "unpacked rows": RowsDataset,
}
ROWS = dict(packed_sequences=False, one_document_per_row=True, micro_batch_size=2)
MODES = ("negotiated", "static", "variable")


def _values(dataset: str = "", **kw) -> dict:
    base = dict(
        seq_length=SEQ,
        micro_batch_size=1,
        global_batch_size=GBS,
        packed_sequences=True,
        pad_to_multiple_of=MULTIPLE,
        train_iters=1,
    )
    if dataset == "unpacked rows":
        base.update(ROWS)
    return tiny_values(**{**base, **kw})


def _reference(rank: int, world_size: int) -> dict:
    """One process, the whole global batch, every sample at its own length: no padding at all."""
    out = {}
    for name, make in DATASETS.items():
        cfg = build_job_config(_values())
        ctx = build_parallel_context(cfg, torch.device("cpu"))
        (model,) = build_model_chunks(
            cfg, resolve_config(cfg, ctx.world_size, VOCAB), ctx.placement, torch.device("cpu")
        )
        ds, total, count = make(), 0.0, 0
        for i in range(GBS):
            s = ds[i]
            mb = collate([s])  # the sample at its own length: no padding
            logits = model(
                input_ids=mb.tokens,
                position_ids=mb.position_ids,
                attention_mask=None,
                packed_seq_params=get_packed_seq_params(mb, model),
            )[0]
            total = total + F.cross_entropy(logits.float(), s["labels"], ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((s["labels"] != IGNORE_INDEX).sum())
        (total / count).backward()
        offset = get_layer_offset(model)
        out[name] = {
            "loss": float(total) / count,
            "grads": {get_global_name(n, offset): p.grad.clone() for n, p in model.named_parameters()},
        }
        destroy_parallel_context()
    return out


def _layouts(rank: int, world_size: int) -> dict:
    out = {}
    # 1. agreement: the ranks of a pipeline replica (TP x PP) read the same samples, so they propose the
    # same maximum (each replica its own) and agree on it rounded up; ranks proposing different maxima
    # read different samples: a ValueError on every rank of the replica, in the same one collective
    ctx = build_parallel_context(build_job_config(_values(**PAR)), torch.device("cpu"))
    local_max = [33, 47][ctx.dp_rank]
    agreed = negotiate_step_length(local_max, ctx.mp_group, MULTIPLE, SEQ)
    out["agreement"] = (dist.get_process_group_ranks(ctx.mp_group), local_max, agreed)
    try:
        negotiate_step_length([5, 33, 17, 9, 60, 2, 31, 47][rank], ctx.mp_group, MULTIPLE, SEQ)
        out["disagreement"] = None
    except ValueError as exc:
        out["disagreement"] = str(exc)
    destroy_parallel_context()
    # 2. gradients and loss in every mode and data set; 3. collectives of one step
    for name, make in DATASETS.items():
        for mode in MODES if name in ("skewed", "unpacked rows") else ("negotiated",):
            run = build_tiny_run(_values(name, sequence_padding=mode, **PAR), make())
            mbs, length = build_step_microbatches(run, run.train_ds, 0)
            run_forward_backward(run.model, mbs, length)
            grads = gather_full_grads(run)
            counts = count_collectives(lambda: train(run))
            keep = run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0
            finite = all(torch.isfinite(p.main_grad).all() for c in run.model for p in c.parameters())
            out[(name, mode)] = {
                "grads": grads if keep else {},
                "losses": [r["loss"] for r in run.records],
                "length": length,
                "counts": counts,
                "finite": finite,
            }
            destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_layouts, 8)


def test_pipeline_ranks_agree_on_the_rounded_global_max(ranks):
    groups = {}
    for r in ranks:
        members, local, agreed = r["agreement"]
        groups.setdefault(tuple(members), []).append((local, agreed))
    assert len(groups) == 2  # two DP replicas of TP2 x PP2
    for members, pairs in groups.items():
        expected = min(SEQ, -(-max(length for length, _ in pairs) // MULTIPLE) * MULTIPLE)
        assert {a for _, a in pairs} == {expected}, (members, pairs)
        assert expected <= SEQ
    for r in ranks:  # TP x PP ranks 0, 1, 4, 5 proposed 5, 33, 60, 2: each of them names the range
        assert "disagree on this step's longest micro-batch" in r["disagreement"]
    assert "2 to 60 tokens" in ranks[0]["disagreement"] and "9 to 47 tokens" in ranks[2]["disagreement"]


def _merged(ranks, key):
    grads, losses = {}, []
    for r in ranks:
        grads.update(r[key]["grads"])
        losses = losses or r[key]["losses"]
    return grads, losses


@pytest.mark.parametrize(
    "key",
    [(n, m) for n in ("skewed", "unpacked rows") for m in MODES]
    + [(n, "negotiated") for n in ("all shorter than the multiple", "one at seq-length")],
)
def test_padding_changes_neither_loss_nor_gradients(key, ranks, reference):
    grads, losses = _merged(ranks, key)
    ref = reference[key[0]]
    assert all(r[key]["finite"] for r in ranks), "NaN or inf in a gradient"
    assert set(grads) == set(ref["grads"])
    for name, g in ref["grads"].items():
        rel = float((grads[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert rel <= 1e-5, f"{key} {name}: {rel:.2e}"
    assert losses[0] == pytest.approx(ref["loss"], rel=1e-5)


def test_edge_case_lengths(ranks):
    assert {r[("all shorter than the multiple", "negotiated")]["length"] for r in ranks} == {MULTIPLE}
    # each DP replica negotiates over its own pipeline: the one holding the 64-token sample pads
    # to --seq-length, the other to its own rounded max (17 -> 32)
    assert {r[("one at seq-length", "negotiated")]["length"] for r in ranks} == {SEQ, 32}
    assert {r[("skewed", "static")]["length"] for r in ranks} == {SEQ}


def test_exactly_one_extra_collective_per_step(ranks):
    """Negotiated minus static: one all-reduce, from megatron_ext.data.padding, on every rank; and the
    full list of collectives our code issues in a (logging) step."""
    for r in ranks:
        neg, static = r[("skewed", "negotiated")]["counts"], r[("skewed", "static")]["counts"]
        diff = neg - static
        assert diff == collections.Counter({("megatron_ext.data.padding", "all_reduce"): 1}), diff
        # (the cross-entropy's TP reductions are the model's own, as megatron-core's were: the
        # diff above shows negotiation leaves them alone)
        # (nor are megatron-core's own that our wrappers now issue: the token count's broadcast and DP
        # all-reduce in training/finalize.py, the grad norm's all-reduce in training/optimizer.py or, with
        # pipeline parallelism, training/grad_norm.py (plus its units' object all-gather at the first step),
        # each once)
        rehomed = (
            "megatron_ext.model.cross_entropy",
            "megatron_ext.training.finalize",
            "megatron_ext.training.optimizer",
            "megatron_ext.training.grad_norm",
        )
        ours = {k: v for k, v in neg.items() if k[0].startswith("megatron_ext") and k[0] not in rehomed}
        assert all(v == 1 for k, v in neg.items() if k[0] in rehomed[1:]), neg
        # the logged loss's DP all-reduce (reduce_loss_over_dp_cp, in training/evaluation.py beside the
        # evaluation that shares it)
        allowed = {("megatron_ext.data.padding", "all_reduce"), ("megatron_ext.training.evaluation", "all_reduce")}
        assert set(ours) <= allowed and all(v == 1 for v in ours.values()), ours
