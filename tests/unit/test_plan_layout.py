"""tools/plan_layout.py on the Llama 3 70B reference config at 512 GPUs: it finishes within the
issue's 30 s (the planning itself, after imports), every printed layout's flags parse through
pretrain_gpt.py's own parser over the same config and pass ``validation.validate`` at that world
size, and a layout pinned with --show that cannot fit says why."""

from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest

from megatron_ext.arguments import parse_args
from megatron_ext.config import ConfigError
from megatron_ext.planning.planner import Layout
from megatron_ext.validation import validate
from tools.plan_layout import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "llama3-70b.yaml")


def test_plan_layout_prints_valid_flags_in_time(capsys):
    start = time.perf_counter()
    assert (
        main(["--config", CONFIG, "--gpus", "512", "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--top", "3"]) == 0
    )
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    print(out)
    assert elapsed < 30, f"planning took {elapsed:.1f} s"
    flags = [line.split("flags: ", 1)[1].split() for line in out.splitlines() if "flags: " in line]
    assert len(flags) == 3
    for argv in flags:
        validate(parse_args(["--config", CONFIG, *argv]), 512, cuda=True)  # a CP layout too


def test_show_says_why_a_layout_does_not_fit(capsys):
    main(["--config", CONFIG, "--gpus", "512", "--show", "tp=8 pp=1 recompute=none mbs=1"])
    out = capsys.readouterr().out
    assert re.search(r"does not fit: needs [\d.]+ GiB on its fullest GPU, 80 GiB available", out), out
    main(["--config", CONFIG, "--gpus", "512", "--show", "tp=1 pp=1 mbs=1"])  # DP 512 > global batch 128
    out = capsys.readouterr().out
    assert "invalid: --global-batch-size 128 is not divisible" in out
    assert "| DP 512\n   invalid:" in out and "micro-batches" not in out.split("--show", 1)[1], out  # (was "0")


def test_of_two_equally_fast_layouts_the_one_with_less_memory_comes_first(monkeypatch):
    """Recompute none and selective tie in predicted time on Llama (flash attention: nothing of s x s to
    recompute); the planner lists the one with more headroom first, whatever order it enumerated them in
    (reversed here, so that the larger one comes first unless the planner orders ties by memory)."""
    from megatron_ext.planning import planner
    from megatron_ext.planning.planner import plan
    from megatron_ext.planning.step_time import Cluster

    enumerate_layouts = planner.enumerate_layouts
    monkeypatch.setattr(planner, "enumerate_layouts", lambda *a: list(reversed(enumerate_layouts(*a))))

    cfg = parse_args(["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml")])
    cluster = Cluster(gpus=64, gpus_per_node=8, gpu_memory_gib=80.0)
    fits = [c for c in plan(cfg, cluster, cfg.data.vocab_size, {"tp": "2", "pp": "1", "mbs": "1"}) if not c.problems]
    assert len(fits) >= 2
    for a, b in zip(fits, fits[1:]):
        assert (a.time.total, a.memory.total) <= (b.time.total, b.memory.total), (a.layout, b.layout)
    tied = [c for c in fits if c.time.total == fits[0].time.total]
    assert len(tied) >= 2, [(c.layout.recompute, c.time.total) for c in fits]  # the tie this orders


def test_an_uneven_last_stage_is_chosen_where_the_time_model_says_it_is_faster(capsys):
    """Llama 3 8B at PP 4: the last rank also runs the output layer (6 h V FLOPs per token, about 1.8
    layers), so 8 layers there make it the busiest. The planner offers the split that balances it and
    ranks it first; it is the fastest of every last-stage (and first-stage) size the validation accepts,
    priced one by one here with the same models, and its printed flags pass ``validate``."""

    from megatron_ext.planning.planner import evaluate
    from megatron_ext.planning.step_time import Cluster

    config = os.path.join(ROOT, "configs", "llama3-8b.yaml")
    fix = "tp=8 pp=4 mbs=1 recompute=none schedule=1F1B"
    assert main(["--config", config, "--gpus", "64", "--fix", fix, "--top", "1"]) == 0
    out = capsys.readouterr().out
    argv = out.split("flags: ", 1)[1].splitlines()[0].split()
    assert "--decoder-last-pipeline-num-layers" in argv, out
    job = parse_args(["--config", config, *argv])
    validate(job, 64)
    chosen = int(argv[argv.index("--decoder-last-pipeline-num-layers") + 1])

    cfg = parse_args(["--config", config])
    cluster = Cluster(gpus=64, gpus_per_node=8, gpu_memory_gib=80.0)
    even = Layout(8, 4, 1, "1F1B", 1, "none", True)
    times = {}
    for field in ("first_layers", "last_layers"):
        for n in [None, *range(1, cfg.model.num_layers)]:
            c = evaluate(cfg, dataclasses.replace(even, **{field: n}), cluster, cfg.data.vocab_size)
            if c.time is not None:
                times[(field, n)] = c.time.total
    assert len(times) > 3, times  # the even split and a few uneven ones are valid
    best = min(times, key=times.get)
    assert best == ("last_layers", chosen), (best, chosen, times)
    assert times[best] < times[("last_layers", None)] * 0.97, times  # noticeably faster than even


def test_the_memory_model_counts_an_uneven_splits_parameters_as_the_model_builds_them():
    """predict_memory's weights per pipeline rank of an uneven layout (first and last stage sizes) equal
    the parameters of that layout's chunks built on ``meta`` (model/param_count.count_parameters)."""
    from megatron_ext.model.param_count import count_parameters
    from megatron_ext.planning.planner import apply_layout
    from megatron_ext.planning.predict import predict_memory

    cfg = parse_args(["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml")])
    for layout in (
        Layout(8, 4, 1, "1F1B", 1, "none", True, None, 5),
        Layout(8, 4, 2, "Interleaved1F1B", 1, "none", True, 6, 6),
    ):
        job = apply_layout(cfg, layout)
        validate(job, 64)
        predicted = [r.state.parameters // 2 for r in predict_memory(job, 64, cfg.data.vocab_size)]  # bf16 weights
        assert predicted == count_parameters(job, cfg.data.vocab_size).per_pp_rank(), layout


# Meta's Llama 3 8B config.json (meta-llama/Meta-Llama-3-8B), as published
LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def test_the_model_from_an_hf_config_json(tmp_path, capsys):
    """--hf-config: Llama 3 8B's config.json gives Llama 3 8B's 8,030,261,248 parameters (the count
    transformers builds from it) and, over the reference config's training settings, the same top
    layout as configs/llama3-8b.yaml (whose mock vocabulary is 128,257 ids: 1,048,576 more)."""
    import json

    import torch
    import transformers

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_HF))
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA3_8B_HF))
    expected = sum(p.numel() for p in reference.parameters())
    assert expected == 8_030_261_248

    config = os.path.join(ROOT, "configs", "llama3-8b.yaml")
    common = ["--gpus", "64", "--fix", "pp=4 mbs=1 recompute=none", "--top", "1"]
    assert main(["--hf-config", str(path), "--config", config, *common]) == 0
    from_hf = capsys.readouterr().out
    assert main(["--config", config, *common]) == 0
    from_yaml = capsys.readouterr().out
    assert from_hf.startswith(f"{expected:,} parameters, 32 layers x hidden 4096"), from_hf
    assert from_yaml.startswith(f"{expected + 1_048_576:,} parameters"), from_yaml
    top = [out.split("flags: ", 1)[1].splitlines()[0] for out in (from_hf, from_yaml)]
    assert top[0] == top[1], top


def test_a_qwen2_config_json_with_tied_embeddings_and_qkv_bias(tmp_path, capsys):
    """Qwen2-0.5B's config.json (tied embeddings, QKV bias, 14 heads over 2 groups): the planner's
    model has the parameters transformers builds from it."""
    import json

    import torch
    import transformers

    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf)).parameters())
    config = os.path.join(ROOT, "configs", "llama3-8b.yaml")
    fix = ["--fix", "tp=1 pp=1 mbs=1 recompute=none", "--", "--seq-length", "4096"]
    assert main(["--hf-config", str(path), "--config", config, "--gpus", "8", "--top", "1", *fix]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{expected:,} parameters, 24 layers x hidden 896"), out


def test_settings_a_layout_turns_off_are_named_for_removal():
    """Over a config that sets --use-distributed-optimizer, --recompute-activations and
    --account-for-loss-in-pipeline-split (no --no-* spelling), an uneven layout without them names
    all three: with them removed its flags validate; with them kept the run would be another layout
    or refused."""
    config = os.path.join(ROOT, "configs", "llama3-8b.yaml")
    extra = [
        "--use-distributed-optimizer",
        "--recompute-activations",
        "--account-for-loss-in-pipeline-split",
    ]
    cfg = parse_args(["--config", config, *extra])
    layout = Layout(1, 4, 1, "1F1B", 1, "none", False, last_layers=5)
    remove = layout.get_settings_to_remove(cfg)
    assert sorted(remove) == sorted(extra)
    validate(parse_args(["--config", config, *layout.flags()]), 64)
    with pytest.raises(ConfigError):  # kept: the uneven split with --account-for-loss-in-pipeline-split
        validate(parse_args(["--config", config, *extra, *layout.flags()]), 64)
    even = Layout(8, 4, 1, "1F1B", 1, "selective", True)
    assert even.get_settings_to_remove(cfg) == ["--recompute-activations"]


def test_lighter_first_splits_pass_megatron_cores_rules():
    """Every lighter first stage the planner offers is a split megatron-core's TransformerConfig
    accepts, and its own ``get_num_layers_to_build`` gives the first rank the layers asked for, fewer
    than the even share, and all the layers to the ranks; ``validate`` accepts the layout too."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.planning.planner import apply_layout, get_lighter_first_splits

    cfg = parse_args(["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml")])
    checked = 0
    for layers in (24, 32, 40, 80):
        for pp in (p for p in range(2, 17) if layers % p == 0):
            for vpp in (v for v in range(1, 9) if (layers // pp) % v == 0):
                for first, last in get_lighter_first_splits(layers, pp, vpp):
                    tf = TransformerConfig(
                        num_layers=layers,
                        hidden_size=64,
                        num_attention_heads=4,
                        pipeline_model_parallel_size=pp,
                        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                        num_layers_in_first_pipeline_stage=first,
                        num_layers_in_last_pipeline_stage=last,
                        pipeline_dtype=torch.bfloat16,
                    )
                    per_rank = [
                        sum(get_num_layers_to_build(tf, vp_stage=s if vpp > 1 else None, pp_rank=r) for s in range(vpp))
                        for r in range(pp)
                    ]
                    assert per_rank[0] == first < layers // pp, (layers, pp, vpp, first, last, per_rank)
                    assert sum(per_rank) == layers and min(per_rank) > 0, (layers, pp, vpp, first, last, per_rank)
                    checked += 1
                    if layers == cfg.model.num_layers and pp <= 8:  # the planner's own check, at 8 GPUs x PP
                        schedule = "Interleaved1F1B" if vpp > 1 else "1F1B"
                        layout = Layout(1, pp, vpp, schedule, 1, "none", True, first, last)
                        validate(apply_layout(cfg, layout), 8 * pp)
    assert checked > 100, checked


def test_a_lighter_first_stage_fits_where_the_even_split_needs_full_recompute(capsys):
    """Llama 3 8B at TP 2 x PP 4 1F1B: 1F1B's rank 0 holds 4 micro-batches in flight, so it is the
    fullest GPU. With a memory budget between the memory model's lightest lighter-first split and its
    lightest even split without full recompute (no figure hard-coded), the even split fits only with
    full recompute (x 4/3 compute); the planner proposes the lighter first stage, says it fits only
    thanks to it, and its printed flags pass ``validate``; by ``predict_memory`` of those flags rank 0
    is below the budget, and rank 0 of the same flags without the split above it."""
    from megatron_ext.planning.memory import GIB
    from megatron_ext.planning.planner import plan
    from megatron_ext.planning.predict import predict_memory
    from megatron_ext.planning.step_time import Cluster

    config = os.path.join(ROOT, "configs", "llama3-8b.yaml")
    cfg = parse_args(["--config", config])
    vocab = cfg.data.vocab_size
    fix = "tp=2 cp=1 pp=4 schedule=1F1B mbs=1"  # (CP 2 would be another way to halve the activations)
    roomy = plan(cfg, Cluster(64, 8, 1e6), vocab, dict(x.split("=") for x in fix.split()))
    even = {c.layout: c for c in roomy if c.layout.first_layers is None and c.layout.last_layers is None}
    lighter = [c for c in roomy if c.layout.lighter_first]
    for c in lighter:  # each kept one is lighter than its even split, whose bytes it carries
        even_split = dataclasses.replace(c.layout, first_layers=None, last_layers=None)
        assert c.memory.total < c.even_memory == even[even_split].memory.total, c.layout
    lightest = min(c.memory.total for c in lighter if c.layout.recompute != "full")
    even_lightest = min(c.memory.total for c in even.values() if c.layout.recompute != "full")
    assert lightest < even_lightest
    budget = round((lightest + even_lightest) / 2 / GIB, 3)
    full = [c for c in even.values() if c.layout.recompute == "full"]
    assert full[0].memory.total < budget * GIB  # the even split fits, with full recompute

    assert main(["--config", config, "--gpus", "64", "--gpu-memory-gib", str(budget), "--fix", fix, "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "fits only with this split" in out and "remove from the config" not in out, out
    argv = out.split("flags: ", 1)[1].splitlines()[0].split()
    assert "--decoder-first-pipeline-num-layers" in argv and "full" not in argv, out
    assert int(argv[argv.index("--decoder-first-pipeline-num-layers") + 1]) < cfg.model.num_layers // 4
    job = parse_args(["--config", config, *argv])
    validate(job, 64)
    i = argv.index("--decoder-first-pipeline-num-layers")
    j = argv.index("--decoder-last-pipeline-num-layers") if "--decoder-last-pipeline-num-layers" in argv else None
    even_argv = [a for k, a in enumerate(argv) if k not in (i, i + 1) and (j is None or k not in (j, j + 1))]
    even_job = parse_args(["--config", config, *even_argv])
    ranks = predict_memory(job, 64, vocab)
    even_ranks = predict_memory(even_job, 64, vocab)
    assert max(r.total for r in ranks) < budget * GIB < even_ranks[0].total, (ranks, even_ranks)
    assert ranks[0].total < budget * GIB
    assert even_ranks[0].total == max(r.total for r in even_ranks)  # rank 0: the even split's fullest GPU
    top = next(c for c in roomy if " ".join(c.layout.flags()) == " ".join(argv))
    assert top.time.total < full[0].time.total  # faster than the even split that fits (full recompute)


def test_no_lighter_first_stage_under_the_v_placement():
    """ZBVZeroBubble refuses --decoder-first/last-pipeline-num-layers: none is offered with it."""
    from megatron_ext.planning.planner import enumerate_layouts
    from megatron_ext.planning.step_time import Cluster

    cfg = parse_args(["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml")])
    layouts = enumerate_layouts(cfg, Cluster(64, 8, 80.0), {"tp": "8"}, cfg.data.vocab_size)
    lighter = [x for x in layouts if x.lighter_first]
    assert {x.schedule for x in lighter} == {"1F1B", "ZBH1", "Interleaved1F1B", "InterleavedZeroBubble"}
    assert all(x.schedule != "ZBVZeroBubble" for x in layouts if x.first_layers or x.last_layers)
