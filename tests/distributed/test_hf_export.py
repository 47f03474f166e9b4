"""--save-hf: a TP2 x PP2 run (4 forked gloo ranks, a tiny Llama/Qwen2/Qwen3 model, 3 steps) writes a
Hugging Face directory at its last save, and ``transformers.AutoModelForCausalLM.from_pretrained``
on it gives the logits our model gives at the same weights (the trained run's own forward, at
TP2 x PP2, on fixed tokens): within 1e-5 relative (fp32; the layout-parity tolerance), within 2e-2
relative under --bf16 (both sides compute in bf16, with other reduction orders: the tolerance
test_mixed_precision.py uses for a bf16 model against transformers). The shards are per stage:
the index lists one file per (pipeline, TP) rank, and none holds every tensor. Under DP2 with the
distributed optimizer, replica 0 alone writes, and --save-hf-interval 2 exports at iteration 2 and
at the last save.

An export that cannot be written (``<save>/hf`` is a file) is a warning naming the directory; the
run goes on and its checkpoint is complete and loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.config import build_job_config
from megatron_ext.data.microbatch import Microbatch
from megatron_ext.hf.export import is_complete_export
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train
from megatron_ext.training.step import run_forward_backward

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")

SEQ, BATCH, ITERS = 16, 2, 3
LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    position_embedding_type="rope",
    rotary_base=50000,
    norm_epsilon=1e-5,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=96,
)
TP2PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
KINDS = {
    "llama untied fp32": dict(untie_embeddings_and_output_weights=True),
    # tied (the last stage's output layer is a copy: not written), q/k/v biases, zero-centred norms, VPP 2
    "qwen2 tied 1p vpp fp32": dict(add_qkv_bias=True, apply_layernorm_1p=True, num_layers_per_virtual_pipeline_stage=1),
    "llama untied bf16": dict(untie_embeddings_and_output_weights=True, bf16=True),
    # Qwen3ForCausalLM: q/k norms over a head_dim (24) that is not hidden / heads (16), SP
    "qwen3 untied head_dim sp fp32": dict(
        untie_embeddings_and_output_weights=True, qk_layernorm=True, kv_channels=24, sequence_parallel=True
    ),
    # DP2 with the distributed optimizer: replica 1 writes nothing; exports at iterations 2 (the
    # interval) and 3 (the last save), not 1
    "llama tied dp2 interval fp32": dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        use_distributed_optimizer=True,
        save_interval=1,
        save_hf_interval=2,
    ),
}
# (PP, TP) ranks of the layout: one shard each
SHARDS = {kind: (1, 1) if "dp2" in kind else (2, 2) for kind in KINDS}
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def _values(save: str, kind: str) -> dict:
    return tiny_values(
        **LLAMA,
        **(TP2PP2 | KINDS[kind]),
        seq_length=SEQ,
        micro_batch_size=BATCH,
        global_batch_size=4,
        train_iters=ITERS,
        save=save,
        save_hf=True,
    )


def _our_logits(run, tokens: torch.Tensor) -> torch.Tensor | None:
    """Our model's logits on ``tokens`` ([b, s]) at the run's layout, gathered over TP on the last
    stage (None elsewhere)."""
    ctx = run.ctx

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        out = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)
        return out, lambda o: (o.sum() * 0.0, torch.tensor(1), {"logits": o.detach()})

    seq = tokens.shape[1]
    mbs = [  # one sample per micro-batch: the interleaved schedule needs at least PP of them
        Microbatch(
            tokens=row[None],
            labels=row[None],
            position_ids=torch.arange(seq)[None],
            num_real_tokens=seq,
            attention_pairs=seq * seq,
        )
        for row in tokens
    ]
    reports = run_forward_backward(run.model, mbs, seq, forward_only=True, forward_step_func=forward_step)
    if not ctx.is_last_stage:
        return None
    local = torch.cat([r["logits"] for r in reports])  # [b, s, padded / TP]
    parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=-1).float()


def _train_and_export(rank: int, world_size: int, save: str, kind: str, tokens: torch.Tensor) -> dict:
    logs = []
    run = build_tiny_run(_values(save, kind), MarkovDataset(SEQ))
    run.log = logs.append
    train(run)
    logits = _our_logits(run, tokens)
    destroy_parallel_context()
    return {"logits": logits, "logs": logs}


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_loads_in_transformers_with_our_logits(tmp_path, kind):
    save = str(tmp_path / "ckpt")
    tokens = torch.randint(0, 120, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = run_ranks(_train_and_export, 4 if SHARDS[kind] == (2, 2) else 2, save, kind, tokens)
    hf_dir = os.path.join(save, "hf", f"iter_{ITERS:07d}")
    assert any(hf_dir in line and "exported" in line for line in out[-1]["logs"]), out[-1]["logs"]
    assert os.path.isdir(os.path.join(save, f"iter_{ITERS:07d}"))  # the checkpoint, beside
    exported = [f"iter_{i:07d}" for i in ((2, ITERS) if "interval" in kind else (ITERS,))]
    assert sorted(os.listdir(os.path.join(save, "hf"))) == exported  # no temporary left

    # per-stage shards: one file per (PP, TP) rank, each holding part of the model
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    pp, tp = SHARDS[kind]
    assert files == [f"model-pp{p:03d}-tp{t:03d}.safetensors" for p in range(pp) for t in range(tp)], files
    by_file = {f: {k for k, v in index["weight_map"].items() if v == f} for f in files}
    if len(files) > 1:
        assert all(0 < len(names) < len(index["weight_map"]) for names in by_file.values()), by_file
        stage0 = by_file[files[0]] | by_file[files[1]]
        assert "model.embed_tokens.weight" in stage0 and not any(".layers.3." in n for n in stage0), stage0
    assert os.path.isfile(os.path.join(hf_dir, "TOKENIZER.txt"))  # NullTokenizer: a note, no files

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    if "qwen3" in kind:
        assert (type(model).__name__, model.config.head_dim) == ("Qwen3ForCausalLM", 24), model.config
    bf16 = "bf16" in kind
    assert model.model.embed_tokens.weight.dtype == (torch.bfloat16 if bf16 else torch.float32)
    with torch.no_grad():
        theirs = model(tokens).logits.float()
    ours = out[-1]["logits"][..., : theirs.shape[-1]]
    rel = float((theirs - ours).norm() / ours.norm())
    assert rel <= TOLERANCE["bf16" if bf16 else "fp32"], f"{kind}: HF logits differ from ours by {rel:.2e}"


def _export_fails(rank: int, world_size: int, save: str) -> dict:
    logs = []
    values = _values(save, "llama untied fp32") | dict(tensor_model_parallel_size=1)
    run = build_tiny_run(values, MarkovDataset(SEQ))
    run.log = logs.append
    train(run)
    destroy_parallel_context()
    run = build_tiny_run(values | dict(save_hf=False), MarkovDataset(SEQ))
    loaded = load_checkpoint(run, save)
    destroy_parallel_context()
    return {"logs": logs, "loaded": loaded, "iteration": run.state.iteration}


def test_export_failure_warns_and_keeps_the_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "hf").write_text("not a directory")  # the export cannot make <save>/hf/.tmp_iter_...
    out = run_ranks(_export_fails, 2, str(save))
    warnings = [line for line in out[-1]["logs"] if "WARNING" in line and "Hugging Face export" in line]
    assert len(warnings) == 1 and os.path.join(str(save), "hf", f"iter_{ITERS:07d}") in warnings[0], out[-1]["logs"]
    assert "convert_checkpoint.py megatron-to-hf" in warnings[0]
    assert out[0]["loaded"] == ITERS and out[1]["loaded"] == ITERS, out


def _export_after_a_crash(rank: int, world_size: int, save: str) -> dict:
    logs = []
    values = _values(save, "llama untied fp32") | dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    run = build_tiny_run(values, MarkovDataset(SEQ))
    run.log = logs.append
    start = time.perf_counter()
    train(run)
    seconds = time.perf_counter() - start
    destroy_parallel_context()
    return {"logs": logs, "seconds": seconds}


def _crashed_export(path, sentinel: str) -> None:
    """A published export (index and config written) that a test recognises by ``sentinel``."""
    os.makedirs(path)
    for name, text in (("model.safetensors.index.json", "{}"), ("config.json", "{}"), ("sentinel", sentinel)):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)


def test_next_export_recovers_a_crashed_publish_and_logs_its_seconds(tmp_path):
    """A crash between ``_publish``'s renames left iteration 1's earlier export as ``iter_0000001.old``
    alone and iteration 2's beside its new one: the run's export (its publishing rank) renames the
    first back, logging it once, deletes the second, and its "exported" line gives the seconds the
    export took (no more than the whole run's)."""
    hf = tmp_path / "ckpt" / "hf"
    _crashed_export(hf / "iter_0000001.old", "earlier 1")
    _crashed_export(hf / "iter_0000002.old", "earlier 2")
    _crashed_export(hf / "iter_0000002", "new 2")
    out = run_ranks(_export_after_a_crash, 1, str(tmp_path / "ckpt"))[0]
    assert sorted(os.listdir(hf)) == ["iter_0000001", "iter_0000002", f"iter_{ITERS:07d}"], out["logs"]
    assert (hf / "iter_0000001" / "sentinel").read_text() == "earlier 1"
    assert (hf / "iter_0000002" / "sentinel").read_text() == "new 2"
    recovered = [line for line in out["logs"] if line.startswith("recovered the Hugging Face export")]
    assert recovered == [line for line in recovered if str(hf / "iter_0000001.old") in line] and len(recovered) == 1
    (line,) = [line for line in out["logs"] if line.startswith("exported a Hugging Face")]
    match = re.search(rf"to {re.escape(str(hf / f'iter_{ITERS:07d}'))} in (\d+\.\d\d) s: ", line)
    assert match, line
    # (a tiny model's export can round to 0.00 s: the unit test checks the value against a clock)
    assert 0.0 <= float(match.group(1)) <= out["seconds"], (line, out["seconds"])


def _train_one_rank_and_export(rank: int, world_size: int, save: str) -> None:
    values = _values(save, "llama untied fp32") | dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    train(build_tiny_run(values, MarkovDataset(SEQ)))
    destroy_parallel_context()


def _start_from_save(rank: int, world_size: int, save: str) -> str:
    """pretrain_gpt.py's start after a restart (--load = --save: the checkpoint of the last iteration,
    nothing left to train); what it logged."""
    import pretrain_gpt
    from megatron_ext.checkpoint.exit_policy import build_exit_decider

    values = _values(save, "llama untied fp32") | dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    cfg = build_job_config(values | dict(load=save))
    out, decider = io.StringIO(), build_exit_decider(cfg)
    try:
        with contextlib.redirect_stdout(out):
            pretrain_gpt._train(cfg, [], torch.device("cpu"), decider)
    finally:
        decider.close()
    return out.getvalue()


def test_an_export_a_killed_run_owed_is_redone_at_the_next_start(tmp_path):
    """Issue 45: a run killed during (or just before) its --save-hf export left no export of its last
    checkpoint, and nothing said so: the resumed run started where the checkpoint was and the export
    was never written. The next start from --save exports the loaded checkpoint, saying why, and
    names an abandoned export of another iteration with the command that redoes it."""
    save = str(tmp_path / "ckpt")
    hf = os.path.join(save, "hf")
    final, tmp = os.path.join(hf, f"iter_{ITERS:07d}"), os.path.join(hf, f".tmp_iter_{ITERS:07d}")
    run_ranks(_train_one_rank_and_export, 1, save)
    assert is_complete_export(final)
    logs = {}
    for kill, why in (
        ("during the export", "an export of it was started and never published"),
        ("before the export", "--save-hf was due there and no export was published"),
    ):
        if kill == "during the export":  # its shards half written: no config, no index, not renamed
            os.rename(final, tmp)
            os.remove(os.path.join(tmp, "config.json"))
            os.makedirs(os.path.join(hf, ".tmp_iter_0000001"))  # an older one, abandoned
        else:
            shutil.rmtree(final)
        log = logs[kill] = run_ranks(_start_from_save, 1, save)[0]
        assert is_complete_export(final) and not os.path.exists(tmp), (kill, sorted(os.listdir(hf)), log)
        assert f"> --save-hf: the export of iteration {ITERS} is missing ({why}" in log, log
    (warning,) = [line for line in logs["during the export"].splitlines() if "iteration 1 was never published" in line]
    assert f"convert_checkpoint.py megatron-to-hf --load {os.path.join(save, 'iter_0000001')}" in warning
    # said once: the first start's export deleted the leftover
    assert "iteration 1 was never published" not in logs["before the export"]
