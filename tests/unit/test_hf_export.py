"""--save-hf's pure parts: the flag rules (a model HF's Llama cannot express is one error naming the
flag, before any work), when an export is due, the TP join (the inverse of the layout-independent
init's TP slicing, gated MLP included), a stage's partial mapping (the same tensors as the whole
model's), and the tokenizer files or note."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.config import ConfigError, build_job_config
from megatron_ext.hf.export import join_tp_shards, should_export_hf, write_tokenizer_files
from megatron_ext.hf.mapping import megatron_to_hf_tensors
from megatron_ext.model.init_weights import slice_for_tp
from megatron_ext.validation import validate

BASE = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100, num_layers=2)
LLAMA = dict(normalization="RMSNorm", swiglu=True, disable_bias_linear=True, position_embedding_type="rope")


def _problems(**values) -> list[str]:
    try:
        validate(build_job_config({**BASE, **values}), 1)
    except ConfigError as err:
        return err.problems
    return []


def test_a_gpt2_style_model_is_one_error_naming_the_flag():
    problems = _problems(save="/tmp/x", save_hf=True)
    assert len(problems) == 1, problems
    assert problems[0].startswith("--save-hf exports Llama/Qwen2/Qwen3-style models only")
    for need in ("--normalization RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type rope"):
        assert need in problems[0]
    assert _problems(save="/tmp/x", save_hf=True, **LLAMA) == []
    assert "--rotary-percent 0.5" in _problems(save="/tmp/x", save_hf=True, rotary_percent=0.5, **LLAMA)[0]


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(save_hf=True), "--save-hf writes the Hugging Face model beside the checkpoints of --save"),
        (dict(save="/tmp/x", save_hf_interval=2), "--save-hf-interval 2 needs --save-hf"),
        (dict(save="/tmp/x", save_hf=True, save_hf_interval=0), "--save-hf-interval 0 needs --save-hf"),
    ],
)
def test_flag_rules(values, message):
    problems = _problems(**LLAMA, **values)
    assert any(message in p for p in problems), problems


def test_export_is_due_at_the_last_save_and_on_the_interval():
    c = build_job_config({**BASE, "save": "/tmp/x", "save_hf": True, "save_hf_interval": 4}).checkpoint
    assert [i for i in range(1, 10) if should_export_hf(c, i, last=i == 9)] == [4, 8, 9]
    off = build_job_config({**BASE, "save": "/tmp/x"}).checkpoint
    assert not should_export_hf(off, 9, last=True)


@pytest.mark.parametrize("gated, dim", [(False, 0), (False, 1), (True, 0)])
def test_join_tp_shards_inverts_the_tp_slicing(gated, dim):
    full = torch.randn(8, 12)
    param = torch.nn.Parameter(torch.empty(0))
    param.tensor_model_parallel, param.partition_dim = True, dim
    shards = [slice_for_tp(full, param, r, 2, gated) for r in range(2)]
    assert torch.equal(join_tp_shards(shards, dim, gated), full)
    if gated:  # a gated shard is [gate part; up part]: joined as plain blocks it would be wrong
        assert not torch.equal(torch.cat(shards, dim=dim), full)


def _ours(layers: int, hidden: int = 8, heads: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"embedding.word_embeddings.weight": torch.randn(12, hidden, generator=g)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        out[p + "self_attention.linear_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        out[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
        out[p + "pre_mlp_layernorm.weight"] = torch.randn(hidden, generator=g)
        out[p + "mlp.linear_fc1.weight"] = torch.randn(2 * 16, hidden, generator=g)
        out[p + "mlp.linear_fc2.weight"] = torch.randn(hidden, 16, generator=g)
    out["decoder.final_layernorm.weight"] = torch.randn(hidden, generator=g)
    out["output_layer.weight"] = torch.randn(12, hidden, generator=g)
    return out


def test_stages_map_to_the_whole_models_tensors():
    hf = dict(num_attention_heads=2, hidden_size=8, vocab_size=10, num_hidden_layers=4, tie_word_embeddings=False)
    ours = _ours(4)
    whole = megatron_to_hf_tensors(ours, hf, zero_centered_gamma=True)
    first = {k: v for k, v in ours.items() if k.startswith(("embedding.", "decoder.layers.0.", "decoder.layers.1."))}
    parts = megatron_to_hf_tensors(first, hf, zero_centered_gamma=True)
    parts |= megatron_to_hf_tensors({k: v for k, v in ours.items() if k not in first}, hf, zero_centered_gamma=True)
    assert sorted(parts) == sorted(whole) and all(torch.equal(parts[k], whole[k]) for k in whole)
    assert whole["lm_head.weight"].shape[0] == 10  # the padding rows dropped


def test_tokenizer_files_are_copied_or_a_note_written(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    cfg = build_job_config({**BASE, "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tok)})
    assert "copied" in write_tokenizer_files(cfg.data, str(out))
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    note_dir = tmp_path / "note"
    note_dir.mkdir()
    cfg = build_job_config({**BASE, "tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/m/sp.model"})
    write_tokenizer_files(cfg.data, str(note_dir))
    note = (note_dir / "TOKENIZER.txt").read_text()
    assert "--tokenizer-type SentencePieceTokenizer" in note and "/m/sp.model" in note


def test_keep_last_prunes_old_hf_exports_as_it_prunes_checkpoints(tmp_path):
    """--keep-last applies to <save>/hf/iter_* too (else --save-hf-interval fills the disk the
    checkpoints need): the newest N remain, never the newest; other entries are left alone."""
    from megatron_ext.training.checkpointing import prune_hf_exports

    names = ["iter_0000002", "iter_0000004", "iter_0000010", "iter_0000006", ".tmp_iter_0000012", "notes"]
    for name in names:
        (tmp_path / name).mkdir()
    logged = []
    assert prune_hf_exports(str(tmp_path), None, logged.append) == []
    assert prune_hf_exports(str(tmp_path), 0, logged.append) == []
    deleted = prune_hf_exports(str(tmp_path), 2, logged.append)
    assert sorted(deleted) == [str(tmp_path / "iter_0000002"), str(tmp_path / "iter_0000004")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_iter_0000012", "iter_0000006", "iter_0000010", "notes"]
    assert logged == [f"--keep-last 2: deleted 2 older Hugging Face export(s) in {tmp_path}"]
    prune_hf_exports(str(tmp_path), 1, logged.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_iter_0000012", "iter_0000010", "notes"]


def _export_dir(path, sentinel: str, complete: bool = True) -> None:
    """An export directory on disk: ``complete`` has the index and config a published one has;
    ``sentinel`` tells which one a test finds later."""
    path.mkdir()
    (path / "sentinel").write_text(sentinel)
    if complete:
        (path / "model.safetensors.index.json").write_text("{}")
        (path / "config.json").write_text("{}")


def test_an_export_interrupted_between_its_renames_is_recovered(tmp_path):
    """The states a crash in ``_publish`` leaves (the earlier export renamed to ``.old``, the new one
    not yet renamed in, or renamed in but ``.old`` not yet deleted): ``.old`` alone comes back, one
    line logged; beside a complete export (or itself partial) it is deleted; a partial directory
    under the name gives way to the complete ``.old``."""
    from megatron_ext.hf.export import recover_interrupted_publish

    _export_dir(tmp_path / "iter_0000002.old", "earlier 2")  # crashed after the first rename
    _export_dir(tmp_path / "iter_0000004.old", "earlier 4")  # crashed after the second
    _export_dir(tmp_path / "iter_0000004", "new 4")
    _export_dir(tmp_path / "iter_0000006.old", "earlier 6")  # a delete cut short under the name
    _export_dir(tmp_path / "iter_0000006", "partial 6", complete=False)
    _export_dir(tmp_path / "iter_0000008.old", "partial old 8", complete=False)
    _export_dir(tmp_path / "iter_0000009", "untouched")
    logged = []
    recovered = recover_interrupted_publish(str(tmp_path), logged.append)
    assert recovered == [str(tmp_path / "iter_0000002"), str(tmp_path / "iter_0000006")]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000009"]
    found = {name: (tmp_path / name / "sentinel").read_text() for name in names}
    assert found == {
        "iter_0000002": "earlier 2",
        "iter_0000004": "new 4",
        "iter_0000006": "earlier 6",
        "iter_0000009": "untouched",
    }
    assert len(logged) == 2 and all(line.startswith("recovered the Hugging Face export") for line in logged)
    assert str(tmp_path / "iter_0000002.old") in logged[0]
    assert recover_interrupted_publish(str(tmp_path), logged.append) == [] and len(logged) == 2  # idempotent
    assert recover_interrupted_publish(str(tmp_path / "absent"), logged.append) == []


def test_keep_last_counts_a_recovered_export(tmp_path):
    """Pruning recovers first: the ``.old`` export is back under its name and counts as the newest."""
    from megatron_ext.training.checkpointing import prune_hf_exports

    _export_dir(tmp_path / "iter_0000002", "2")
    _export_dir(tmp_path / "iter_0000004", "4")
    _export_dir(tmp_path / "iter_0000006.old", "6")
    logged = []
    deleted = prune_hf_exports(str(tmp_path), 2, logged.append)
    assert deleted == [str(tmp_path / "iter_0000002")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000006"]
    assert logged[0].startswith(f"recovered the Hugging Face export {tmp_path / 'iter_0000006'}")


def test_the_export_line_gives_its_seconds(tmp_path):
    """As the checkpoint's "saved checkpoint ... in X s": the seconds since the export started."""
    import re
    import time

    from megatron_ext.hf.export import _publish

    cfg = build_job_config({**BASE, "save": str(tmp_path)})
    tmp, final = tmp_path / ".tmp_iter_0000003", tmp_path / "iter_0000003"
    tmp.mkdir()
    shard = {"weight_map": {"model.norm.weight": "model-pp000-tp000.safetensors"}, "bytes": 64}
    logged = []
    before = time.perf_counter()
    assert (
        _publish(
            {"architectures": ["LlamaForCausalLM"]}, cfg, [shard], str(tmp), str(final), logged.append, before - 100.0
        )
        == []
    )
    elapsed = time.perf_counter() - before
    (line,) = logged
    match = re.search(r" in (\d+\.\d\d) s: ", line)
    assert match and line.startswith(f"exported a Hugging Face LlamaForCausalLM to {final} in "), line
    assert 100.0 <= float(match.group(1)) <= 100.0 + elapsed + 0.01


def test_keep_last_after_a_rollback_keeps_the_export_just_written(tmp_path):
    """After a --ckpt-step resume rolled back below exports of the abandoned run, the export just
    written is not the newest iteration: --keep-last deleted it right after its publication (and
    this run's older ones); the abandoned run's later exports are now neither counted nor deleted."""
    from megatron_ext.training.checkpointing import prune_hf_exports

    for it in (100, 200, 300):  # 200 and 300: exported by the run a --ckpt-step 100 resume rolled back from
        _export_dir(tmp_path / f"iter_{it:07d}", str(it))
    _export_dir(tmp_path / "iter_0000150", "150, just exported")
    assert prune_hf_exports(str(tmp_path), 1, [].append, keep=150) == [str(tmp_path / "iter_0000100")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000150", "iter_0000200", "iter_0000300"]
    assert (tmp_path / "iter_0000150" / "sentinel").read_text() == "150, just exported"


def test_an_export_is_on_disk_before_its_publishing_rename(tmp_path, monkeypatch):
    """Each shard is fsynced by its writer; ``publish_directory`` fsyncs every file and the
    directory's entries before the rename that publishes it, and the parent's entries after (a
    power loss after the rename cannot leave a published export with a torn or missing file)."""
    import megatron_ext.hf.export as export

    events = []
    monkeypatch.setattr(export, "fsync_path", lambda path: events.append(("fsync", path)))
    real_rename = os.rename
    monkeypatch.setattr(export.os, "rename", lambda a, b: (events.append(("rename", a, b)), real_rename(a, b)))
    tmp, final = tmp_path / ".tmp_iter_0000003", tmp_path / "iter_0000003"
    tmp.mkdir()
    shard = {}
    name = "model-pp000-tp000.safetensors"
    assert export._write_shard({"model.norm.weight": torch.ones(4)}, str(tmp), name, shard) is None
    assert events == [("fsync", str(tmp / name))]
    (tmp / "config.json").write_text("{}")
    final.mkdir()  # an earlier export of the iteration: aside first, deleted after
    (final / "config.json").write_text("{}")
    events.clear()
    export.publish_directory(str(tmp), str(final), synced=frozenset([name]))  # --save-hf's: not reopened
    publish = events.index(("rename", str(tmp), str(final)))
    synced = {e[1] for e in events[:publish] if e[0] == "fsync"}
    assert synced == {str(tmp / "config.json"), str(tmp)}, events
    assert ("rename", str(final), str(final) + ".old") in events[:publish]
    assert events[publish + 1 :] == [("fsync", str(tmp_path))], events
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003"] and sorted(os.listdir(final)) == ["config.json", name]
    (tmp_path / "tmp2").mkdir()
    (tmp_path / "tmp2" / name).write_text("x")
    events.clear()
    export.publish_directory(str(tmp_path / "tmp2"), str(tmp_path / "new"))  # the converter's: every file
    assert events[:2] == [("fsync", str(tmp_path / "tmp2" / name)), ("fsync", str(tmp_path / "tmp2"))], events
