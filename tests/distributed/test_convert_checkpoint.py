"""tools/convert_checkpoint.py against ``transformers``' own Llama (random, from a config).

HF -> ours (converted in one forked process), loaded under TP2 x PP2 (4 forked ranks): the
last stage's logits, gathered over TP, equal the ``transformers`` model's logits on the same
tokens within 1e-4 relative (fp32). Ours -> HF reproduces the original tensors exactly. GQA
(4 heads, 2 groups), a non-default RoPE theta and RMSNorm epsilon; tied and untied embeddings.
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
    check_supported, convert_hf_to_megatron, convert_megatron_to_hf, hf_config_to_values,
)

VOCAB, SEQ, BATCH = 200, 16, 2


def _make_hf(path: str, tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=tied, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _convert(rank: int, world_size: int, hf_dir: str, save: str) -> str:
    return convert_hf_to_megatron(hf_dir, save, tp=2, divisible_by=32, log=lambda s: None)


def _logits_tp2pp2(rank: int, world_size: int, save: str, hf: dict, tokens: torch.Tensor):
    from megatron_ext.checkpoint.state import CheckpointMeta, load_checkpoint
    from megatron_ext.data.microbatch import Microbatch
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.testing import build_tiny_run
    from megatron_ext.training.step import run_forward_backward

    values = {**hf_config_to_values(hf, 32), "tensor_model_parallel_size": 2,
              "pipeline_model_parallel_size": 2, "mock_data": True, "tokenizer_type": "NullTokenizer",
              "vocab_size": VOCAB - 1, "seq_length": SEQ, "micro_batch_size": BATCH, "global_batch_size": BATCH}
    run = build_tiny_run(values, None)
    model, ctx = run.model, run.ctx
    padded = 224  # 200 rounded up to 32, whatever the TP size
    assert run.checkpoint_meta.padded_vocab_size == padded
    load_checkpoint(run, save, CheckpointMeta(tokenizer={}, padded_vocab_size=padded))

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        out = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)
        return out, lambda o: (o.sum() * 0.0, torch.tensor(1), {"logits": o.detach()})

    mb = Microbatch(tokens=tokens, labels=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                    num_real_tokens=BATCH * SEQ, attention_pairs=BATCH * SEQ * SEQ)
    reports = run_forward_backward(model, [mb], SEQ, forward_only=True, forward_step_func=forward_step)
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


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_ours_logits_and_round_trip(tmp_path, tied):
    from safetensors.torch import load_file

    hf_dir, save, back = str(tmp_path / "hf"), str(tmp_path / "ours"), str(tmp_path / "back")
    hf_model = _make_hf(hf_dir, tied)
    hf = hf_model.config.to_dict()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits

    run_ranks(_convert, 1, hf_dir, save, timeout=300)
    logits = run_ranks(_logits_tp2pp2, 4, save, hf, tokens, timeout=300)[-1]
    rel = ((logits - expected).norm() / expected.norm()).item()
    assert rel <= 1e-4, f"logits differ by {rel:.2e} relative"

    run_ranks(_back_to_hf, 1, save, back, timeout=300)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    restored = load_file(os.path.join(back, "model.safetensors"))
    if tied:
        original.pop("lm_head.weight", None)
    assert set(restored) == set(original)
    differ = [k for k in original if not torch.equal(original[k], restored[k])]
    assert not differ, differ
    reloaded = transformers.LlamaForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change,needle", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type 'gpt2'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_architectures_are_named(change, needle):
    hf = dict(model_type="llama", hidden_size=64, num_attention_heads=4, hidden_act="silu")
    with pytest.raises(ValueError, match="cannot convert") as err:
        check_supported({**hf, **change})
    assert needle in str(err.value)


@pytest.mark.parametrize("text, needle", [
    ('{"model_type": "llama", "hidden_size": 64,', "config.json is not valid JSON"),
    ('[1, 2]', "config.json holds list, not an object"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "hidden_act": "silu"}',
     "config.json: vocab_size must be a positive integer, got None"),
])
def test_malformed_hf_config_is_named(tmp_path, text, needle):
    from tools.convert_checkpoint import _read_hf

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="") as err:
        _read_hf(str(tmp_path))
    assert needle in str(err.value), str(err.value)
