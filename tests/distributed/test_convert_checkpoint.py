"""tools/convert_checkpoint.py against ``transformers``' own Llama (random, from a config).

HF -> ours (converted in one forked process), loaded under TP2 x PP2 (4 forked ranks): the
last stage's logits, gathered over TP, equal the ``transformers`` model's logits on the same
tokens within 1e-4 relative (fp32). Ours -> HF reproduces the original tensors exactly. GQA
(4 heads, 2 groups), a non-default RoPE theta and RMSNorm epsilon; tied and untied embeddings.
With --apply-layernorm-1p the converted checkpoint holds HF's norm weights minus 1: its (1 + gamma)
model's logits equal the plain HF model's, and the export adds the 1 back exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import run_ranks

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")

from tools.convert_checkpoint import (  # noqa: E402
    check_supported,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    hf_config_to_values,
)

VOCAB, SEQ, BATCH = 200, 16, 2


# Llama-3.1-style RoPE scaling: with theta 500000 and head_dim 16, the lowest frequencies have
# wavelengths beyond 8192 / low_freq_factor and are divided by the factor, the middle ones smoothed
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
KINDS = {
    "llama untied": ("llama", dict(tie_word_embeddings=False)),
    "llama tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-3.1 rope scaling": (
        "llama",
        dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=16384),
    ),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "llama untied --apply-layernorm-1p": ("llama", dict(tie_word_embeddings=False)),
}


def _make_hf(path: str, kind: str):
    model_type, extra = KINDS[kind]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    common.update(extra)
    torch.manual_seed(0)
    if model_type == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    model = model.eval()
    with torch.no_grad():  # random norms and biases too, so a swapped norm or bias shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _convert(rank: int, world_size: int, hf_dir: str, save: str, one_p: bool = False) -> str:
    return convert_hf_to_megatron(hf_dir, save, tp=2, divisible_by=32, log=lambda s: None, apply_layernorm_1p=one_p)


def _logits_tp2pp2(rank: int, world_size: int, save: str, hf: dict, tokens: torch.Tensor, one_p: bool = False):
    from megatron_ext.checkpoint.parts import CheckpointMeta
    from megatron_ext.data.microbatch import Microbatch
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import build_tiny_run
    from megatron_ext.training.checkpointing import load_checkpoint
    from megatron_ext.training.step import run_forward_backward

    values = {
        **hf_config_to_values(hf, 32),
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "mock_data": True,
        "tokenizer_type": "NullTokenizer",
        "vocab_size": VOCAB - 1,
        "seq_length": tokens.shape[1],
        "micro_batch_size": BATCH,
        "global_batch_size": BATCH,
        "apply_layernorm_1p": one_p,
    }
    seq = tokens.shape[1]
    run = build_tiny_run(values, None)
    model, ctx = run.model, run.ctx
    padded = 224  # 200 rounded up to 32, whatever the TP size
    assert run.checkpoint_meta.padded_vocab_size == padded
    load_checkpoint(run, save, CheckpointMeta(tokenizer={}, padded_vocab_size=padded))

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        out = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)
        return out, lambda o: (o.sum() * 0.0, torch.tensor(1), {"logits": o.detach()})

    mb = Microbatch(
        tokens=tokens,
        labels=tokens,
        position_ids=torch.arange(seq).expand(BATCH, seq),
        num_real_tokens=BATCH * seq,
        attention_pairs=BATCH * seq * seq,
    )
    reports = run_forward_backward(model, [mb], seq, forward_only=True, forward_step_func=forward_step)
    logits = None
    if ctx.is_last_stage:
        local = reports[0]["logits"]  # [b, s, padded / TP]
        parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
        logits = torch.cat(parts, dim=-1)[..., :VOCAB]
    destroy_parallel_context()
    return logits


def _back_to_hf(rank: int, world_size: int, save: str, out: str) -> str:
    return convert_megatron_to_hf(save, out, log=lambda s: None)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_to_ours_logits_and_round_trip(tmp_path, kind):
    from safetensors.torch import load_file

    tied = KINDS[kind][1]["tie_word_embeddings"]
    hf_dir, save, back = str(tmp_path / "hf"), str(tmp_path / "ours"), str(tmp_path / "back")
    hf_model = _make_hf(hf_dir, kind)
    hf = hf_model.config.to_dict()
    # RoPE scaling changes only low frequencies: at 16 positions the logits move by ~2e-5, at 256 by ~2e-4
    seq = 256 if "rope scaling" in kind else SEQ
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
    if "rope scaling" in kind:  # control: the same weights without the scaling are told apart
        config = hf_model.config.to_dict()
        config.pop("rope_scaling", None)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        unscaled = type(hf_model)(type(hf_model.config).from_dict(config)).eval()
        unscaled.load_state_dict(hf_model.state_dict())
        with torch.no_grad():
            assert ((unscaled(tokens).logits - expected).norm() / expected.norm()).item() > 1e-4

    one_p = kind.endswith("--apply-layernorm-1p")
    run_ranks(_convert, 1, hf_dir, save, one_p, timeout=300)
    logits = run_ranks(_logits_tp2pp2, 4, save, hf, tokens, one_p, timeout=300)[-1]
    rel = ((logits - expected).norm() / expected.norm()).item()
    assert rel <= 2e-5, f"logits differ by {rel:.2e} relative"

    run_ranks(_back_to_hf, 1, save, back, timeout=300)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    restored = load_file(os.path.join(back, "model.safetensors"))
    mode = os.stat(os.path.join(back, "model.safetensors")).st_mode & 0o777
    assert mode == os.stat(os.path.join(back, "config.json")).st_mode & 0o777, oct(mode)  # not safetensors' 0600
    if tied:
        original.pop("lm_head.weight", None)
    assert set(restored) == set(original)
    differ = [k for k in original if not torch.equal(original[k], restored[k])]
    assert not differ, differ
    reloaded = type(hf_model).from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type 'gpt2'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={**LLAMA3_ROPE, "low_freq_factor": 2.0}), "converts only with low_freq_factor 1"),
        (
            dict(rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 4096}),
            "{'original_max_position_embeddings': 4096}",
        ),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "RoPE scaling 'yarn' is not supported"),
        (dict(model_type="qwen2", use_sliding_window=True), "sliding-window attention is not supported"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5: only full-dimension RoPE converts"),
        # --rotary-base is an integer: 3.7 would have converted as 3 (logits 5e-3 off transformers')
        (dict(rope_theta=3.7), "rope_theta 3.7: not supported, --rotary-base takes an integer"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.5}), "rope_theta 10000.5: not supported"),
        # an FP8 checkpoint's q_proj.weight is float8 with a weight_scale beside it: converted as plain
        # weights it loaded 448 where HF's dequantized maximum was 0.07, without a word
        # a tied Llama reward model converted silently into a causal LM (its score head dropped)
        (
            dict(architectures=["LlamaForSequenceClassification"]),
            "architectures ['LlamaForSequenceClassification']: only causal language models",
        ),
        (
            dict(quantization_config={"quant_method": "compressed-tensors"}),
            "quantization_config (quant_method 'compressed-tensors'): quantized checkpoints are not supported",
        ),
    ],
)
def test_unsupported_architectures_are_named(change, needle):
    hf = dict(model_type="llama", hidden_size=64, num_attention_heads=4, hidden_act="silu")
    with pytest.raises(ValueError, match="cannot convert") as err:
        check_supported({**hf, **change})
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"model_type": "llama", "hidden_size": 64,', "config.json is not valid JSON"),
        ("[1, 2]", "config.json holds list, not an object"),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "hidden_act": "silu"}',
            "config.json: vocab_size must be a positive integer, got None",
        ),
    ],
)
def test_malformed_hf_config_is_named(tmp_path, text, needle):
    from tools.convert_checkpoint import _read_hf

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as err:
        _read_hf(str(tmp_path))
    assert needle in str(err.value), str(err.value)


def test_checkpoints_trained_here_export_as_qwen2_or_scaled_llama():
    from tools.convert_checkpoint import build_hf_config

    args = dict(
        swiglu=True,
        normalization="RMSNorm",
        disable_bias_linear=True,
        position_embedding_type="rope",
        hidden_size=64,
        ffn_hidden_size=96,
        num_layers=2,
        num_attention_heads=4,
        group_query_attention=False,
        norm_epsilon=1e-5,
        rotary_base=10000,
        seq_length=32,
        untie_embeddings_and_output_weights=True,
    )
    qwen = build_hf_config({**args, "add_qkv_bias": True}, {"padded_vocab_size": 256})
    assert (qwen["model_type"], qwen["architectures"], qwen["use_sliding_window"]) == (
        "qwen2",
        ["Qwen2ForCausalLM"],
        False,
    )
    llama = build_hf_config({**args, "use_rope_scaling": True, "rope_scaling_factor": 32.0}, {"padded_vocab_size": 256})
    assert llama["model_type"] == "llama"
    assert llama["rope_parameters"] == {**LLAMA3_ROPE, "factor": 32.0, "rope_theta": 10000.0}
    check_supported({**llama, "vocab_size": 256})
    assert hf_config_to_values({**llama, "vocab_size": 256})["rope_scaling_factor"] == 32.0


def test_partial_rotary_checkpoints_are_refused_not_exported_as_another_model():
    from tools.convert_checkpoint import build_hf_config

    args = dict(
        swiglu=True,
        normalization="RMSNorm",
        disable_bias_linear=True,
        position_embedding_type="rope",
        hidden_size=64,
        ffn_hidden_size=96,
        num_layers=2,
        num_attention_heads=4,
        group_query_attention=False,
        norm_epsilon=1e-5,
        rotary_base=10000,
        seq_length=32,
        untie_embeddings_and_output_weights=True,
    )
    build_hf_config({**args, "rotary_percent": 1.0}, {"padded_vocab_size": 256})
    with pytest.raises(ValueError, match="--rotary-percent 0.5: HF Llama/Qwen2 rotate the whole head"):
        build_hf_config({**args, "rotary_percent": 0.5}, {"padded_vocab_size": 256})


def test_conversions_never_write_over_checkpoints_or_models(tmp_path):
    # hf-to-megatron writes iteration 0: beside a run's checkpoints, --load would take the run's newest
    from tools.convert_checkpoint import main

    save = tmp_path / "run"
    (save / "iter_0000010").mkdir(parents=True)
    (tmp_path / "hf").mkdir()
    with pytest.raises(ValueError, match=f"--save {save} already holds checkpoints \\(iter_0000010\\)"):
        convert_hf_to_megatron(str(tmp_path / "hf"), str(save), log=lambda s: None)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match=f"--hf-dir {out} already holds a model \\(model.safetensors\\)"):
        convert_megatron_to_hf(str(save), str(out), log=lambda s: None)
    assert (out / "model.safetensors").read_bytes() == b"weights"
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as refused:  # one error line, as argparse reads --hf-dir
        main(["megatron-to-hf", "--load", str(save), "--hf-dir", str(tmp_path / "file")])
    assert refused.value.code == 2


def test_a_missing_safetensors_is_one_error_line_before_any_work(tmp_path, monkeypatch, capsys):
    # the quick start installs the [logging] extras only: safetensors comes with [convert]
    import tools.convert_checkpoint as convert

    monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
    assert convert.main(["megatron-to-hf", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install -e '.[convert]'" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_safetensors_file_is_one_error_naming_it(tmp_path, capsys, damage):
    # safetensors' own SafetensorError escaped as a traceback naming no file
    from tools.convert_checkpoint import main

    hf_dir = tmp_path / "hf"
    _make_hf(str(hf_dir), "llama untied")
    weights = hf_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(os.urandom(4096) if damage == "garbage" else data[: len(data) // 2])
    capsys.readouterr()  # transformers' progress bar
    assert main(["hf-to-megatron", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: --hf-dir: {weights} is not a readable safetensors file (") and err.count("\n") == 1
    ), err
    assert "Traceback" not in err and not (tmp_path / "ours").exists(), err  # before any work


def _load_converted(rank: int, world_size: int, save: str, hf: dict, extra: dict) -> int:
    from megatron_ext.checkpoint.parts import CheckpointMeta
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import build_tiny_run
    from megatron_ext.training.checkpointing import load_checkpoint

    values = {
        **hf_config_to_values(hf, 32),
        "mock_data": True,
        "tokenizer_type": "NullTokenizer",
        "vocab_size": VOCAB - 1,
        "seq_length": SEQ,
        "micro_batch_size": 1,
        "global_batch_size": 1,
        **extra,
    }
    run = build_tiny_run(values, None)
    loaded = load_checkpoint(run, save, CheckpointMeta(tokenizer={}, padded_vocab_size=224))
    destroy_parallel_context()
    return loaded


@pytest.mark.parametrize(
    "extra", [dict(use_distributed_optimizer=True), dict(bf16=True)], ids=["distributed optimizer", "bf16"]
)
def test_a_converted_checkpoint_loads_whatever_the_optimizer_form(tmp_path, extra):
    # it holds weights only: the checks that a resumed optimizer state has this run's form do not apply
    # (README: "the converted model loads at any TP/PP/VPP"; its "load it with" flags came first)
    hf_dir, save = str(tmp_path / "hf"), str(tmp_path / "ours")
    hf = _make_hf(hf_dir, "llama untied").config.to_dict()
    run_ranks(_convert, 1, hf_dir, save, timeout=300)
    assert run_ranks(_load_converted, 1, save, hf, extra, timeout=300) == [0]


LLAMA_HERE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    disable_bias_linear=True,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=96,
    rotary_base=50000,
    norm_epsilon=1e-5,
    untie_embeddings_and_output_weights=True,
)


def _save_with_distributed_optimizer(rank: int, world_size: int, save: str, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import MarkovDataset, build_tiny_run, tiny_values
    from megatron_ext.training.checkpointing import save_checkpoint
    from megatron_ext.training.loop import train

    run = build_tiny_run(
        tiny_values(
            **LLAMA_HERE,
            use_distributed_optimizer=True,
            train_iters=2,
            seq_length=SEQ,
            global_batch_size=2,
            micro_batch_size=2,
        ),
        MarkovDataset(SEQ),
    )
    train(run)
    save_checkpoint(run, save)
    b, s = tokens.shape
    with torch.no_grad():
        logits = run.model[0](input_ids=tokens, position_ids=torch.arange(s).expand(b, s), attention_mask=None)
    destroy_parallel_context()
    return logits


def test_export_reads_the_weights_not_the_optimizer_state(tmp_path, monkeypatch):
    # a distributed-optimizer checkpoint also holds fp32 main parameters and two Adam moments per
    # weight (6x a bf16 model's bytes): the export read all of them into memory, then dropped them
    from torch.distributed import checkpoint as dcp

    save, out = str(tmp_path / "ours"), str(tmp_path / "hf")
    tokens = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    (ours,) = run_ranks(_save_with_distributed_optimizer, 1, save, tokens, timeout=300)
    read, real_load = [], dcp.load

    def recording_load(state, *args, **kwargs):
        read.extend(state)
        return real_load(state, *args, **kwargs)

    monkeypatch.setattr(dcp, "load", recording_load)
    convert_megatron_to_hf(save, out, log=lambda s: None)
    assert "embedding.word_embeddings.weight" in read
    assert not [k for k in read if k.startswith("optimizer.")], read
    model = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(tokens).logits
    vocab = theirs.shape[-1]
    rel = ((ours[..., :vocab] - theirs).norm() / theirs.norm()).item()
    assert rel <= 2e-5, f"logits differ by {rel:.2e} relative"


def _load_log(rank: int, world_size: int, save: str, hf: dict, extra: dict) -> list[str]:
    from megatron_ext.config import build_job_config
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.run import build_training_run
    from megatron_ext.training.checkpointing import load_checkpoint

    lines = []
    values = {
        **hf_config_to_values(hf, 32),
        "mock_data": True,
        "tokenizer_type": "NullTokenizer",
        "vocab_size": VOCAB - 1,
        "micro_batch_size": 1,
        "global_batch_size": 1,
        **extra,
    }
    run = build_training_run(
        build_job_config(values), device=torch.device("cpu"), data=(None, None), log=lines.append, metrics=False
    )
    load_checkpoint(run, save)
    destroy_parallel_context()
    return lines


def test_loading_a_converted_checkpoint_warns_of_model_settings_only(tmp_path):
    # the converter's one-process model had --seq-length 16 and default seed and dropout: every
    # run that loaded it was told the checkpoint was "trained with --seq-length 16"
    hf_dir, save = str(tmp_path / "hf"), str(tmp_path / "ours")
    hf = _make_hf(hf_dir, "llama untied").config.to_dict()
    run_ranks(_convert, 1, hf_dir, save, timeout=300)
    run = dict(seq_length=64, seed=7, hidden_dropout=0.1, attention_dropout=0.1)
    (lines,) = run_ranks(_load_log, 1, save, hf, run, timeout=300)
    assert not [line for line in lines if "changes settings" in line], lines
    (lines,) = run_ranks(_load_log, 1, save, hf, {**run, "rotary_base": 10000}, timeout=300)
    warned = [line for line in lines if "changes settings" in line]
    assert len(warned) == 1 and "--rotary-base 50000 -> 10000" in warned[0] and "seq-length" not in warned[0], lines
