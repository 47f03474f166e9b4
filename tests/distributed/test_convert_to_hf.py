"""tools/convert_checkpoint.py megatron-to-hf writes what --save-hf writes, and publishes as safely.

A checkpoint of a tiny Llama trained here with the shipped SentencePiece model (saved in one forked
rank; the model file then moved, so its recorded path is gone): converted with ``--tokenizer-model``
at its new place, ``AutoTokenizer.from_pretrained`` on the export gives sentencepiece's own ids
(the reference) on varied texts, and config.json names sentencepiece's eos/pad/bos ids; without the
flag the export gets the note; another SentencePiece model given is refused before anything is
written. Over an earlier export (``--overwrite``), a converter killed (SIGKILL, in a forked child)
while writing, or between its two renames, leaves the earlier export whole, and the next run finds
it in place. A checkpoint converted from Hugging Face (no tokenizer recorded) keeps the HF config's
special ids and exports the tokenizer given with --tokenizer-type.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal

import pytest

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")
pytest.importorskip("tokenizers")

from tools.convert_checkpoint import convert_megatron_to_hf, get_replaced_path, main  # noqa: E402
from tools.train_tokenizer import TRAINER_OPTIONS  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED_MODEL = os.path.join(REPO, "data", "default", "tokenizer.model")
LLAMA_HERE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    disable_bias_linear=True,
    ffn_hidden_size=96,
    num_layers=2,
    untie_embeddings_and_output_weights=True,
)
TEXTS = [
    "Hello world",
    " leading space",
    "a\n\nb\n",
    "digits 12345 and x1y2z3, 3.14159",
    "naïve café, 数据, emoji 😀",
    "<s> and </s> and <pad> as text",
    "def f(x):\n    return x * 2  # comment\n",
]


def _save(rank: int, world_size: int, save: str, model: str) -> None:
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import build_tiny_run, tiny_values
    from megatron_ext.training.checkpointing import save_checkpoint

    values = tiny_values(**LLAMA_HERE, tokenizer_type="SentencePieceTokenizer", tokenizer_model=model, vocab_size=None)
    run = build_tiny_run(values, None)
    save_checkpoint(run, save)
    destroy_parallel_context()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint directory, where its tokenizer is now): saved with the tokenizer at
    ``recorded/tokenizer.model``, which is then moved to ``moved/``."""
    root = tmp_path_factory.mktemp("sp_ckpt")
    (root / "recorded").mkdir()
    (root / "moved").mkdir()
    recorded = str(root / "recorded" / "tokenizer.model")
    shutil.copyfile(SHIPPED_MODEL, recorded)
    run_ranks(_save, 1, str(root / "ckpt"), recorded, timeout=300)
    moved = str(root / "moved" / "tokenizer.model")
    os.rename(recorded, moved)
    return str(root / "ckpt"), moved


def _quiet(line: str) -> None:
    pass


def test_the_export_has_sentencepieces_ids_and_special_tokens(ckpt, tmp_path, monkeypatch):
    save, model = ckpt
    out = tmp_path / "out"
    convert_megatron_to_hf(save, str(out), log=_quiet, tokenizer_flags={"tokenizer_model": model})
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary or replaced directory left
    names = ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer.model"]
    assert sorted(os.listdir(out)) == sorted(names + ["tokenizer_config.json"])
    processor = sentencepiece.SentencePieceProcessor(model_file=SHIPPED_MODEL)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert hf(text, add_special_tokens=True)["input_ids"] == processor.encode(text), text
    config = json.loads((out / "config.json").read_text())
    got = {k: config[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id")}
    assert got == {
        "eos_token_id": processor.eos_id(),
        "pad_token_id": processor.pad_id(),
        "bos_token_id": processor.bos_id(),
    }
    transformers.AutoModelForCausalLM.from_pretrained(str(out))  # loads with those ids


def test_a_tokenizer_gone_from_its_recorded_path_gets_the_note(ckpt, tmp_path):
    save, _ = ckpt
    out = tmp_path / "out"
    logged = []
    convert_megatron_to_hf(save, str(out), log=logged.append)
    assert sorted(os.listdir(out)) == ["TOKENIZER.txt", "config.json", "model.safetensors"]
    assert "SentencePieceTokenizer" in (out / "TOKENIZER.txt").read_text()
    warned = [line for line in logged if line.startswith("WARNING: the checkpoint's tokenizer")]
    assert len(warned) == 1 and "--tokenizer-model" in warned[0], logged
    config = json.loads((out / "config.json").read_text())
    assert "eos_token_id" not in config  # not guessed: the note says which tokenizer


def _train_other_model(root) -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    prefix = os.path.join(str(root), "other")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=400, model_type="bpe", **TRAINER_OPTIONS
    )
    return prefix + ".model"


def test_a_mismatched_tokenizer_model_is_refused_before_anything_is_written(ckpt, tmp_path, monkeypatch, capsys):
    import megatron_ext.checkpoint.state as state

    save, _ = ckpt
    other = _train_other_model(tmp_path)
    read = []
    monkeypatch.setattr(state, "load_full_tensors", lambda *a, **k: read.append(a))
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        convert_megatron_to_hf(save, str(out), log=_quiet, tokenizer_flags={"tokenizer_model": other})
    message = str(err.value)
    assert message.startswith("--tokenizer-type/--tokenizer-model: the checkpoint was saved with tokenizer"), message
    assert f"--tokenizer-model {other} give" in message and "vocab_size': 400" in message, message
    assert not read and not out.exists() and sorted(os.listdir(tmp_path)) == ["other.model", "other.vocab"]
    capsys.readouterr()
    assert main(["megatron-to-hf", "--load", save, "--hf-dir", str(out), "--tokenizer-model", other]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: --tokenizer-type/--tokenizer-model") and stderr.count("\n") == 1, stderr
    assert not out.exists()


def _snapshot(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def _earlier_export(save: str, out, model: str) -> dict[str, bytes]:
    """An export in ``out`` told apart from a new one by a key in its config.json; its files."""
    convert_megatron_to_hf(save, str(out), log=_quiet, tokenizer_flags={"tokenizer_model": model})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "sentinel": "earlier"}))
    return _snapshot(out)


def _killed_convert(save: str, out: str, model: str, where: str) -> None:
    """The converter with --overwrite, SIGKILLed ``where``: mid-way through the weights file, or
    between the rename that moves the earlier export aside and the one that publishes."""
    import safetensors.torch

    import megatron_ext.hf.export as export

    if where == "writing":
        real_save = safetensors.torch.save_file

        def save_file(tensors, path, metadata=None):
            real_save(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        safetensors.torch.save_file = save_file
    else:
        real_rename = os.rename

        def rename(src, dst):
            if dst == out:  # the earlier export is aside: the new one's rename would be next
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)

        export.os.rename = rename
    convert_megatron_to_hf(save, out, log=_quiet, overwrite=True, tokenizer_flags={"tokenizer_model": model})


@pytest.mark.parametrize("where", ["writing", "between renames"])
def test_a_converter_killed_over_an_earlier_export_leaves_it_whole(ckpt, tmp_path, where):
    save, model = ckpt
    out = tmp_path / "out"
    earlier = _earlier_export(save, out, model)
    child = mp.get_context("fork").Process(target=_killed_convert, args=(save, str(out), model, where))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    if where == "writing":
        assert _snapshot(out) == earlier
    else:  # aside, whole, under the converter's own name
        assert not out.exists() and _snapshot(tmp_path / f".{out.name}.replaced-export") == earlier
    logged = []
    with pytest.raises(ValueError, match="already holds a model"):  # the next run finds it in place
        convert_megatron_to_hf(save, str(out), log=logged.append, tokenizer_flags={"tokenizer_model": model})
    assert _snapshot(out) == earlier
    assert (where == "between renames") == any(line.startswith("recovered the Hugging Face export") for line in logged)
    convert_megatron_to_hf(save, str(out), log=_quiet, overwrite=True, tokenizer_flags={"tokenizer_model": model})
    assert "sentinel" not in json.loads((out / "config.json").read_text())
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the killed run's temporary directory deleted
    assert not os.path.exists(get_replaced_path(str(out)))


def test_overwrite_replaces_only_a_directory_of_export_files(tmp_path):
    from tools.convert_checkpoint import check_hf_output_dir

    out = tmp_path / "out"
    check_hf_output_dir(str(out))  # new
    out.mkdir()
    check_hf_output_dir(str(out))  # empty
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds files \(tokenizer.json\): .* or --overwrite"):
        check_hf_output_dir(str(out))
    check_hf_output_dir(str(out), overwrite=True)
    (out / "model.safetensors").write_text("x")
    (out / "README.md").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files an export does not write \(README.md\)"):
        check_hf_output_dir(str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors", "tokenizer.json"]


def _hf_to_ours(rank: int, world_size: int, hf_dir: str, save: str) -> None:
    from tools.convert_checkpoint import convert_hf_to_megatron

    convert_hf_to_megatron(hf_dir, save, divisible_by=32, log=_quiet)


def test_a_checkpoint_converted_from_hf_keeps_its_ids_and_takes_the_tokenizer_given(tmp_path, monkeypatch):
    """hf-to-megatron records no tokenizer: the export back keeps the HF config's special ids and
    writes the note, or with --tokenizer-type and --tokenizer-model that tokenizer's files (a
    SentencePiece model's Hugging Face equivalent here, as a local tokenizer directory)."""
    from megatron_ext.config import DataConfig
    from megatron_ext.hf.export import write_tokenizer_files

    tok = tmp_path / "tok"
    tok.mkdir()
    write_tokenizer_files(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=SHIPPED_MODEL), str(tok))
    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        bos_token_id=5,
        eos_token_id=[2, 7],
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    run_ranks(_hf_to_ours, 1, str(tmp_path / "hf"), str(tmp_path / "ours"), timeout=300)
    save = str(tmp_path / "ours")
    plain, given = tmp_path / "plain", tmp_path / "given"
    convert_megatron_to_hf(save, str(plain), log=_quiet)
    assert "records no tokenizer" in (plain / "TOKENIZER.txt").read_text()
    with pytest.raises(ValueError, match="give --tokenizer-type too"):
        convert_megatron_to_hf(save, str(given), log=_quiet, tokenizer_flags={"tokenizer_model": str(tok)})
    assert not given.exists()
    flags = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tok)}
    convert_megatron_to_hf(save, str(given), log=_quiet, tokenizer_flags=flags)
    assert (given / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    for out in (plain, given):
        written = json.loads((out / "config.json").read_text())
        assert (written["bos_token_id"], written["eos_token_id"]) == (5, [2, 7]), out


@pytest.mark.parametrize("where", ["writing", "publishing"])
def test_a_failed_write_over_an_earlier_export_is_one_error_and_leaves_it(ckpt, tmp_path, monkeypatch, where):
    """Disk full while writing the weights, or the publishing rename refused after the earlier
    export was moved aside: one ValueError naming --hf-dir, the earlier export back in place, no
    temporary or replaced directory left."""
    import errno

    import safetensors.torch

    import megatron_ext.hf.export as export

    save, model = ckpt
    out = tmp_path / "out"
    earlier = _earlier_export(save, out, model)

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "writing":
        monkeypatch.setattr(safetensors.torch, "save_file", fail)
    else:
        real_rename = os.rename
        monkeypatch.setattr(export.os, "rename", lambda a, b: fail() if ".tmp-" in a else real_rename(a, b))
    with pytest.raises(ValueError, match=f"--hf-dir {out}: writing the export failed .*No space left on device"):
        convert_megatron_to_hf(save, str(out), log=_quiet, overwrite=True, tokenizer_flags={"tokenizer_model": model})
    monkeypatch.undo()
    assert _snapshot(out) == earlier and sorted(os.listdir(tmp_path)) == ["out"]
