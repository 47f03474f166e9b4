"""``model/param_count.count_parameters`` under context parallelism (pure: meta builds, no process
group): CP ranks hold the same parameters, so every CP size counts exactly as CP 1 does, chunk by
chunk and per TP rank. Before, the count resolved the layout for a world of TP x PP ranks (DP 0 at
CP > 1: a ZeroDivisionError), and rehearse.py / the planner counted a CP 1 copy of the job."""

from __future__ import annotations

import pytest

from megatron_ext.config import build_job_config
from megatron_ext.model.param_count import count_parameters
from megatron_ext.testing import LLAMA_STYLE, VOCAB, tiny_values

LAYOUTS = {
    "Llama GQA, TP 2 x PP 2 x VPP 2, SP": dict(
        LLAMA_STYLE,
        group_query_attention=True,
        num_query_groups=2,
        num_layers=8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=2,
        sequence_parallel=True,
    ),
    "Qwen3 style (q/k norms, head dim 32), uneven PP 3": dict(
        LLAMA_STYLE,
        qk_layernorm=True,
        kv_channels=32,
        num_layers=8,
        pipeline_model_parallel_size=3,
        decoder_first_pipeline_num_layers=2,
        decoder_last_pipeline_num_layers=3,
    ),
    "GPT, tied embeddings, PP 2": dict(num_layers=4, pipeline_model_parallel_size=2),
}


def count(values: dict, cp: int):
    return count_parameters(build_job_config(tiny_values(**values, context_parallel_size=cp)), VOCAB - 1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_count_at_cp_2_and_4_is_the_count_at_cp_1(name):
    one = count(LAYOUTS[name], 1)
    assert one.total > 0 and len(one.chunks) > 1
    for cp in (2, 4):
        assert count(LAYOUTS[name], cp) == one, (name, cp)


def test_the_meta_build_at_cp_2_goes_through_our_core_attention(monkeypatch):
    """Our core attention builds megatron-core's on a CP 1 copy of the config; with upstream's own in
    the layer spec the same count trips its CP == 1 assert."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_ext.model import attention

    count(LAYOUTS["GPT, tied embeddings, PP 2"], 2)
    monkeypatch.setattr(attention, "VarlenDotProductAttention", DotProductAttention)
    with pytest.raises(AssertionError, match="Context parallelism is only supported by TEDotProductAttention"):
        count(LAYOUTS["GPT, tied embeddings, PP 2"], 2)
