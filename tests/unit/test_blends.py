"""Blends of several indexed datasets: Megatron-LM's data flags (--data-path with weights,
--data-args-path, --train/valid/test-data-path, --per-split-data-args-path) on the packed path
(--packed-sequences) and on megatron-core's GPTDataset path.

Three corpora with disjoint token ranges (A: ids 0-39, B: 40-79, C: 80-119), so a sample's tokens
say which corpus it came from, independently of any index."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.data.blends import resolve_data_blends
from megatron_ext.data.builder import build_train_valid_datasets
from megatron_ext.data.microbatch import fetch_step_samples
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.testing import VOCAB, tiny_values
from megatron_ext.validation import validate

SEQ = 64
EOD = VOCAB - 1
RANGES = {"A": (0, 40), "B": (40, 80), "C": (80, 120)}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("blend")
    out = {}
    for k, (name, (lo, hi)) in enumerate(RANGES.items()):
        prefix = str(root / f"corpus_{name}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        rng = np.random.default_rng(k)
        for _ in range(120 + 40 * k):
            doc = np.append(rng.integers(lo, hi, rng.integers(5, 60)), EOD).astype(np.uint16)
            builder.add_document(doc, [len(doc)])
        builder.finalize(prefix + ".idx")
        out[name] = prefix
    return out


def _source(sample) -> str:
    real = sample["tokens"][sample["tokens"] != EOD]
    names = {n for n, (lo, hi) in RANGES.items() if ((real >= lo) & (real < hi)).any()}
    assert len(names) == 1, f"a sample mixes corpora {names}"
    return names.pop()


def _values(tmp_path, **flags) -> dict:
    values = tiny_values(
        mock_data=False,
        seq_length=SEQ,
        global_batch_size=8,
        train_iters=75,
        data_cache_path=str(tmp_path / "cache"),
        packed_sequences=True,
        split="90,10,0",
    )
    values.update(flags)
    return values


def _build(values):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    cfg = build_job_config(values)
    validate(cfg, 1)
    return build_train_valid_datasets(cfg, tok, cfg.training.global_batch_size)


def _sources(ds, n: int) -> list[str]:
    return [_source(s) for (s,) in fetch_step_samples(ds, [[i] for i in range(n)])]


def test_flags_resolve_as_megatron_lm_and_conflicts_name_the_flags(tmp_path):
    assert resolve_data_blends(["0.3", "a", "0.7", "b"]).blend == (["a", "b"], [0.3, 0.7])
    args = tmp_path / "blend.txt"
    args.write_text("0.3 a\n0.7 b\n")
    assert resolve_data_blends(data_args_path=str(args)).blend == (["a", "b"], [0.3, 0.7])
    per = resolve_data_blends(train_data_path=["1", "a", "3", "b"], valid_data_path=["c"])
    assert per.per_split == ((["a", "b"], [1.0, 3.0]), (["c"], None), None) and per.prefixes == ["a", "b", "c"]
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": "1 a 3 b", "valid": ["c"], "test": None}))
    assert resolve_data_blends(per_split_data_args_path=str(spec)).per_split == per.per_split
    assert resolve_data_blends() is None
    for kwargs, message in [
        (dict(data_path=["a"], train_data_path=["b"]), "are exclusive: give one kind"),
        (dict(data_path=["a"], data_args_path=str(args)), "--data-path and --data-args-path are exclusive"),
        (dict(valid_data_path=["c"]), "--train-data-path is missing"),
        (dict(train_data_path=["0.5", "a", "b"]), "--train-data-path 0.5 a b mixes weights and prefixes"),
        (dict(data_args_path=str(tmp_path / "nope.txt")), "--data-args-path .*nope.txt: cannot read it"),
    ]:
        with pytest.raises(ConfigError, match=message):
            resolve_data_blends(**kwargs)


def test_validation_names_missing_files_and_a_missing_validation_blend(corpora, tmp_path):
    with pytest.raises(ConfigError, match=r"--train/valid/test-data-path .*/nothing: missing .*nothing.bin"):
        validate(build_job_config(_values(tmp_path, train_data_path=[corpora["A"], str(tmp_path / "nothing")])), 1)
    with pytest.raises(ConfigError, match="--eval-interval 5 needs a validation blend: give --valid-data-path"):
        validate(build_job_config(_values(tmp_path, train_data_path=[corpora["A"]], eval_interval=5)), 1)


def test_packed_blend_realises_the_weights_in_megatron_core_blending_order(corpora, tmp_path):
    weights = {"A": 0.2, "B": 0.3, "C": 0.5}
    data_path = [x for n, w in weights.items() for x in (str(w), corpora[n])]
    train, _ = _build(_values(tmp_path, data_path=data_path))
    n = 600
    assert len(train) >= n
    got = _sources(train, n)
    for upto in (10, 50, 200, 600):  # every prefix of the run follows the weights within a sample or two
        for name, w in weights.items():
            assert abs(got[:upto].count(name) - w * upto) <= 2, (upto, name, got[:upto].count(name))
    # the same order as megatron-core's BlendedDataset of GPTDatasets with these weights
    gpt, _ = _build(_values(tmp_path, data_path=data_path, packed_sequences=False))
    assert [["A", "B", "C"][k] for k in gpt.dataset_index[:n]] == got
    # the index is cached per blend; a rebuild reads it back (same samples), another seed differs
    assert list((tmp_path / "cache").glob("corpus_A_blend_*.npz"))
    again, _ = _build(_values(tmp_path, data_path=data_path))
    for i in (0, 7, 123, 599):
        assert np.array_equal(train[i]["tokens"], again[i]["tokens"])
    other, _ = _build(_values(tmp_path, data_path=data_path, seed=99))
    assert any(not np.array_equal(train[i]["tokens"], other[i]["tokens"]) for i in range(20))


def test_unweighted_packed_blend_draws_by_packed_samples(corpora, tmp_path):
    train, _ = _build(_values(tmp_path, data_path=[corpora["A"], corpora["C"]]))
    bins = [d.index.num_bins for d in train.datasets]
    got = _sources(train, 300)
    share = bins[0] / sum(bins)
    assert abs(got.count("A") - share * 300) <= 2 and set(got) == {"A", "C"}


def test_unweighted_gpt_blend_logs_its_windows(corpora, tmp_path):
    """megatron-core builds each prefix of an unweighted blend as one epoch (num_samples None): the
    start-up line of each prefix's windows must not fail on it (it raised TypeError, so
    ``--data-path A B`` without --packed-sequences never started)."""
    values = _values(tmp_path, data_path=[corpora["A"], corpora["B"]], packed_sequences=False)
    cfg = build_job_config(values)
    validate(cfg, 1)
    lines = []
    train, _ = build_train_valid_datasets(
        cfg, build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1), cfg.training.global_batch_size, log=lines.append
    )
    assert [n for n in ("corpus_A", "corpus_B") if any(n in line for line in lines)] == ["corpus_A", "corpus_B"]
    assert all("one epoch" in line for line in lines), lines


@pytest.mark.parametrize("packed", [True, False])
def test_blend_per_split_reads_each_prefix_whole(corpora, tmp_path, packed):
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": f"0.25 {corpora['A']} 0.75 {corpora['B']}", "valid": corpora["C"]}))
    train, valid = _build(
        _values(tmp_path, per_split_data_args_path=str(spec), eval_interval=25, eval_iters=2, packed_sequences=packed)
    )
    got = _sources(train, 200)
    assert set(got) == {"A", "B"} and abs(got.count("A") - 50) <= 2
    assert set(_sources(valid, len(valid) if packed else 40)) == {"C"}
    if packed:  # whole prefixes: every document of C appears in the validation packs
        docs = {int(d) for d in valid.index.piece_doc}
        assert docs == set(range(200))


def test_one_document_per_row_blends_too(corpora, tmp_path):
    train, _ = _build(
        _values(
            tmp_path,
            data_path=["0.25", corpora["A"], "0.75", corpora["B"]],
            packed_sequences=False,
            one_document_per_row=True,
        )
    )
    got = _sources(train, 200)
    assert abs(got.count("A") - 50) <= 2 and set(got) == {"A", "B"}


def test_zero_weights_and_empty_prefixes_are_refused_by_name(corpora, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    with pytest.raises(ConfigError, match=r"weights \[0.0, 1.0\] must be finite and > 0"):
        resolve_data_blends(["0", corpora["A"], "1", corpora["B"]])
    empty = str(tmp_path / "empty")
    IndexedDatasetBuilder(empty + ".bin", dtype=np.uint16).finalize(empty + ".idx")
    for packed in (True, False):  # megatron-core's GPTDataset would count epochs forever
        with pytest.raises(ConfigError, match="empty has no documents"):
            _build(_values(tmp_path, train_data_path=[corpora["A"], empty], packed_sequences=packed))


def test_config_error_keeps_its_problems_across_processes():
    import pickle

    err = pickle.loads(pickle.dumps(ConfigError(["token id 999 is outside the vocabulary"])))
    assert err.problems == ["token id 999 is outside the vocabulary"] and str(err).count("  - ") == 1
