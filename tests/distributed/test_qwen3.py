"""Qwen3 in and out: ``--qk-layernorm`` and ``--kv-channels`` against ``transformers``' own
``Qwen3ForCausalLM`` (random weights from tiny configs made here, nothing downloaded).

- HF -> ours (``tools/convert_checkpoint.py``, one forked process), loaded at TP2 x PP2 with
  sequence parallelism (4 forked ranks): the logits equal transformers' within 1e-5 relative (fp32),
  for a head_dim = hidden / heads and a head_dim = 2 x hidden / heads (Qwen3-0.6B's ratio; converted
  with --apply-layernorm-1p, the q/k norms' 1 subtracted and added back); ours -> HF
  gives back every tensor bit for bit, and ``tools/generate.py`` on the converted checkpoint greedily
  continues a prompt as ``generate(do_sample=False)`` does.
- Training parity: a Qwen3-style model (q/k norms, head_dim != hidden / heads) at TP2 + SP against one
  process, 6 steps: step-1 gradients and every loss within the layout tolerance (1e-5); the same run
  without the TP sum of the q/k norms' gradients (``TransformerConfig.qk_layernorm`` unset after the
  build) is told apart.
- The memory model with ``--kv-channels``: a layer's saved bytes, measured, as predicted.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import LLAMA_STYLE, MarkovDataset, build_tiny_run, gather_full_grads, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")

from tests.distributed.test_hf_export import _our_logits  # noqa: E402  (our logits at a run's layout)
from tools.convert_checkpoint import convert_hf_to_megatron, convert_megatron_to_hf, hf_config_to_values  # noqa: E402

VOCAB, SEQ, BATCH, PADDED = 200, 16, 2, 224
# hidden 64, 4 heads in 2 key/value groups; head_dim 16 is hidden / heads, 32 is twice it; (head_dim,
# tied, converted with --apply-layernorm-1p: our (1 + gamma) norms, the q/k ones included)
SHAPES = {
    "head_dim 16 = hidden / heads, tied": (16, True, False),
    "head_dim 32 != hidden / heads, untied, 1p": (32, False, True),
}


def _make_qwen3(path: str, head_dim: int, tied: bool):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        initializer_range=0.1,  # peaked next-token distributions: greedy ties are unlikely
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # random norms, the q/k ones included, so a swapped or dropped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _convert(rank: int, world_size: int, jobs: list[tuple[str, str, bool]]) -> None:
    for hf_dir, save, one_p in jobs:
        convert_hf_to_megatron(hf_dir, save, tp=2, divisible_by=32, log=lambda s: None, apply_layernorm_1p=one_p)


def _logits_tp2pp2_sp(rank: int, world_size: int, jobs: list[tuple[str, dict, bool]], tokens: torch.Tensor) -> list:
    from megatron_ext.checkpoint.parts import CheckpointMeta
    from megatron_ext.training.checkpointing import load_checkpoint

    out = []
    for save, hf, one_p in jobs:
        values = {
            **hf_config_to_values(hf, 32),
            "apply_layernorm_1p": one_p,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "sequence_parallel": True,
            "mock_data": True,
            "tokenizer_type": "NullTokenizer",
            "vocab_size": VOCAB - 1,
            "seq_length": SEQ,
            "micro_batch_size": 1,
            "global_batch_size": BATCH,
        }
        run = build_tiny_run(values, None)
        load_checkpoint(run, save, CheckpointMeta(tokenizer={}, padded_vocab_size=PADDED))
        logits = _our_logits(run, tokens)
        out.append(None if logits is None else logits[..., :VOCAB])
        destroy_parallel_context()
    return out


def _back_and_generate(rank: int, world_size: int, pairs: list[tuple[str, str]], prompt: list[int]) -> list:
    from tools.generate import generate, load_model

    out = []
    for save, back in pairs:
        convert_megatron_to_hf(save, back, log=lambda s: None)
        model, _ = load_model(save, torch.device("cpu"), log=lambda s: None)
        out.append(generate(model, prompt, 8, VOCAB))
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Per shape: the HF model, its directory, our converted checkpoint, the export back to HF, our
    logits at TP2 x PP2 + SP, and tools/generate.py's greedy tokens."""
    root = tmp_path_factory.mktemp("qwen3")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    prompt = [5, 17, 3, 99, 42]
    out = {}
    for i, (name, (head_dim, tied, one_p)) in enumerate(SHAPES.items()):
        paths = {k: str(root / f"{k}{i}") for k in ("hf", "ours", "back")}
        out[name] = dict(model=_make_qwen3(paths["hf"], head_dim, tied), one_p=one_p, **paths)
    run_ranks(_convert, 1, [(o["hf"], o["ours"], o["one_p"]) for o in out.values()], timeout=300)
    jobs = [(o["ours"], o["model"].config.to_dict(), o["one_p"]) for o in out.values()]
    logits = run_ranks(_logits_tp2pp2_sp, 4, jobs, tokens, timeout=300)[-1]
    greedy = run_ranks(_back_and_generate, 1, [(o["ours"], o["back"]) for o in out.values()], prompt, timeout=300)[0]
    for o, ours, ids in zip(out.values(), logits, greedy):
        o.update(tokens=tokens, logits=ours, prompt=prompt, greedy=ids)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_equal_transformers_at_tp2_pp2_with_sequence_parallelism(qwen3, shape):
    o = qwen3[shape]
    model = o["model"]
    with torch.no_grad():
        expected = model(o["tokens"]).logits
    rel = float((o["logits"] - expected).norm() / expected.norm())
    assert rel <= 1e-5, f"{shape}: logits differ by {rel:.2e} relative"
    # control: the q/k norms take part (the same model with q_norm/k_norm at 1 is told apart)
    plain = type(model)(model.config).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
        assert float((plain(o["tokens"]).logits - expected).norm() / expected.norm()) > 1e-3


@pytest.mark.parametrize("shape", list(SHAPES))
def test_ours_back_to_hf_is_bit_exact_and_generate_works(qwen3, shape):
    import json

    from safetensors.torch import load_file

    o = qwen3[shape]
    head_dim, tied, _ = SHAPES[shape]
    original = load_file(os.path.join(o["hf"], "model.safetensors"))
    restored = load_file(os.path.join(o["back"], "model.safetensors"))
    if tied:
        original.pop("lm_head.weight", None)
    assert set(restored) == set(original) and any(k.endswith("self_attn.q_norm.weight") for k in restored)
    differ = [k for k in original if not torch.equal(original[k], restored[k])]
    assert not differ, differ
    config = json.load(open(os.path.join(o["back"], "config.json")))
    assert (config["model_type"], config["architectures"], config["head_dim"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        head_dim,
    )
    with torch.no_grad():
        theirs = o["model"].generate(torch.tensor([o["prompt"]]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert o["greedy"] == theirs[0].tolist()
    assert len(set(o["greedy"][len(o["prompt"]) :])) > 1, o["greedy"]  # not one token repeated


# ----------------------------------------------------------------------------- training parity

QWEN3_STYLE = dict(
    **LLAMA_STYLE,
    qk_layernorm=True,
    kv_channels=24,  # hidden 64 / 4 heads = 16
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=128,
    train_iters=6,
    global_batch_size=4,
    micro_batch_size=2,
)


def _train(rank: int, world_size: int, reduce_qk_norm_grads: bool = True) -> dict:
    from megatron.core.utils import get_model_config

    from megatron_ext.data.microbatch import get_microbatch_indices
    from megatron_ext.testing import fetch_step_microbatches
    from megatron_ext.training.loop import train
    from megatron_ext.training.step import run_forward_backward

    tp = dict(tensor_model_parallel_size=2, sequence_parallel=True) if world_size == 2 else {}
    run = build_tiny_run(tiny_values(**QWEN3_STYLE, **tp), MarkovDataset(32, mask_every=1))
    if not reduce_qk_norm_grads:  # the modules keep their q/k norms; finalize_model_grads no longer sums them
        get_model_config(run.model[0]).qk_layernorm = False
    indices = get_microbatch_indices(0, run.global_batch_size, 2, run.ctx.dp_rank, run.ctx.dp_size)
    run_forward_backward(run.model, fetch_step_microbatches(run.train_ds, indices), 32)
    grads = gather_full_grads(run)
    train(run)
    destroy_parallel_context()
    return {"grads": grads, "losses": [r["loss"] for r in run.records]}


def _worst(result: dict, reference: dict) -> tuple[str, float, float]:
    """(the parameter whose step-1 gradient differs most, that relative difference, the losses')."""
    rel = {k: float((result["grads"][k] - g).norm() / g.norm()) for k, g in reference["grads"].items()}
    name = max(rel, key=rel.get)
    losses, ref = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    return name, rel[name], float(((losses - ref).abs() / ref.abs()).max())


def test_qk_layernorm_at_tp2_with_sequence_parallelism_trains_as_one_process():
    (reference,) = run_ranks(_train, 1)
    assert any("q_layernorm" in k for k in reference["grads"])
    assert reference["losses"][-1] < reference["losses"][0], reference["losses"]
    tp2 = run_ranks(_train, 2)[0]
    name, grad_rel, loss_rel = _worst(tp2, reference)
    assert grad_rel <= 1e-5, f"step-1 gradient of {name} differs by {grad_rel:.2e}"
    assert loss_rel <= 1e-5, f"losses differ by {loss_rel:.2e}: {tp2['losses']} vs {reference['losses']}"
    # the same run without the TP sum of the q/k norms' gradients fails both checks (measured: step-1
    # gradient of a q_layernorm 0.84 off, losses 1.7e-4)
    unsummed = run_ranks(_train, 2, False)[0]
    name, grad_rel, loss_rel = _worst(unsummed, reference)
    assert "layernorm" in name and grad_rel > 1e-2, (name, grad_rel)
    assert loss_rel > 1e-5, f"losses without the q/k norm reduction still match ({loss_rel:.2e})"


# ----------------------------------------------------------------------------- memory model


def _measure(rank: int, world_size: int) -> list:
    from megatron_ext.planning.memory import get_saved_per_token
    from tools.calibrate_memory import PRECISIONS, RECOMPUTE, get_flags, get_shape, measure

    out = []
    shape = (64, 4, 2, 192, 64, 1, 127)
    for recompute in ("none", "selective"):
        values = {**get_flags("llama", shape, 1, False), **PRECISIONS["bf16"], **RECOMPUTE[recompute]}
        measured = measure({**values, "kv_channels": 32})["layer"]
        row = dict(family="llama", precision="bf16", recompute=recompute, shape=shape, tp=1, sp=False)
        per_token = {
            d: get_saved_per_token("llama", "bf16", recompute, dataclasses.replace(get_shape(row), head_dim=d)).layer
            for d in (32, 0)  # 0: hidden / heads, as before --kv-channels
        }
        out.append((recompute, measured, {d: v * shape[4] for d, v in per_token.items()}))
    return out


def test_memory_model_counts_the_query_width_of_kv_channels():
    for recompute, measured, predicted in run_ranks(_measure, 1)[0]:
        assert abs(predicted[32] / measured - 1) <= 0.02, (recompute, measured, predicted)
        assert abs(predicted[0] / measured - 1) > 0.05, (recompute, measured, predicted)  # hidden / heads: 12% off
