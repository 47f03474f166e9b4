"""The V placement in megatron-core (model/v_placement.py), against the loop placement of the same
pipeline (2 chunks per rank), without a schedule.

One 4-rank world, two layouts (PP 4; PP 2 x DP 2 with the distributed optimizer), tied and untied
embeddings, each built under the loop placement (interleaved) and under V (``--pipeline-schedule
ZBVZeroBubble``):
- every stage has the same checkpoint entries (keys, global offsets, replica ids) and the same
  initial values under both placements, and the embedding and the output layer sit on the first and
  last stage (rank 0 under V);
- ``finalize_model_grads`` of the placement, fed the same hand-made gradients per stage and a token
  count on the loss rank only, gives the same final gradients (DP reduce, tied embedding, per-token
  scaling): under V the tie is local to rank 0 and the count comes from rank 0;
- one whole step: under V the ZBVZeroBubble schedule (``pipeline/runtime.py``: each backward split
  into B, captured, and W, run later from the queue, each chunk's last micro-batch outside
  ``no_sync``; the loss and the token count on rank 0) gives bitwise the losses and the final
  gradients (tied embedding, output layer, every layer) of megatron-core's interleaved 1F1B under
  the loop placement;
- checkpoints across schedules (PP 2 x DP 2, distributed optimizer): after that step and the
  optimizer's, the checkpoint saved under V holds exactly the tensors (weights, Adam moments) of the
  one saved under the loop placement, and each loads into the other placement's fresh run giving
  the stepped weights of every parameter.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from megatron_ext.checkpoint.state import (
    build_model_sharded_state_dict, load_checkpoint, load_full_tensors, save_checkpoint,
)
from megatron_ext.pipeline.runtime import get_schedule_runtime
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, gather_full_grads, run_ranks, tiny_values
from megatron_ext.training.optimizer import step_optimizer
from megatron_ext.training.step import build_step_microbatches, run_forward_backward, unwrap_model

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "PP 4": dict(pipeline_model_parallel_size=4, num_layers=8),
    # no clipping: the global grad norm sums each rank's partial norm, grouped as the placement groups
    # the stages, so its last bits (and a clipped update's) depend on the placement; Adam's do not
    "PP 2 x DP 2, distributed optimizer": dict(pipeline_model_parallel_size=2, num_layers=4,
                                               use_distributed_optimizer=True, clip_grad=0.0),
    # Float16Module's casts: inputs on stage 0, the upcast on stage 2p-1 (rank 0 under V)
    "PP 2 x DP 2, bf16": dict(pipeline_model_parallel_size=2, num_layers=4, bf16=True),
    # the embedding group per TP rank; SP: the activations between stages are sequence shards
    "TP 2 x PP 2, SP": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4,
                            sequence_parallel=True),
}
CHECKPOINT_LAYOUT = "PP 2 x DP 2, distributed optimizer"
PLACEMENTS = {"loop": {}, "v": dict(pipeline_schedule="ZBVZeroBubble")}
TIES = {"tied": {}, "untied": dict(untie_embeddings_and_output_weights=True)}
# untied once (the output layer's own weight takes no special path otherwise)
CASES = [(layout, tie) for layout in LAYOUTS for tie in TIES if tie == "tied" or layout == CHECKPOINT_LAYOUT]


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
        out[stage] = {"entries": entries, "pre": model.pre_process, "post": model.post_process,
                      "rank": run.ctx.pp_rank}
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


def _world(rank: int, world_size: int, root: str) -> dict:
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
                    "stages": stages, "grads": grads, "copies": copies,
                    "loss_rank": run.ctx.is_last_stage, "dp_rank": run.ctx.dp_rank, "tp_rank": run.ctx.tp_rank,
                    "placement": run.ctx.stage_placement,
                }
                destroy_parallel_context()
                checkpointed = layout == CHECKPOINT_LAYOUT and tie == "tied"
                save = os.path.join(root, f"{layout}-{tie}-{placement}") if checkpointed else None
                out[("step", layout, tie, placement)] = _one_step(values, save)
                destroy_parallel_context()
            if layout == CHECKPOINT_LAYOUT and tie == "tied":
                out.update(_cross_loads(root, layout, tie, flags, tie_flags))
    return out


def _full_params(run) -> dict[str, torch.Tensor]:
    """{global name: weight} of this rank's parameters (TP 1: no gather)."""
    out = {}
    for chunk in run.model:
        model = unwrap_model(chunk)
        offset = get_layer_offset(model)
        for local_name, param in model.named_parameters():
            name = get_global_name(local_name, offset)
            if model.share_embeddings_and_output_weights and name == "output_layer.weight":
                name = "embedding.word_embeddings.weight"
            out[name] = param.detach().clone()
    return out


def _cross_loads(root: str, layout: str, tie: str, flags: dict, tie_flags: dict) -> dict:
    """The loop placement's checkpoint loaded under V, and V's under the loop placement."""
    out = {}
    for placement, other in (("v", "loop"), ("loop", "v")):
        values = tiny_values(num_virtual_stages_per_pipeline_rank=2, **flags, **tie_flags, **PLACEMENTS[placement])
        run = build_tiny_run(values, MarkovDataset(32))
        out[("loaded", tie, placement)] = load_checkpoint(run, os.path.join(root, f"{layout}-{tie}-{other}"))
        out[("loaded params", tie, placement)] = _full_params(run)
        destroy_parallel_context()
    return out


def _one_step(values: dict, save: str | None = None) -> dict:
    """One step's losses and final gradients: megatron-core's interleaved schedule (loop) or ours,
    ZBVZeroBubble (``pipeline/runtime.py``, which run.py attaches to the chunks with the W queue their
    linears defer to)."""
    run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    mbs, length = build_step_microbatches(run, run.train_ds, 0)
    losses = [float(r["lm loss"][0]) for r in run_forward_backward(run.model, mbs, length)]
    runtime = get_schedule_runtime(run.model)
    assert (runtime is not None) == (run.ctx.stage_placement == "v")
    deferred = sum(getattr(p, "skip_backward_post_hook", False) for c in run.model for p in c.parameters())
    out = {"grads": gather_full_grads(run), "losses": losses if run.ctx.is_last_stage else None,
           "pending": runtime.queue.pending() if runtime else 0, "deferred": deferred}
    if save is not None:
        assert step_optimizer(run.optimizer, True)[0]
        run.state.iteration = 1
        save_checkpoint(run, save)
        out["params"] = _full_params(run)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("v_placement"))
    return [root, *run_ranks(_world, 4, root, timeout=600)]


def _merged_stages(results, key):
    stages = {}
    for rank_out in results[1:]:
        r = rank_out[key]
        if r["dp_rank"] == 0 and r["tp_rank"] == 0:
            stages.update(r["stages"])
    return stages




@pytest.mark.parametrize("layout,tie", CASES)
def test_each_stage_has_the_same_checkpoint_entries_and_initial_values(results, layout, tie):
    loop, v = _merged_stages(results, (layout, tie, "loop")), _merged_stages(results, (layout, tie, "v"))
    num_stages = 2 * LAYOUTS[layout]["pipeline_model_parallel_size"]
    assert sorted(loop) == sorted(v) == list(range(num_stages))
    assert results[1][(layout, tie, "v")]["placement"] == "v"
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
        loss_ranks = [r for r, out in enumerate(results[1:]) if out[(layout, tie, placement)]["loss_rank"]]
        assert loss_ranks == [r for r in range(4) if r // (4 // pp) == loss_pp], placement
    merged = {}
    for placement in PLACEMENTS:
        grads = {}
        for rank_out in results[1:]:
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
        for rank_out in results[1:]:
            r = rank_out[(layout, tie, "v")]
            if r["loss_rank"]:
                first, last = r["copies"]
                assert torch.equal(first, last)


@pytest.mark.parametrize("layout,tie", CASES)
def test_a_v_step_gives_1f1bs_losses_and_gradients_bitwise(results, layout, tie):
    merged = {}
    for placement in PLACEMENTS:
        grads, losses = {}, []
        for rank_out in results[1:]:
            out = rank_out[("step", layout, tie, placement)]
            assert out["pending"] == 0 and (out["deferred"] > 0) == (placement == "v")
            losses += out["losses"] or []
            for name, g in out["grads"].items():
                if name in grads:
                    assert torch.equal(grads[name], g), (placement, name)
                grads[name] = g
        merged[placement] = (grads, losses)
    (loop_grads, loop_losses), (v_grads, v_losses) = merged["loop"], merged["v"]
    tp = LAYOUTS[layout].get("tensor_model_parallel_size", 1)
    assert loop_losses == v_losses and len(v_losses) == 4 * tp  # 4 micro-batches per step, on every TP rank
    assert loop_grads.keys() == v_grads.keys()
    for name, g in loop_grads.items():
        assert g.abs().sum() > 0, name
        assert torch.equal(g, v_grads[name]), f"{name}: max diff {(g - v_grads[name]).abs().max()}"


def test_checkpoints_saved_under_either_placement_are_the_same_and_load_into_the_other(results, tie="tied"):
    root, ranks = results[0], results[1:]
    saved = {p: load_full_tensors(os.path.join(root, f"{CHECKPOINT_LAYOUT}-{tie}-{p}", "iter_0000001"))
             for p in PLACEMENTS}
    keys = sorted(k for k in saved["loop"] if not k.startswith("optimizer.") or ".exp_avg" in k)
    assert any(".exp_avg_sq." in k for k in keys) and any(k.startswith("decoder.layers.") for k in keys)
    assert saved["v"].keys() == saved["loop"].keys()
    differ = [k for k in keys if not torch.equal(saved["loop"][k], saved["v"][k])]
    assert not differ, differ
    for placement in ("v", "loop"):
        for rank_out in ranks:
            assert rank_out[("loaded", tie, placement)] == 1
            stepped = rank_out[("step", CHECKPOINT_LAYOUT, tie, placement)]["params"]
            loaded = rank_out[("loaded params", tie, placement)]
            assert stepped.keys() == loaded.keys()
            for name, w in stepped.items():
                assert torch.equal(w, loaded[name]), (placement, name)
