"""Tokenizers users bring: a local Hugging Face tokenizer directory and GPT-2's vocab.json +
merges.txt. The tokenizer files are made here (a tiny byte-level BPE trained with the tokenizers
package on text shipped in this repository: nothing is downloaded). For each type our
preprocessing writes exactly the ids the tokenizer itself produces (transformers' own loaders as
the reference), EOD ends every document, and a checkpoint refuses another tokenizer on resume."""

from __future__ import annotations

import inspect
import json
import os

import numpy
import pytest

from megatron_ext.checkpoint.compatibility import check_compatible
from megatron_ext.checkpoint.parts import CheckpointMeta
from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.data.tokenizers import build_tokenizer
from tools.preprocess_data import preprocess_data

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEXTS = [
    "Packed documents never attend across boundaries.",
    "",
    "def f(x):\n    return x * 2  # naïve café",
    "Pipeline parallelism, tensor parallelism and data parallelism: " * 3,
]


def _train_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        tok.train_from_iterator([f.read()], trainer)
    return tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    tok = _train_bpe(600)
    out = {}
    for name, special in (
        ("hf", dict(eos_token="<|endoftext|>")),
        ("hf_pad", dict(eos_token="<|endoftext|>", pad_token="<pad>")),
        ("hf_no_eos", {}),
    ):
        PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(root / name))
        out[name] = str(root / name)
    PreTrainedTokenizerFast(tokenizer_object=_train_bpe(400), eos_token="<|endoftext|>").save_pretrained(
        str(root / "hf_other")
    )
    out["hf_other"] = str(root / "hf_other")
    os.makedirs(root / "gpt2")
    tok.model.save(str(root / "gpt2"))
    out["vocab"], out["merges"] = str(root / "gpt2" / "vocab.json"), str(root / "gpt2" / "merges.txt")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    out["jsonl"], out["root"] = str(root / "docs.jsonl"), str(root)
    return out


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def _gpt2_reference(vocab: str, merges: str):
    """transformers' GPT2Tokenizer over the same files (its constructor differs between 4.x and 5.x)."""
    from transformers import GPT2Tokenizer

    if "vocab_file" in inspect.signature(GPT2Tokenizer.__init__).parameters:
        return GPT2Tokenizer(vocab_file=vocab, merges_file=merges)
    with open(merges, encoding="utf-8") as f:
        pairs = [tuple(line.split()) for line in f.read().splitlines()[1:] if line]
    with open(vocab, encoding="utf-8") as f:
        return GPT2Tokenizer(vocab=json.load(f), merges=pairs)


def test_huggingface_directory_preprocesses_to_the_tokenizer_ids(files):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(files["hf"])
    eod = reference.eos_token_id
    preprocess_data(
        files["jsonl"],
        os.path.join(files["root"], "hf_out"),
        "HuggingFaceTokenizer",
        files["hf"],
        append_eod=True,
        progress=False,
    )
    expected = [reference.encode(t, add_special_tokens=False) + [eod] for t in TEXTS if t]
    assert _documents(os.path.join(files["root"], "hf_out_text_document")) == expected
    tokenizer = build_tokenizer("HuggingFaceTokenizer", files["hf"])
    assert (tokenizer.eod, tokenizer.pad, tokenizer.vocab_size) == (eod, eod, len(reference))  # pad falls back to EOD
    assert tokenizer.detokenize(expected[1][:-1]) == TEXTS[2]
    assert build_tokenizer("HuggingFaceTokenizer", files["hf_pad"]).pad == reference.convert_tokens_to_ids("<pad>")


def test_gpt2_bpe_files_preprocess_to_gpt2_ids(files):
    reference = _gpt2_reference(files["vocab"], files["merges"])
    preprocess_data(
        files["jsonl"],
        os.path.join(files["root"], "gpt2_out"),
        "GPT2BPETokenizer",
        append_eod=True,
        progress=False,
        vocab_file=files["vocab"],
        merge_file=files["merges"],
    )
    eod = reference.convert_tokens_to_ids("<|endoftext|>")
    expected = [reference.encode(t) + [eod] for t in TEXTS if t]
    assert _documents(os.path.join(files["root"], "gpt2_out_text_document")) == expected
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=files["merges"])
    assert tokenizer.eod == tokenizer.pad == eod and tokenizer.vocab_size == 600
    assert tokenizer.detokenize(expected[0][:-1]) == TEXTS[0]


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("hub id", "is not a local directory (hub ids are not downloaded"),
        ("bare file", "a bare tokenizer file names no eos token; pass the tokenizer's directory"),
        ("no eos", "the tokenizer defines no eos token"),
        ("no merges", "--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file"),
        ("tiktoken", "--tokenizer-type TikTokenizer needs --tokenizer-model PATH.json"),
    ],
)
def test_tokenizer_errors_name_the_flag_and_the_fix(files, kind, needle):
    args = {
        "hub id": ("HuggingFaceTokenizer", "meta-llama/Meta-Llama-3-8B", {}),
        "bare file": ("HuggingFaceTokenizer", os.path.join(files["hf"], "tokenizer.json"), {}),
        "no eos": ("HuggingFaceTokenizer", files["hf_no_eos"], {}),
        "no merges": ("GPT2BPETokenizer", None, dict(vocab_file=files["vocab"])),
        "tiktoken": ("TikTokenizer", "/x/tokenizer.model", {}),  # test_tiktokenizer.py: the type itself
    }[kind]
    with pytest.raises(ConfigError) as err:
        build_tokenizer(args[0], args[1], **args[2])
    assert needle in str(err.value), str(err.value)


def test_a_checkpoint_refuses_another_tokenizer_directory(files):
    cfg = build_job_config(dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files["hf"]))
    saved_tok, other = (build_tokenizer("HuggingFaceTokenizer", files[k]) for k in ("hf", "hf_other"))
    saved = {"tokenizer": saved_tok.identity(), "padded_vocab_size": 640}
    assert check_compatible(saved, cfg, CheckpointMeta(saved_tok.identity(), 640)) == []
    assert build_tokenizer("HuggingFaceTokenizer", files["hf"]).identity() == saved_tok.identity()  # stable
    problems = check_compatible(saved, cfg, CheckpointMeta(other.identity(), 640))
    assert len(problems) == 1 and problems[0].startswith("--tokenizer-type/--tokenizer-model"), problems


def test_preprocessed_token_dtype_fits_the_vocabulary(files):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert IndexedDataset(os.path.join(files["root"], "hf_out_text_document")).index.dtype == numpy.uint16
