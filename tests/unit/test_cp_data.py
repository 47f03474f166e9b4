"""The data side of context parallelism (pure): packed documents padded to g, the step-data collate's
CP split against its reference (the micro-batch one process builds with the same g: the union over
the CP ranks of their shares, put back at their global positions, equals it), the local counters,
the packer with g, the errors naming a sample or a flag, and the checkpoint's record of g."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from megatron_ext.checkpoint.compatibility import check_document_pad_multiple
from megatron_ext.config import build_job_config
from megatron_ext.context_parallel.layout import build_document_layout, build_row_layout
from megatron_ext.data.context_split import ContextSplit, build_context_split, pad_documents
from megatron_ext.data.microbatch import IGNORE_INDEX
from megatron_ext.data.packed_dataset import _cache_path, build_packed_sample, lengths_digest, load_or_build_index
from megatron_ext.data.packing import build_packing_index, check_packing_index
from megatron_ext.data.padding import collate_step
from megatron_ext.data.prefetch import _CheckedSamples
from megatron_ext.data.step_data import StepDataBuilder, StepDataSpec
from megatron_ext.testing import tiny_values

PAD = 0


def packed(lengths: list[int], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return build_packed_sample([rng.integers(1, 1000, n) for n in lengths])


def row(n: int, seed: int = 0) -> dict:
    sample = packed([n], seed)
    del sample["cu_seqlens"]
    return sample


def window(doc_lengths: list[int], seed: int = 0) -> dict:
    """A GPTDataset window with its EOD documents as boundaries: labels run across the documents."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(1, 1000, sum(doc_lengths) + 1))
    cu = torch.tensor([0, *np.cumsum(doc_lengths).tolist()], dtype=torch.int32)
    return {
        "tokens": tokens[:-1],
        "labels": tokens[1:],
        "position_ids": torch.arange(len(tokens) - 1),
        "cu_seqlens": cu,
    }


def collate(raw, c: int, r: int, layout: str, g: int, mode: str = "negotiated", max_length: int = 64, multiple=8):
    """The step's micro-batches of CP rank r of c (c = 1: the reference) and the schedule's length."""
    return collate_step(raw, mode, None, multiple, max_length, PAD, split=ContextSplit(c, r, layout, g))


def merged(shares: list) -> dict:
    """The CP ranks' micro-batches put back at their global positions (each position exactly once)."""
    full = shares[0].cp_layout.num_tokens
    b = shares[0].tokens.shape[0]
    out = {k: torch.full((b, full), -7, dtype=torch.int64) for k in ("tokens", "labels", "position_ids")}
    seen = torch.zeros(full, dtype=torch.int64)
    for mb in shares:
        index = mb.cp_layout.local_index
        seen[index] += 1
        for k in out:
            out[k][:, index] = getattr(mb, k)
    assert seen.eq(1).all(), "every global position is held by exactly one CP rank"
    return out


def assert_split_equals_reference(raw, c: int, layout: str, g: int, mode="negotiated", max_length=64, multiple=None):
    multiple = multiple or 2 * c  # --pad-to-multiple-of: a multiple of 2c
    ref, ref_length = collate(raw, 1, 0, layout, g, mode, max_length, multiple)
    ranks = [collate(raw, c, r, layout, g, mode, max_length, multiple) for r in range(c)]
    assert {length for _, length in ranks} == {ref_length}  # the schedule's seq_length: the whole sequence's
    for i, want in enumerate(ref):
        shares = [mbs[i] for mbs, _ in ranks]
        got = merged(shares)
        for k in got:
            assert torch.equal(got[k], getattr(want, k)), (i, k)
        for mb in shares:
            assert mb.tokens.shape == (want.tokens.shape[0], want.tokens.shape[1] // c)
            assert mb.cu_seqlens_host == want.cu_seqlens_host and mb.max_seqlen == want.max_seqlen
            assert (mb.cu_seqlens is None) == (want.cu_seqlens is None)
            assert mb.cu_seqlens is None or torch.equal(mb.cu_seqlens, want.cu_seqlens)
        # the local counters sum to the whole micro-batch's over the CP group
        assert sum(mb.num_real_tokens for mb in shares) == want.num_real_tokens
        assert sum(mb.attention_pairs for mb in shares) == want.attention_pairs
    return ref, ranks


PACKS = [[3, 10, 1], [7], [20, 2, 5], [1, 1, 1, 1], [9, 9], [2]]


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("mode", ["negotiated", "static"])
@pytest.mark.parametrize("b", [1, 2])
def test_packed_split_is_the_reference_micro_batch(c, mode, b):
    """Per-document head-tail of packed documents (b > 1 packs joined into one THD row), negotiated
    and static padding: the shares tile the reference; every document a multiple of 2c."""
    g = 2 * c
    samples = [packed(n, seed) for seed, n in enumerate(PACKS)]
    raw = [samples[i : i + b] for i in range(0, len(samples) - b + 1, b)]
    ref, ranks = assert_split_equals_reference(raw, c, "document", g, mode, max_length=64 * b)
    for i, want in enumerate(ref):
        cu = want.cu_seqlens_host
        assert all((e - s) % (2 * c) == 0 for s, e in zip(cu, cu[1:])), cu
        for r, (mbs, _) in enumerate(ranks):
            assert torch.equal(mbs[i].cp_layout.local_index, build_document_layout(cu, c, r).local_index)


def test_documents_are_padded_at_their_end_positions_continue_labels_ignored():
    s = packed([3, 6, 1])
    p = pad_documents(s, 4, PAD)
    assert p["cu_seqlens"].tolist() == [0, 4, 12, 16] and p["cu_seqlens"].dtype == torch.int32
    assert p["tokens"][:3].tolist() == s["tokens"][:3].tolist() and p["tokens"][3] == PAD
    assert p["tokens"][4:10].tolist() == s["tokens"][3:9].tolist() and p["tokens"][10:12].tolist() == [PAD, PAD]
    assert p["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert p["labels"].tolist()[:4] == s["labels"][:3].tolist() + [IGNORE_INDEX]
    assert p["labels"].tolist()[9:] == [IGNORE_INDEX] * 7  # a document's last label, then its pads
    assert pad_documents(s, 1, PAD) is s
    # the micro-batch: real tokens and pairs of the real documents only; padding grows the last one
    (mb,), length = collate([[s]], 1, 0, "document", 4, multiple=4)
    assert length == 16 and mb.cu_seqlens_host == (0, 4, 12, 16) and mb.max_seqlen == 8
    assert mb.num_real_tokens == 10 and mb.attention_pairs == 9 + 36 + 1


@pytest.mark.parametrize("c", [2, 4])
def test_negotiated_padding_grows_the_last_document_by_a_multiple_of_2c(c):
    """Documents of 2c + 1 and 1 tokens padded to 4c and 2c; the step (--pad-to-multiple-of 4c) is 8c
    long: the last document grows to 4c, still a multiple of 2c, its growth ignored by the loss."""
    raw = [[packed([2 * c + 1, 1])], [packed([2])]]
    ref, ranks = assert_split_equals_reference(raw, c, "document", 2 * c, multiple=4 * c)
    assert ref[0].cu_seqlens_host == (0, 4 * c, 8 * c) and ref[0].max_seqlen == 4 * c
    assert ref[1].cu_seqlens_host == (0, 8 * c)  # the only document grew
    assert ref[0].labels[0, 4 * c :].eq(IGNORE_INDEX).all() and ref[0].tokens[0, 4 * c + 1 :].eq(PAD).all()


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("mode", ["negotiated", "static"])
def test_unpacked_rows_split_head_tail_per_row(c, mode):
    """Unpacked rows and --one-document-per-row: row head-tail, the same layout for every row;
    positions 0.. per row sliced; the padded rows' pads count neither as tokens nor as pairs."""
    raw = [[row(n, seed) for seed, n in enumerate(lengths)] for lengths in ([5, 17, 9], [30, 1, 2])]
    ref, ranks = assert_split_equals_reference(raw, c, "row", 1, mode)
    for r, (mbs, length) in enumerate(ranks):
        want = build_row_layout(length, 1, c, r)
        assert all(torch.equal(mb.cp_layout.local_index, want.local_index) for mb in mbs)
        # the 30-token row's positions: its global ones (0 for the two pads at its end)
        assert torch.equal(mbs[1].position_ids[0], torch.where(want.local_index < 30, want.local_index, 0))
        assert all(mb.cu_seqlens is None and mb.cu_seqlens_host is None for mb in mbs)


@pytest.mark.parametrize("c", [2, 4])
def test_windows_with_document_boundaries_split_head_tail_over_the_windows(c):
    """GPTDataset windows with document boundaries (THD over b windows): the row layout over the b
    windows, the documents bounding attention; windows never grow beyond --seq-length."""
    s = 16
    raw = [[window([3, 13], 0), window([16], 1)], [window([1, 2, 3, 10], 2), window([7, 9], 3)]]
    ref, ranks = assert_split_equals_reference(raw, c, "row", 1, "static", max_length=2 * s)
    for i, want in enumerate(ref):
        assert want.tokens.shape == (1, 2 * s)  # no window grew
        for r, (mbs, _) in enumerate(ranks):
            layout = build_row_layout(s, 2, c, r, want.cu_seqlens_host)
            assert torch.equal(mbs[i].cp_layout.local_index, layout.local_index)
            assert mbs[i].cp_layout.pieces == layout.pieces


def _spec(c: int = 2, r: int = 0, layout: str = "document", g: int = 4, **kw) -> StepDataSpec:
    values = dict(
        global_batch_size=2,
        micro_batch_size=1,
        dp_rank=0,
        dp_size=1,
        sequence_padding="negotiated",
        pad_to_multiple_of=8,
        max_microbatch_length=16,
        pad_id=PAD,
        vocab_size=None,
        context_split=ContextSplit(c, r, layout, g),
    )
    return StepDataSpec(**(values | kw))


class Samples:
    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]

    def describe_sample(self, i: int) -> str:
        return f"corpus.bin, documents {i}, {i + 1}"


def test_samples_the_split_cannot_lay_out_are_a_value_error_naming_the_sample():
    builder = StepDataBuilder(_spec(), torch.device("cpu"))
    bad = packed([3, 5])
    bad["cu_seqlens"] = torch.tensor([0, 3, 7], dtype=torch.int32)  # 8 tokens, boundaries end at 7
    with pytest.raises(ValueError, match=r"corpus.bin, documents 1, 2: its document boundaries .* do not tile"):
        builder.read(Samples([packed([4]), bad]), 0)
    too_long = packed([5, 5, 5])  # 15 tokens fit --seq-length 16; padded to 4: 24 do not
    with pytest.raises(ValueError, match=r"documents 0, 1: .* take 24 tokens, more than --seq-length 16"):
        builder.read(Samples([too_long, packed([2])]), 0)
    windows = StepDataBuilder(_spec(layout="row", g=1), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"documents 1, 2: a window of 12 tokens, not --seq-length 16"):
        windows.read(Samples([window([16]), window([4, 8])]), 0)
    # worker processes return the error as a value (raised in the training process)
    assert isinstance(_CheckedSamples(Samples([bad]), _spec())[0], ValueError)
    # without CP and g, nothing is checked: today's behaviour
    assert len(StepDataBuilder(_spec(1, 0, g=1), torch.device("cpu")).read(Samples([too_long, bad]), 0)) == 2


def test_split_and_spec_refuse_what_cannot_be_split():
    with pytest.raises(ValueError, match="--document-pad-multiple 4 is not a multiple of 2 x --context-parallel"):
        ContextSplit(4, 0, "document", 4)
    with pytest.raises(ValueError, match="--document-pad-multiple 4: >= 1, and > 1 only with --packed-sequences"):
        ContextSplit(2, 0, "row", 4)
    with pytest.raises(ValueError, match="CP rank 2 is not in"):
        ContextSplit(2, 2)
    with pytest.raises(ValueError, match="--pad-to-multiple-of 6 is not a multiple of 2 x --context-parallel-size 2"):
        _spec(pad_to_multiple_of=6)
    with pytest.raises(ValueError, match="--sequence-padding variable"):
        _spec(sequence_padding="variable")
    # the run's split: packed documents get g (default 2c), other data the row layout and g = 1
    cfg = build_job_config(tiny_values(packed_sequences=True, seq_length=64))
    assert build_context_split(cfg.data, 4, 3) == ContextSplit(4, 3, "document", 8)
    cfg = build_job_config(tiny_values(seq_length=64))
    assert build_context_split(cfg.data, 4, 3) == ContextSplit(4, 3, "row", 1)


def _doc_lengths(seed: int, n: int = 400) -> np.ndarray:
    return np.maximum(1, np.random.default_rng(seed).lognormal(np.log(60), 1.0, n).astype(np.int64))


def _digest(index) -> str:
    parts = (np.ascontiguousarray(getattr(index, k)).tobytes() for k in ("piece_doc", "piece_start", "piece_len"))
    return hashlib.sha256(b"".join([*parts, index.bin_offsets.tobytes()])).hexdigest()[:16]


@pytest.mark.parametrize("strategy,digest", [("best_fit", "8c44d5034bac57fc"), ("sequential", "8fee532ece223176")])
def test_packing_with_g(strategy, digest):
    """g = 1 gives today's index byte for byte (digests of the index main built before g existed);
    g = 8 packs the documents counted padded: every bin fits --seq-length once padded."""
    lengths = _doc_lengths(7)
    assert _digest(build_packing_index(np.arange(400), lengths, 256, strategy)) == digest
    index = build_packing_index(np.arange(400), lengths, 256, strategy, pad_multiple=8)
    check_packing_index(index, {d: int(n) for d, n in enumerate(lengths)}, 256, pad_multiple=8)
    assert index.padded_bin_lengths(8).max() <= 256 and index.num_bins >= 127  # g = 1: 127 bins
    assert index.padded_bin_lengths(8).sum() > index.bin_lengths().sum() == lengths.sum()
    with pytest.raises(ValueError, match="packing index has a bin longer than --seq-length 256"):
        check_packing_index(build_packing_index(np.arange(400), lengths, 256, strategy), {}, 256, pad_multiple=64)
    with pytest.raises(ValueError, match="--seq-length 100 is not a multiple of --document-pad-multiple 8"):
        build_packing_index(np.arange(400), lengths, 100, strategy, pad_multiple=8)


def test_packing_cache_key_holds_g_and_keeps_today_s_key_at_g_1(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    lengths = _doc_lengths(3, 50)
    digest = lengths_digest(lengths)
    today = {"prefix": os.path.abspath(prefix), "num_docs": 50, "range": [0, 50], "seq": 64}
    today |= {"strategy": "best_fit", "v": 1, "lengths": digest}  # the key as main builds it
    plain = load_or_build_index(prefix, lengths, (0, 50), 64, "best_fit", None, digest)
    padded = load_or_build_index(prefix, lengths, (0, 50), 64, "best_fit", None, digest, pad_multiple=8)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and os.path.basename(_cache_path(prefix, None, today)) in files
    assert os.path.basename(_cache_path(prefix, None, today | {"g": 8})) in files
    assert padded.num_bins >= plain.num_bins and padded.padded_bin_lengths(8).max() <= 64


def _saved(g: int | None, cp: int = 1, seq: int = 64, packed: bool = True) -> dict:
    saved = {"args": {"seq_length": seq, "packing_strategy": "best_fit", "packed_sequences": packed}}
    saved["args"]["context_parallel_size"] = cp
    return saved if g is None else saved | {"document_pad_multiple": g}


def test_a_resume_at_another_cp_keeps_g_or_is_refused_by_name():
    def cfg(**kw):
        return build_job_config(tiny_values(packed_sequences=True, seq_length=64, **kw))

    assert check_document_pad_multiple(_saved(8), cfg(document_pad_multiple=8)) == []
    (problem,) = check_document_pad_multiple(_saved(4), cfg())  # saved at CP 2 (g = 4), resumed at CP 1 (g = 1)
    assert problem.startswith("--document-pad-multiple: the checkpoint's packed documents were padded to a multiple of")
    assert "pass --document-pad-multiple 4" in problem and "--finetune" in problem
    (problem,) = check_document_pad_multiple(_saved(4), cfg(document_pad_multiple=8))
    assert "padded to a multiple of 4, this run's to 8" in problem
    at_cp4 = cfg()
    at_cp4.parallel.context_parallel_size = 4  # (refused by validation until training is wired)
    (problem,) = check_document_pad_multiple(_saved(4, cp=2), at_cp4)
    assert "this run's to 8 (--context-parallel-size 4)" in problem
    assert "pass --document-pad-multiple 4 with a --context-parallel-size in [1, 2]" in problem
    # without the record (saved before g existed): g = 1; other packs anyway: not this check's
    assert check_document_pad_multiple(_saved(None), cfg()) == []
    assert check_document_pad_multiple(_saved(None), cfg(document_pad_multiple=2)) != []
    assert check_document_pad_multiple(_saved(4, seq=128), cfg()) == []
    assert check_document_pad_multiple(_saved(4, packed=False), cfg()) == []
