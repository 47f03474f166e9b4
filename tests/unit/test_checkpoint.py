"""Pure checkpoint logic: which directories count, retention, publishing, fault specs, mismatch
messages, exit-flag agreement and the HF <-> ours tensor maps (no process group)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ext.checkpoint.compatibility import check_compatible
from megatron_ext.checkpoint.directory import (
    COMPLETE_MARKER,
    TRACKER_FILE,
    apply_retention,
    find_latest_checkpoint,
    get_checkpoint_dir,
    list_complete_checkpoints,
    publish_checkpoint,
    read_tracker,
    resolve_load_path,
    select_checkpoints_to_delete,
    should_inject_fault,
)
from megatron_ext.checkpoint.exit_policy import (
    DURATION_EXCEEDED,
    INTERVAL_REACHED,
    SIGNAL_RECEIVED,
    describe_exit,
    get_interval_flag,
    get_local_exit_flags,
)
from megatron_ext.checkpoint.parts import CheckpointMeta
from megatron_ext.config import build_job_config


def _complete(root, iteration):
    path = get_checkpoint_dir(str(root), iteration)
    os.makedirs(path)
    open(os.path.join(path, COMPLETE_MARKER), "w").write("{}")
    return path


def test_only_marked_final_directories_count(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    os.makedirs(get_checkpoint_dir(str(tmp_path), 6))  # no marker: a torn copy
    os.makedirs(get_checkpoint_dir(str(tmp_path), 8) + ".tmp-abc")  # interrupted save
    assert [it for it, _ in list_complete_checkpoints(str(tmp_path))] == [2, 4]
    assert find_latest_checkpoint(str(tmp_path))[0] == 4
    assert find_latest_checkpoint(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    "iterations,keep,expected",
    [
        ([2, 4, 6], 2, [2]),
        ([2, 4, 6], 1, [2, 4]),
        ([6], 1, []),
        ([2, 4], None, []),
        ([2, 4], 0, []),
        ([4, 2, 6], 5, []),
    ],
)
def test_retention_never_deletes_the_newest(iterations, keep, expected):
    assert select_checkpoints_to_delete(iterations, keep) == expected


def test_publish_then_retention(tmp_path):
    root = str(tmp_path)
    _complete(tmp_path, 2)
    tmp = get_checkpoint_dir(root, 4) + ".tmp-x"
    os.makedirs(tmp)
    open(os.path.join(tmp, "shard"), "w").write("data")
    os.makedirs(get_checkpoint_dir(root, 3) + ".tmp-old")  # leftover of a crashed save
    publish_checkpoint(tmp, get_checkpoint_dir(root, 4), root, 4, rank=0)
    assert read_tracker(root) == 4 and not os.path.exists(tmp)
    assert json.load(open(os.path.join(get_checkpoint_dir(root, 4), COMPLETE_MARKER)))["iteration"] == 4
    apply_retention(root, 1, get_checkpoint_dir(root, 4))
    assert sorted(os.listdir(root)) == sorted([TRACKER_FILE, "iter_0000004"])


def test_republishing_an_iteration_replaces_it(tmp_path):
    root = str(tmp_path)
    _complete(tmp_path, 4)
    tmp = get_checkpoint_dir(root, 4) + ".tmp-y"
    os.makedirs(tmp)
    open(os.path.join(tmp, "new"), "w").close()
    publish_checkpoint(tmp, get_checkpoint_dir(root, 4), root, 4, rank=0)
    assert "new" in os.listdir(get_checkpoint_dir(root, 4))


def test_fault_spec():
    assert should_inject_fault("after_shards:1", "after_shards", 1, 7)
    assert not should_inject_fault("after_shards:1", "after_shards", 0, 7)
    assert should_inject_fault("before_publish:0:4", "before_publish", 0, 4)
    assert not should_inject_fault("before_publish:0:4", "before_publish", 0, 2)
    assert not should_inject_fault(None, "before_publish", 0, 2)
    with pytest.raises(ValueError, match="phase one of"):
        should_inject_fault("sometime:0", "after_shards", 0, 1)


def _cfg(**values):
    return build_job_config(dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=127, **values))


def test_mismatch_names_flag_and_both_values():
    saved = {
        "args": _cfg(num_layers=8).to_flat_dict(),
        "padded_vocab_size": 128,
        "tokenizer": {"type": "NullTokenizer", "vocab_size": 127},
    }
    meta = CheckpointMeta(tokenizer={"type": "NullTokenizer", "vocab_size": 255}, padded_vocab_size=256)
    problems = check_compatible(saved, _cfg(num_layers=4, hidden_size=256), meta)
    text = "\n".join(problems)
    assert "--num-layers: the checkpoint was saved with 8, this run has 4" in text
    assert "--hidden-size: the checkpoint was saved with 128, this run has 256" in text
    assert "padded vocabulary is 128, this run's is 256" in text
    assert "--tokenizer-type/--tokenizer-model" in text
    same = CheckpointMeta(tokenizer=saved["tokenizer"], padded_vocab_size=128)
    assert check_compatible(saved, _cfg(num_layers=8, tensor_model_parallel_size=2), same) == []


def test_distributed_optimizer_switch_is_refused_unless_weights_only():
    saved = {"args": _cfg(use_distributed_optimizer=True).to_flat_dict()}
    meta = CheckpointMeta(tokenizer={}, padded_vocab_size=128)
    assert "--use-distributed-optimizer" in check_compatible(saved, _cfg(), meta)[0]
    assert check_compatible(saved, _cfg(), meta, load_optimizer=False) == []


def test_defaults_and_the_same_values_given_explicitly_are_one_model():
    meta = CheckpointMeta(tokenizer={}, padded_vocab_size=128)
    saved = {"args": _cfg(hidden_size=64, num_attention_heads=4).to_flat_dict()}  # ffn default 4 x 64, MHA
    same = _cfg(
        hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, group_query_attention=True, num_query_groups=4
    )
    assert check_compatible(saved, same, meta) == []
    text = "\n".join(
        check_compatible(
            saved,
            _cfg(
                hidden_size=64,
                num_attention_heads=4,
                ffn_hidden_size=128,
                group_query_attention=True,
                num_query_groups=2,
            ),
            meta,
        )
    )
    assert "--ffn-hidden-size: the checkpoint was saved with 256, this run has 128" in text, text
    assert (
        "--group-query-attention/--num-query-groups (key/value heads): the checkpoint was saved with 4, "
        "this run has 2" in text
    ), text
    assert "None" not in text
    swiglu = "\n".join(check_compatible(saved, _cfg(hidden_size=64, num_attention_heads=4, swiglu=True), meta))
    assert "--swiglu" in swiglu and "--ffn-hidden-size" not in swiglu, swiglu  # both widths defaulted


def test_precision_switch_is_refused_where_the_optimizer_states_differ():
    meta = CheckpointMeta(tokenizer={}, padded_vocab_size=128)
    fp32, bf16 = {"args": _cfg().to_flat_dict()}, {"args": _cfg(bf16=True).to_flat_dict()}
    (problem,) = check_compatible(fp32, _cfg(bf16=True), meta)
    assert "precision: the checkpoint was saved in fp32, this run is bf16" in problem and "--no-load-optim" in problem
    assert "saved in bf16, this run is fp32" in check_compatible(bf16, _cfg(), meta)[0]
    assert check_compatible(fp32, _cfg(bf16=True), meta, load_optimizer=False) == []
    assert "saved in bf16, this run is fp16" in check_compatible(bf16, _cfg(fp16=True), meta)[0]  # no loss scaler state
    fp16 = {"args": _cfg(fp16=True, use_distributed_optimizer=True).to_flat_dict()}
    dist = {"args": _cfg(use_distributed_optimizer=True).to_flat_dict()}
    # the distributed optimizer keeps fp32 main parameters and Adam state in every precision
    assert check_compatible(dist, _cfg(bf16=True, use_distributed_optimizer=True), meta) == []
    assert check_compatible(fp16, _cfg(bf16=True, use_distributed_optimizer=True), meta) == []
    assert (
        "saved in fp32, this run is fp16"
        in check_compatible(dist, _cfg(fp16=True, use_distributed_optimizer=True), meta)[0]
    )


def test_a_resume_that_changes_what_the_model_computes_says_so():
    from megatron_ext.checkpoint.compatibility import describe_changed_settings

    saved = {"args": _cfg(position_embedding_type="rope", seed=1).to_flat_dict()}
    assert describe_changed_settings(saved, _cfg(position_embedding_type="rope", seed=1)) is None
    line = describe_changed_settings(saved, _cfg(position_embedding_type="rope", seed=2, rotary_base=500000))
    assert "--rotary-base 10000 -> 500000" in line and "--seed 1 -> 2" in line, line


def test_exit_flags():
    assert get_local_exit_flags(False, 5.0, None) == 0
    assert get_local_exit_flags(True, 0.0, None) == SIGNAL_RECEIVED
    assert get_local_exit_flags(False, 10.0, 10.0) == DURATION_EXCEEDED
    assert get_interval_flag(6, 3) == INTERVAL_REACHED and get_interval_flag(7, 3) == 0
    assert get_interval_flag(6, None) == 0
    assert "exit signal" in describe_exit(SIGNAL_RECEIVED | DURATION_EXCEEDED)


def test_hf_tensor_maps_are_inverse():
    from tools.convert_checkpoint import hf_to_megatron_tensors, megatron_to_hf_tensors

    hf = dict(
        num_hidden_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=12,
        vocab_size=10,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (10, 8),
        "lm_head.weight": (10, 8),
        "model.norm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.mlp.gate_proj.weight": (12, 8),
        "model.layers.0.mlp.up_proj.weight": (12, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 12),
    }
    state = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    ours = hf_to_megatron_tensors(state, hf, padded_vocab=16)
    qkv = ours["decoder.layers.0.self_attention.linear_qkv.weight"]
    # group 0 = [q heads 0,1; k head 0; v head 0], head_dim 2
    assert torch.equal(qkv[:4], state["model.layers.0.self_attn.q_proj.weight"][:4])
    assert torch.equal(qkv[4:6], state["model.layers.0.self_attn.k_proj.weight"][:2])
    assert torch.equal(qkv[6:8], state["model.layers.0.self_attn.v_proj.weight"][:2])
    assert ours["embedding.word_embeddings.weight"].shape == (16, 8)
    back = megatron_to_hf_tensors(ours, hf)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_publish_makes_every_file_durable_before_the_marker(tmp_path, monkeypatch):
    """megatron-core writes common.pt and metadata.json without fsync: the publish must fsync
    them (and the directory) before the marker exists; rank shards (*.distcp) are their writers'."""
    root = str(tmp_path)
    tmp = get_checkpoint_dir(root, 4) + ".tmp-z"
    os.makedirs(tmp)
    for name in ("common.pt", "metadata.json", ".metadata", "__0_0.distcp"):
        open(os.path.join(tmp, name), "w").write("x")
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        marker_exists = os.path.exists(os.path.join(folder, COMPLETE_MARKER))
        synced.append((os.path.basename(path), marker_exists))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    publish_checkpoint(tmp, get_checkpoint_dir(root, 4), root, 4, rank=0)
    before_marker = {name for name, marker in synced if not marker}
    assert {"common.pt", "metadata.json", ".metadata", os.path.basename(tmp)} <= before_marker
    assert "__0_0.distcp" not in {name for name, _ in synced}


def test_host_snapshot_copies_and_reuses_its_buffers():
    from megatron_ext.checkpoint.async_save import HostSnapshot

    snap = HostSnapshot()
    a, b = torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.bfloat16)
    first = snap.copy([("a", a), ("b", b[1:])])  # a view is copied whole into its own storage
    snap.wait()
    a.add_(100)
    assert torch.equal(first[0][1], torch.arange(6.0).view(2, 3)) and first[1][1].dtype == torch.bfloat16
    assert snap.bytes == 6 * 4 + 3 * 2
    buffers = [t for _, t in first]
    snap.reset()
    second = snap.copy([("a", a), ("b", b[1:])])
    snap.wait()
    assert [t.data_ptr() for _, t in second] == [t.data_ptr() for t in buffers]  # reused, not reallocated
    assert torch.equal(second[0][1], a)
    snap.reset()
    third = snap.copy([("a", torch.zeros(5))])  # another shape: a new buffer; the unused one is freed
    snap.wait()
    assert third[0][1].data_ptr() != buffers[0].data_ptr() and len(snap._buffers) == 1


def test_async_save_needs_save_dir():
    from megatron_ext.config import ConfigError, build_job_config
    from megatron_ext.validation import validate

    cfg = build_job_config(dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128, async_save=True))
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert any(
        "--async-save writes the checkpoints of --save in the background: give --save DIR" in p
        for p in err.value.problems
    )


def test_async_save_bits_stay_out_of_the_exit_reasons():
    from megatron_ext.checkpoint.exit_policy import (
        _AGREED_BITS,
        ASYNC_SAVE_FAILED,
        ASYNC_SAVE_NOT_FINITE,
        ASYNC_SAVE_WRITING,
        EXIT_FLAGS,
    )

    assert not (ASYNC_SAVE_WRITING | ASYNC_SAVE_FAILED | ASYNC_SAVE_NOT_FINITE) & EXIT_FLAGS
    assert ASYNC_SAVE_NOT_FINITE < 1 << _AGREED_BITS  # a bit the all-reduce does not carry would be lost
    assert describe_exit((ASYNC_SAVE_WRITING | SIGNAL_RECEIVED) & EXIT_FLAGS) == "exit signal received"


def test_a_full_disk_at_the_save_probe_leaves_no_probe_file(tmp_path, monkeypatch):
    """The probe file is created, then its write fails (ENOSPC): named error, and the file goes."""
    import builtins
    import errno

    from megatron_ext.checkpoint import directory
    from megatron_ext.config import ConfigError

    class Full:
        def __init__(self, path, mode):
            self.f = builtins.open(path, mode)

        def __enter__(self):
            return self

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(directory, "open", Full, raising=False)
    with pytest.raises(ConfigError) as err:
        directory.probe_save_dir(str(tmp_path / "ck"))
    assert "No space left on device" in str(err.value) and "MiB free" in str(err.value), err.value
    assert os.listdir(tmp_path / "ck") == []


def _undeletable_markers(monkeypatch):
    """os.unlink removes every file but a checkpoint's marker (EACCES injected): a delete cut short
    that leaves the marker. Returns the real os.unlink, to put back."""
    import errno

    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.path.basename(path) == COMPLETE_MARKER:
            raise PermissionError(errno.EACCES, "Permission denied (injected)", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    return real_unlink


def test_a_retention_delete_cut_short_leaves_no_marked_partial_checkpoint(tmp_path, monkeypatch):
    """rmtree removes a checkpoint's files one at a time: when it stops part-way (a kill, or a
    file it cannot remove, e.g. EACCES or NFS's EBUSY), the directory must not still be an
    ``iter_XXXXXXX`` with its marker and some shards gone, counted complete and loadable by
    --ckpt-step or --ckpt-fallback-on-corruption."""

    root = str(tmp_path)
    old = _complete(tmp_path, 2)
    for name in ("__0_0.distcp", "__1_0.distcp", "common.pt"):
        open(os.path.join(old, name), "w").write("shard")
    _complete(tmp_path, 4)
    real_unlink = _undeletable_markers(monkeypatch)
    apply_retention(root, 1, get_checkpoint_dir(root, 4))
    assert [it for it, _ in list_complete_checkpoints(root)] == [4]
    monkeypatch.setattr(os, "unlink", real_unlink)
    apply_retention(root, 1, get_checkpoint_dir(root, 4))  # the next save's retention finishes it
    assert sorted(os.listdir(root)) == ["iter_0000004"]


def test_a_failed_republish_keeps_the_checkpoint_it_was_to_replace(tmp_path, monkeypatch):
    """Saving an iteration again (after a resume from an older one) moves the old directory aside
    first: when the new one then cannot take its name, the old one must get it back, not be left
    as a ``.old-`` directory that is never loaded and that the next retention deletes."""
    import errno

    root = str(tmp_path)
    old = _complete(tmp_path, 4)
    tmp = get_checkpoint_dir(root, 4) + ".tmp-y"
    os.makedirs(tmp)
    real_rename = os.rename

    def rename(src, dst):
        if src == tmp:
            raise PermissionError(errno.EACCES, "Permission denied (injected)", src)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(PermissionError):
        publish_checkpoint(tmp, old, root, 4, rank=0)
    assert list_complete_checkpoints(root) == [(4, old)]


class _Killed(BaseException):
    """A SIGKILL at that instant: no except clause of ours runs."""


def test_a_republish_killed_between_its_renames_loses_nothing(tmp_path, monkeypatch):
    """Saving an iteration again moves the earlier copy aside, then renames the new one in: a kill
    between the two renames leaves the iteration only in the moved-aside copy. Loads must find it
    (not fall back to an older checkpoint) and retention must not delete it as a leftover: the next
    save's retention renames it back. Before, it was ``.old-`` and the next retention deleted it."""
    root = str(tmp_path)
    older, old = _complete(tmp_path, 2), _complete(tmp_path, 4)
    open(os.path.join(old, "shard"), "w").write("the first save of iteration 4")
    tmp = get_checkpoint_dir(root, 4) + ".tmp-y"
    os.makedirs(tmp)
    real_rename = os.rename

    def rename(src, dst):
        if src == tmp:
            raise _Killed
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(_Killed):
        publish_checkpoint(tmp, old, root, 4, rank=0)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not os.path.exists(old)  # the kill's window: the iteration is only in the copy aside
    (found_it, found), warning = resolve_load_path(root)
    assert found_it == 4 and found != older and warning is None
    assert open(os.path.join(found, "shard")).read() == "the first save of iteration 4"
    assert resolve_load_path(root, 4)[0] == (4, found)
    assert [it for it, _ in list_complete_checkpoints(root)] == [2, 4]
    _complete(tmp_path, 6)  # the next save; its retention renames iteration 4 back, the killed save's tmp goes
    apply_retention(root, 2, get_checkpoint_dir(root, 6))
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000006"]
    assert open(os.path.join(old, "shard")).read() == "the first save of iteration 4"


def test_retention_deletes_a_replaced_copy_beside_its_complete_iteration(tmp_path):
    root = str(tmp_path)
    _complete(tmp_path, 4)
    aside = get_checkpoint_dir(root, 4) + ".replaced-0a1b2c3d"
    os.makedirs(aside)
    open(os.path.join(aside, COMPLETE_MARKER), "w").write("{}")
    assert list_complete_checkpoints(root) == [(4, get_checkpoint_dir(root, 4))]
    apply_retention(root, None, get_checkpoint_dir(root, 4))
    assert os.listdir(root) == ["iter_0000004"]


def test_the_finite_check_finds_every_nan_and_inf_and_nothing_else():
    from megatron_ext.checkpoint.finite import find_non_finite

    def one_bad(value, dtype, n, position):
        t = torch.randn(n).to(dtype) * 100
        t[position] = value
        return t

    named = [
        (f"{dtype}-{n}-{pos}-{value}", one_bad(value, dtype, n, pos))
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for n in (1, 7, 33, 4099)
        for pos in {0, n // 2, n - 1}
        for value in (float("nan"), float("inf"), -float("inf"))
    ]
    big = torch.full((5,), 3.0e38)  # finite, near fp32's largest: a sum would overflow, the check must not
    fine = [("big", big), ("empty", torch.empty(0)), ("fp16 max", torch.full((3,), 65504.0, dtype=torch.float16))]
    bad, checked = find_non_finite(named + fine)
    assert bad == [name for name, _ in named] and checked == len(named) + 2  # the empty tensor holds nothing


def test_a_refused_save_names_the_updates_since_the_last_finite_save():
    import types

    from megatron_ext.checkpoint.directory import NonFiniteCheckpoint
    from megatron_ext.training.loop import describe_non_finite_save

    def describe(weights_finite_at, iteration, steps, newest=(4, "/ck/iter_0000004")):
        run = types.SimpleNamespace(
            weights_finite_at=weights_finite_at, steps_this_run=steps, state=types.SimpleNamespace(iteration=iteration)
        )
        return describe_non_finite_save(run, NonFiniteCheckpoint("refused", 8, "/ck", newest))

    text = describe(4, 8, 8)
    assert text.startswith(
        "training diverged: one of the updates of iterations 5 to 8 made the weights non-finite "
        "(they were finite at the save of iteration 4; weights are checked at saves only)"
    ), text
    assert "Resume from that last good checkpoint (--load /ck loads it)" in text
    # --async-save refuses it a step later; a resumed run that has not saved yet names its start
    assert "the update of iteration 8 made" in describe(7, 9, 9)
    text = describe(None, 9, 4, newest=None)
    assert "iterations 6 to 8" in text and "not checked since this run started at iteration 5" in text, text
    assert "No checkpoint holds this run's weights" in text


def test_retention_after_a_rollback_keeps_the_runs_own_checkpoints(tmp_path):
    """A --ckpt-step resume rolls back below checkpoints of the run it abandons. Counted against
    --keep-last, those later iterations pushed this run's own older checkpoints out as each new one
    was saved: it was left the one just saved, nothing for --ckpt-fallback-on-corruption or a
    --ckpt-step to go back to. They are now neither counted nor deleted."""
    root = str(tmp_path)
    for it in (100, 200, 300):  # 200 and 300: the history a --ckpt-step 100 resume rolled back from
        _complete(tmp_path, it)
    apply_retention(root, 2, _complete(tmp_path, 150))
    assert [it for it, _ in list_complete_checkpoints(root)] == [100, 150, 200, 300]
    apply_retention(root, 2, _complete(tmp_path, 175))
    assert [it for it, _ in list_complete_checkpoints(root)] == [150, 175, 200, 300]


def test_retention_without_a_rollback_counts_every_checkpoint(tmp_path):
    root = str(tmp_path)
    for it in (2, 4, 6):
        _complete(tmp_path, it)
    apply_retention(root, 2, _complete(tmp_path, 8))
    assert [it for it, _ in list_complete_checkpoints(root)] == [6, 8]


def test_a_replaced_copys_delete_cut_short_leaves_no_marked_partial_copy(tmp_path, monkeypatch):
    """A re-save deletes the iteration's earlier copy (``.replaced-``) after its own rename: when
    that delete stops part-way (a kill, or a file it cannot remove), the copy must not keep its
    marker without all its shards: once --keep-last retires the iteration's ``iter_XXXXXXX``, loads
    found the partial copy as that iteration and the next retention renamed it back under the name."""

    root = str(tmp_path)
    old = _complete(tmp_path, 4)
    for name in ("__0_0.distcp", "common.pt"):
        open(os.path.join(old, name), "w").write("the first save of iteration 4")
    tmp = get_checkpoint_dir(root, 4) + ".tmp-y"
    os.makedirs(tmp)
    real_unlink = _undeletable_markers(monkeypatch)
    publish_checkpoint(tmp, old, root, 4, rank=0)
    apply_retention(root, 1, _complete(tmp_path, 6))  # retires iteration 4's new copy
    assert list_complete_checkpoints(root) == [(6, get_checkpoint_dir(root, 6))]
    monkeypatch.setattr(os, "unlink", real_unlink)
    apply_retention(root, 1, get_checkpoint_dir(root, 6))
    assert list_complete_checkpoints(root) == [(6, get_checkpoint_dir(root, 6))]
    assert resolve_load_path(root, 4) == (None, None)


def test_a_swept_replaced_copys_delete_cut_short_leaves_no_marked_partial_copy(tmp_path, monkeypatch):
    """The same for retention's sweep of a ``.replaced-`` copy beside its complete iteration."""

    root = str(tmp_path)
    _complete(tmp_path, 4)
    aside = get_checkpoint_dir(root, 4) + ".replaced-0a1b2c3d"
    os.makedirs(aside)
    for name in (COMPLETE_MARKER, "__0_0.distcp", "common.pt"):
        open(os.path.join(aside, name), "w").write("{}")
    _undeletable_markers(monkeypatch)
    apply_retention(root, None, get_checkpoint_dir(root, 4))
    apply_retention(root, 1, _complete(tmp_path, 6))  # retires iteration 4
    assert list_complete_checkpoints(root) == [(6, get_checkpoint_dir(root, 6))]
