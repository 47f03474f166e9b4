"""--full-validation / --multiple-validation-sets rules and the whole-split read (no process group)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.data.builder import get_num_samples
from megatron_ext.data.microbatch import get_microbatch_indices, normalize_sample
from megatron_ext.data.validation_sets import FullPassDataset, ValidationSet, get_validation_sets
from megatron_ext.testing import MarkovDataset
from megatron_ext.training.metrics import format_validation_line
from megatron_ext.validation import validate

MOCK = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("valsets")
    out = []
    for k in range(3):
        prefix = str(root / f"part{k}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(5):
            builder.add_document(np.arange(1, 20, dtype=np.uint16), [19])
        builder.finalize(prefix + ".idx")
        out.append(prefix)
    return out


def _problems(**values) -> list[str]:
    try:
        validate(build_job_config(values), 1)
    except ConfigError as err:
        return err.problems
    return []


def _per_split(prefixes, **values) -> dict:
    return dict(
        tokenizer_type="NullTokenizer",
        vocab_size=128,
        train_data_path=[prefixes[0]],
        valid_data_path=prefixes[1:],
        eval_interval=10,
        **values,
    )


def test_multiple_sets_need_full_validation_one_error_naming_both(prefixes):
    problems = _problems(**_per_split(prefixes, multiple_validation_sets=True))
    assert len(problems) == 1
    assert "--multiple-validation-sets needs --full-validation" in problems[0]


def test_accepted_with_a_validation_blend_per_split(prefixes):
    assert _problems(**_per_split(prefixes, multiple_validation_sets=True, full_validation=True)) == []
    assert _problems(**_per_split(prefixes, full_validation=True)) == []
    assert _problems(**MOCK, full_validation=True, eval_interval=5) == []


def test_refused_where_megatron_cannot_read_sets_whole(prefixes):
    both = dict(multiple_validation_sets=True, full_validation=True)
    assert any("--valid-data-path" in p for p in _problems(**MOCK, eval_interval=5, **both))
    weighted = dict(_per_split(prefixes, **both), valid_data_path=["1", prefixes[1], "2", prefixes[2]])
    assert any("weighted" in p and "drop the weights" in p for p in _problems(**weighted))
    assert any("--packed-sequences" in p for p in _problems(**_per_split(prefixes, packed_sequences=True, **both)))
    assert any("--eval-interval" in p for p in _problems(**MOCK, full_validation=True))


def test_spike_guard_rules():
    assert any("--skip-spiky-loss-factor 1.0 must be > 1" in p for p in _problems(**MOCK, skip_spiky_loss_factor=1.0))
    assert any("--skip-spiky-loss-window" in p for p in _problems(**MOCK, skip_spiky_loss_window=0))
    assert _problems(**MOCK, skip_spiky_loss_factor=10.0, skip_spiky_loss_window=5) == []


def test_full_validation_builds_one_epoch_of_the_valid_split():
    cfg = build_job_config({**MOCK, "full_validation": True, "eval_interval": 5})
    assert get_num_samples(cfg.training, 8)[1] is None
    cfg = build_job_config({**MOCK, "eval_interval": 5, "eval_iters": 2, "train_iters": 12})
    assert get_num_samples(cfg.training, 8)[1] == 3 * 2 * 8


@pytest.mark.parametrize("num_samples", [1, 13, 16, 17])
def test_full_pass_reads_every_sample_once_and_fillers_count_no_token(num_samples):
    ds = MarkovDataset(8, num_samples=num_samples)
    whole = FullPassDataset(ds, 8)
    assert whole.num_batches == -(-num_samples // 8) and len(whole) == whole.num_batches * 8
    read = [
        i
        for b in range(whole.num_batches)
        for dp in range(2)
        for mb in get_microbatch_indices(b * 8, 8, 2, dp, 2)
        for i in mb
    ]
    assert sorted(read) == list(range(len(whole)))
    for i in read:
        valid = (normalize_sample(whole[i])["labels"] >= 0).sum()
        assert (valid > 0) == (i < num_samples)


def test_sets_and_their_lines():
    assert get_validation_sets(None) == []
    one = MarkovDataset(8, 3)
    assert get_validation_sets(one) == [ValidationSet("", one)]
    assert format_validation_line(4, 2.0) == (
        " validation loss at iteration 4 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |"
    )
    assert format_validation_line(4, 2.0, "-1", "/d/b").startswith(" validation-1 loss at iteration 4 |")
    assert format_validation_line(4, 2.0, "-1", "/d/b").endswith(" set: /d/b |")


def test_eval_iters_zero_keeps_full_validation_on():
    from megatron_ext.arguments import parse_args_with_notes

    cfg, notes = parse_args_with_notes(["--eval-interval", "2", "--eval-iters", "0", "--full-validation"])
    assert cfg.training.eval_interval == 2 and not any("--eval-iters 0" in n for n in notes)
    cfg, _ = parse_args_with_notes(["--eval-interval", "2", "--eval-iters", "0"])
    assert cfg.training.eval_interval == 0  # without it, as Megatron-LM: no validation batches, no validation
