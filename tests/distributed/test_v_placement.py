"""The V placement in megatron-core (model/v_placement.py) against the loop placement of the same
pipeline (2 chunks per rank), without a schedule (whole steps under the schedule runtime:
``test_zero_bubble_model.py``).

One 4-rank world; PP 4, PP 2 x DP 2 (distributed optimizer; tied and untied; the embedding and loss
counted as layers) and TP 2 x PP 2 with sequence parallelism, each built under the loop placement
(interleaved) and under V (``--pipeline-schedule ZBVZeroBubble``):
- every stage has the same checkpoint entries (keys, global offsets, replica ids) and the same
  initial values under both placements, and the embedding and the output layer sit on the first and
  last stage (rank 0 under V);
- ``finalize_model_grads`` of the placement, fed the same hand-made gradients per stage and a token
  count on the loss rank only, gives the same final gradients (DP reduce, tied embedding, per-token
  scaling): under V the tie is local to rank 0 and the count comes from rank 0.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megatron_ext.checkpoint.state import build_model_sharded_state_dict
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, gather_full_grads, run_ranks, tiny_values
from megatron_ext.training.step import unwrap_model

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "PP 4": dict(pipeline_model_parallel_size=4, num_layers=8),
    "PP 2 x DP 2, distributed optimizer": dict(
        pipeline_model_parallel_size=2, num_layers=4, use_distributed_optimizer=True
    ),
    # stages 0 and 2p-1 (rank 0 under V) give a layer's place to the embedding and to the loss
    "PP 2 x DP 2, embedding and loss counted as layers": dict(
        pipeline_model_parallel_size=2,
        num_layers=6,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ),
    # the embedding group per TP rank; SP: the activations between stages are sequence shards
    "TP 2 x PP 2, SP": dict(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4, sequence_parallel=True
    ),
}
PLACEMENTS = {"loop": {}, "v": dict(pipeline_schedule="ZBVZeroBubble")}
TIES = {"tied": {}, "untied": dict(untie_embeddings_and_output_weights=True)}
# untied once (the output layer's own weight takes no special path otherwise)
CASES = [
    (layout, tie)
    for layout in LAYOUTS
    for tie in TIES
    if tie == "tied" or layout == "PP 2 x DP 2, distributed optimizer"
]


def _stage_entries(run) -> dict[int, dict]:
    """{stage: {(key, global offset, replica id): value}} of this rank's chunks' checkpoint entries."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    state = build_model_sharded_state_dict(run.model)
    for i in range(len(run.model)):
        stage = run.ctx.placement.get_stage(i)
        entries = {}
        for t in state[f"model{i}"].values():
            if isinstance(t, ShardedTensor):
                entries[(t.key, tuple(t.global_offset), tuple(t.replica_id))] = t.data.detach().clone()
        model = unwrap_model(run.model[i])
        out[stage] = {"entries": entries, "pre": model.pre_process, "post": model.post_process, "rank": run.ctx.pp_rank}
    return out


def _fake_grad(name: str, dp_rank: int, shape) -> torch.Tensor:
    seed = int(hashlib.sha256(f"{name}:{dp_rank}".encode()).hexdigest()[:12], 16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _finalized_grads(run) -> tuple[dict, list]:
    """Hand-made main_grads (a function of the parameter's stage-independent name and the DP rank),
    a token count on the loss rank, the placement's finalize; the full final gradients."""
    for chunk in run.model:
        chunk.zero_grad_buffer()
        model = unwrap_model(chunk)
        offset = get_layer_offset(model)
        for local_name, param in model.named_parameters():
            param.main_grad.copy_(_fake_grad(get_global_name(local_name, offset), run.ctx.dp_rank, param.shape))
    num_tokens = torch.tensor(37 + 5 * run.ctx.dp_rank if run.ctx.is_last_stage else 0, dtype=torch.int)
    run.model[0].config.finalize_model_grads_func(run.model, num_tokens)
    copies = []  # every copy of the tied embedding's gradient on this rank
    for chunk in run.model:
        model = unwrap_model(chunk)
        if model.share_embeddings_and_output_weights and model.shared_embedding_or_output_weight() is not None:
            copies.append(model.shared_embedding_or_output_weight().main_grad.clone())
    return gather_full_grads(run), copies


def _world(rank: int, world_size: int) -> dict:
    out = {}
    for layout, flags in LAYOUTS.items():
        for tie, tie_flags in TIES.items():
            if (layout, tie) not in CASES:
                continue
            for placement, placement_flags in PLACEMENTS.items():
                values = tiny_values(num_virtual_stages_per_pipeline_rank=2, **flags, **tie_flags, **placement_flags)
                run = build_tiny_run(values, MarkovDataset(32))
                stages = _stage_entries(run)  # the initial weights (finalize changes only gradients)
                grads, copies = _finalized_grads(run)
                out[(layout, tie, placement)] = {
                    "stages": stages,
                    "grads": grads,
                    "copies": copies,
                    "loss_rank": run.ctx.is_last_stage,
                    "dp_rank": run.ctx.dp_rank,
                    "tp_rank": run.ctx.tp_rank,
                    "placement": run.ctx.stage_placement,
                }
                destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 4, timeout=600)


def _merged_stages(results, key):
    stages = {}
    for rank_out in results:
        r = rank_out[key]
        if r["dp_rank"] == 0 and r["tp_rank"] == 0:
            stages.update(r["stages"])
    return stages


@pytest.mark.parametrize("layout,tie", CASES)
def test_each_stage_has_the_same_checkpoint_entries_and_initial_values(results, layout, tie):
    loop, v = _merged_stages(results, (layout, tie, "loop")), _merged_stages(results, (layout, tie, "v"))
    num_stages = 2 * LAYOUTS[layout]["pipeline_model_parallel_size"]
    assert sorted(loop) == sorted(v) == list(range(num_stages))
    assert results[0][(layout, tie, "v")]["placement"] == "v"
    for stage in range(num_stages):
        a, b = loop[stage], v[stage]
        assert (a["pre"], a["post"]) == (b["pre"], b["post"]) == (stage == 0, stage == num_stages - 1)
        assert a["entries"].keys() == b["entries"].keys(), stage
        for k, value in a["entries"].items():
            assert torch.equal(value, b["entries"][k]), (stage, k)
    # the embedding and the loss: rank 0 and rank p-1 under loop, both rank 0 under V
    assert (v[0]["rank"], v[num_stages - 1]["rank"]) == (0, 0)
    assert (loop[0]["rank"], loop[num_stages - 1]["rank"]) == (0, num_stages // 2 - 1)
    layer_keys = {k[0] for s in v.values() for k in s["entries"] if "decoder.layers" in k[0]}
    assert layer_keys, "megatron-core keys layers by one stacked key and a global offset"


@pytest.mark.parametrize("layout,tie", CASES)
def test_finalize_under_v_equals_the_loop_placement(results, layout, tie):
    pp = LAYOUTS[layout]["pipeline_model_parallel_size"]
    for placement in PLACEMENTS:  # the loss: pipeline rank p-1 under loop, 0 under V (pp is the outer rank dim)
        loss_pp = 0 if placement == "v" else pp - 1
        loss_ranks = [r for r, out in enumerate(results) if out[(layout, tie, placement)]["loss_rank"]]
        assert loss_ranks == [r for r in range(4) if r // (4 // pp) == loss_pp], placement
    merged = {}
    for placement in PLACEMENTS:
        grads = {}
        for rank_out in results:
            for name, g in rank_out[(layout, tie, placement)]["grads"].items():
                if name in grads:
                    assert torch.equal(grads[name], g), (placement, name)
                grads[name] = g
        merged[placement] = grads
    assert merged["loop"].keys() == merged["v"].keys()
    assert ("output_layer.weight" in merged["v"]) == (tie == "untied")
    for name, g in merged["loop"].items():
        assert torch.equal(g, merged["v"][name]), name
    # under V, rank 0 holds both copies of the tied embedding, equal after the local tie
    if tie == "tied":
        for rank_out in results:
            r = rank_out[(layout, tie, "v")]
            if r["loss_rank"]:
                first, last = r["copies"]
                assert torch.equal(first, last)
