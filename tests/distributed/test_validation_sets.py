"""--full-validation --multiple-validation-sets: each prefix of --valid-data-path is evaluated whole
and logged on its own line.

A DP2 x PP2 run (4 forked ranks) trains 2 steps on one indexed corpus and evaluates two validation
corpora of 23 and 37 windows (neither a multiple of the global batch 8, so the last batch is partial)
at iteration 2. The reference is a one-process run of the same flags (same weights after 2 steps up
to float rounding, as layout parity shows) whose loss per set is computed directly: megatron-core's
GPTDataset of that prefix alone, one epoch, every window through the model, token losses summed over
valid tokens and divided once. Each logged "validation-K" loss must equal it; the two sets must differ.
The same world then runs --full-validation alone over the first corpus: Megatron-LM's one line, equal
to that set's direct loss.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from megatron_ext.config import build_job_config
from megatron_ext.data.gpt_datasets import build_gpt_datasets
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.run import build_training_run
from megatron_ext.testing import VOCAB, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

SEQ = 32
EOD = VOCAB - 1


def _corpus(prefix: str, seed: int, num_tokens: int, lo: int, hi: int) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(seed)
    written = 0
    while written < num_tokens:
        doc = np.append(rng.integers(lo, hi, int(rng.integers(5, 40))), EOD).astype(np.uint16)
        builder.add_document(doc, [len(doc)])
        written += len(doc)
    builder.finalize(prefix + ".idx")


def _values(root: str, **extra) -> dict:
    values = dict(
        mock_data=False,
        train_data_path=[root + "/train"],
        valid_data_path=[root + "/valid_a", root + "/valid_b"],
        full_validation=True,
        multiple_validation_sets=True,
        eval_interval=2,
        train_iters=2,
        seq_length=SEQ,
        data_cache_path=root + "/cache",
    )
    return tiny_values(**{**values, **extra})


def _direct_loss(model: torch.nn.Module, prefix: str, root: str) -> tuple[float, int]:
    """Token-mean loss over one epoch of ``prefix``'s windows, computed sample by sample."""
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    _, ds, _ = build_gpt_datasets(
        tokenizer,
        SEQ,
        [0, None, 0],
        blend_per_split=[None, ([prefix], None), None],
        unused_splits=(0, 2),
        path_to_cache=root + "/cache_ref",
        create_attention_mask=False,
    )
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(len(ds)):
            s = ds[i]
            tokens = torch.as_tensor(np.asarray(s["tokens"])).long()[None]
            labels = torch.as_tensor(np.asarray(s["labels"])).long()[None]
            valid = torch.as_tensor(np.asarray(s["loss_mask"]))[None] > 0
            out = model(input_ids=tokens, position_ids=torch.arange(SEQ)[None], attention_mask=None, labels=labels)
            total += float(out.double()[valid].sum())
            count += int(valid.sum())
    return total / count, len(ds)


def _world(rank: int, world_size: int, root: str) -> dict:
    layout = dict(pipeline_model_parallel_size=2) if world_size == 4 else {}
    lines: list[str] = []
    run = build_training_run(
        build_job_config(_values(root, **layout)), device=torch.device("cpu"), log=lines.append, metrics=False
    )
    train(run)
    out = {"lines": [line for line in lines if "validation" in line and "loss at" in line]}
    if world_size == 1:
        out["direct"] = [_direct_loss(run.model[0], root + p, root) for p in ("/valid_a", "/valid_b")]
    destroy_parallel_context()
    lines.clear()  # --full-validation alone over --valid-data-path valid_a: one set, Megatron-LM's line
    values = _values(root, **layout, multiple_validation_sets=False)
    values["valid_data_path"] = [root + "/valid_a"]
    train(build_training_run(build_job_config(values), device=torch.device("cpu"), log=lines.append, metrics=False))
    out["single"] = [line for line in lines if "validation" in line and "loss at" in line]
    destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("valsets"))
    _corpus(root + "/train", 0, 4000, 0, 60)
    _corpus(root + "/valid_a", 1, 23 * SEQ + 5, 0, 60)  # 23 windows
    _corpus(root + "/valid_b", 2, 37 * SEQ + 9, 60, 120)  # 37 windows, another distribution
    return run_ranks(_world, 1, root, timeout=300), run_ranks(_world, 4, root, timeout=300)


def _logged(lines: list[str]) -> dict[str, float]:
    out = {}
    for line in lines:
        m = re.match(r" validation(-\d) loss at iteration 2 \| lm loss value: (\S+) \|.* set: (\S+) \|", line)
        assert m, line
        out[m.group(1)] = float(m.group(2))
    return out


def test_each_set_logged_equals_a_direct_one_process_evaluation(results):
    reference, distributed = results
    (loss_a, n_a), (loss_b, n_b) = reference[0]["direct"]
    assert (n_a, n_b) == (23, 37)  # partial last batches, so a dropped or doubled sample would show
    assert abs(loss_a - loss_b) > 0.1  # two different sets
    one = _logged(reference[0]["lines"])
    assert one == {"-0": pytest.approx(loss_a, rel=1e-6), "-1": pytest.approx(loss_b, rel=1e-6)}
    logged = _logged(distributed[-1]["lines"])  # the last rank logs
    assert logged == {"-0": pytest.approx(loss_a, rel=1e-5), "-1": pytest.approx(loss_b, rel=1e-5)}
    assert distributed[-1]["lines"][0].endswith("/valid_a |") and distributed[-1]["lines"][1].endswith("/valid_b |")


def test_full_validation_of_one_set_logs_megatrons_line(results):
    reference, distributed = results
    (loss_a, _), _ = reference[0]["direct"]
    (line,) = distributed[-1]["single"]
    m = re.match(r" validation loss at iteration 2 \| lm loss value: (\S+) \| lm loss PPL: \S+ \|$", line)
    assert m, line
    assert float(m.group(1)) == pytest.approx(loss_a, rel=1e-5)
