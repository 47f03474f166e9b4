"""Varlen packed sequences: a packed batch equals each document run alone; no document sees
another; TP2 x PP2 x VPP2 x DP2 trains the packed model exactly as one process does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packed_dataset import build_packed_sample
from megatron_ext.data.padding import collate_padded
from megatron_ext.derived import resolve_config
from megatron_ext.model.gpt import build_model_chunks
from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
from megatron_ext.testing import VOCAB, PackedMarkovDataset, build_tiny_run, gather_full_grads, run_ranks, tiny_values
from megatron_ext.training.loop import train
from megatron_ext.training.step import build_step_microbatches, get_packed_seq_params, run_forward_backward

pytestmark = pytest.mark.distributed

SEQ = 64
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    group_query_attention=True,
    num_query_groups=2,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    ffn_hidden_size=128,
)
STYLES = {"gpt2": {}, "llama": LLAMA}
DOC_LENGTHS = [9, 17, 5, 20]


def _docs(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n) for n in DOC_LENGTHS]


def _per_document_check(rank: int, world_size: int) -> dict:
    out = {}
    for style, overrides in STYLES.items():
        cfg = build_job_config(tiny_values(seq_length=SEQ, micro_batch_size=1, packed_sequences=True, **overrides))
        ctx = build_parallel_context(cfg, torch.device("cpu"))
        (model,) = build_model_chunks(
            cfg, resolve_config(cfg, ctx.world_size, VOCAB), ctx.placement, torch.device("cpu")
        )
        params = dict(model.named_parameters())

        def packed(docs):
            mb = collate_padded([build_packed_sample(docs)], SEQ, pad_id=0)  # padded to 64
            logits = model(
                input_ids=mb.tokens,
                position_ids=mb.position_ids,
                attention_mask=None,
                packed_seq_params=get_packed_seq_params(mb, model),
            )
            return logits[0], mb

        # packed forward + token-sum loss backward
        logits, mb = packed(_docs())
        F.cross_entropy(logits.float(), mb.labels[0], ignore_index=IGNORE_INDEX, reduction="sum").backward()
        grads_packed = {n: p.grad.clone() for n, p in params.items()}
        model.zero_grad()
        # each document alone: megatron-core's own causal attention (an explicit causal mask keeps
        # our SDPA path out) and, for RoPE, its own unpacked rotation
        alone = []
        for doc in _docs():
            sample = build_packed_sample([doc])
            t = sample["tokens"][None]
            future = torch.ones(len(doc), len(doc), dtype=torch.bool).triu(1)[None, None]
            lg = model(input_ids=t, position_ids=sample["position_ids"][None], attention_mask=future)[0]
            F.cross_entropy(lg.float(), sample["labels"], ignore_index=IGNORE_INDEX, reduction="sum").backward()
            alone.append(lg.detach())
        grads_alone = {n: p.grad.clone() for n, p in params.items()}
        model.zero_grad()
        # no leakage: change document 2 only
        changed = _docs()
        changed[2] = (changed[2] + 1) % VOCAB
        with torch.no_grad():
            logits_changed, _ = packed(changed)
        out[style] = dict(
            logits=logits.detach(),
            alone=alone,
            changed=logits_changed,
            grads_packed=grads_packed,
            grads_alone=grads_alone,
            pad=mb.tokens.shape[1],
        )
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def per_document():
    return run_ranks(_per_document_check, 1)[0]


@pytest.mark.parametrize("style", list(STYLES))
def test_packed_logits_equal_each_document_alone(style, per_document):
    r = per_document[style]
    bounds = np.concatenate([[0], np.cumsum(DOC_LENGTHS)])
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        torch.testing.assert_close(r["logits"][s:e], r["alone"][i], rtol=1e-5, atol=1e-5)
    assert r["pad"] == SEQ and torch.isfinite(r["logits"]).all()


@pytest.mark.parametrize("style", list(STYLES))
def test_packed_gradients_equal_sum_over_documents(style, per_document):
    r = per_document[style]
    for name, g in r["grads_packed"].items():
        ref = r["grads_alone"][name]
        rel = float((g - ref).norm() / ref.norm().clamp_min(1e-30))
        assert rel < 1e-5, f"{style} {name}: {rel:.2e}"


@pytest.mark.parametrize("style", list(STYLES))
def test_no_leakage_between_documents(style, per_document):
    r = per_document[style]
    bounds = np.concatenate([[0], np.cumsum(DOC_LENGTHS)])
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        same = torch.equal(r["logits"][s:e], r["changed"][s:e])
        assert same == (i != 2), f"document {i}: changed={not same}"


PAR = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)


def _packed_training(rank: int, world_size: int, layout: dict) -> dict:
    out = {}
    for style, overrides in STYLES.items():
        values = tiny_values(
            seq_length=SEQ,
            micro_batch_size=1,
            global_batch_size=8,
            packed_sequences=True,
            pad_to_multiple_of=16,
            train_iters=5,
            **overrides,
            **layout,
        )
        run = build_tiny_run(values, PackedMarkovDataset(SEQ))
        mbs, length = build_step_microbatches(run, run.train_ds, 0)
        run_forward_backward(run.model, mbs, length)
        grads = gather_full_grads(run)
        train(run)
        keep = run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0
        out[style] = {"grads": grads if keep else {}, "losses": [r["loss"] for r in run.records]}
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def packed_runs():
    ref = run_ranks(_packed_training, 1, {})[0]
    per_rank = run_ranks(_packed_training, 8, PAR)
    merged = {s: {"grads": {}, "losses": []} for s in STYLES}
    for r in per_rank:
        for s in STYLES:
            merged[s]["grads"].update(r[s]["grads"])
            merged[s]["losses"] = merged[s]["losses"] or r[s]["losses"]
    return ref, merged


@pytest.mark.parametrize("style", list(STYLES))
def test_packed_training_under_tp_pp_vpp_dp_matches_one_process(style, packed_runs):
    ref, got = packed_runs[0][style], packed_runs[1][style]
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        rel = float((got["grads"][name] - g).norm() / g.norm().clamp_min(1e-30))
        assert rel <= 1e-5, f"{name}: {rel:.2e}"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert ref["losses"][-1] < ref["losses"][0]
