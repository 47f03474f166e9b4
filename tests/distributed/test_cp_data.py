"""The step's data under context parallelism in a forked gloo world of 4 ranks (CP 2 x DP 2).

Each rank builds its micro-batches of three steps (packed documents, g = 4, two packs joined per
micro-batch, negotiated padding over its replica's TP x CP x PP group) with the synchronous builder
and with the prefetcher's background thread on its own gloo group: both are this rank's share of
the micro-batch one process builds with the same g (the reference, built here with no group), with
one collective per step. CP peers that read different samples are a ValueError on both ranks, from
the negotiation, before any CP collective (whose mismatched all-gather would abort the process).

And in one process, the one-process reference itself: a tiny packed run with --document-pad-multiple
4 at CP 1 trains on the padded documents, records g in its checkpoint, and a resume with another g is
refused naming the flag (--finetune, which starts the data over, loads).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_ext.checkpoint.reader import read_common
from megatron_ext.config import ConfigError
from megatron_ext.data.context_split import ContextSplit
from megatron_ext.data.packed_dataset import build_packed_sample
from megatron_ext.data.prefetch import StepPrefetcher, build_data_group
from megatron_ext.data.step_data import StepDataBuilder, StepDataSpec
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import VOCAB, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

CP, DP, SEQ, G, STEPS = 2, 2, 32, 4, 3


class PaddedPacks:
    """Packs of skewed documents that fit --seq-length once each is padded to a multiple of G (as the
    packer builds them); ``truncate``: every sample cut to its first document (a rank reading other data)."""

    def __init__(self, truncate: bool = False):
        self.truncate = truncate

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        docs, used = [], 0
        budget = int(rng.integers(SEQ // 4, SEQ + 1))
        while True:
            n = int(max(1, rng.lognormal(np.log(5), 1.0)))
            if used + -(-n // G) * G > budget:
                break
            docs.append(rng.integers(1, VOCAB - 1, n))
            used += -(-n // G) * G
        docs = docs or [rng.integers(1, VOCAB - 1, 1)]
        return build_packed_sample(docs[:1] if self.truncate else docs)


def _spec(dp_rank: int, cp_size: int, cp_rank: int) -> StepDataSpec:
    return StepDataSpec(
        global_batch_size=8,
        micro_batch_size=2,
        dp_rank=dp_rank,
        dp_size=DP,
        sequence_padding="negotiated",
        pad_to_multiple_of=8,
        max_microbatch_length=2 * SEQ,
        pad_id=0,
        vocab_size=VOCAB,
        context_split=ContextSplit(cp_size, cp_rank, "document", G),
    )


def _as_lists(microbatches) -> list:
    keep = ("tokens", "labels", "position_ids", "cu_seqlens_host", "max_seqlen", "num_real_tokens", "attention_pairs")
    out = []
    for mb in microbatches:
        row = {k: getattr(mb, k) for k in keep}
        row = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in row.items()}
        layout = mb.cp_layout
        out.append(row | {"local_index": None if layout is None else layout.local_index.tolist(), "index": mb.index})
    return out


def _counting_all_reduce(counter: list[int]):
    original = dist.all_reduce

    def counted(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    return original, counted


def _world(rank: int, world_size: int) -> dict:
    dp_rank, cp_rank = rank // CP, rank % CP  # megatron-core's order tp-cp-ep-dp-pp: CP next to TP
    replicas = [dist.new_group([d * CP + c for c in range(CP)]) for d in range(DP)]
    ctx = types.SimpleNamespace(tp_size=1, pp_size=1, cp_size=CP, world_size=world_size, dp_rank=dp_rank)
    background = build_data_group(ctx)  # every rank creates every group, in the same order
    builder = StepDataBuilder(_spec(dp_rank, CP, cp_rank), torch.device("cpu"), replicas[dp_rank])
    reference = StepDataBuilder(_spec(dp_rank, 1, 0), torch.device("cpu"))
    ds, out = PaddedPacks(), {"sync": [], "prefetch": [], "reference": [], "lengths": []}
    counter = [0]
    original, dist.all_reduce = _counting_all_reduce(counter)
    try:
        for step in range(STEPS):
            mbs, length = builder.build(ds, step * 8)
            out["sync"].append(_as_lists(mbs))
            out["lengths"].append(length)
        out["collectives"] = counter[0]
    finally:
        dist.all_reduce = original
    for step in range(STEPS):
        ref, length = reference.build(ds, step * 8)
        out["reference"].append((_as_lists(ref), length))
    prefetcher = StepPrefetcher(builder.with_group(background), ds)
    for step in range(STEPS):
        prefetcher.request(step * 8)
        mbs, length = prefetcher.take(step * 8)
        out["prefetch"].append(_as_lists(mbs))
        assert length == out["lengths"][step]
    # CP rank 1 of each replica reads other samples: the negotiation refuses on both peers
    prefetcher.dataset = other = PaddedPacks(truncate=cp_rank == 1)
    prefetcher.request(0)  # built in the background thread, raised by take
    for name, run in (("sync", lambda: builder.build(other, 0)), ("prefetch", lambda: prefetcher.take(0))):
        try:
            run()
            out[f"disagreement {name}"] = None
        except ValueError as exc:
            out[f"disagreement {name}"] = str(exc)
    prefetcher.close()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_world, CP * DP, timeout=300)


def test_shares_are_the_one_process_micro_batch_sliced(ranks):
    """Each rank's micro-batches are its share of the reference (same g, no group): tokens, labels and
    positions at its layout's global positions; boundaries and lengths the whole sequence's; the
    counters' shares sum over the CP group to the reference's."""
    for rank, r in enumerate(ranks):
        peer = ranks[rank ^ 1]
        for step in range(STEPS):
            ref, ref_length = r["reference"][step]
            assert r["lengths"][step] == ref_length
            for mb, other, want in zip(r["sync"][step], peer["sync"][step], ref):
                index = mb["local_index"]
                assert len(index) == len(want["tokens"][0]) // CP
                for k in ("tokens", "labels", "position_ids"):
                    assert mb[k][0] == [want[k][0][i] for i in index], (rank, step, k)
                assert mb["cu_seqlens_host"] == want["cu_seqlens_host"] and mb["max_seqlen"] == want["max_seqlen"]
                assert sorted(index + other["local_index"]) == list(range(len(want["tokens"][0])))
                assert mb["num_real_tokens"] + other["num_real_tokens"] == want["num_real_tokens"]
                assert mb["attention_pairs"] + other["attention_pairs"] == want["attention_pairs"]
    assert len({r["lengths"][0] for r in ranks}) == 2, "each DP replica negotiates its own length"


def test_prefetcher_builds_what_the_synchronous_builder_builds(ranks):
    for r in ranks:
        assert r["prefetch"] == r["sync"]
        assert r["collectives"] == STEPS  # one all-reduce per step, the negotiation's


def test_cp_peers_reading_different_samples_are_a_value_error_on_both(ranks):
    for r in ranks:
        for name in ("sync", "prefetch"):
            message = r[f"disagreement {name}"]
            assert message is not None and "disagree on this step's longest micro-batch" in message, (name, message)
            assert "the 2 ranks reading the same samples" in message


def _resume(rank: int, world_size: int, root: str) -> dict:
    values = tiny_values(
        num_layers=2,
        seq_length=SEQ,
        packed_sequences=True,
        document_pad_multiple=G,
        pad_to_multiple_of=8,
        micro_batch_size=1,
        global_batch_size=2,
        train_iters=2,
        save=root,
        save_interval=2,
    )
    run = build_tiny_run(values, PaddedPacks())
    train(run)
    out = {"losses": [r["loss"] for r in run.records]}
    ckpt = [d for d in os.listdir(root) if d.startswith("iter_")][0]
    out["recorded"] = read_common(os.path.join(root, ckpt))["document_pad_multiple"]
    destroy_parallel_context()
    values.pop("document_pad_multiple")  # g = 1: other packs
    run = build_tiny_run(values, PaddedPacks())
    try:
        load_checkpoint(run, root)
        out["refused"] = None
    except ConfigError as exc:
        out["refused"] = str(exc)
    out["finetune"] = load_checkpoint(run, root, weights_only=True)
    destroy_parallel_context()
    return out


def test_the_reference_run_trains_with_g_and_its_checkpoint_keeps_it(tmp_path):
    (r,) = run_ranks(_resume, 1, str(tmp_path), timeout=300)
    assert len(r["losses"]) == 2 and all(np.isfinite(r["losses"]))
    assert r["recorded"] == G
    assert "--document-pad-multiple: the checkpoint's packed documents were padded to a multiple of 4" in r["refused"]
    assert r["finetune"] == 2
