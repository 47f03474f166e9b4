"""The reference configs at real sizes (configs/llama3-8b.yaml, llama3-70b.yaml, gpt3-175b.yaml):
valid at the world size of the layout they copy from Megatron-LM's examples, and building exactly
the published parameter counts, counted chunk by chunk on the ``meta`` device
(``megatron_ext/model/param_count.py``; a whole 175B model would ask for about 700 GB).

The independent reference is the closed-form count of a GPT/Llama decoder below (the published
totals: Llama 3 8B 8,030,261,248 and 70B 70,553,706,496 as Hugging Face counts them, GPT-3 175B
174,604,836,864 at a vocabulary of 50,304)."""

from __future__ import annotations

import os
import re

import pytest

from megatron_ext.arguments import parse_args
from megatron_ext.config import ConfigError
from megatron_ext.derived import get_chunk_layer_counts, get_data_parallel_size, get_num_microbatches
from megatron_ext.model.param_count import count_parameters
from megatron_ext.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# config -> (world size of its layout, TP, PP, VPP, DP, the model's parameters at the real tokenizer's vocabulary)
REFERENCE = {
    "llama3-8b.yaml": (8, 1, 1, None, 8, 8_030_261_248),
    "llama3-8b-cp2.yaml": (8, 1, 1, None, 4, 8_030_261_248),  # CP 2 (the README table's 8B row)
    "llama3-70b.yaml": (64, 4, 8, 5, 2, 70_553_706_496),
    "gpt3-175b.yaml": (128, 8, 16, None, 1, 174_604_836_864),
}
CP = {"llama3-8b-cp2.yaml": 2}


def load(name: str):
    return parse_args(["--config", os.path.join(ROOT, "configs", name)])


def closed_form_layer(h: int, ffn: int, heads: int, groups: int, gated: bool, bias: bool, layernorm: bool) -> int:
    """One decoder layer's parameters: QKV, output projection, MLP and two norms."""
    kv = 2 * groups * (h // heads)
    qkv = h * (h + kv) + (h + kv if bias else 0)
    proj = h * h + (h if bias else 0)
    fc1 = h * ffn * (2 if gated else 1) + (ffn * (2 if gated else 1) if bias else 0)
    fc2 = ffn * h + (h if bias else 0)
    norms = 2 * h * (2 if layernorm else 1)
    return qkv + proj + fc1 + fc2 + norms


def closed_form(cfg, vocab: int) -> tuple[int, int]:
    """(whole model, one layer) of ``cfg`` over ``vocab`` padded ids."""
    m = cfg.model
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    layernorm = m.normalization == "LayerNorm"
    layer = closed_form_layer(
        m.hidden_size,
        m.ffn_hidden_size or 4 * m.hidden_size,
        m.num_attention_heads,
        groups,
        m.swiglu,
        not m.disable_bias_linear,
        layernorm,
    )
    embeddings = vocab * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1)
    positions = (
        (m.max_position_embeddings or m.seq_length) * m.hidden_size
        if m.position_embedding_type == "learned_absolute"
        else 0
    )
    final_norm = m.hidden_size * (2 if layernorm else 1)
    return m.num_layers * layer + embeddings + positions + final_norm, layer


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_config_is_valid_at_its_world_size(name):
    world, tp, pp, vpp, dp, _ = REFERENCE[name]
    cfg = load(name)
    validate(cfg, world, cuda=False)  # pure: mock data, nothing built
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, get_data_parallel_size(cfg, world)) == (
        tp,
        pp,
        dp,
    )
    assert p.context_parallel_size == CP.get(name, 1)
    counts = get_chunk_layer_counts(cfg)
    assert len(counts) == pp * (vpp or 1) and sum(counts) == cfg.model.num_layers
    assert get_num_microbatches(cfg, world) == cfg.training.global_batch_size // dp
    # one rank more does not fit the layout or the batch: refused (the validation is not vacuous)
    with pytest.raises(ConfigError):
        validate(cfg, world + 1, cuda=False)
    # a real corpus instead of the config's synthetic data, from the command line
    real = parse_args(["--config", os.path.join(ROOT, "configs", name), "--no-mock-data", "--data-path", "corpus"])
    assert real.data.mock_data is False and real.data.data_path == ["corpus"]


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_config_builds_the_published_parameter_count(name):
    world, tp, pp, vpp, _, published = REFERENCE[name]
    cfg = load(name)  # (CP ranks hold the same parameters: llama3-8b-cp2's count is the 8B's)
    vocab = cfg.data.vocab_size  # the real tokenizer's ids (Llama 3's 128,256; GPT-2's 50,257 -> 50,304 padded)
    padded = -(-vocab // cfg.model.make_vocab_size_divisible_by) * cfg.model.make_vocab_size_divisible_by
    reference, layer = closed_form(cfg, padded)
    assert reference == published  # the closed form reproduces the published figure
    count = count_parameters(cfg, vocab)
    assert count.total == published
    assert len(count.chunks) == pp * (vpp or 1) and sorted(c.stage for c in count.chunks) == list(
        range(len(count.chunks))
    )
    assert sum(c.num_layers for c in count.chunks) == cfg.model.num_layers
    # a middle chunk is its layers only; one TP rank holds 1/TP of its matrices and whole norms
    middle = [c for c in count.chunks if 0 < c.stage < len(count.chunks) - 1]
    h = cfg.model.hidden_size
    norms_per_layer = 2 * h * (2 if cfg.model.normalization == "LayerNorm" else 1)
    row_biases = 0 if cfg.model.disable_bias_linear else 2 * h  # attention output and fc2 biases are not split
    for c in middle:
        assert c.parameters == c.num_layers * layer
        assert c.per_tp_rank == c.num_layers * (
            (layer - norms_per_layer - row_biases) // tp + norms_per_layer + row_biases
        )
    # the model's figure changes with its vocabulary (the count reads the padded vocabulary it is given)
    assert count_parameters(cfg, padded + 1).total != published


def test_tied_output_copy_is_held_but_not_counted():
    """GPT-3 175B ties its output layer to the word embeddings: the last pipeline stage holds a copy
    (its memory) that the model's count leaves out."""
    cfg = load("gpt3-175b.yaml")
    count = count_parameters(cfg, cfg.data.vocab_size)
    first, last = count.chunks[0], count.chunks[-1]
    embedding = 50304 * 12288
    assert last.per_tp_rank - count.chunks[1].per_tp_rank == embedding // 8 + 2 * 12288  # the copy, the final norm
    assert first.parameters - count.chunks[1].parameters == embedding + 2048 * 12288
    assert last.parameters - count.chunks[1].parameters == 2 * 12288
    assert count.per_pp_rank() == [c.per_tp_rank for c in count.chunks]


# ----------------------------------------------------------------------------- issue 43: what each config says


def read_memory_claims(name: str) -> tuple[float, int, list[str], float]:
    """(predicted peak GiB, at GPUs, the flags that fit 80 GiB, their peak GiB) from the config's comments."""
    text = open(os.path.join(ROOT, "configs", name)).read()
    peak = re.search(r"^# Predicted peak: ([\d.]+) GiB per GPU at (\d+) GPUs$", text, re.M)
    fits = re.search(r"^# Fits 80 GiB with: (.+) \(([\d.]+) GiB\)$", text, re.M)
    assert peak and fits, f"configs/{name} does not state its predicted peak and the flags that fit 80 GiB"
    return float(peak.group(1)), int(peak.group(2)), fits.group(1).split(), float(fits.group(2))


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_each_config_states_its_predicted_peak_and_the_cheapest_flags_that_fit_80_gib(name):
    """The figures in the config's comments are the memory model's (``predict_memory`` at the layout's
    own world size, the fullest GPU), the flags are what ``--rehearse --gpu-memory-gib 80`` names as the
    cheapest change keeping the layout, and with them the job validates and fits."""
    from megatron_ext.planning.fit import find_cheapest_change
    from megatron_ext.planning.memory import GIB
    from megatron_ext.planning.predict import predict_memory
    from megatron_ext.planning.step_time import Cluster

    world = REFERENCE[name][0]
    peak, at, flags, fitted = read_memory_claims(name)
    cfg = load(name)
    assert at == world
    assert round(max(r.total for r in predict_memory(cfg, world, cfg.data.vocab_size)) / GIB, 1) == peak > 80
    change = find_cheapest_change(cfg, Cluster(world, 8, 80.0), cfg.data.vocab_size)
    assert list(change.flags) == flags and not change.remove, change
    job = parse_args(["--config", os.path.join(ROOT, "configs", name), *flags])
    validate(job, world, cuda=False)
    assert round(max(r.total for r in predict_memory(job, world, job.data.vocab_size)) / GIB, 1) == fitted <= 80


def test_the_llama_configs_carry_what_the_script_sets():
    """configs/llama3-8b.yaml against Megatron-LM's train_llama3_8b_h100_fp8.sh (its argv in
    tests/unit/test_megatron_flags.py, the fp8 flags left out): the same model but the stated
    difference (--normalization RMSNorm), --apply-layernorm-1p included, and the same training
    settings; the 70B and CP 2 configs take the 8B script's training flags and its
    --apply-layernorm-1p. GPT-3's script does not set it."""
    import dataclasses

    from megatron_ext.arguments import parse_args_with_notes
    from megatron_ext.derived import get_kv_channels
    from tests.unit.test_megatron_flags import REFUSED, _without, script_argv

    script, _ = parse_args_with_notes(_without(script_argv(), REFUSED))
    ours = load("llama3-8b.yaml")
    differ = {
        f.name: (getattr(script.model, f.name), getattr(ours.model, f.name))
        for f in dataclasses.fields(script.model)
        if getattr(script.model, f.name) != getattr(ours.model, f.name)
    }
    if get_kv_channels(script.model) == get_kv_channels(ours.model):  # the script's --kv-channels 128 = 4096 / 32
        differ.pop("kv_channels", None)
    assert differ == {"normalization": ("LayerNorm", "RMSNorm")}, differ
    for name in ("llama3-8b.yaml", "llama3-8b-cp2.yaml", "llama3-70b.yaml"):
        cfg = load(name)
        assert cfg.model.apply_layernorm_1p, name
        t = cfg.training
        assert (t.lr, t.min_lr, t.decoupled_lr, t.weight_decay, t.train_samples, t.calculate_per_token_loss) == (
            script.training.lr,
            script.training.min_lr,
            script.training.decoupled_lr,
            script.training.weight_decay,
            script.training.train_samples,
            script.training.calculate_per_token_loss,
        ), name
    assert not load("gpt3-175b.yaml").model.apply_layernorm_1p


def test_the_cp2_config_is_the_8b_config_at_cp_2():
    """configs/llama3-8b-cp2.yaml differs from llama3-8b.yaml in the layout only (and its output
    directories): CP 2 with --cp-comm-type all_gather spelled out."""
    import dataclasses

    base, cp2 = load("llama3-8b.yaml"), load("llama3-8b-cp2.yaml")
    assert cp2.parallel.cp_comm_type == ["all_gather"]
    assert "cp-comm-type: all_gather" in open(os.path.join(ROOT, "configs", "llama3-8b-cp2.yaml")).read()
    same = dataclasses.replace(
        cp2,
        parallel=dataclasses.replace(cp2.parallel, context_parallel_size=1),
        checkpoint=dataclasses.replace(cp2.checkpoint, save=base.checkpoint.save),
        logging=dataclasses.replace(cp2.logging, tensorboard_dir=base.logging.tensorboard_dir),
    )
    assert same == base
