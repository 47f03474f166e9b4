"""--apply-layernorm-1p on the whole model (one gloo process; the HF round trip at TP2 x PP2 is a
case of test_convert_checkpoint.py).

Reference: the same GPT built with plain torch norms whose weight is 1 + our gamma, every other
weight copied, gives the same logits to fp32 precision (GPT-2 style LayerNorm with biases, and
Llama-style RMSNorm). Weight decay: megatron-core 0.16.1's param groups (``get_standard_config_overrides``)
give every 1-D parameter and bias wd_mult 0, whatever ``layernorm_zero_centered_gamma`` says, and
Megatron-LM core_v0.16.1's training never passes another rule for it; the zero-centred gamma is
1-D, so it gets no weight decay, as there.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_ext.testing import VOCAB, run_ranks, tiny_values

pytestmark = pytest.mark.distributed

_NORM_WEIGHT = re.compile(r"(layernorm|final_layernorm)\.weight$")
STYLES = {
    "gpt2 LayerNorm": dict(normalization="LayerNorm"),
    "llama RMSNorm": dict(
        normalization="RMSNorm", swiglu=True, disable_bias_linear=True, position_embedding_type="rope"
    ),
}


def _forward_and_groups(rank: int, world_size: int):
    from megatron_ext.config import build_job_config
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.testing import build_tiny_run

    out = {}
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB - 1, (2, 32), generator=g)
    positions = torch.arange(32).expand(2, 32)
    run = None
    for style, extra in STYLES.items():
        values = tiny_values(num_layers=2, weight_decay=0.1, **extra)
        if run is None:  # the optimizer's param groups of a real run (and its process groups)
            run = build_tiny_run({**values, "apply_layernorm_1p": True}, None)
            out["groups"] = _norm_weight_decay(run)
        models = {}
        for one_p in (True, False):
            cfg = build_job_config({**values, "apply_layernorm_1p": one_p})
            (models[one_p],) = build_model_chunks(cfg, resolve_config(cfg, 1, VOCAB), run.ctx.placement, cpu)
        ours, plain = models[True], models[False]
        norms = [n for n, _ in ours.named_parameters() if _NORM_WEIGHT.search(n)]
        initial = {n: p.detach().clone() for n, p in ours.named_parameters()}
        with torch.no_grad():
            plain_params = dict(plain.named_parameters())
            for name, param in ours.named_parameters():
                if name in norms:
                    param.uniform_(-0.5, 0.5, generator=g)
                    plain_params[name].copy_(1.0 + param)
                else:
                    if name.endswith("bias"):
                        param.normal_(0.0, 0.5, generator=g)  # the norms' biases too
                    plain_params[name].copy_(param)
            logits = ours(input_ids=tokens, position_ids=positions, attention_mask=None)
            expected = plain(input_ids=tokens, position_ids=positions, attention_mask=None)
        out[style] = dict(
            norms=norms,
            initial_norms_zero=all(torch.equal(initial[n], torch.zeros_like(initial[n])) for n in norms),
            max_diff=(logits - expected).abs().max().item(),
            scale=expected.abs().max().item(),
            # control: the plain model with gamma itself (not 1 + gamma) is another model
            control=_forgot_the_one(plain, ours, norms, tokens, positions, expected),
        )
    return out


def _forgot_the_one(plain, ours, norms, tokens, positions, expected) -> float:
    with torch.no_grad():
        params = dict(plain.named_parameters())
        for name, param in ours.named_parameters():
            if name in norms:
                params[name].copy_(param)
        return (plain(input_ids=tokens, position_ids=positions, attention_mask=None) - expected).abs().max().item()


def _norm_weight_decay(run) -> dict[str, set[float]]:
    """{"norm weights" | "other weights": the wd_mult of their optimizer groups}."""
    chunk = run.model[0].module
    kinds = {id(p): "norm weights" if _NORM_WEIGHT.search(n) else "matrices" for n, p in chunk.named_parameters()}
    kinds.update({id(p): "biases" for n, p in chunk.named_parameters() if n.endswith("bias")})
    found: dict[str, set[float]] = {}
    for group in run.optimizer.param_groups:
        for param in group["params"]:
            found.setdefault(kinds[id(param)], set()).add(group["wd_mult"])
    return found


def test_1p_model_equals_the_plain_model_with_gamma_plus_one_and_gamma_gets_no_weight_decay():
    (out,) = run_ranks(_forward_and_groups, 1, timeout=300)
    for style in STYLES:
        r = out[style]
        assert len(r["norms"]) == 2 * 2 + 1, r["norms"]  # two per layer and the final norm
        assert r["initial_norms_zero"], style
        assert r["max_diff"] <= 1e-5 * r["scale"], (style, r)
        assert r["control"] > 100 * r["max_diff"] + 1e-3, (style, r)
    # Megatron-LM's rule: no weight decay on any 1-D parameter, the zero-centred gamma included
    assert out["groups"] == {"norm weights": {0.0}, "biases": {0.0}, "matrices": {1.0}}, out["groups"]
