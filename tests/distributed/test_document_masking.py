"""--reset-position-ids, --reset-attention-mask and --eod-mask-loss on megatron-core's GPTDataset
windows: the EOD token closes its document, positions restart after it, no attention crosses it
(THD boundaries, never a dense [s, s] mask), the loss skips positions whose input is EOD. The
reference is each document of a window run alone with megatron-core's causal attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config import build_job_config
from megatron_ext.data.builder import build_train_valid_datasets
from megatron_ext.data.microbatch import IGNORE_INDEX, fetch_step_samples
from megatron_ext.data.padding import collate_step
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.derived import get_max_microbatch_length, resolve_config
from megatron_ext.model.gpt import build_model_chunks
from megatron_ext.parallel import build_parallel_context, destroy_parallel_context
from megatron_ext.testing import VOCAB, run_ranks, tiny_values
from megatron_ext.training.loop import train
from megatron_ext.training.step import get_packed_seq_params

pytestmark = pytest.mark.distributed

SEQ = 64
EOD = VOCAB - 1  # NullTokenizer --vocab-size 127: eod = 127
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
ALL = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """80 documents of 3-40 tokens, each closed by EOD (what preprocess_data --append-eod writes)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("eod") / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(3)
    for _ in range(80):
        doc = np.append(rng.integers(0, EOD, rng.integers(3, 41)), EOD).astype(np.uint16)
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def _values(corpus: str, **flags) -> dict:
    return tiny_values(
        data_path=[corpus], mock_data=False, seq_length=SEQ, split="100,0,0", data_cache_path=corpus + "_cache", **flags
    )


def _split_at_eod(tokens: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each document of a window: an EOD ends the document it closes."""
    ends = [i + 1 for i, t in enumerate(tokens.tolist()) if t == EOD and i + 1 < len(tokens)]
    return list(zip([0] + ends, ends + [len(tokens)]))


def test_windows_carry_eod_boundaries_restarted_positions_and_masked_eod_loss(corpus):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    plain, _ = build_train_valid_datasets(build_job_config(_values(corpus)), tok, 8)
    masked, _ = build_train_valid_datasets(build_job_config(_values(corpus, **ALL)), tok, 8)
    positions_only, _ = build_train_valid_datasets(build_job_config(_values(corpus, reset_position_ids=True)), tok, 8)
    saw_eod = 0
    for i in range(12):
        (p,), (m,), (r,) = (fetch_step_samples(ds, [[i]])[0] for ds in (plain, masked, positions_only))
        assert torch.equal(p["tokens"], m["tokens"]) and torch.equal(
            p["labels"][m["labels"] != IGNORE_INDEX], m["labels"][m["labels"] != IGNORE_INDEX]
        )
        tokens = p["tokens"].numpy()
        docs = _split_at_eod(tokens)
        saw_eod += len(docs) - 1
        assert m["cu_seqlens"].tolist() == [0] + [e for _, e in docs]
        want_pos = np.concatenate([np.arange(e - s) for s, e in docs])
        assert m["position_ids"].tolist() == want_pos.tolist() == r["position_ids"].tolist()
        assert r["cu_seqlens"].tolist() == [0, SEQ]  # positions restart, attention spans the window
        assert "cu_seqlens" not in p and p["position_ids"].tolist() == list(range(SEQ))
        assert ((m["labels"] == IGNORE_INDEX) == (p["tokens"] == EOD)).all()
    assert saw_eod >= 12  # the windows do cross documents


def _forward_check(rank: int, world_size: int, corpus: str) -> dict:
    out = {}
    for style, overrides in {"gpt2": {}, "llama": LLAMA}.items():
        for name, flags in {"all": ALL, "no_reset": dict(eod_mask_loss=True)}.items():
            cfg = build_job_config(_values(corpus, micro_batch_size=2, **overrides, **flags))
            ctx = build_parallel_context(cfg, torch.device("cpu"))
            torch.manual_seed(0)
            (model,) = build_model_chunks(
                cfg, resolve_config(cfg, ctx.world_size, VOCAB), ctx.placement, torch.device("cpu")
            )
            params = dict(model.named_parameters())
            tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
            train_ds, _ = build_train_valid_datasets(cfg, tok, 8)
            raw = fetch_step_samples(train_ds, [[0, 1]])
            (mb,), _ = collate_step(raw, "static", None, 64, get_max_microbatch_length(cfg), pad_id=EOD)
            logits = model(
                input_ids=mb.tokens,
                position_ids=mb.position_ids,
                attention_mask=None,
                packed_seq_params=get_packed_seq_params(mb, model) if mb.is_packed else None,
            )
            logits = logits.reshape(-1, logits.shape[-1])
            F.cross_entropy(
                logits.float(), mb.labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            ).backward()
            grads = {n: p.grad.clone() for n, p in params.items()}
            model.zero_grad()
            # the reference: every document of both windows alone, causal, positions from 0,
            # labels of the unmasked window with EOD inputs masked by hand
            alone, offset = [], 0
            for sample in raw[0]:
                tokens = sample["tokens"].numpy()
                labels = sample["labels"].clone()
                labels[sample["tokens"] == EOD] = IGNORE_INDEX
                for s, e in _split_at_eod(tokens):
                    t = sample["tokens"][s:e][None]
                    future = torch.ones(e - s, e - s, dtype=torch.bool).triu(1)[None, None]
                    lg = model(input_ids=t, position_ids=torch.arange(e - s)[None], attention_mask=future)[0]
                    F.cross_entropy(lg.float(), labels[s:e], ignore_index=IGNORE_INDEX, reduction="sum").backward()
                    alone.append((offset + s, offset + e, lg.detach()))
                offset += len(tokens)
            ref = {n: p.grad.clone() for n, p in params.items()}
            out[style, name] = dict(
                logits=logits.detach(),
                alone=alone,
                grads=grads,
                ref=ref,
                packed=mb.is_packed,
                shape=tuple(mb.tokens.shape),
            )
            destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def forward(corpus):
    return run_ranks(_forward_check, 1, corpus)[0]


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_micro_batch_of_two_windows_equals_each_document_alone(style, forward):
    r = forward[style, "all"]
    assert r["packed"] and r["shape"] == (1, 2 * SEQ)  # two windows joined into one THD row
    assert len(r["alone"]) > 2
    for s, e, lg in r["alone"]:
        torch.testing.assert_close(r["logits"][s:e], lg, rtol=1e-5, atol=1e-5)
    for name, g in r["grads"].items():
        rel = float((g - r["ref"][name]).norm() / r["ref"][name].norm().clamp_min(1e-30))
        assert rel < 1e-5, f"{name}: {rel:.2e}"


def test_without_reset_attention_crosses_documents(forward):
    """The control: --eod-mask-loss alone keeps Megatron-LM's plain causal window, so a document
    after the first sees its predecessors and differs from its run alone."""
    r = forward["llama", "no_reset"]
    assert not r["packed"] and r["shape"] == (2, SEQ)
    later = [(s, e, lg) for s, e, lg in r["alone"] if s % SEQ]
    assert later and all(not torch.allclose(r["logits"][s:e], lg, atol=1e-4) for s, e, lg in later)


def _train(rank: int, world_size: int, corpus: str, layout: dict) -> list[float]:
    from megatron_ext.run import build_training_run

    values = _values(corpus, train_iters=4, **ALL, **LLAMA, **layout)
    run = build_training_run(build_job_config(values), device=torch.device("cpu"), log=lambda s: None, metrics=False)
    train(run)
    losses = [r["loss"] for r in run.records]
    destroy_parallel_context()
    return losses


def test_training_with_document_masking_under_pp_vpp_dp_matches_one_process(corpus):
    ref = run_ranks(_train, 1, corpus, {})[0]
    per_rank = run_ranks(
        _train, 4, corpus, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    )
    got = max(per_rank, key=len)  # the last pipeline stage reports the loss
    assert len(ref) == 4 and np.isfinite(ref).all()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", ["packed_sequences", "one_document_per_row"])
def test_eod_mask_loss_holds_already_on_the_packed_paths(corpus, layout):
    """--eod-mask-loss is accepted with packing: every position whose input is EOD (a document's
    last token) predicts nothing there by construction."""
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    cfg = build_job_config(_values(corpus, eod_mask_loss=True, **{layout: True}))
    train_ds, _ = build_train_valid_datasets(cfg, tok, 8)
    eods = 0
    for (s,) in fetch_step_samples(train_ds, [[i] for i in range(20)]):
        at_eod = s["tokens"] == EOD
        eods += int(at_eod.sum())
        assert (s["labels"][at_eod] == IGNORE_INDEX).all()
    assert eods >= 20
    # an EOD inside a stored document (corpora concatenated before preprocessing) is masked too
    from megatron_ext.data.packed_dataset import EodLossMask, build_packed_sample

    inner = EodLossMask([build_packed_sample([np.array([5, EOD, 6, 7, EOD]), np.array([8, 9])])], EOD)[0]
    assert inner["labels"].tolist() == [EOD, IGNORE_INDEX, 7, EOD, IGNORE_INDEX, 9, IGNORE_INDEX]
