"""tools/generate.py against transformers, on a checkpoint saved at TP2 x PP2 (4 forked gloo ranks,
a tiny Llama model, 2 steps, with --save-hf for the reference).

- greedy: our tokens (the checkpoint read in one process, fp32) equal
  ``generate(do_sample=False)`` of the exported HF model, token for token, and the loaded model's
  logits equal the HF model's within 1e-5 relative;
- top-p: a seed gives the same tokens twice, another seed other tokens, and every sampled token is
  inside the nucleus computed directly from the HF model's logits at its position;
- the command line prints the same greedy ids;
- a GPT-2-style checkpoint (learned positions, LayerNorm: no HF export) generates too, and its
  greedy tokens are the argmax chain of the training layout's own forward.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")

from tools.generate import generate, load_model  # noqa: E402

SEQ, NEW, TOP_P, TEMPERATURE = 16, 8, 0.8, 1.3
PROMPT = [5, 17, 3, 99, 42]
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    position_embedding_type="rope",
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=96,
    untie_embeddings_and_output_weights=True,
    init_method_std=0.2,  # peaked next-token distributions: greedy ties are unlikely
)
LAYOUT = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)


def _train(rank: int, world_size: int, save: str, model: dict, save_hf: bool) -> list[int] | None:
    values = tiny_values(
        **model, **LAYOUT, seq_length=SEQ, micro_batch_size=2, global_batch_size=4, train_iters=2, save=save
    )
    run = build_tiny_run(values | dict(save_hf=save_hf), MarkovDataset(SEQ))
    train(run)
    chain = None if save_hf else _argmax_chain(run)
    destroy_parallel_context()
    return chain


def _argmax_chain(run) -> list[int] | None:
    """Greedy continuation of PROMPT by the training layout's own forward (no tool involved)."""
    from megatron_ext.data.microbatch import Microbatch
    from megatron_ext.training.step import run_forward_backward

    ids, ctx = list(PROMPT), run.ctx
    for _ in range(NEW):
        seq = len(ids)
        tokens = torch.tensor([ids])

        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            out = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)
            return out, lambda o: (o.sum() * 0.0, torch.tensor(1), {"logits": o.detach()})

        mb = Microbatch(tokens, tokens, torch.arange(seq)[None], seq, seq * seq)
        reports = run_forward_backward(run.model, [mb], seq, forward_only=True, forward_step_func=forward_step)
        nxt = torch.zeros(1, dtype=torch.long)
        if ctx.is_last_stage:
            local = reports[0]["logits"][0, -1]
            parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
            nxt[0] = int(torch.argmax(torch.cat(parts)[:128]))
        dist.all_reduce(nxt, op=dist.ReduceOp.MAX)  # the last stage's token (0 elsewhere), to every rank
        ids.append(int(nxt[0]))
    return ids


def _generate(rank: int, world_size: int, save: str) -> dict:
    model, common = load_model(save, torch.device("cpu"), log=lambda s: None)
    vocab = common["tokenizer"]["vocab_size"]
    out = {"greedy": generate(model, PROMPT, NEW, vocab)}
    with torch.no_grad():
        tokens = torch.tensor([PROMPT])
        logits = model(input_ids=tokens, position_ids=torch.arange(len(PROMPT))[None], attention_mask=None)
    out["logits"] = logits[..., :vocab].float()
    for seed in (1, 1, 2):
        out.setdefault("top_p", []).append(
            generate(model, PROMPT, NEW, vocab, temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
        )
    destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("llama"))
    run_ranks(_train, 4, save, LLAMA, True)
    out = run_ranks(_generate, 1, save)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(save, "hf", "iter_0000002"), attn_implementation="eager"
    ).eval()
    return save, out, hf


def test_greedy_equals_transformers_generate(llama):
    _, out, hf = llama
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    assert out["greedy"] == theirs[0].tolist()
    with torch.no_grad():  # the model the tool loaded is the exported one: same logits (fp32)
        ref = hf(torch.tensor([PROMPT])).logits.float()
    assert float((out["logits"] - ref).norm() / ref.norm()) <= 1e-5
    assert len(set(out["greedy"][len(PROMPT) :])) > 1, out["greedy"]  # not one token repeated


def test_top_p_is_seeded_and_stays_in_the_nucleus(llama):
    _, out, hf = llama
    first, again, other = out["top_p"]
    assert first == again and first != other, out["top_p"]
    for ids in (first, other):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        for t in range(len(PROMPT), len(ids)):
            probs = torch.softmax(logits[t - 1] / TEMPERATURE, -1)
            ranked = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
            nucleus, total = set(), 0.0
            for i in ranked:  # the smallest set of most likely tokens reaching TOP_P
                nucleus.add(i)
                total += float(probs[i])
                if total >= TOP_P:
                    break
            assert ids[t] in nucleus, (t, ids[t], sorted(nucleus))
            assert len(nucleus) > 1  # sampling had a choice to make


def test_command_line_prints_the_greedy_ids(llama):
    save, out, _ = llama
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [sys.executable, os.path.join(root, "tools", "generate.py"), "--load", save, "--greedy"]
    argv += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert f"ids: {','.join(map(str, out['greedy']))}" in done.stdout, done.stdout


def test_a_gpt2_style_checkpoint_generates(tmp_path):
    save = str(tmp_path)
    chains = run_ranks(_train, 4, save, dict(init_method_std=0.2), False)
    out = run_ranks(_generate, 1, save)[0]
    assert out["greedy"] == chains[-1], (out["greedy"], chains[-1])
