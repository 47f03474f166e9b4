"""Megatron-LM's checkpoints, the pure parts (no process group): the map of its settings to our flags
checked against core_v0.16.1's own parser, the refusals, which checkpoint a directory names, and the
format checks. The data: tests/data/megatron_lm/ (README.md: written by Megatron-LM core_v0.16.1)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import types

import pytest
import torch

from megatron_ext.checkpoint.megatron_lm import (
    MegatronLMCheckpoint,
    Selection,
    check_format,
    check_padded_vocab,
    read_megatron_lm_common,
    select_load,
    select_megatron_lm_checkpoint,
)
from megatron_ext.checkpoint.megatron_lm_args import (
    MEGATRON_LM_ARGS,
    NOT_MODEL_ARGS,
    NOT_MODEL_PREFIXES,
    UNSUPPORTED_ARGS,
    describe_tokenizer_difference,
    map_megatron_lm_args,
)
from megatron_ext.checkpoint.megatron_lm_load import check_optimizer_form, decide_rng, describe_stream_difference
from megatron_ext.checkpoint.reader import UnsafeCheckpointFile, read_common
from megatron_ext.config import ConfigError, build_job_config

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "megatron_lm")
CASES = ("tp2pp2_dp_reshardable", "tp1_dp_reshardable", "tp1_fully_reshardable", "tp1_non_distributed")
MODEL_GROUPS = (
    "transformer configuration",
    "network size",
    "moe",
    "mla",
    "experimental_attention_variant",
    "heterogeneous architecture",
)


@pytest.fixture(scope="module")
def parser_dump() -> dict:
    with open(os.path.join(DATA, "arguments_core_v0.16.1.json")) as f:
        return json.load(f)


def _args(case: str = "tp1_fully_reshardable") -> argparse.Namespace:
    return read_megatron_lm_common(os.path.join(DATA, case, "iter_0000001"))["args"]


# ----------------------------------------------------------------------------- the map vs core_v0.16.1


def test_every_name_in_the_tables_is_a_core_v0161_argument(parser_dump):
    known = set(parser_dump["defaults"])
    for table in (MEGATRON_LM_ARGS, UNSUPPORTED_ARGS, NOT_MODEL_ARGS):
        assert sorted(set(table) - known) == []


def test_every_model_setting_of_core_v0161_is_mapped_refused_or_known_not_to_matter(parser_dump):
    # a model setting a later map forgets would load a checkpoint as another model, silently
    unclassified = [
        dest
        for group in MODEL_GROUPS
        for dest in parser_dump["groups"][group]
        if dest not in MEGATRON_LM_ARGS
        and dest not in UNSUPPORTED_ARGS
        and dest not in NOT_MODEL_ARGS
        and not dest.startswith(NOT_MODEL_PREFIXES)
    ]
    assert unclassified == []
    assert not set(MEGATRON_LM_ARGS) & set(UNSUPPORTED_ARGS) - {"position_embedding_type"}


def test_the_neutral_value_of_each_refused_setting_is_core_v0161s_default(parser_dump):
    # so a checkpoint trained without the feature is never refused for it; Transformer Engine is
    # Megatron-LM's default layer implementation and is refused (its _extra_state is not covered)
    shape = argparse.Namespace(num_attention_heads=4, hidden_size=32)
    refused = [n for n, (neutral, _) in UNSUPPORTED_ARGS.items() if not neutral(parser_dump["defaults"][n], shape)]
    assert refused == ["transformer_impl"]


def test_the_recorded_checkpoints_map_to_the_flags_that_trained_them():
    values, problems = map_megatron_lm_args(_args("tp2pp2_dp_reshardable"))
    assert problems == []
    assert {k: values[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")} == {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "ffn_hidden_size": 64,
    }
    assert values["normalization"] == "RMSNorm" and values["swiglu"] and values["disable_bias_linear"]
    assert values["group_query_attention"] and values["num_query_groups"] == 2
    assert values["norm_epsilon"] == 1e-5 and values["apply_layernorm_1p"] is False
    gpt, problems = map_megatron_lm_args(_args("tp1_non_distributed"))
    assert problems == [] and gpt["normalization"] == "LayerNorm" and not gpt["disable_bias_linear"]
    assert gpt["position_embedding_type"] == "learned_absolute" and gpt["num_query_groups"] is None
    assert gpt["use_distributed_optimizer"] is False and values["use_distributed_optimizer"] is True


def test_a_model_setting_we_do_not_build_is_refused_by_name():
    args = _args()
    for name, value in (
        ("num_experts", 8),
        ("window_size", (128, 0)),
        ("multi_latent_attention", True),
        ("rotary_interleaved", True),
        ("mtp_num_layers", 1),
        ("squared_relu", True),
        ("softmax_type", "learnable"),
        ("kv_channels", 16),
        ("transformer_impl", "transformer_engine"),
        ("fp8", "hybrid"),
        ("position_embedding_type", "mrope"),
    ):
        changed = argparse.Namespace(**{**vars(args), name: value})
        _, problems = map_megatron_lm_args(changed)
        assert len(problems) == 1 and f"Megatron-LM's {name} = {value!r}" in problems[0], (name, problems)
    # kv_channels equal to hidden / heads is the default head dimension, not a refused one
    assert map_megatron_lm_args(argparse.Namespace(**{**vars(args), "kv_channels": 8}))[1] == []


def test_the_zero_centred_gamma_and_biases_read_as_our_flags():
    args = argparse.Namespace(
        **{**vars(_args()), "layernorm_zero_centered_gamma": True, "add_bias_linear": False, "add_qkv_bias": True}
    )
    values, _ = map_megatron_lm_args(args)
    assert values["apply_layernorm_1p"] and values["disable_bias_linear"] and values["add_qkv_bias"]
    args.add_bias_linear = True  # biases everywhere: the QKV one is among them
    values, _ = map_megatron_lm_args(args)
    assert not values["disable_bias_linear"] and not values["add_qkv_bias"]


def test_tokenizers_compare_by_what_megatron_lm_records():
    args = _args()  # NullTokenizer, --vocab-size 299
    ours = {"type": "NullTokenizer", "model_sha256": None, "vocab_size": 300}
    assert describe_tokenizer_difference(args, ours) == (None, None)
    problem, _ = describe_tokenizer_difference(args, {**ours, "vocab_size": 301})
    assert "NullTokenizer over 300 ids (--vocab-size 299)" in problem
    sp = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/data/tok.model")
    problem, warning = describe_tokenizer_difference(sp, {"type": "SentencePieceTokenizer", "vocab_size": 9})
    assert problem is None and "/data/tok.model" in warning and "not its contents" in warning
    problem, _ = describe_tokenizer_difference(sp, {"type": "HuggingFaceTokenizer", "vocab_size": 9})
    assert problem.startswith("--tokenizer-type: the checkpoint was trained with SentencePieceTokenizer")


# ----------------------------------------------------------------------------- which checkpoint


def _copy(case: str, root) -> str:
    target = os.path.join(str(root), case)
    shutil.copytree(os.path.join(DATA, case), target, ignore=shutil.ignore_patterns("reference.pt"))
    return target


def _fake_iteration(root: str, iteration: int) -> None:
    shutil.copytree(os.path.join(root, "iter_0000001"), os.path.join(root, f"iter_{iteration:07d}"))


def test_the_tracker_names_the_checkpoint_and_newer_directories_are_named_not_loaded(tmp_path):
    root = _copy("tp1_fully_reshardable", tmp_path)
    for it in (3, 7):
        _fake_iteration(root, it)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    selection = select_megatron_lm_checkpoint(root)
    assert selection.checkpoint.iteration == 3 and selection.checkpoint.path.endswith("iter_0000003")
    (note,) = selection.notes
    assert "iter_0000007" in note and "not loaded" in note and "--ckpt-step 7" in note
    assert [c.iteration for c in selection.fallback] == [1]  # only those below the tracker
    assert select_megatron_lm_checkpoint(root, step=7).checkpoint.iteration == 7
    with pytest.raises(ConfigError, match="--ckpt-step 5: .* none of iteration 5"):
        select_megatron_lm_checkpoint(root, step=5)


def test_a_directory_without_a_tracker_names_none(tmp_path):
    # Megatron-LM itself starts from scratch there; we refuse to guess
    root = _copy("tp1_fully_reshardable", tmp_path)
    os.remove(os.path.join(root, "latest_checkpointed_iteration.txt"))
    with pytest.raises(ConfigError, match="no latest_checkpointed_iteration.txt: .*--ckpt-step N"):
        select_megatron_lm_checkpoint(root)
    assert select_megatron_lm_checkpoint(root, step=1).checkpoint.iteration == 1
    one = os.path.join(root, "iter_0000001")
    assert select_megatron_lm_checkpoint(one) == Selection(select_megatron_lm_checkpoint(root, 1).checkpoint)


def test_release_is_iteration_zero_with_fine_tuning_semantics(tmp_path):
    selection = select_megatron_lm_checkpoint(os.path.join(DATA, "release"))
    assert selection.checkpoint.release and selection.checkpoint.iteration == 0


def test_ours_and_megatron_lms_in_one_directory_load_the_newest(tmp_path):
    root = _copy("tp1_fully_reshardable", tmp_path)
    ours = os.path.join(root, "iter_0000004")
    os.makedirs(ours)
    with open(os.path.join(ours, "complete.json"), "w") as f:
        json.dump({"iteration": 4}, f)
    assert select_load(root) is None  # ours (4) is newer than Megatron-LM's tracker (1)
    assert select_load(root, step=1).checkpoint.iteration == 1
    _fake_iteration(root, 9)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("9")
    assert select_load(root).checkpoint.iteration == 9


# ----------------------------------------------------------------------------- formats


def test_formats_not_read_here_are_named(tmp_path):
    legacy = tmp_path / "iter_0000002"
    (legacy / "mp_rank_00").mkdir(parents=True)
    (problem,) = check_format(str(legacy), None)
    assert "legacy --ckpt-format torch checkpoint" in problem and "--ckpt-convert-format torch_dist" in problem
    dcp = tmp_path / "iter_0000003"
    dcp.mkdir()
    (dcp / ".metadata").write_text("")
    (problem,) = check_format(str(dcp), None)
    assert "not a megatron-core torch_dist checkpoint" in problem
    ckpt = os.path.join(DATA, "tp1_fully_reshardable", "iter_0000001")
    common = read_megatron_lm_common(ckpt)
    assert check_format(ckpt, common) == []
    (problem,) = check_format(ckpt, {k: v for k, v in common.items() if k != "content_metadata"})
    assert "older than 0.13" in problem
    (problem,) = check_format(ckpt, {**common, "rerun_state_machine": {"state": "WILL_RERUN_FROM_CHECKPOINT"}})
    assert "saved mid-rerun" in problem and "WILL_RERUN_FROM_CHECKPOINT" in problem


class _RunsACommand:
    def __reduce__(self):  # what a tampered file's pickle does on a plain torch.load
        return (os.system, ("echo this ran",))


def test_common_pt_is_read_with_only_megatron_lms_own_classes_allowed(tmp_path):
    root = _copy("tp1_fully_reshardable", tmp_path)
    path = os.path.join(root, "iter_0000001", "common.pt")
    common = torch.load(path, weights_only=False)
    common["args"].evil = _RunsACommand()
    torch.save(common, path)
    with pytest.raises(UnsafeCheckpointFile, match="may have been tampered with"):
        read_megatron_lm_common(os.path.dirname(path))
    # Megatron-LM's classes are allowed for its checkpoints' reads only: ours never hold a Namespace
    with pytest.raises(UnsafeCheckpointFile, match="argparse.Namespace"):
        read_common(os.path.join(DATA, "tp1_fully_reshardable", "iter_0000001"))


# ----------------------------------------------------------------------------- what a load takes


def _ctx(tp: int = 1, pp: int = 1, device: str = "cuda", vp: int | None = None):
    return types.SimpleNamespace(tp_size=tp, pp_size=pp, vp_size=vp, device=torch.device(device))


def test_rng_states_load_by_megatron_lms_rules_and_only_on_cuda():
    common = read_megatron_lm_common(os.path.join(DATA, "tp2pp2_dp_reshardable", "iter_0000001"))
    ckpt = MegatronLMCheckpoint("iter_0000001", 1)
    assert decide_rng(common, _ctx(2, 2), ckpt, wanted=True) is None
    assert "CUDA generator states" in decide_rng(common, _ctx(2, 2, "cpu"), ckpt, wanted=True)
    assert "saved at TP x PP = 2 x 2, this run is 1 x 2" in decide_rng(common, _ctx(1, 2), ckpt, wanted=True)
    assert "--no-load-rng / --finetune" in decide_rng(common, _ctx(2, 2), ckpt, wanted=False)
    release = MegatronLMCheckpoint("release", 0, release=True)
    assert "release checkpoint" in decide_rng(common, _ctx(2, 2), release, wanted=True)
    no_rng = {**common, "args": argparse.Namespace(**{**vars(common["args"]), "no_save_rng": True})}
    assert "--no-save-rng" in decide_rng(no_rng, _ctx(2, 2), ckpt, wanted=True)


def test_the_optimizer_state_form_decides_where_it_loads():
    dp = read_megatron_lm_common(os.path.join(DATA, "tp2pp2_dp_reshardable", "iter_0000001"))
    assert check_optimizer_form(dp, _ctx(2, 2)) == []  # its layout, any DP
    (problem,) = check_optimizer_form(dp, _ctx(2, 2, vp=2))
    assert "dp_reshardable" in problem and "saved at TP x PP x VPP = 2 x 2 x 1" in problem
    assert "--no-load-optim" in problem and "--dist-ckpt-optim-fully-reshardable" in problem
    fully = read_megatron_lm_common(os.path.join(DATA, "tp1_fully_reshardable", "iter_0000001"))
    plain = read_megatron_lm_common(os.path.join(DATA, "tp1_non_distributed", "iter_0000001"))
    assert check_optimizer_form(fully, _ctx(2, 4, vp=2)) == [] and check_optimizer_form(plain, _ctx(8)) == []
    other = {**dp, "content_metadata": {"distrib_optim_sharding_type": "fully_sharded_model_space"}}
    (problem,) = check_optimizer_form(other, _ctx(2, 2))
    assert "'fully_sharded_model_space', which is not read here" in problem


def test_one_line_names_the_flags_that_make_our_sample_stream_differ():
    args = read_megatron_lm_common(os.path.join(DATA, "tp1_dp_reshardable", "iter_0000001"))["args"]
    same = build_job_config(
        {
            "data_path": list(args.data_path),
            "split": "90,9,1",
            "seq_length": 16,
            "tokenizer_type": "NullTokenizer",
            "vocab_size": 299,
        }
    )
    assert describe_stream_difference(args, same).endswith(
        "as megatron-core's GPTDataset gives Megatron-LM with these data flags"
    )
    packed = build_job_config({**same.to_flat_dict(), "packed_sequences": True, "split": "98,2,0"})
    line = describe_stream_difference(args, packed)
    assert line.startswith(
        "samples from 8 on differ from Megatron-LM's stream: --packed-sequences, --split '90,9,1' -> '98,2,0'"
    ), line


def test_a_padded_vocabulary_must_hold_the_tokenizer_and_split_over_tp():
    assert check_padded_vocab(512, 300, 2) is None and check_padded_vocab(512, 300, 8) is None
    assert "fewer than this run's tokenizer's 513 ids" in check_padded_vocab(512, 513, 1)
    assert "--tensor-model-parallel-size 3 does not divide" in check_padded_vocab(512, 300, 3)


def _stats(x: torch.Tensor) -> list[float]:
    """generate_reference.stats: the statistics the generator recorded, computed the same way."""
    spec = importlib.util.spec_from_file_location("generate_reference", os.path.join(DATA, "generate_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.stats(x)


# the local spec's norms are stored under Transformer Engine's names (the fused linear's layer_norm_*)
_NORM_KEYS = {
    "input_layernorm": "self_attention.linear_qkv.layer_norm",
    "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm",
}


def _stored_key(name: str) -> tuple[str, int | None]:
    """(checkpoint key, layer) of a TP1 x PP1 parameter name: layers are stacked in dimension 0."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return name, None
    rest = ".".join(parts[3:])
    for module, stored in _NORM_KEYS.items():
        rest = rest.replace(f"{module}.", f"{stored}_")
    return f"decoder.layers.{rest}", int(parts[2])


@pytest.mark.parametrize("case", ["tp1_fully_reshardable", "tp1_non_distributed"])
def test_the_moments_megatron_lm_saved_are_the_ones_it_held(case):
    # what a foreign optimizer state means: each parameter's moments as its optimizer held them at the
    # save (reference.pt, from its memory), also where megatron-core's gather could have shifted them
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    reader = FileSystemReader(os.path.join(DATA, case, "iter_0000001"))
    stored = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in reader.read_metadata().state_dict_metadata.items()
        if k.startswith("optimizer.state.exp_avg")
    }
    dcp_load(stored, storage_reader=reader, no_dist=True)
    recorded = torch.load(os.path.join(DATA, case, "reference.pt"), weights_only=False)["moments"]
    for (_, _, _, name), moments in recorded.items():
        key, layer = _stored_key(name)
        for which in ("exp_avg", "exp_avg_sq"):
            saved = stored[f"optimizer.state.{which}.{key}"]
            got = _stats(saved if layer is None else saved[layer])
            assert got == pytest.approx(moments[which], rel=1e-9, abs=1e-12), (name, which)


def test_megatron_lms_random_number_states_are_restored_as_its_load_restores_them(monkeypatch):
    # the states loaded only on CUDA (decide_rng); here torch.cuda.set_rng_state is recorded, not run,
    # and everything else is restored for real: Python's, NumPy's and torch's generators, the tracker
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    from megatron_ext.checkpoint.megatron_lm import get_rng_safe_globals, read_sharded_object
    from megatron_ext.checkpoint.megatron_lm_load import set_megatron_lm_rng_state

    ckpt = os.path.join(DATA, "tp1_non_distributed", "iter_0000001")
    (state,) = read_sharded_object(ckpt, "rng_state/shard_0.0_1.1", get_rng_safe_globals())
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, *a, **k: cuda.append(s))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    try:
        set_megatron_lm_rng_state([state], dp_rank=0, data_parallel_random_init=False)
        assert random.getstate() == state["random_rng_state"]
        np_state = np.random.get_state()
        assert np_state[0] == state["np_rng_state"][0] and (np_state[1] == state["np_rng_state"][1]).all()
        assert torch.equal(torch.get_rng_state(), state["torch_rng_state"])
        assert len(cuda) == 1 and torch.equal(cuda[0], state["cuda_rng_state"])
        assert sorted(tracker.get_states()) == sorted(state["rng_tracker_states"]) != []
    finally:
        random.setstate(before[0])
        np.random.set_state(before[1])
        torch.set_rng_state(before[2])
        tracker.reset()
